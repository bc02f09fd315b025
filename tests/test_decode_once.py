"""Decoding a restored cache once for CPU answering: the table-lookup decoder is bit-identical to
the codec's, and attention over the decoded prefix equals the blocked path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from longctx import kvcache
from longctx.kvcache import attend_blocked, attend_cpu
from longctx.kvcache.attention import compressed_attention
from longctx.kvcache.presets import get_preset
from longctx.kvcache.turbo import TurboQuantCache
from longctx.quant import lut
from longctx.quant.codec import QuantSpec, VectorCodec

SPECS = [QuantSpec(b) for b in range(1, 9)] + [QuantSpec(2, 2), QuantSpec(3, 1), QuantSpec(3, qjl=True), QuantSpec(4, 4)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dim", [64, 72, 80])  # 72 pads to 80 (values past the dim are dropped); 80 is a non-power-of-two size
def test_lookup_decode_is_bit_identical(spec, dim):
    codec = VectorCodec(dim, spec, seed=3)
    x = mx.random.normal((2, 3, 37, dim), key=mx.random.key(spec.bits * 10 + spec.bits2)) * 3.0
    enc = codec.encode(x)
    got = lut.decode_rotated(codec, enc)
    assert got.dtype == np.float32 and got.shape == (2, 3, 37, codec.padded_dim)
    assert np.array_equal(got, np.array(codec.decode_rotated(enc)))


def test_lookup_reads_packing_layout_directly():
    # The documented b = 3 example: values 0..7 repeated, words 0x88FAC688, 0xC688FAC6, 0xFAC688FA.
    words = mx.array([[0x88FAC688, 0xC688FAC6, 0xFAC688FA]], dtype=mx.uint32)
    table = np.arange(8, dtype=np.float32) * 10
    assert lut.lookup(words, 3, 32, table).tolist() == [[10.0 * (i % 8) for i in range(32)]]


@pytest.mark.parametrize("spec", [QuantSpec(3, qjl=True), QuantSpec(4), QuantSpec(2, 2)], ids=str)
def test_scoring_vectors_give_the_estimated_scores(spec):
    codec = VectorCodec(64, spec, seed=5)
    keys = mx.random.normal((1, 2, 50, 64), key=mx.random.key(1))
    q_rot = codec.rotate(mx.random.normal((1, 2, 4, 64), key=mx.random.key(2)))
    enc = codec.encode(keys)
    ref = q_rot @ codec.decode_rotated(enc).swapaxes(-1, -2)
    if spec.qjl:
        ref = ref + codec.qjl_correction(codec.qjl_project(q_rot), enc)
    got = q_rot @ codec.decode_scoring(enc).swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-4)


def _restored(name: str, n: int = 300, heads: int = 2, dim: int = 64, batch: int = 1) -> TurboQuantCache:
    preset = get_preset(name)
    c = TurboQuantCache(preset, 0)
    kv = mx.random.normal((2, batch, heads, n, dim), key=mx.random.key(7)) + 0.3
    c.update_and_fetch(kv[0], kv[1])
    c.seal()
    return TurboQuantCache.from_arrays(preset, 0, c.arrays(), dim)


@pytest.mark.parametrize("name", ["tq4", "tq4k3v", "tq3+qjl", "rvq2+2"])
@pytest.mark.parametrize("lq,mask", [(1, None), (7, "causal")])
def test_attention_over_decoded_prefix_equals_blocked_path(name, lq, mask):
    blocked = _restored(name)
    dense = _restored(name)
    assert dense.decode_prefix() == dense.dense_prefix_bytes() > 0
    new = mx.random.normal((2, 1, 2, lq, 64), key=mx.random.key(9))
    q = mx.random.normal((1, 4, lq, 64), key=mx.random.key(11))
    outs = []
    for cache in (blocked, dense):
        view, _ = cache.update_and_fetch(new[0], new[1])
        outs.append(compressed_attention(q, view, 0.125, mask=mask, fused=False))
    assert view.dense is not None
    np.testing.assert_allclose(np.array(outs[1]), np.array(outs[0]), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["tq4", "tq3+qjl", "rvq2+2"])
@pytest.mark.parametrize("dim", [64, 72])  # 72: rotations pad to 80
@pytest.mark.parametrize("lq,mask,earlier", [(1, None, 0), (7, "causal", 0), (5, "causal", 9)])
@pytest.mark.parametrize("writes_through", [True, False])
def test_numpy_dense_path_equals_blocked_path(monkeypatch, name, dim, lq, mask, earlier, writes_through):
    """On the CPU a decoded prefix plus the window is attended as one softmax (the window rotated
    into the prefix's frames); `earlier` tokens already in the window before the queries are
    visible to all of them, the queries' own causally. Where numpy's view of MLX memory were a
    copy, the probabilities go back into MLX by copy: same result."""
    from longctx.kvcache import attend_blocked, attend_cpu

    if not writes_through:
        monkeypatch.setattr(attend_blocked, "numpy_writes_through", lambda: False)
    blocked, dense = (_restored(name, n=200, dim=dim, batch=2) for _ in range(2))
    dense.decode_prefix()
    calls = []
    real = attend_cpu.attention
    monkeypatch.setattr(attend_cpu, "attention", lambda *a: calls.append(1) or real(*a))
    q = mx.random.normal((2, 4, lq, dim), key=mx.random.key(21)) * 3.0
    outs = []
    for cache in (blocked, dense):
        if earlier:
            kv = mx.random.normal((2, 2, 2, earlier, dim), key=mx.random.key(22))
            cache.update_and_fetch(kv[0], kv[1])
        kv = mx.random.normal((2, 2, 2, lq, dim), key=mx.random.key(23))
        view, _ = cache.update_and_fetch(kv[0], kv[1])
        outs.append(compressed_attention(q, view, 0.125, mask=mask, fused=False))
    assert calls == [1]  # the dense cache only
    assert outs[1].shape == (2, 4, lq, dim) and outs[1].dtype == q.dtype
    np.testing.assert_allclose(np.array(outs[1]), np.array(outs[0]), rtol=2e-5, atol=2e-5)


def test_numpy_views_of_mlx_arrays_write_through():
    """The in-place softmax relies on it with this MLX (else it copies, tested above)."""
    from longctx.kvcache.attend_blocked import numpy_writes_through

    assert numpy_writes_through()


def test_rotation_matrices_are_the_rotation():
    from longctx.kvcache.attention import rotation_matrices

    codec = VectorCodec(72, QuantSpec(4), seed=4)
    r, u = rotation_matrices(codec)
    assert r.shape == (72, 80) and u.shape == (80, 72)
    x = mx.random.normal((3, 72), key=mx.random.key(1))
    np.testing.assert_allclose(np.array(x @ r), np.array(codec.rotate(x)), atol=1e-5)
    y = mx.random.normal((3, codec.padded_dim), key=mx.random.key(2))
    np.testing.assert_allclose(np.array(y @ u), np.array(codec.unrotate(y)), atol=1e-5)


def test_decoded_prefix_survives_answer_tokens_leaving_the_window():
    """A long answer pushes tokens out of the window into the tail; the prefix stays decoded and
    attention still matches the blocked path."""
    blocked, dense = _restored("tq4"), _restored("tq4")
    dense.decode_prefix()
    for cache in (blocked, dense):
        for i in range(150):  # > the 128-token window
            kv = mx.random.normal((2, 1, 2, 1, 64), key=mx.random.key(100 + i))
            view, _ = cache.update_and_fetch(kv[0], kv[1])
        assert cache.tail_len > 0
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(5))
    a = compressed_attention(q, blocked.view(), 0.125, fused=False)
    b = compressed_attention(q, dense.view(), 0.125, fused=False)
    np.testing.assert_allclose(np.array(b), np.array(a), rtol=2e-5, atol=2e-5)


def test_forks_share_the_decoded_prefix_and_trim_drops_it():
    parent = _restored("tq4")
    parent.decode_prefix()
    child = parent.fork()
    assert child.dense_prefix is parent.dense_prefix
    kv = mx.random.normal((2, 1, 2, 3, 64))
    child.update_and_fetch(kv[0], kv[1])
    assert child.fork().dense_prefix is parent.dense_prefix  # the new tokens sit in the window
    child.trim(10)  # past the window: into the prefix
    assert child.dense_prefix is None and child.view().dense is None


def test_decode_once_respects_its_memory_budget():
    caches = [_restored("tq4"), _restored("tq4")]
    need = sum(c.dense_prefix_bytes() for c in caches)
    assert kvcache.decode_once(caches, max_bytes=need - 1) == 0
    assert all(c.dense_prefix is None for c in caches)
    assert kvcache.decode_once(caches, max_bytes=need) == need
    assert all(c.dense_prefix is not None for c in caches)


@pytest.mark.parametrize("mask", [None, "causal"])
def test_numpy_softmax_step_matches_mlx(monkeypatch, mask):
    from longctx.kvcache import attend_blocked as attention

    cache = _restored("tq4", n=400)
    new = mx.random.normal((2, 1, 2, 6, 64), key=mx.random.key(3))
    view, _ = cache.update_and_fetch(new[0], new[1])
    q = mx.random.normal((1, 4, 6, 64), key=mx.random.key(4)) * 4.0
    monkeypatch.setattr(attention, "NUMPY_SOFTMAX_MIN", 1 << 40)
    ref = compressed_attention(q, view, 0.125, mask=mask, fused=False)
    monkeypatch.setattr(attention, "NUMPY_SOFTMAX_MIN", 0)
    got = compressed_attention(q, view, 0.125, mask=mask, fused=False)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-6)


def test_numpy_softmax_step_in_place_only_when_asked():
    from longctx.kvcache import attend_blocked as attention
    from longctx.kvcache.attend_blocked import _softmax_step

    base = mx.random.normal((1, 2, 8, 2048), key=mx.random.key(5)) * 3.0  # numpy-sized block
    assert base.size >= attention.NUMPY_SOFTMAX_MIN
    m = mx.full((1, 2, 8, 1), -mx.inf)
    mx.eval(base, m)
    keep = np.array(base)
    ref = [np.array(a) for a in _softmax_step(base, m, cpu=False)]
    got = [np.array(a) for a in _softmax_step(base, m, cpu=True)]  # numpy path, copying
    np.testing.assert_array_equal(np.array(base), keep)  # the caller's scores are untouched
    fresh = base * 1.0
    inplace = [np.array(a) for a in _softmax_step(fresh, m, cpu=True, inplace=True)]
    for r, g, i in zip(ref, got, inplace):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(i, g)
    np.testing.assert_array_equal(np.array(base), keep)  # only `fresh` was overwritten


@pytest.mark.parametrize("spec", [QuantSpec(4), QuantSpec(3), QuantSpec(2, 2), QuantSpec(3, qjl=True)], ids=str)
def test_decoding_after_head_rows_equals_concatenation(spec):
    codec = VectorCodec(64, spec, seed=9)
    enc = codec.encode(mx.random.normal((1, 2, 40, 64), key=mx.random.key(1)))
    head = mx.random.normal((1, 2, 4, 64), key=mx.random.key(2))
    got = codec.decode_scoring(enc, head=head)
    want = mx.concatenate([head, codec.decode_scoring(enc)], axis=2)
    assert np.array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("lq,lk,mask", [(1, 700, None), (37, 300, "causal"), (64, 64, "causal"), (16, 900, None)])
@pytest.mark.parametrize("writes_through", [True, False])
def test_exact_cpu_attention_equals_mlx_sdpa(monkeypatch, lq, lk, mask, writes_through):
    """The CPU's numpy-softmax attention over uncompressed keys (fp16 caches, the layer-major
    prefill's staging cache) is MLX's SDPA: grouped heads, causal masks, both numpy modes."""
    monkeypatch.setattr(attend_blocked, "numpy_writes_through", lambda: writes_through)
    mx.random.seed(3)
    q = mx.random.normal((1, 6, lq, 64))
    k = mx.random.normal((1, 2, lk, 64)) * 3
    v = mx.random.normal((1, 2, lk, 64))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = attend_cpu.exact_attention(q, k, v, 0.125, mask)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert mx.allclose(got, want, atol=2e-5, rtol=1e-4).item()


def test_model_attention_routes_long_exact_calls_on_the_cpu(monkeypatch):
    """mlx-lm's attention calls with an uncompressed cache take `exact_attention` on the CPU
    past its size threshold, and MLX's SDPA below it or with an array mask."""
    from longctx.kvcache import routing
    from mlx_lm.models import base

    calls = []
    real = attend_cpu.exact_attention
    monkeypatch.setattr(attend_cpu, "exact_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(attend_cpu, "EXACT_MIN_SCORES", 6 * 8 * 100)
    sdpa = routing._wrap(base.scaled_dot_product_attention)
    q, k = mx.random.normal((1, 6, 8, 32)), mx.random.normal((1, 2, 100, 32))
    want = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.2, mask="causal")
    assert mx.allclose(sdpa(q, k, k, cache=None, scale=0.2, mask="causal"), want, atol=2e-5).item()
    assert calls == [1]
    sdpa(q[:, :, :4], k, k, cache=None, scale=0.2, mask="causal")  # below the threshold
    sdpa(q, k, k, cache=None, scale=0.2, mask=mx.zeros((8, 100)))  # an array mask
    assert calls == [1]


def test_an_fp16_cache_routes_the_models_attention(tiny_model, monkeypatch):
    """`kvcache.make` with the fp16 preset routes the model's attention too, so an fp16 ingest
    on the CPU takes `exact_attention` past its threshold, with the same logits."""
    from longctx.runtime import models

    lm = models.load(models.resolve(str(tiny_model)))
    ids = mx.array([list(range(3, 40))], dtype=mx.int32)
    want = lm.model(ids, cache=kvcache.make(lm.model, get_preset("fp16")))
    calls = []
    real = attend_cpu.exact_attention
    monkeypatch.setattr(attend_cpu, "exact_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(attend_cpu, "EXACT_MIN_SCORES", 1)
    got = lm.model(ids, cache=kvcache.make(lm.model, get_preset("fp16")))
    assert calls and mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
