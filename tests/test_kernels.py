"""GPU kernels: references vs the library's pure-MLX code (CPU), kernels vs references (GPU).

On the CPU (CI) the references are checked against `longctx.quant` / `longctx.kvcache.attention`
and the dispatchers' launch plans are checked with a recording executor. The `gpu` tests run each
kernel against its reference on the same device over a shape grid (head_dim 64/128/256, GQA
1/4/8, lengths 1/17/4095 and 32k/128k, every turbo preset) and skip cleanly without a GPU.
`tests/test_kernels_emulated.py` runs the kernel bodies themselves on the CPU (opt-in).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile

# GPU runs: references in full fp32 (no TF32 matmuls), and one MLX JIT cache per xdist worker
# (concurrent writers of one cache file can hand a reader half a module).
os.environ.setdefault("MLX_ENABLE_TF32", "0")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault(
        "MLX_PTX_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"mlx_ptx_{os.environ['PYTEST_XDIST_WORKER']}")
    )

import mlx.core as mx
import numpy as np
import pytest
from kernel_cases import TURBO, preset_bits, random_segment, state_errors, tables

from longctx import kvcache
from longctx.kernels import _prelude
from longctx.kernels import decode_attend as da
from longctx.kernels import decode_attend_mma as dm
from longctx.kernels import decode_step_mma as ds
from longctx.kernels import hadamard_quant as hq
from longctx.kernels import pack as kp
from longctx.kernels import qjl_encode as qe
from longctx.kernels import scalar_quant as sq
from longctx.kernels import split_combine as sc
from longctx.kvcache.attention import compressed_attention, kernel_table
from longctx.kvcache.turbo import TurboQuantCache
from longctx.quant import packing, scalar
from longctx.quant.codebooks import as_mx, lloyd_max
from longctx.quant.codec import QuantSpec, VectorCodec
from longctx.quant.qjl import QJLSketch

ON_GPU = _prelude.backend() in ("metal", "cuda")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a Metal or CUDA device")


def _rng(seed=0):
    return np.random.default_rng(seed)


# --- references vs the library (CPU and GPU) -------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_reference_is_packing_layout(bits):
    for n in (1, 17, 32, 100, 256):
        x = mx.array(_rng(bits * n).integers(0, 1 << bits, size=(2, 3, n)).astype(np.uint8))
        words = kp.pack_reference(x, bits)
        assert mx.array_equal(words, packing.pack(x, bits))
        assert mx.array_equal(kp.unpack_reference(words, bits, n), packing.unpack(words, bits, n))


def test_pack_reference_documented_example():
    """packing.py's docstring example: 3-bit 0..7 repeated gives 0x88FAC688, 0xC688FAC6, ..."""
    x = mx.array(np.tile(np.arange(8, dtype=np.uint8), 4))
    assert np.array(kp.pack_reference(x, 3)).tolist() == [0x88FAC688, 0xC688FAC6, 0xFAC688FA]


@pytest.mark.parametrize("bits", range(1, 9))
def test_scalar_reference_is_library_quantizer(bits):
    cb = lloyd_max(128, bits)
    cents, bounds = as_mx(cb)
    x = mx.array(_rng(bits).normal(size=(5, 301)).astype(np.float32) * 0.12)
    idx = sq.quantize_reference(x, bounds)
    assert mx.array_equal(idx, scalar.quantize(x, cb))
    assert mx.array_equal(sq.dequantize_reference(idx, cents), scalar.dequantize(idx, cb))


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_hadamard_reference_is_codec_encode(dim, bits):
    codec = VectorCodec(dim, QuantSpec(bits), seed=11 + dim)
    x = mx.array(_rng(dim + bits).normal(size=(2, 3, 17, dim)).astype(np.float32))
    enc = codec.encode(x)
    idx, norm = hq.hadamard_quantize_reference(x, codec.rotation.signs, as_mx(codec.codebook)[1])
    assert mx.array_equal(idx, enc["idx"]) and mx.array_equal(norm, enc["norm"])


@pytest.mark.parametrize("dim", [64, 128])
def test_qjl_reference_is_sketch(dim):
    sketch = QJLSketch(dim, seed=5)
    r = mx.array(_rng(dim).normal(size=(3, 19, dim)).astype(np.float32))
    signs, rnorm = qe.qjl_encode_reference(r, sketch._st)
    want_signs, want_rnorm = sketch.sketch(r)
    assert mx.array_equal(signs, want_signs) and mx.array_equal(rnorm, want_rnorm)


def _two_segment_view(preset, hkv, d, seed=0, layer=2):
    """A view with a read-only prefix, a private tail and (from the last chunk) a window."""
    mx.random.seed(seed)
    k, v = mx.random.normal((1, hkv, 330, d)), mx.random.normal((1, hkv, 330, d))
    parent = TurboQuantCache(preset, layer=layer)
    parent.update_and_fetch(k[:, :, :200], v[:, :, :200])
    child = parent.fork()
    child.update_and_fetch(k[:, :, 200:300], v[:, :, 200:300])
    view, _ = child.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    assert len(view.segments) == 2 and view.window is not None
    return view


@pytest.mark.parametrize("name", list(TURBO))
@pytest.mark.parametrize("hq_,hkv,lq,d", [(8, 2, 1, 64), (4, 4, 1, 128), (8, 1, 3, 64), (9, 3, 16, 64)])
def test_fused_attention_path_matches_mlx_path(name, hq_, hkv, lq, d):
    """compressed_attention with segments through decode_attend (its reference on the CPU, the
    kernel on a GPU) equals the blocked pure-MLX path."""
    view = _two_segment_view(kvcache.get_preset(name), hkv, d)
    q = mx.random.normal((1, hq_, lq, d))
    mask = "causal" if lq > 1 else None
    a = compressed_attention(q, view, d**-0.5, mask=mask, fused=False, block=64)
    b = compressed_attention(q, view, d**-0.5, mask=mask, fused=True)
    err = float(mx.abs(a - b).max() / mx.abs(a).max())
    assert err < 1e-5, err


