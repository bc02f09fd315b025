"""The compressed cache: mlx-lm cache protocol, attention routing, persistence, forking."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from longctx import engine, kvcache, prompt, session
from longctx.kvcache.attention import compressed_attention
from longctx.kvcache.turbo import TurboQuantCache
from longctx.runtime import models

TURBO = [p for p in kvcache.PRESETS.values() if p.kind == "turbo"]


def _kv(B=1, H=2, L=37, D=64, seed=0):
    mx.random.seed(seed)
    return mx.random.normal((B, H, L, D)), mx.random.normal((B, H, L, D))


def _dense_attention(q, k, v, scale, causal):
    B, Hq, Lq, D = q.shape
    r = Hq // k.shape[1]
    k, v = mx.repeat(k, r, axis=1), mx.repeat(v, r, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * scale
    if causal:
        L = k.shape[2]
        allowed = mx.arange(L)[None, :] <= mx.arange(L - Lq, L)[:, None]
        s = mx.where(allowed, s, -mx.inf)
    return mx.softmax(s, axis=-1) @ v


@pytest.mark.parametrize("preset", TURBO, ids=lambda p: p.name)
def test_protocol_update_fetch_trim(preset):
    cache = TurboQuantCache(preset, layer=0)
    assert cache.empty() and cache.offset == 0
    k, v = _kv(L=300)
    view, _ = cache.update_and_fetch(k[:, :, :260], v[:, :, :260])
    view, _ = cache.update_and_fetch(k[:, :, 260:], v[:, :, 260:])
    assert cache.offset == view.offset == 300 and cache.size() == 300
    assert cache.nbytes > 0 and cache.nbytes < k.nbytes  # compressed below fp32
    assert cache.make_mask(5) == "causal" and cache.make_mask(1) is None
    assert cache.trim(10) == 10 and cache.offset == 290
    assert not hasattr(cache, "bits")  # mlx-lm would treat it as its own quantized cache


@pytest.mark.parametrize("preset", TURBO, ids=lambda p: p.name)
@pytest.mark.parametrize("hq,hkv,lq", [(2, 2, 1), (8, 2, 1), (4, 1, 7), (6, 3, 17)])
def test_attention_matches_dense_attention_on_decoded_keys(preset, hq, hkv, lq):
    """Blocked online softmax == dense softmax over the same decoded keys/values (no QJL)."""
    k, v = _kv(H=hkv, L=150)
    cache = TurboQuantCache(preset, layer=3)
    cache.update_and_fetch(k, v)
    cache.seal()
    view = cache.view()  # everything compressed now
    q = mx.random.normal((1, hq, lq, 64))
    out = compressed_attention(q, view, scale=0.125, mask="causal" if lq > 1 else None, block=64)
    kc, vc = view.key_codec, view.value_codec
    seg_k, seg_v, _ = view.segments[0]
    k_mu, v_mu = cache.means
    sink_k, sink_v = (a.astype(mx.float32) for a in cache.sink)  # the first tokens, exact
    assert sink_k.shape[2] == preset.sink == 4
    np.testing.assert_allclose(np.array(sink_k + k_mu), np.array(k[:, :, :4]), atol=2e-2)
    k_hat = mx.concatenate([sink_k, kc.decode(seg_k)], axis=2) + k_mu
    v_hat = mx.concatenate([sink_v, vc.decode(seg_v)], axis=2) + v_mu
    if preset.key_qjl:  # with QJL the scores differ from decoded keys by the correction: compare loosely
        ref = _dense_attention(q, k, v, 0.125, lq > 1)
        assert np.abs(np.array(out - ref)).max() < 0.5
        return
    ref = _dense_attention(q, k_hat, v_hat, 0.125, lq > 1)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-4, rtol=1e-3)


def test_attention_close_to_exact_at_4_bits():
    k, v = _kv(H=2, L=200, seed=5)
    cache = TurboQuantCache(kvcache.get_preset("tq4"), layer=0)
    cache.update_and_fetch(k, v)
    cache.seal()
    view = cache.view()
    q = mx.random.normal((1, 4, 1, 64)) * 0.3
    out = compressed_attention(q, view, scale=0.125)
    exact = _dense_attention(q, k, v, 0.125, False)
    err = np.linalg.norm(np.array(out - exact)) / np.linalg.norm(np.array(exact))
    assert err < 0.15


def test_new_tokens_attend_to_themselves_uncompressed():
    """The view returned by update_and_fetch holds the new chunk exactly; the cache then compresses it."""
    k, v = _kv(H=2, L=40, seed=2)
    from dataclasses import replace

    cache = TurboQuantCache(replace(kvcache.get_preset("tq3"), window=0), layer=0)
    view, _ = cache.update_and_fetch(k, v)
    # all 40 exact: in the window, or (a fused GPU chunk) the first ones in the sink already
    exact_rows = sum(a[0].shape[2] for a in (view.sink, view.window) if a is not None)
    assert view.segments == () and exact_rows == 40
    q = mx.random.normal((1, 4, 40, 64))
    out = compressed_attention(q, view, scale=0.125, mask="causal")
    exact = _dense_attention(q, k, v, 0.125, True)
    np.testing.assert_allclose(np.array(out), np.array(exact), atol=1e-4, rtol=1e-3)
    assert cache.window is None and cache.sink_len + cache.tail_len == 40  # compressed after the step


def test_window_keeps_newest_tokens_uncompressed():
    from dataclasses import replace

    assert kvcache.get_preset("tq4").window == 128
    preset = replace(kvcache.get_preset("tq4"), window=16)
    k, v = _kv(L=50)
    cache = TurboQuantCache(preset, layer=0)
    cache.update_and_fetch(k[:, :, :30], v[:, :, :30])
    cache.update_and_fetch(k[:, :, 30:], v[:, :, 30:])
    assert cache.window_len == 16 and cache.sink_len + cache.tail_len == 34 and cache.offset == 50
    np.testing.assert_allclose(np.array(cache.window[0] + cache.means[0]), np.array(k[:, :, 34:]), atol=1e-5)
    assert cache.trim(20) == 20 and cache.window_len == 0 and cache.offset == 30
    cache.seal()
    assert cache.window is None and cache.offset == 30


def test_fork_leaves_parent_untouched():
    k, v = _kv(L=64)
    parent = TurboQuantCache(kvcache.get_preset("tq4"), layer=0)
    parent.update_and_fetch(k, v)
    before = {n: np.array(a) for n, a in parent.arrays().items()}
    child = parent.fork()
    child.update_and_fetch(k[:, :, :5], v[:, :, :5])
    assert child.offset == 69 and parent.offset == 64
    after = parent.arrays()
    assert all(np.array_equal(before[n], np.array(after[n])) for n in before)


def test_answering_fork_keeps_question_and_answer_exact():
    k, v = _kv(L=400)
    parent = TurboQuantCache(kvcache.get_preset("tq4"), layer=0)
    parent.update_and_fetch(k[:, :, :100], v[:, :, :100])
    parent.seal()
    (child,) = kvcache.fork([parent])  # as `longctx ask` forks: up to ANSWER_EXACT new tokens exact
    plain = parent.fork()  # only the preset's 128-token window
    for c in (child, plain):
        for lo in range(100, 400, 50):  # a question, then an answer, in steps
            c.update_and_fetch(k[:, :, lo : lo + 50], v[:, :, lo : lo + 50])
    assert kvcache.ANSWER_EXACT >= 300
    assert child.window_len == 300 and child.tail_len == 0 and child.offset == 400
    np.testing.assert_allclose(np.array(child.window[0] + child.means[0]), np.array(k[:, :, 100:]), atol=1e-5)
    assert plain.window_len == 128 and plain.tail_len == 172
    (small,) = kvcache.fork([parent], exact_new=60)  # past the cap, the oldest are compressed
    small.update_and_fetch(k[:, :, 100:400], v[:, :, 100:400])
    assert small.window_len == 128 and small.tail_len == 172  # never below the preset's window
    assert child.fork().window_cap == kvcache.ANSWER_EXACT  # a fork of a fork keeps its cap
    child.seal()
    assert child.window is None and child.tail_len == 300 and child.offset == 400
    assert parent.offset == 100 and parent.window is None


@pytest.mark.parametrize("name", ["fp16", "affine8", "tq4", "tq3+qjl", "rvq2+2"])
def test_save_restore_gives_identical_arrays_and_attention(tiny_model, text_doc, name):
    from longctx.kernels import backend

    if name.startswith("affine") and backend() == "cuda":
        pytest.skip("MLX's CUDA backend has no quantized_matmul for group 32 (head_dim 32 here)")
    entry = session.ingest(text_doc, model=str(tiny_model), preset=name).entry
    lm = models.load(models.resolve(str(tiny_model)))
    from longctx.store import Store

    store = Store()
    arrays, meta = store.load(entry)
    restored = session.restore(entry, lm, store)
    again = kvcache.to_arrays(restored, kvcache.get_preset(name))
    for key, arr in again.items():
        assert np.array_equal(np.array(arr), np.array(arrays[key])), key
    # Same prompt through a fresh prefill vs the restored cache: identical next-token logits.
    lay = prompt.layout(lm.tokenizer, entry.name, text_doc.read_text())
    prefix = prompt.prefix_tokens(lm.tokenizer, lay)
    fresh = kvcache.make(lm.model, kvcache.get_preset(name))
    engine.prefill(lm.model, prefix, fresh)
    kvcache.seal(fresh)
    q = prompt.question_tokens(lm.tokenizer, lay, "How many sheep?")
    a = engine.greedy_tokens(lm.model, q, kvcache.fork(restored), 6)
    b = engine.greedy_tokens(lm.model, q, fresh, 6)
    assert a == b
    assert entry.kv_preset == name and json.loads(meta["kv_config"])["name"] == name


def test_turbo_cache_is_smaller_on_disk(tiny_model, text_doc):
    fp16 = session.ingest(text_doc, model=str(tiny_model), preset="fp16").entry
    tq4 = session.ingest(text_doc, model=str(tiny_model), preset="tq4").entry
    tq3 = session.ingest(text_doc, model=str(tiny_model), preset="tq3").entry
    assert fp16.id != tq4.id
    assert tq4.bytes < fp16.bytes / 2.5 and tq3.bytes < tq4.bytes


def test_answer_window_is_buffered_and_decode_steps_do_not_retrace(monkeypatch):
    """An answering fork keeps its exact tokens in preallocated buffers: decode steps change no
    input shape of the compiled fused path (no retrace), and attend exactly as the blocked path."""
    from longctx.kvcache import attend_fused

    k, v = _kv(L=300)
    parent = TurboQuantCache(kvcache.get_preset("tq4"), layer=2)
    parent.update_and_fetch(k, v)
    parent.seal()
    child = parent.fork(exact_new=1024)
    traces = []
    real = attend_fused.attend
    monkeypatch.setattr(attend_fused, "attend", lambda *a: traces.append(1) or real(*a))
    mx.random.seed(1)
    for step in range(6):
        kn, vn = mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64))
        view, _ = child.update_and_fetch(kn, vn)
        assert view.window[0].shape[2] == step + 1  # the valid tokens
        assert view.window_buffer[0].shape[2] == 256  # the buffer: grown in steps of 256
        q = mx.random.normal((1, 4, 1, 64))
        got = attend_fused.compiled_attention(q, view, 0.125, None)
        n = len(traces)
        want = compressed_attention(q, view, scale=0.125, fused=False)
        del traces[n:]  # the blocked reference is not a trace
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-4)
    assert len(traces) == 2  # step 0: the eager check and the one trace; no step after traces
    assert parent.window is None and parent.offset == 300  # the fork wrote only its own buffers
