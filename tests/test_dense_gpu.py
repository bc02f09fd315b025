"""The GPU prefill path (dequantize + fp16 SDPA, `kvcache.dense_gpu`) and its dequant kernel.

On the CPU the path runs with the dequant kernel's reference and MLX's CPU SDPA, and is compared
with the blocked pure-MLX path (the oracle); the `gpu` tests run the kernel itself.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kernel_cases import preset_bits

from longctx import kvcache
from longctx.kernels import _prelude
from longctx.kernels import dequant as dq
from longctx import config
from longctx.kvcache import attention, dense_gpu
from longctx.kvcache.attention import compressed_attention, kernel_table
from longctx.kvcache.turbo import TurboQuantCache

TURBO = [p for p in kvcache.PRESETS.values() if p.kind == "turbo"]
ON_GPU = _prelude.backend() in ("metal", "cuda")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a Metal or CUDA device")


def _filled(preset, hkv=2, d=64, n=700, new=300, seed=0):
    """A cache holding `n` tokens (a sink, a compressed tail) and a view over `new` more tokens
    kept exact (the window plus a chunk), as a prefill chunk sees it."""
    mx.random.seed(seed)
    k = mx.random.normal((1, hkv, n + new, d)) * 2.0 + 0.5
    v = mx.random.normal((1, hkv, n + new, d))
    cache = TurboQuantCache(preset, layer=1)
    cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
    view, _ = cache.update_and_fetch(k[:, :, n:], v[:, :, n:])
    return view


@pytest.mark.parametrize("preset", TURBO, ids=lambda p: p.name)
def test_dequant_reference_is_codec_decode(preset):
    view = _filled(preset, n=300, new=10)
    kc, vc = view.key_codec, view.value_codec
    seg_k, seg_v, _ = view.segments[0]
    for codec, enc in ((kc, seg_k), (vc, seg_v)):
        bits2 = codec.spec.bits2 if codec.rvq is not None else 0
        got = dq.dequant_reference(enc, kernel_table(codec), bits=codec.spec.bits, bits2=bits2,
                                   p=codec.padded_dim)
        want = codec.decode_rotated(enc).astype(mx.float16)
        assert mx.array_equal(got, want)


def test_dequant_head_and_after_rows():
    view = _filled(kvcache.get_preset("tq4"), n=300, new=10)
    kc = view.key_codec
    seg_k = view.segments[0][0]
    head = mx.random.normal((1, 2, 4, 64)).astype(mx.float16)
    after = mx.random.normal((1, 2, 9, 64)).astype(mx.float16)
    out = dq.dequant(seg_k, kernel_table(kc), bits=4, p=64, head=head, after=after)
    n = seg_k["norm"].shape[2]
    assert out.shape == (1, 2, 4 + n + 9, 64) and out.dtype == mx.float16
    assert mx.array_equal(out[:, :, :4], head) and mx.array_equal(out[:, :, 4 + n:], after)


@pytest.mark.parametrize("preset", TURBO, ids=lambda p: p.name)
@pytest.mark.parametrize("hq,hkv,lq,mask", [(4, 2, 300, "causal"), (6, 3, 129, "causal"),
                                            (2, 2, 65, None), (8, 2, 100, "array")])
def test_dense_path_matches_blocked_path(preset, hq, hkv, lq, mask):
    view = _filled(preset, hkv=hkv, new=lq)
    q = mx.random.normal((1, hq, lq, 64)) * 2.0
    if mask == "array":
        n = view.offset
        mask = mx.arange(n)[None, :] <= mx.arange(n - lq, n)[:, None]  # causal, as a bool array
    want = compressed_attention(q, view, scale=0.125, mask=mask, fused=False)
    got = dense_gpu.attention(q, view, 0.125, mask)
    err = np.abs(np.array(got) - np.array(want)).max() / np.abs(np.array(want)).max()
    assert err < 5e-3, err  # fp16 keys, values and queries against the fp32 blocked path


def test_routing_takes_the_dense_path_for_many_rows_on_a_gpu(monkeypatch):
    view = _filled(kvcache.get_preset("tq4"), new=200)
    calls = []
    monkeypatch.setattr(dense_gpu, "attention", lambda *a: calls.append(a[0].shape) or a[0])
    q = mx.random.normal((1, 4, 200, 64))
    with _prelude.force_backend("cpu"):
        compressed_attention(q, view, scale=0.125, mask="causal")
    assert calls == []  # the CPU keeps its own path
    with _prelude.force_backend("cuda"):
        assert dense_gpu.applies(view, "causal")
        compressed_attention(q, view, scale=0.125, mask="causal")
        assert attention.choose_path(view, "causal", 200)[0] == "dense-gpu"
        with config.override(dense_gpu=False):  # switched off: the blocked path
            assert attention.choose_path(view, "causal", 200)[0] == "blocked"
    assert calls == [(1, 4, 200, 64)]


@gpu
@pytest.mark.parametrize("name", sorted(p.name for p in TURBO))
@pytest.mark.parametrize("p,length", [(64, 1), (64, 4099), (128, 517), (256, 33)])
def test_gpu_dequant(name, p, length):
    from kernel_cases import random_segment, tables

    b1, b2, qjl, bv = preset_bits(name)
    _, _, keys, values, kt, vt = random_segment(1, 3, 1, p, length, b1, b2, bv, qjl, seed=length,
                                                capacity=length + 5)
    head = mx.random.normal((1, 3, 4, p)).astype(mx.float16)
    after = mx.random.normal((1, 3, 7, p)).astype(mx.float16)
    for enc, table, bits, bits2 in ((keys, kt, b1, b2), (values, vt, bv, 0)):
        kw = dict(bits=bits, bits2=bits2, p=p, head=head, after=after)
        assert mx.array_equal(dq.dequant(enc, table, **kw), dq.dequant_reference(enc, table, **kw))


@gpu
@pytest.mark.parametrize("preset", TURBO, ids=lambda p: p.name)
def test_gpu_dense_path_matches_blocked_path(preset):
    view = _filled(preset, hkv=2, n=3000, new=640)
    q = mx.random.normal((1, 8, 512, 64)) * 2.0
    want = compressed_attention(q, view, scale=0.125, mask="causal", fused=False)
    got = compressed_attention(q, view, scale=0.125, mask="causal")
    err = np.abs(np.array(got) - np.array(want)).max() / np.abs(np.array(want)).max()
    assert err < 5e-3, err


def test_encode_takes_the_fused_kernel_on_a_gpu():
    """On a GPU backend a scalar codec encodes through `hadamard_quantize` (one launch); its
    reference computes exactly what the MLX encode does."""
    from longctx.kernels import hadamard_quant as hq
    from longctx.quant.codec import QuantSpec, VectorCodec

    launched = []

    def reference(spec, launch):
        launched.append(spec.name)
        return list(hq.hadamard_quantize_reference(*launch.inputs))

    x = mx.random.normal((1, 2, 37, 128)) * 3.0
    for spec, fused in ((QuantSpec(4), True), (QuantSpec(3, bits2=0, qjl=True), False),
                        (QuantSpec(2, bits2=2), False)):
        codec = VectorCodec(128, spec, seed=5)
        want = codec.encode(x)
        launched.clear()
        with _prelude.executor(reference, as_backend="cuda"):
            got = codec.encode(x)
        assert launched == (["lc_hadamard_quantize"] if fused else [])
        assert set(got) == set(want)
        for name in want:
            assert mx.array_equal(got[name], want[name]), name
    assert not VectorCodec(72, QuantSpec(4), seed=5)._fused_encode()  # padded dims: MLX path