@pytest.mark.parametrize("name", ["tq4", "tq3+qjl", "rvq2+2"])
@pytest.mark.parametrize("lq", [1, 16])
def test_compiled_path_serves_every_layer_with_its_own_arrays(monkeypatch, name, lq):
    """One compiled function serves layers of equal sizes (the fused path under mx.compile is
    keyed by sizes, specs and positions only): each layer's call must use its own rotation signs,
    QJL projection, tables and segments, never those captured when the function was traced."""
    from collections import OrderedDict

    from longctx.kvcache import attend_fused, turbo

    preset = kvcache.get_preset(name)
    views = [_two_segment_view(preset, 2, 64, seed=s, layer=layer) for s, layer in ((0, 0), (1, 5), (2, 0))]
    q = mx.random.normal((1, 6, lq, 64))
    mask = "causal" if lq > 1 else None
    eager = [dataclasses.replace(view, paths=turbo.Paths(compile="0")) for view in views]
    want = [compressed_attention(q, view, 0.125, mask=mask, fused=True) for view in eager]
    monkeypatch.setattr(attend_fused, "_COMPILED", OrderedDict())
    got = [compressed_attention(q, view, 0.125, mask=mask, fused=True) for view in views]
    assert len(attend_fused._COMPILED) == 1  # one function served all three layers
    for a, b in zip(want, got):
        assert float(mx.abs(a - b).max() / mx.abs(a).max()) < 1e-5


@pytest.mark.parametrize("name", ["tq3", "tq3+qjl", "rvq2+2"])
def test_decode_attend_reference_causal_is_dense_softmax(name):
    """Causal rows against a dense softmax over the codec's own decoded keys and values."""
    preset = kvcache.get_preset(name)
    cache = TurboQuantCache(preset, layer=0)
    mx.random.seed(3)
    k, v = mx.random.normal((1, 2, 90, 64)), mx.random.normal((1, 2, 90, 64))
    cache.update_and_fetch(k, v)
    cache.seal()  # compress the uncompressed window too
    view = cache.view()
    seg_k, seg_v, length = view.segments[0]
    kc, vc = view.key_codec, view.value_codec
    lq, r = 3, 2
    q_rot = mx.random.normal((1, 2, r * lq, 64))
    q_proj = kc.qjl_project(q_rot) if kc.spec.qjl else None
    causal_base = 40
    m, l, acc = da.decode_attend_reference(
        q_rot,
        seg_k,
        seg_v,
        kernel_table(kc),
        kernel_table(vc),
        key_bits=kc.spec.bits,
        key_bits2=kc.spec.bits2,
        value_bits=vc.spec.bits,
        scale=0.125,
        q_proj=q_proj,
        lq=lq,
        causal_base=causal_base,
        block=32,
    )
    s = q_rot @ kc.decode_rotated(seg_k).swapaxes(-1, -2)
    if q_proj is not None:
        s = s + kc.qjl_correction(q_proj, seg_k)
    s = s * 0.125
    allowed = mx.arange(length)[None, :] <= causal_base + (mx.arange(r * lq) % lq)[:, None]
    p = mx.softmax(mx.where(allowed, s, -mx.inf), axis=-1)
    want = p @ vc.decode_rotated(seg_v)
    np.testing.assert_allclose(np.array(acc / l), np.array(want), rtol=1e-4, atol=1e-5)


def test_split_combine_reference_merges_splits():
    q, qp, keys, values, kt, vt = random_segment(1, 2, 4, 64, 300, 3, 0, 3, False)
    kw = dict(key_bits=3, value_bits=3, scale=0.125)
    whole = da.decode_attend_reference(q, keys, values, kt, vt, **kw)
    parts = [
        da.decode_attend_reference(
            q, {k: a[:, :, lo:hi] for k, a in keys.items()}, {k: a[:, :, lo:hi] for k, a in values.items()}, kt, vt, **kw
        )
        for lo, hi in ((0, 100), (100, 250), (250, 300))
    ]
    stack = [mx.stack([p[i].reshape(2, 4, -1) for p in parts], axis=1) for i in range(3)]
    m, l, acc = sc.split_combine_reference(stack[0][..., 0], stack[1][..., 0], stack[2])
    errs = state_errors((m[..., None].reshape(1, 2, 4, 1), l.reshape(1, 2, 4, 1), acc.reshape(1, 2, 4, 64)), whole)
    assert errs["out_rel"] < 1e-6 and errs["l_rel"] < 1e-5


# --- dispatch on the CPU ------------------------------------------------------------------


def test_public_functions_use_references_on_cpu():
    if ON_GPU:
        pytest.skip("CPU dispatch")
    x = mx.array(_rng().integers(0, 8, size=(4, 40)).astype(np.uint8))
    assert mx.array_equal(kp.pack(x, 3), packing.pack(x, 3))
    assert mx.array_equal(kp.unpack(kp.pack(x, 3), 3, 40), x)
    q, qp, keys, values, kt, vt = random_segment(1, 1, 2, 64, 50, 3, 0, 3, True)
    kw = dict(key_bits=3, value_bits=3, scale=0.125, q_proj=qp)
    for a, b in zip(da.decode_attend(q, keys, values, kt, vt, **kw), da.decode_attend_reference(q, keys, values, kt, vt, **kw)):
        assert mx.array_equal(a, b)


class _Recorder:
    """An executor that records launches and returns zero outputs."""

    def __init__(self):
        self.launches = []

    def __call__(self, spec, launch):
        self.launches.append((spec, launch))
        return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]


def _geometry(launch):
    (gx, gy, gz), (tx, ty, tz) = launch.grid, launch.threadgroup
    assert gy == gz == ty == tz == 1 and gx % tx == 0  # MLX's grid counts threads
    return gx // tx, tx


def test_launch_plans():
    rec = _Recorder()
    with _prelude.executor(rec):
        kp.pack(mx.zeros((3, 5, 100), dtype=mx.uint8), 3)  # 15 rows x 12 words
        hq.hadamard_quantize(mx.zeros((7, 128)), mx.ones((128,)), mx.zeros((15,)))
        qe.qjl_encode(mx.zeros((9, 64)), mx.zeros((64, 64)))
        q, qp, keys, values, kt, vt = random_segment(2, 3, 20, 64, 1000, 4, 0, 3, False)
        m, l, acc = da.decode_attend(q, keys, values, kt, vt, key_bits=4, value_bits=3, scale=1.0)
    (pk, pl), (hs, hl), (qs, ql) = rec.launches[:3]
    assert _geometry(pl) == (1, 256) and pl.output_shapes == [(15, 12)]
    assert _geometry(hl) == (7, 128) and hl.output_shapes == [(7, 16), (7,)]
    assert _geometry(ql) == (9, 64) and ql.output_shapes == [(9, 2), (9,)]
    # decode_attend: 20 rows > max_rows(64) = 16 -> one launch of two row blocks of 10 rows each,
    # then one combine.
    names = [s.name for s, _ in rec.launches[3:]]
    assert names == ["lc_decode_attend", "lc_split_combine"]
    launch = rec.launches[3][1]
    groups_, threads = _geometry(launch)
    t = dict(launch.template)
    params = launch.inputs[da._SPEC.inputs.index("params")]
    chunk, splits, rows = (int(params[i]) for i in (1, 3, 4))
    assert threads == da.NT and groups_ == 2 * 3 * splits * 2 and t["R"] == 10 and rows == 20
    assert chunk % t["TK"] == 0 and (splits - 1) * chunk < 1000 <= splits * chunk
    scales = launch.inputs[da._SPEC.inputs.index("scales")]
    assert abs(float(scales[0]) - da.LOG2E) < 1e-6  # scale 1.0 in base 2, applied in the kernel
    assert t["DPT"] * t["BV"] <= 32 and t["DPT"] * t["R"] <= 32
    assert launch.output_shapes == [(6, splits, 20), (6, splits, 20), (6, splits, 20, 64)]
    assert da.row_blocks(48, 64) == (16, 3) and da.row_blocks(3, 64) == (3, 1)
    assert da.row_blocks(17, 128) == (6, 3)  # max_rows(128) = 8
    assert m.shape == (2, 3, 20, 1) and acc.shape == (2, 3, 20, 64)
    assert not da._SPEC.row_contiguous  # slices of the cache's tail are read in place


def test_shape_errors():
    q, qp, keys, values, kt, vt = random_segment(1, 2, 4, 64, 30, 3, 0, 3, False)
    with pytest.raises(ValueError, match="keys"):
        da.decode_attend(q, keys, values, kt, vt, key_bits=4, value_bits=3, scale=1.0)
    with pytest.raises(ValueError, match="tables"):
        da.decode_attend(q, keys, values, vt[:4], vt, key_bits=3, value_bits=3, scale=1.0)
    with pytest.raises(ValueError):
        kp.unpack(mx.zeros((2, 5), dtype=mx.uint32), 3, 64)


# --- kernels vs references on the GPU ----------------------------------------------------------


@gpu
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 17, 128, 4095])
def test_gpu_pack_unpack(bits, n):
    x = mx.array(_rng(n).integers(0, 1 << bits, size=(33, n)).astype(np.uint8))
    words = kp.pack(x, bits)
    assert mx.array_equal(words, kp.pack_reference(x, bits))
    assert mx.array_equal(kp.unpack(words, bits, n), x)


@gpu
@pytest.mark.parametrize("bits", range(1, 9))
def test_gpu_scalar_quantize(bits):
    cents, bounds = as_mx(lloyd_max(128, bits))
    x = mx.array(_rng(bits).normal(size=(4095, 17)).astype(np.float32) * 0.1)
    idx = sq.quantize(x, bounds)
    assert mx.array_equal(idx, sq.quantize_reference(x, bounds))
    assert mx.array_equal(sq.dequantize(idx, cents), sq.dequantize_reference(idx, cents))


def _assert_fp16_close(got, want):
    """fp16 norms: equal, or one fp16 step apart (the fp32 sum of squares associates differently
    in the kernel, which can move the value across an fp16 rounding boundary)."""
    a, b = (np.array(x).astype(np.float16).view(np.int16).astype(np.int32) for x in (got, want))
    assert np.abs(a - b).max() <= 1 and (a != b).mean() < 0.01


@gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gpu_hadamard_quantize(dim, bits):
    codec = VectorCodec(dim, QuantSpec(bits), seed=7)
    bounds = as_mx(codec.codebook)[1]
    x = mx.array(_rng(dim).normal(size=(4095, dim)).astype(np.float32))
    idx, norm = hq.hadamard_quantize(x, codec.rotation.signs, bounds)
    ref_idx, ref_norm = hq.hadamard_quantize_reference(x, codec.rotation.signs, bounds)
    _assert_fp16_close(norm, ref_norm)
    got, want = (np.array(kp.unpack_reference(i, bits, dim)) for i in (idx, ref_idx))
    y = np.array(codec.rotation.forward(x / mx.linalg.norm(x, axis=-1, keepdims=True)))
    gap = np.abs(y[..., None] - np.array(bounds)).min(axis=-1)  # distance to nearest boundary
    assert np.all(gap[got != want] < 1e-5), "a code differs away from a cell boundary"
    assert (got != want).mean() < 1e-4


@gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_gpu_qjl_encode(dim):
    sketch = QJLSketch(dim, seed=9)
    r = mx.array(_rng(dim).normal(size=(4095, dim)).astype(np.float32) * 0.1)
    signs, rnorm = qe.qjl_encode(r, sketch._st)
    ref_signs, ref_rnorm = qe.qjl_encode_reference(r, sketch._st)
    _assert_fp16_close(rnorm, ref_rnorm)
    got, want = (np.array(kp.unpack_reference(s, 1, sketch.m)) for s in (signs, ref_signs))
    dots = np.abs(np.array(r @ sketch._st))
    assert np.all(dots[got != want] < 1e-5), "a sign differs away from zero"


def _gpu_decode_case(name, p, gqa, length, lq=1, causal_base=None, capacity=None, seed=0):
    b1, b2, qjl, bv = preset_bits(name)
    q, qp, keys, values, kt, vt = random_segment(1, 8, gqa * lq, p, length, b1, b2, bv, qjl, seed=seed, capacity=capacity)
    kw = dict(key_bits=b1, key_bits2=b2, value_bits=bv, scale=p**-0.5, q_proj=qp, lq=lq, causal_base=causal_base)
    out = da.decode_attend(q, keys, values, kt, vt, **kw)
    ref = da.decode_attend_reference(q, keys, values, kt, vt, **kw)
    errs = state_errors(out, ref)
    assert errs["finite"] and errs["unseen_ok"], errs
    assert errs["out_rel"] < 2e-5 and errs["l_rel"] < 1e-4 and errs["m_abs"] < 1e-4, errs


@gpu
@pytest.mark.parametrize("name", list(TURBO))
@pytest.mark.parametrize("p", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_gpu_decode_attend(name, p, gqa):
    for length in (1, 17, 4095):  # one kernel variant (compile) per test, three lengths
        _gpu_decode_case(name, p, gqa, length, seed=length)


@gpu
@pytest.mark.parametrize("name", ["tq4", "tq3", "tq3+qjl", "rvq2+2"])
@pytest.mark.parametrize("gqa", [4, 8])
@pytest.mark.parametrize("length", [32768, 131072])
def test_gpu_decode_attend_long(name, gqa, length):
    _gpu_decode_case(name, 128, gqa, length)


@gpu
@pytest.mark.parametrize("name", ["tq4", "tq3+qjl", "rvq2+2"])
def test_gpu_decode_attend_causal_and_strided(name):
    """Lq = 3 with keys masked per row (whole splits masked), read in place from tail slices."""
    _gpu_decode_case(name, 128, 4, 3000, lq=3, causal_base=900, capacity=3328)
    _gpu_decode_case(name, 64, 8, 517, lq=2, causal_base=-1, capacity=768)  # a row sees nothing
    _gpu_decode_case(name, 64, 3, 4000, lq=16, causal_base=3990)  # a question's worth of rows


@gpu
@pytest.mark.parametrize("name", list(TURBO))
def test_gpu_fused_attention_end_to_end(name):
    view = _two_segment_view(kvcache.get_preset(name), 8, 128, seed=4)
    q = mx.random.normal((1, 32, 1, 128))
    a = compressed_attention(q, view, 128**-0.5, fused=False)
    b = compressed_attention(q, view, 128**-0.5)  # auto: fused on a GPU
    assert float(mx.abs(a - b).max() / mx.abs(a).max()) < 1e-4


def _stacked_views_case(name: str):
    """Three compressed layers through `to_arrays` (small parts stacked) and `split_layers`: the
    last layer's arrays are slices at an offset into the stacked ones. Returns (attention over
    the original layer, over the restored one, both fused where the backend has a kernel, and
    the restored one's MLX path)."""
    preset = kvcache.get_preset(name)
    layers = []
    for i in range(3):
        c = TurboQuantCache(preset, i)
        kv = mx.random.normal((2, 1, 2, 300, 64), key=mx.random.key(40 + i)) + 0.2
        c.update_and_fetch(kv[0], kv[1])
        layers.append(c)
    arrays = kvcache.to_arrays(layers, preset)
    assert any(n.startswith("turbo.") for n in arrays) and "2.k.idx" in arrays
    per_layer = kvcache.split_layers(arrays, [0, 1, 2])
    restored = TurboQuantCache.from_arrays(preset, 2, per_layer["2"], 64)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(5))
    outs = [compressed_attention(q, c.view(), 0.125) for c in (layers[2], restored)]
    return outs[0], outs[1], compressed_attention(q, restored.view(), 0.125, fused=False)


@pytest.mark.parametrize("name", ["tq4", "tq3+qjl"])
def test_attention_reads_stacked_slices(name):
    original, restored, mlx_path = _stacked_views_case(name)
    np.testing.assert_array_equal(np.array(restored), np.array(original))
    # a CUDA decode step of 4-bit keys and values runs on tensor cores: fp16 products
    mma = _prelude.backend() == "cuda" and name == "tq4"
    tol = dict(rtol=3e-3, atol=3e-4) if mma else dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(restored), np.array(mlx_path), **tol)


@gpu
@pytest.mark.parametrize("name", ["tq4", "tq3+qjl"])
def test_gpu_kernel_reads_stacked_slices(name):
    test_attention_reads_stacked_slices(name)


def test_kernel_tables_are_codec_values():
    """The fused kernel's tables decode exactly what VectorCodec.decode_rotated decodes."""
    for spec in (QuantSpec(3), QuantSpec(2, bits2=2)):
        codec = VectorCodec(64, spec, seed=1)
        x = mx.array(_rng().normal(size=(5, 64)).astype(np.float32))
        enc = codec.encode(x)
        codes = kp.unpack_reference(enc["idx"], spec.bits, 64).astype(mx.uint32)
        if spec.bits2:
            codes = (codes << spec.bits2) | kp.unpack_reference(enc["idx2"], spec.bits2, 64)
        got = mx.take(kernel_table(codec), codes) * enc["norm"].astype(mx.float32)[:, None]
        assert mx.array_equal(got, codec.decode_rotated(enc))
    kt, _ = tables(64, 2, 2, 3)
    assert kt.shape == (16,) and math.isfinite(float(kt.sum()))


def _step_view(H, P, L, n_sink, n_win, name="tq4", seed=0):
    from longctx.kvcache.presets import get_preset
    from longctx.kvcache.turbo import CompressedKV, codecs_for

    kc, vc = codecs_for(get_preset(name), P, layer=1)
    rng = np.random.default_rng(seed)

    def normal(*shape, dtype=np.float32):
        return mx.array(rng.normal(size=shape).astype(dtype))

    seg_k, seg_v = kc.encode(normal(1, H, L, P)), vc.encode(normal(1, H, L, P))
    sink = (normal(1, H, n_sink, P, dtype=np.float16),) * 2 if n_sink else None
    window = (normal(1, H, n_win, P), normal(1, H, n_win, P)) if n_win else None
    return CompressedKV(kc, vc, ((seg_k, seg_v, L),), n_sink + L + n_win, normal(1, H, 1, P), window, sink)


def _rel(got, want) -> float:
    a, b = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("n_sink,n_win,qdt", [(4, 37, "float16"), (0, 0, "float32"), (0, 20, "float32"), (3, 0, "float16")])
def test_decode_step_references(n_sink, n_win, qdt):
    """The two-launch decode step's references (the CPU path and the kernels' oracle): the
    partials of unrotated queries and the finish (merge, rotation back, exact tokens, mean)
    compose to the blocked path's output."""
    from longctx.kernels import decode_attend as da
    from longctx.kernels import decode_finish as df
    from longctx.kvcache.attention import kernel_table

    H, r, P, L = 2, 4, 64, 300
    view = _step_view(H, P, L, n_sink, n_win, seed=n_sink + n_win)
    kc, vc = view.key_codec, view.value_codec
    seg_k, seg_v, _ = view.segments[0]
    q = mx.array(np.random.default_rng(1).normal(size=(1, H * r, 1, P))).astype(getattr(mx, qdt))
    parts = da.decode_attend_partials(
        q.reshape(1, H, r, P),
        seg_k,
        seg_v,
        kernel_table(kc),
        kernel_table(vc),
        kc.rotation.signs,
        key_bits=4,
        value_bits=4,
        scale=0.125,
    )
    got = df.decode_finish(
        *parts, q.reshape(1, H, r, P), view.sink, view.window, vc.rotation.signs, view.value_mean, 0.125
    ).reshape(q.shape)
    want = compressed_attention(q, view, 0.125, fused=False)
    assert got.dtype == q.dtype
    assert _rel(got, want) < (2e-3 if qdt == "float16" else 1e-5)


@gpu
@pytest.mark.parametrize("shape", [(8, 4, 128, 4096), (8, 4, 128, 32768), (3, 3, 64, 5000), (1, 4, 256, 3000), (2, 16, 64, 700)])
@pytest.mark.parametrize("qdt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("name", ["tq4", "tq3", "tq4k3v", "tq4:portable"])
def test_gpu_decode_step(shape, qdt, name, monkeypatch):
    """On the device, a decode step takes the two-launch path and matches the blocked path and
    the compiled fused path (`fused_step=False`); its sink and window are in the decode-attend
    kernel's splits, the tensor-core one's or the portable one's (tq4:portable: the kernel Metal
    runs, `attend_step.attention(..., tensor_cores=False)`)."""
    from longctx.kvcache import attend_step
    from longctx.kvcache.attention import choose_path

    portable = name.endswith(":portable")
    name = name.split(":")[0]
    H, r, P, L = shape
    view = _step_view(H, P, L, 4, 57, name, seed=L)
    q = (mx.random.normal((1, H * r, 1, P), key=mx.random.key(L)) * 2).astype(getattr(mx, qdt))
    assert choose_path(view, None, 1, rows=r)[0] == "fused-step"
    got = attend_step.attention(q, view, P**-0.5, tensor_cores=False) if portable else compressed_attention(q, view, P**-0.5)
    want = compressed_attention(q, view, P**-0.5, fused=False)
    assert choose_path(view, None, 1, rows=r, fused_step=False)[0] == "fused-compiled"
    compiled = compressed_attention(q, view, P**-0.5, fused_step=False)
    assert got.dtype == q.dtype
    tol = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 2e-5}[qdt]
    if dm.applies(P, r, view.key_codec, view.value_codec):
        tol = max(tol, 1e-3)  # the tensor-core kernel (the compiled path's too): fp16 products, fp32 accumulation
    assert _rel(got, want) < tol and _rel(got, compiled) < tol


@gpu
@pytest.mark.skipif(_prelude.backend() != "cuda", reason="the tensor-core kernel is CUDA only")
@pytest.mark.parametrize(
    "shape", [(8, 4, 128, 131072), (4, 7, 128, 32768), (3, 3, 64, 5000), (1, 8, 256, 3001), (2, 1, 128, 17), (8, 4, 128, 4095)]
)
@pytest.mark.parametrize("qdt", ["bfloat16", "float32"])
def test_gpu_decode_attend_mma(shape, qdt):
    """On the device, the tensor-core kernel's split states merge to the portable kernel's
    reference within fp16 rounding, the cache a slice of a longer tail (only the GPU checks its
    `cp.async` pipeline)."""
    from longctx.quant.rotation import rademacher_signs

    H, r, P, L = shape
    q, _, keys, values, kt, _ = random_segment(1, H, r, P, L, 4, 0, 4, False, seed=L, capacity=L + 300)
    q = q.astype(getattr(mx, qdt))
    signs = mx.array(rademacher_signs(P, 9))
    got = dm.decode_attend_mma_partials(q, keys, values, kt, signs, scale=P**-0.5)
    assert not _prelude.failed(dm.NAME)
    with _prelude.force_backend("cpu"):
        ref = da.decode_attend_partials(q, keys, values, kt, kt, signs, key_bits=4, value_bits=4, scale=P**-0.5)

    def merged(state):
        m, l, acc = sc.split_combine_reference(*state)
        return m[..., None], l[..., None], acc

    errs = state_errors(merged(got), merged(ref))
    assert errs["finite"] and errs["out_rel"] < 1e-3 and errs["l_rel"] < 5e-3, errs


def _gpu_step_case(H, r, P, L, q_dtype):
    """A whole decode step's arguments (one batch, H KV heads of r query rows, L compressed keys
    in a buffer of L + 300, a 4-token sink and a window of 37 valid slots of 64; the output in q's
    dtype) and its reference on the CPU (the partials', then the finish's, fp32): (args for
    `decode_step_mma` before its count array, want)."""
    from longctx.kernels import decode_finish as dfin
    from longctx.quant.rotation import rademacher_signs

    q, _, keys, values, kt, _ = random_segment(1, H, r, P, L, 4, 0, 4, False, seed=L, capacity=L + 300)
    q = q.astype(q_dtype)
    rng = np.random.default_rng(L)

    def normal(*s):
        return mx.array(rng.normal(size=s).astype(np.float32))

    sink = (normal(1, H, 4, P), normal(1, H, 4, P))
    window = (normal(1, H, 64, P)[:, :, :37], normal(1, H, 64, P)[:, :, :37])
    k_signs, v_signs = mx.array(rademacher_signs(P, 9)), mx.array(rademacher_signs(P, 10))
    mean = normal(1, H, 1, P)
    count = dfin.count(37)
    args = (q, keys, values, kt, k_signs, sink, window, v_signs, mean, P**-0.5, q.dtype, count)
    with _prelude.force_backend("cpu"):
        parts = da.decode_attend_partials(q, keys, values, kt, kt, k_signs, key_bits=4, value_bits=4, scale=P**-0.5)
        want = dfin.decode_finish_reference(*parts, q, sink, window, v_signs, mean, P**-0.5, mx.float32, count)
    return args, want


@gpu
@pytest.mark.skipif(_prelude.backend() != "cuda", reason="the tensor-core kernel is CUDA only")
@pytest.mark.parametrize("shape", [(8, 4, 128, 131072), (4, 7, 128, 32768), (2, 1, 128, 17), (8, 4, 128, 4095)])
@pytest.mark.parametrize("qdt", ["bfloat16", "float32"])
def test_gpu_decode_step_mma_whole(shape, qdt):
    """On the device, the whole step in one launch (the last threadgroup of each KV head runs
    the finish) equals the partials' and the finish's references within fp16 rounding, with a
    sink and a window as the valid prefix of its buffers; ten launches chained through their
    count outputs (as `attend_step` passes them) give the same output each time (bit for bit
    where every split's keys are fixed; within fp32 rounding where the step hands keys out, from
    `DYNAMIC_MIN_KEYS` on: which warp takes which grant, and so the order of its sums, varies),
    and the counts stay zeros."""
    H, r, P, L = shape
    args, want = _gpu_step_case(H, r, P, L, getattr(mx, qdt))
    assert ds.fuses_finish(P, r)
    counts = ds.counter(H)
    outs = []
    for _ in range(10):
        out, counts = ds.decode_step_mma(*args, counts)
        outs.append(out)
    mx.eval(outs, counts)
    assert not _prelude.failed(ds.STEP_NAME)
    assert not np.array(counts).any() and not np.array(ds.counter(H)).any()
    tol = {"bfloat16": 1e-2, "float32": 2e-3}[qdt]
    assert _rel(outs[0], want) < tol
    # (bfloat16 outputs: one rounding step of the output, 2^-8 relative, where a sum's order
    # flips it)
    again = {"bfloat16": 8e-3, "float32": 1e-5}[qdt] if ds.hands_out(L) else 0.0
    for o in outs[1:]:
        if again:
            assert _rel(o, outs[0]) < again
        else:
            assert np.array_equal(np.array(o.astype(mx.float32)), np.array(outs[0].astype(mx.float32)))


@gpu
@pytest.mark.skipif(_prelude.backend() != "cuda", reason="the tensor-core kernel is CUDA only")
@pytest.mark.parametrize("shape", [(8, 4, 128, 131072), (4, 7, 128, 32768), (2, 1, 128, 17), (8, 4, 128, 4095)])
def test_gpu_decode_step_mma_dynamic(shape):
    """On the device, the whole step with its keys handed out while it runs (`dynamic=True`, at
    every length) equals the references within fp16 rounding with a sink and a window; ten
    launches chained through their count outputs agree within rounding (which warp takes which
    grant varies), and every count and grant line is back to zero."""
    H, r, P, L = shape
    args, want = _gpu_step_case(H, r, P, L, mx.bfloat16)
    counts = ds.counter(H)
    assert counts.shape == (33 * max(4, H),)
    outs = []
    for _ in range(10):
        out, counts = ds.decode_step_mma(*args, counts, dynamic=True)
        outs.append(out)
    mx.eval(outs, counts)
    assert not _prelude.failed(ds.STEP_NAME)
    assert not np.array(counts).any() and not np.array(ds.counter(H)).any()
    for o in outs:
        assert _rel(o, want) < 1e-2


@gpu
@pytest.mark.parametrize("name", ["tq4", "tq3"])
def test_gpu_decode_steps_through_a_fork(name):
    """The product's flow: a restored prefix, an answering fork, a question, then decode steps
    (the window fills its buffers; the compiled two-launch step replays with a new count each
    step): every step matches the blocked path, and steps share one trace."""
    from longctx.kvcache import attend_step

    preset = kvcache.get_preset(name)
    parent = TurboQuantCache(preset, 0)
    kv = mx.random.normal((2, 1, 8, 3000, 128), key=mx.random.key(3)).astype(mx.bfloat16)
    parent.update_and_fetch(kv[0], kv[1])
    parent.seal()
    restored = TurboQuantCache.from_arrays(preset, 0, parent.arrays(), 128)
    fork = restored.fork(exact_new=64)
    question = mx.random.normal((2, 1, 8, 12, 128), key=mx.random.key(4)).astype(mx.bfloat16)
    fork.update_and_fetch(question[0], question[1])
    attend_step._COMPILED.clear()
    for step in range(5):
        new = mx.random.normal((2, 1, 8, 1, 128), key=mx.random.key(10 + step)).astype(mx.bfloat16)
        view, _ = fork.update_and_fetch(new[0], new[1])
        q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(20 + step)).astype(mx.bfloat16)
        got = compressed_attention(q, view, 128**-0.5)
        want = compressed_attention(q, view, 128**-0.5, fused=False)
        assert _rel(got, want) < 1e-2, step
    assert len(attend_step._COMPILED) == 1


def _same_fields(a, b) -> bool:
    """Two objects' fields hold the same values (arrays, nested in tuples, lists and dicts)."""

    def same(x, y):
        if isinstance(x, mx.array) or isinstance(y, mx.array):
            return (
                isinstance(x, mx.array)
                and isinstance(y, mx.array)
                and x.shape == y.shape
                and x.dtype == y.dtype
                and mx.array_equal(x, y).item()
            )
        if isinstance(x, (tuple, list)):
            return type(x) is type(y) and len(x) == len(y) and all(map(same, x, y))
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x is y or x == y

    return vars(a).keys() == vars(b).keys() and all(same(vars(a)[k], vars(b)[k]) for k in vars(a))


def test_decode_step_plan_replays_and_checks(monkeypatch):
    """A layer's decode step keeps its compiled launch with its cache (`attend_step._Plan`): later
    steps replay it, with the outputs of the full path bit for bit and of the blocked path to
    bf16 precision; a changed switch, executor or forced backend, a full or grown window buffer,
    another layout or the other decode-attend kernel sends the step back to the full path. The kernels run as their references (on the
    CPU, the GPU backend's code paths)."""
    from longctx.kernels import decode_finish as df
    from longctx.kvcache import attend_step, turbo

    def references(spec, launch, reference=None):
        return list(reference())

    for module in (da, dm, ds, df):
        monkeypatch.setattr(module, "run", references)
    preset = kvcache.get_preset("tq4")
    parent = TurboQuantCache(preset, 0)
    kv = mx.random.normal((2, 1, 2, 300, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    parent.update_and_fetch(kv[0], kv[1])
    parent.seal()
    fork = TurboQuantCache.from_arrays(preset, 0, parent.arrays(), 64).fork(exact_new=300)
    full = []
    monkeypatch.setattr(attend_step, "attention", lambda *a, _f=attend_step.attention, **k: full.append(1) or _f(*a, **k))
    attend_step._COMPILED.clear()
    with _prelude.force_backend("cuda"):
        question = mx.random.normal((2, 1, 2, 250, 64), key=mx.random.key(4)).astype(mx.bfloat16)
        fork.update_and_fetch(question[0], question[1])
        for step in range(10):  # window 251..260: its buffer of 256 fills at 256, then grows
            new = mx.random.normal((2, 1, 2, 1, 64), key=mx.random.key(10 + step)).astype(mx.bfloat16)
            view, _ = fork.update_and_fetch(new[0], new[1])
            # the decode view (`_step_view`, from the last one's fields) is what view() builds
            assert _same_fields(view, fork.view()), step
            q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(20 + step)).astype(mx.bfloat16)
            before = len(full)
            got = compressed_attention(q, view, 0.125)
            replayed = len(full) == before
            # a step's first trace is an eager call, the next keeps the plan: steps 0 and 1; 5
            # fills the buffer (the view has none), 6 and 7 trace the grown buffer's step
            assert replayed == (step not in (0, 1, 5, 6, 7)), step
            assert _rel(got, compressed_attention(q, view, 0.125, fused=False)) < 1e-2, step
            if replayed:
                assert mx.array_equal(got, attend_step.attention(q, view, 0.125)), step
                # a view with other paths (the blocked path asked for) is not the kept one's
                blocked = dataclasses.replace(view, paths=turbo.Paths(fused_max_lq=0))
                assert attend_step.replay(q, blocked, 0.125) is None
                assert attend_step.replay(q.astype(mx.float16), view, 0.125) is None
                # the portable kernel's step (`tensor_cores=False`) is not the kept one
                assert attend_step.replay(q, view, 0.125, tensor_cores=False) is None
                # a backend forced again, even the same one, retires the kept plan (`_env`
                # compares generations); the next step keeps a new one
                with _prelude.force_backend("cuda"):
                    pass
                assert attend_step.replay(q, view, 0.125) is None
                assert mx.array_equal(got, attend_step.attention(q, view, 0.125)), step
                assert attend_step.replay(q, view, 0.125) is not None
    with _prelude.force_backend("cpu"):  # another backend: the full path decides again
        assert attend_step.replay(q, view, 0.125) is None
        # a view without a window (benchmarks/attend.py's) keeps a plan too
        bare = dataclasses.replace(fork.view(), window=None, window_buffer=None, sink=None, plan=[None])
    with _prelude.force_backend("cuda"):
        n = len(full)
        first = [compressed_attention(q, bare, 0.125) for _ in range(2)]
        assert attend_step.replay(q, bare, 0.125) is not None and len(full) == n + 2
        assert mx.array_equal(compressed_attention(q, bare, 0.125), first[1])
        assert _rel(first[1], compressed_attention(q, bare, 0.125, fused=False)) < 1e-2


def test_decode_attend_mma_launch_plan(monkeypatch):
    """The tensor-core kernel's launch plan: shared memory within an H200 block's 227 KiB, at
    least one threadgroup per SM (4 at P = 128, the register cap's), splits of whole 16 x
    WARPS-key tiles that cover the keys with none empty, about one wave; and it applies only to
    what it decodes (CUDA, 4-bit single-stage keys and values of one codebook, no QJL, P
    64/128/256, <= 8 rows)."""
    from longctx.kvcache.presets import get_preset
    from longctx.kvcache.turbo import codecs_for

    waves, warps = 1, dm.WARPS
    assert dm.resident(128) == 4 and "__launch_bounds__(128, 4)" in dm.kernel_spec(128).header
    for p in dm.DIMS:
        assert dm.shared_bytes(p) <= 227 * 1024 and dm.resident(p) >= 1
        assert dm.resident(p) * (dm.shared_bytes(p) + 1024) <= dm.SMEM_PER_SM
        for length in (1, 63, 64, 65, 4095, 32768, 131072):
            for bh in (1, 8, 32):
                for least in (1, 2, 4):  # MIN_WARP_BLOCKS: a split's fewest blocks per warp
                    monkeypatch.setattr(dm, "MIN_WARP_BLOCKS", least)
                    chunk, n = dm.splits(length, bh, p)
                    assert chunk % (16 * warps) == 0 and (n - 1) * chunk < length <= n * chunk
                    assert bh * n <= max(bh, waves * da.SM_COUNT * dm.resident(p) + bh)
                    if length == 131072 and least == 1:  # long enough to fill the waves
                        assert bh * n > (waves - 0.5) * da.SM_COUNT * dm.resident(p)
                    assert n == 1 or chunk >= 16 * warps * least
    kc, vc = codecs_for(get_preset("tq4"), 128, layer=0)
    with _prelude.force_backend("cuda"):
        assert dm.applies(128, 4, kc, vc) and dm.applies(128, 8, kc, vc)
        assert not dm.applies(128, 9, kc, vc) and not dm.applies(96, 4, kc, vc)
        for name in ("tq3", "tq4k3v", "rvq2+2", "tq3+qjl"):
            assert not dm.applies(128, 4, *codecs_for(get_preset(name), 128, layer=0)), name
    with _prelude.force_backend("metal"):
        assert not dm.applies(128, 4, kc, vc)


def test_decode_step_codec_plan_follows_backend():
    """What a decode step works out once per codec pair (path fit, tensor-core and portable
    kernels, tables) is worked out again when the backend changes, and per codec object (another
    layer's codecs of the same spec get their own tables)."""
    from longctx.kvcache import attend_step
    from longctx.kvcache.presets import get_preset
    from longctx.kvcache.turbo import codecs_for

    kc, vc = codecs_for(get_preset("tq4"), 128, layer=0)
    k1, v1 = codecs_for(get_preset("tq4"), 128, layer=1)
    with _prelude.force_backend("cpu"):
        assert not attend_step._codecs(kc, vc, 4).fits  # CPU: the references
    with _prelude.force_backend("cuda"):
        c = attend_step._codecs(kc, vc, 4)
        assert c.fits and c.mma and not c.sg and attend_step._codecs(kc, vc, 4) is c
        assert c.portable  # (`attention(..., tensor_cores=False)`: it rotates q itself)
        other = attend_step._codecs(k1, v1, 4)
        assert other is not c and other.spec == c.spec and other.k_arrays[1] is k1.rotation.signs
        assert not attend_step._codecs(kc, vc, 9).mma  # past the MMA's 8 rows
    with _prelude.force_backend("metal"):
        c2 = attend_step._codecs(kc, vc, 4)
        assert c2 is not c and c2.fits and not c2.mma and c2.sg  # simdgroup matrices
        assert not attend_step._codecs(kc, vc, 9).sg  # past their 8 rows


def test_decode_finish_bounds_its_threadgroup_memory():
    """Shapes whose buffers would pass Metal's 32 KiB (16 rows of 256 dims: 48 KiB) are not
    taken; they stay on the compiled fused path."""
    from longctx.kernels import decode_finish as df

    assert df.supported(128, 4) and df.supported(256, 8) and df.supported(64, 16)
    assert not df.supported(256, 16) and not df.supported(128, 17) and not df.supported(96, 4)


def test_decode_finish_reference_reads_the_count_inside_a_trace():
    """The finish's reference (the fallback of a compiled step) takes the window's count as an
    array: one trace serves every count, each step seeing exactly its valid slots."""
    from longctx.kernels import decode_attend as da
    from longctx.kernels import decode_finish as df
    from longctx.kvcache.attention import kernel_table

    H, r, P, L = 2, 4, 64, 200
    view = _step_view(H, P, L, 3, 40, seed=5)
    kc, vc = view.key_codec, view.value_codec
    seg_k, seg_v, _ = view.segments[0]
    q = mx.array(np.random.default_rng(2).normal(size=(1, H, r, P)).astype(np.float32))
    parts = da.decode_attend_partials(
        q, seg_k, seg_v, kernel_table(kc), kernel_table(vc), kc.rotation.signs, key_bits=4, value_bits=4, scale=0.125
    )
    fn = mx.compile(
        lambda count: df.decode_finish_reference(
            *parts, q, view.sink, view.window, vc.rotation.signs, view.value_mean, 0.125, mx.float32, count
        )
    )
    for n in (40, 7, 23, 1):
        want = df.decode_finish(
            *parts, q, view.sink, (view.window[0][:, :, :n], view.window[1][:, :, :n]), vc.rotation.signs, view.value_mean, 0.125
        )
        got = fn(mx.array([n], dtype=mx.int32))
        assert _rel(got, want) < 1e-5, n


def test_kernel_launches_pass_no_array_of_eight_bytes_or_less():
    """MLX's CUDA allocator puts arrays of <= 8 bytes in a managed pool advised read-mostly,
    whose device copy a host write invalidates (one 8-byte scales read was about half of the
    decode step's tensor-core kernel at 8k on the H200): a prefill chunk's and a decode step's
    launches pass their parameters, scales and counts as `_prelude.constant` arrays, padded past
    it. The stand-ins for absent inputs, which no kernel reads, are the only exceptions."""
    from longctx.kernels import decode_attend as da_mod
    from longctx.kernels import decode_finish as df

    small = []

    def record(spec, launch):
        unread = {id(a) for a in da_mod._DUMMIES + df._DUMMY}
        small.extend((spec.name, a.shape, a.dtype) for a in launch.inputs if a.nbytes <= 8 and id(a) not in unread)
        return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]

    preset = kvcache.get_preset("tq4")
    with _prelude.executor(record, as_backend="cuda"):
        parent = TurboQuantCache(preset, 0)
        for n in (300, 200):  # a second chunk: the fused prefill encode and the dense path
            kv = mx.random.normal((2, 1, 2, n, 128), key=mx.random.key(n)).astype(mx.bfloat16)
            view, _ = parent.update_and_fetch(kv[0], kv[1])
            q = mx.random.normal((1, 8, n, 128), key=mx.random.key(1)).astype(mx.bfloat16)
            mx.eval(compressed_attention(q, view, 128**-0.5, mask="causal"))
        parent.seal()
        fork = TurboQuantCache.from_arrays(preset, 0, parent.arrays(), 128).fork(exact_new=64)
        for _ in range(3):  # decode steps: the tensor-core kernel and the finish
            new = mx.random.normal((2, 1, 2, 1, 128), key=mx.random.key(7)).astype(mx.bfloat16)
            view, _ = fork.update_and_fetch(new[0], new[1])
            q = mx.random.normal((1, 8, 1, 128), key=mx.random.key(8)).astype(mx.bfloat16)
            mx.eval(compressed_attention(q, view, 128**-0.5))
    assert small == []
    assert _prelude.constant((3,), mx.int32).tolist() == [3, 0, 0, 0]
    assert _prelude.constant((0.5,), mx.float16).nbytes == 16


def test_no_kernel_module_global_is_set_from_outside():
    """Kernel variants are chosen by template arguments and keyword arguments, not by module
    globals set from outside: no library module or benchmark assigns an attribute of a kernel
    module (a compiled decode step's trace and kept plan would not see it change). (`_prelude`,
    the launcher, takes hooks: `runtime.cuda_kernels.install`.)"""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    for path in [*root.glob("longctx/**/*.py"), *root.glob("benchmarks/**/*.py")]:
        tree = ast.parse(path.read_text())
        kernel_names = {
            a.asname or a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("kernels")
            for a in node.names
            if not a.name.startswith("_")
        }
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in kernel_names:
                        found.append(f"{path.relative_to(root)}:{e.lineno} {e.value.id}.{e.attr}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in kernel_names
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno} setattr")
    assert found == []
