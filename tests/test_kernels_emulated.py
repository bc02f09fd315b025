"""The kernel bodies themselves, run on the CPU by an emulator, and compiled with nvcc (opt-in).

Set LONGCTX_KERNEL_EMU=1 to run (g++ needed; each kernel variant compiles in ~2 s, ~1 min in
all, so the plain test command leaves it out and `.ci/run` runs it after the Metal checks).
With nvcc on the PATH the exact sources MLX would hand NVRTC are also compiled for sm_90 and
must not spill registers.
"""

from __future__ import annotations

import os
import re
import shutil

import mlx.core as mx
import numpy as np
import pytest
from kernel_cases import preset_bits, random_segment, state_errors

from longctx.kernels import _prelude
from longctx.kernels import decode_attend as da
from longctx.kernels import decode_attend_mma as dm
from longctx.kernels import decode_step_mma as ds
from longctx.kernels import hadamard_quant as hq
from longctx.kernels import pack as kp
from longctx.kernels import qjl_encode as qe
from longctx.kernels import scalar_quant as sq
from longctx.quant.codebooks import as_mx, lloyd_max
from longctx.quant.codec import QuantSpec, VectorCodec
from longctx.quant.qjl import QJLSketch

kernel_emu = pytest.importorskip("kernel_emu")

if os.environ.get("LONGCTX_KERNEL_EMU") == "1" and not kernel_emu.available():
    raise RuntimeError("LONGCTX_KERNEL_EMU=1 needs g++ on the PATH")  # CI must not skip quietly
pytestmark = pytest.mark.skipif(os.environ.get("LONGCTX_KERNEL_EMU") != "1", reason="opt-in: LONGCTX_KERNEL_EMU=1 (needs g++)")


@pytest.fixture
def emulated():
    with _prelude.executor(kernel_emu.emulator()):
        yield


def test_pack_unpack(emulated):
    rng = np.random.default_rng(0)
    for bits in (1, 2, 3, 5, 8):
        x = mx.array(rng.integers(0, 1 << bits, size=(5, 100)).astype(np.uint8))
        words = kp.pack(x, bits)
        assert mx.array_equal(words, kp.pack_reference(x, bits))
        assert mx.array_equal(kp.unpack(words, bits, 100), x)


def test_scalar(emulated):
    for bits in (2, 4, 6):
        cents, bounds = as_mx(lloyd_max(128, bits))
        x = mx.array(np.random.default_rng(bits).normal(size=(3, 77)).astype(np.float32) * 0.1)
        idx = sq.quantize(x, bounds)
        assert mx.array_equal(idx, sq.quantize_reference(x, bounds))
        assert mx.array_equal(sq.dequantize(idx, cents), sq.dequantize_reference(idx, cents))


@pytest.mark.parametrize("dim,bits", [(64, 3), (128, 4), (256, 2)])
def test_hadamard_quantize(emulated, dim, bits):
    codec = VectorCodec(dim, QuantSpec(bits), seed=3)
    x = mx.array(np.random.default_rng(dim).normal(size=(6, dim)).astype(np.float32))
    idx, norm = hq.hadamard_quantize(x, codec.rotation.signs, as_mx(codec.codebook)[1])
    enc = codec.encode(x)
    assert mx.array_equal(norm, enc["norm"])
    assert mx.array_equal(idx, enc["idx"])  # a boundary tie is possible in principle, not here


@pytest.mark.parametrize("dim", [64, 128])
def test_qjl_encode(emulated, dim):
    sketch = QJLSketch(dim, 5)
    r = mx.array(np.random.default_rng(dim).normal(size=(5, dim)).astype(np.float32))
    signs, rnorm = qe.qjl_encode(r, sketch._st)
    want = sketch.sketch(r)
    assert mx.array_equal(signs, want[0]) and mx.array_equal(rnorm, want[1])


CASES = [  # B, H, R, P, L, preset, lq, causal_base, target_groups
    (1, 2, 4, 128, 300, "tq4", 1, None, None),
    (1, 1, 3, 64, 200, "tq3+qjl", 1, None, None),
    (2, 2, 8, 64, 130, "rvq2+2", 2, None, None),
    (1, 2, 6, 128, 260, "tq3", 3, 250, None),
    (1, 1, 20, 64, 129, "tq4k3v", 4, None, None),  # 20 rows: two row blocks of 10
    (1, 1, 20, 64, 129, "tq4k3v", 4, 100, None),  # causal: block 2 starts mid-token (row 10)
    (1, 2, 17, 128, 260, "tq4", 1, None, None),  # 3 row blocks of 6: the last has 5 rows
    (1, 2, 19, 64, 300, "tq3+qjl", 19, 250, None),  # blocks of 10 + 9, causal, QJL
    (1, 1, 2, 256, 150, "tq4", 1, None, None),
    (1, 2, 4, 128, 1000, "tq4", 1, None, 2),  # chunks of several tiles: rescaling
    (1, 2, 4, 128, 1000, "tq3+qjl", 1, None, 2),
    (1, 2, 4, 128, 1000, "rvq2+2", 1, None, 2),  # staged rows of both stages, several tiles
    (1, 1, 4, 256, 700, "tq4", 1, None, 2),  # 64-key tiles (STAGE_WORDS)
    (1, 1, 6, 64, 700, "rvq2+2", 3, 40, 3),  # later splits fully masked
    (1, 1, 4, 64, 300, "tq4", 2, -1, None),  # row 0 of each head sees nothing
    (1, 2, 4, 128, 300, "tq5k4v", 1, None, None),  # 5-bit keys straddle words
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[5]}-P{c[3]}-R{c[2]}-L{c[4]}")
def test_decode_attend(emulated, monkeypatch, case):
    B, H, R, P, L, name, lq, causal_base, target = case
    b1, b2, qjl, bv = preset_bits(name)
    q, qp, keys, values, kt, vt = random_segment(B, H, R, P, L, b1, b2, bv, qjl, seed=L)
    if target:
        monkeypatch.setattr(da, "TARGET_GROUPS", target)
    kw = dict(key_bits=b1, key_bits2=b2, value_bits=bv, scale=P**-0.5, q_proj=qp, lq=lq, causal_base=causal_base)
    errs = state_errors(
        da.decode_attend(q, keys, values, kt, vt, **kw), da.decode_attend_reference(q, keys, values, kt, vt, **kw)
    )
    assert errs["finite"] and errs["unseen_ok"], errs
    assert errs["out_rel"] < 1e-5 and errs["l_rel"] < 1e-5 and errs["m_abs"] < 1e-5, errs


@pytest.mark.parametrize("strided,odd_rows", [(False, False), (True, True)])
@pytest.mark.parametrize("name", ["tq4", "rvq2+2", "tq3+qjl"])
def test_decode_attend_row_layouts(name, strided, odd_rows):
    """Contiguous rows, and rows of odd stride (no 16-byte staging loads: word by word), compute
    the same state as the padded rows of the other cases."""
    b1, b2, qjl, bv = preset_bits(name)
    q, qp, keys, values, kt, vt = random_segment(1, 2, 4, 128, 300, b1, b2, bv, qjl, seed=1)
    kw = dict(key_bits=b1, key_bits2=b2, value_bits=bv, scale=0.1, q_proj=qp)
    with _prelude.executor(kernel_emu.emulator(strided, odd_rows)):
        errs = state_errors(
            da.decode_attend(q, keys, values, kt, vt, **kw), da.decode_attend_reference(q, keys, values, kt, vt, **kw)
        )
    assert errs["finite"] and errs["out_rel"] < 1e-5 and errs["l_rel"] < 1e-5, errs


class _Recording:
    """An executor that runs `inner` and records the kernel names it launched."""

    def __init__(self, inner, names: list):
        self.inner, self.names = inner, names

    def __call__(self, spec, launch):
        self.names.append(spec.name)
        return self.inner(spec, launch)


class _Capture:
    def __init__(self):
        self.launches = {}

    def __call__(self, spec, launch):
        self.launches[(spec.name, tuple(launch.template))] = (spec, launch)
        return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_sources_compile_without_spills():
    cap = _Capture()
    with _prelude.executor(cap):
        kp.pack(mx.zeros((4, 128), dtype=mx.uint8), 3)
        kp.unpack(mx.zeros((4, 12), dtype=mx.uint32), 3, 128)
        sq.quantize(mx.zeros((10,)), mx.zeros((15,)))
        sq.quantize(mx.zeros((10,)), mx.zeros((63,)))
        sq.dequantize(mx.zeros((10,), dtype=mx.uint8), mx.zeros((16,)))
        hq.hadamard_quantize(mx.zeros((4, 256)), mx.ones((256,)), mx.zeros((15,)))
        qe.qjl_encode(mx.zeros((4, 128)), mx.zeros((128, 128)))
        for name in ("tq4", "tq3+qjl", "rvq2+2"):
            for p, r in ((128, 4), (128, 8), (64, 16), (256, 4), (64, 3)):
                b1, b2, qjl, bv = preset_bits(name)
                q, qp, keys, values, kt, vt = random_segment(1, 1, r, p, 40, b1, b2, bv, qjl)
                da.decode_attend(
                    q, keys, values, kt, vt, key_bits=b1, key_bits2=b2, value_bits=bv, scale=0.1, q_proj=qp, causal_base=7
                )
        for name, p, r, dt in (
            ("tq4", 128, 4, mx.bfloat16),
            ("tq3", 64, 3, mx.float16),
            ("tq4", 256, 8, mx.float32),
            ("tq4", 64, 3, mx.float16),
        ):
            # the decode step: one launch at P = 128, else two (the tensor-core partials with
            # the exact tokens at P = 64 / 256, tq4)
            from longctx.kvcache import attend_step

            view = _step_view(1, r, p, 40, name, 4, 9, seed=p)
            attend_step.attention(mx.zeros((1, r, 1, p), dtype=dt), view, 0.1)
    for (name, template), (spec, launch) in cap.launches.items():
        report = kernel_emu.nvcc_check(spec, launch)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(a == "0" and b == "0" for a, b in spills), (name, template, report)


@pytest.mark.parametrize("name,p,length", [("tq4", 64, 37), ("tq3", 128, 5), ("rvq2+2", 64, 9), ("tq5k4v", 256, 3)])
def test_dequant(emulated, name, p, length):

    from longctx.kernels import dequant as dq

    b1, b2, qjl, bv = preset_bits(name)
    _, _, keys, values, kt, vt = random_segment(1, 2, 1, p, length, b1, b2, bv, qjl, seed=length, capacity=length + 3)
    head = mx.array(np.random.default_rng(1).normal(size=(1, 2, 4, p)).astype(np.float16))
    after = mx.array(np.random.default_rng(2).normal(size=(1, 2, 5, p)).astype(np.float16))
    for enc, table, bits, bits2 in ((keys, kt, b1, b2), (values, vt, bv, 0)):
        for h, a in ((head, after), (None, None)):
            kw = dict(bits=bits, bits2=bits2, p=p, head=h, after=a)
            assert mx.array_equal(dq.dequant(enc, table, **kw), dq.dequant_reference(enc, table, **kw))


@pytest.mark.parametrize("b1,b2", [(1, 0), (6, 0), (7, 0), (8, 0), (3, 3), (5, 2), (1, 7)])
def test_dequant_bit_widths(emulated, b1, b2):
    """Every width: 8 codes of a chunk span up to 3 words (7 bits: 56 bits from bit 24)."""
    from kernel_cases import random_segment

    from longctx.kernels import dequant as dq

    _, _, keys, _, _, _ = random_segment(1, 2, 1, 64, 6, b1, b2, 4, False, seed=b1 * 10 + b2)
    table = mx.array(np.random.default_rng(b1).normal(size=(1 << (b1 + b2),)).astype(np.float32))
    kw = dict(bits=b1, bits2=b2, p=64)
    assert mx.array_equal(dq.dequant(keys, table, **kw), dq.dequant_reference(keys, table, **kw))


STEP_CASES = [  # H, R, P, L, preset, sink, window, target_groups, q dtype
    (2, 4, 128, 300, "tq4", 4, 37, None, "float16"),
    (2, 4, 128, 1000, "tq3", 0, 0, 2, "float32"),  # several tiles per split, no exact tokens
    (1, 3, 64, 200, "tq4k3v", 0, 150, None, "float16"),  # window over two tiles of 64 keys
    (1, 1, 256, 150, "tq4", 2, 1, None, "float32"),
    (2, 16, 64, 130, "tq3", 3, 0, None, "float16"),  # 16 rows: one row block
    (1, 2, 32, 90, "tq4", 1, 40, None, "float32"),
]


def _step_view(H, R, P, L, name, n_sink, n_win, seed):
    from longctx.kvcache.presets import get_preset
    from longctx.kvcache.turbo import CompressedKV, codecs_for

    kc, vc = codecs_for(get_preset(name), P, layer=seed % 5)
    rng = np.random.default_rng(seed)

    def normal(*shape, dtype=np.float32):
        return mx.array(rng.normal(size=shape).astype(dtype))

    # The cache's own encodings of random centered keys (one segment, a slice of a longer tail)
    k, v = normal(1, H, L + 5, P), normal(1, H, L + 5, P)
    seg_k = {n: a[:, :, :L] for n, a in kc.encode(k).items()}
    seg_v = {n: a[:, :, :L] for n, a in vc.encode(v).items()}
    sink = (normal(1, H, n_sink, P, dtype=np.float16), normal(1, H, n_sink, P, dtype=np.float16))
    # the window: the valid prefix of larger fp32 buffers, as `TurboQuantCache` keeps it
    wbuf = (normal(1, H, n_win + 7, P), normal(1, H, n_win + 7, P))
    window = (wbuf[0][:, :, :n_win], wbuf[1][:, :, :n_win])
    return CompressedKV(
        kc, vc, ((seg_k, seg_v, L),), n_sink + L + n_win, normal(1, H, 1, P), window if n_win else None, sink if n_sink else None
    )


@pytest.mark.parametrize("kernel", ["tensor-cores", "portable"])
@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: f"{c[4]}-P{c[2]}-R{c[1]}-L{c[3]}")
def test_decode_step(monkeypatch, case, kernel):
    """The decode step equals the pure-MLX blocked path: in one launch (the tensor-core kernel
    whose last threadgroup per KV head runs the finish, where it applies: P = 128), or in two (q
    rotated in the decode-attend kernel, or the tensor-core kernel where it applies, then the
    finish kernel: split merge, rotation back, sink and window, mean); `portable`: the portable
    kernel where the tensor-core one applies (`tensor_cores=False`)."""
    from longctx.kvcache import attend_step, attention

    H, R, P, L, name, n_sink, n_win, target, qdt = case
    view = _step_view(H, R, P, L, name, n_sink, n_win, seed=L + P)
    q = mx.array(np.random.default_rng(R).normal(size=(1, H * R, 1, P)).astype(qdt)) * 2
    if target:
        monkeypatch.setattr(da, "TARGET_GROUPS", target)
    tensor_cores = kernel != "portable"
    want = attention.compressed_attention(q, view, P**-0.5, fused=False)
    launched = []
    with _prelude.executor(_Recording(kernel_emu.emulator(), launched)):
        assert attention.choose_path(view, None, 1, True, rows=R)[0] == "fused-step"
        got = attend_step.attention(q, view, P**-0.5, tensor_cores=tensor_cores)
    mma = tensor_cores and name == "tq4" and P in dm.DIMS and R <= 8
    whole = mma and P == 32 * dm.WARPS
    # the portable kernel takes the sink and the window in its splits where they fit
    exact = (n_sink or n_win) and da.exact_fits(P, R, view.value_codec.spec.bits)
    assert launched == (
        [ds.STEP_NAME] if whole else [dm.NAME if mma else da.EXACT_NAME if exact else "lc_decode_attend", "lc_decode_finish"]
    )
    assert got.dtype == q.dtype and got.shape == q.shape
    a, b = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    # the tensor-core kernel's products are fp16 (fp32 accumulation)
    tol = 2e-3 if qdt == "float16" or mma else 2e-5
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < tol
    if n_win:  # the window as the valid prefix of longer buffers (a decode step's view)
        import dataclasses

        wk, wv = view.window
        bufs = [mx.concatenate([w, mx.full((1, H, 9, P), 1e4)], axis=2) for w in (wk, wv)]
        buffered = dataclasses.replace(view, window_buffer=(*bufs, mx.arange(n_win + 9) < n_win))
        with _prelude.executor(kernel_emu.emulator()):
            got2 = attend_step.attention(q, buffered, P**-0.5, tensor_cores=tensor_cores)
        assert np.array_equal(np.array(got2), np.array(got))


@pytest.mark.parametrize(
    "S,R,P,n_sink,n_win",
    [
        (1, 4, 128, 0, 0),
        (200, 4, 64, 2, 9),
        (66, 4, 128, 0, 0),
        (67, 16, 128, 1, 3),
        (300, 3, 32, 0, 40),
        (129, 1, 128, 1, 0),
        (50, 2, 32, 40, 30),
    ],
)  # a sink over two tiles
def test_decode_finish_merges_many_splits(emulated, S, R, P, n_sink, n_win):
    """The finish kernel's split merge over more splits than threads (blocks of P splits), with
    empty splits (m = -inf, l = 0, acc = 0) among them and a row whose splits are all empty,
    equals its MLX reference, the exact tokens included."""
    from longctx.kernels import decode_finish as dfin

    rng = np.random.default_rng(S + R + P)
    N, H = 2, 2

    def normal(*shape, dtype=np.float32):
        return mx.array(rng.normal(size=shape).astype(dtype))

    m = rng.normal(size=(N, S, R)).astype(np.float32) * 3
    empty = rng.random(size=(N, S, R)) < 0.3
    empty[0, :, 0] = True  # a row no split saw a key of: only the exact tokens (if any) count
    m[empty] = -np.inf
    m_p = mx.array(m)
    l_p = mx.where(mx.array(empty), 0.0, mx.abs(normal(N, S, R)) + 0.5)
    acc_p = mx.where(mx.array(empty)[..., None], 0.0, normal(N, S, R, P))
    q = normal(1, H, R, P, dtype=np.float16)
    sink = (normal(1, H, n_sink, P), normal(1, H, n_sink, P)) if n_sink else None
    window = (normal(1, H, n_win, P), normal(1, H, n_win, P)) if n_win else None
    signs = mx.array(np.where(rng.random(P) < 0.5, -1.0, 1.0).astype(np.float32))
    mean = normal(1, H, 1, P)
    args = (m_p, l_p, acc_p, q, sink, window, signs, mean, P**-0.5)
    got = dfin.decode_finish(*args, out_dtype=mx.float32)
    want = dfin.decode_finish_reference(*args, mx.float32, dfin.count(n_win) if window is not None else None)
    assert np.allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)


MMA_CASES = [  # B, H, R, P, L, capacity, q dtype, SM_COUNT (1: several blocks per warp)
    (1, 2, 4, 128, 300, None, "float32", None),
    (1, 1, 7, 128, 77, 96, "float16", None),  # a slice of a longer tail; GQA 7 (Qwen2.5-7B)
    (2, 1, 3, 64, 999, 1200, "float32", 1),  # ragged last block, double-buffered stages
    (1, 2, 8, 256, 1500, None, "float32", 1),
    (1, 1, 1, 128, 3, None, "float32", None),  # fewer keys than one block
]


@pytest.mark.parametrize("odd_rows", [False, True], ids=["aligned", "odd-rows"])
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: f"P{c[3]}-R{c[2]}-L{c[4]}")
def test_decode_attend_mma(monkeypatch, case, odd_rows):
    """The tensor-core kernel's split states, merged, equal the portable kernel's reference
    within fp16 rounding; splits past the keys hold nothing. Norms ramp up along the segment, so
    the running maxima move late and the accumulators are rescaled. Odd row strides take the
    word-by-word copies instead of 16-byte `cp.async`."""
    from longctx.kernels.split_combine import split_combine_reference
    from longctx.quant.rotation import rademacher_signs

    B, H, R, P, L, cap, qdt, sm = case
    if sm:
        monkeypatch.setattr(da, "SM_COUNT", sm)
    q, _, keys, values, kt, _ = random_segment(B, H, R, P, L, 4, 0, 4, False, seed=L, capacity=cap)
    q = q.astype(getattr(mx, qdt))
    keys["norm"] = (keys["norm"].astype(mx.float32) * mx.linspace(0.2, 2.0, L)).astype(mx.float16)
    signs = mx.array(rademacher_signs(P, 5))
    ref = da.decode_attend_partials(q, keys, values, kt, kt, signs, key_bits=4, value_bits=4, scale=P**-0.5)
    with _prelude.executor(kernel_emu.emulator(True, odd_rows)):
        got = dm.decode_attend_mma_partials(q, keys, values, kt, signs, scale=P**-0.5)
        assert not _prelude.failed(dm.NAME)
    chunk, n_split = dm.splits(L, B * H, P)
    assert got[0].shape == (B * H, n_split, R) and got[2].shape == (B * H, n_split, R, P)
    assert chunk % (16 * dm.WARPS) == 0 and (n_split - 1) * chunk < L

    def merged(state):
        m, l, acc = split_combine_reference(*state)
        return m[..., None], l[..., None], acc

    errs = state_errors(merged(got), merged(ref))
    assert errs["finite"] and errs["unseen_ok"], errs
    assert errs["out_rel"] < 1e-3 and errs["l_rel"] < 3e-3 and errs["m_abs"] < 3e-3, errs
    # the split states themselves, not only their merge
    m_g, l_g = np.array(got[0]), np.array(got[1])
    m_r, _, _ = merged(ref)
    assert np.isfinite(m_g).all() and (l_g > 0).all()
    assert np.abs(m_g.max(axis=1) - np.array(m_r)[..., 0]).max() < 3e-3


def _exact_step_inputs(B, H, P, n_sink, n_win, seed):
    """A decode step's arrays beside its segment: sink and window (the window the valid prefix
    of a buffer twice as long; None where empty), the key and value rotations' signs, the value
    mean, and the window's count."""
    from longctx.kernels import decode_finish as dfin
    from longctx.quant.rotation import rademacher_signs

    rng = np.random.default_rng(seed)

    def normal(*shape):
        return mx.array(rng.normal(size=shape).astype(np.float32))

    sink = (normal(B, H, n_sink, P), normal(B, H, n_sink, P)) if n_sink else None
    window = (normal(B, H, 2 * n_win, P)[:, :, :n_win], normal(B, H, 2 * n_win, P)[:, :, :n_win]) if n_win else None
    k_signs, v_signs = mx.array(rademacher_signs(P, 5)), mx.array(rademacher_signs(P, 6))
    return sink, window, k_signs, v_signs, normal(B, H, 1, P), dfin.count(n_win)


EXACT_PARTIAL_CASES = [  # B, H, R, P, L, n_sink, n_win (of a 2x longer buffer), q dtype, SM_COUNT
    (1, 2, 3, 64, 700, 4, 150, "float16", 1),  # SmolLM2's head dim; several rounds per split
    (1, 1, 4, 128, 2000, 0, 5, "bfloat16", None),  # fewer exact keys than splits
    (2, 1, 2, 256, 600, 2, 70, "float32", 1),  # Gemma's head dim: two dims per thread
]


@pytest.mark.parametrize("case", EXACT_PARTIAL_CASES, ids=lambda c: f"P{c[3]}-R{c[2]}-L{c[4]}")
def test_decode_attend_mma_partials_take_the_exact_tokens(monkeypatch, case):
    """The tensor-core partials with the exact tokens folded into their splits (the two-launch
    step's first launch), merged by a finish without exact tokens, give the step's output: the
    reference partials then the finish with the sink and the window; and so does the variant's
    MLX reference (`exact_into_partials`)."""
    from longctx.kernels import decode_finish as dfin

    B, H, R, P, L, n_sink, n_win, qdt, sm = case
    q, _, keys, values, kt, _ = random_segment(B, H, R, P, L, 4, 0, 4, False, seed=L + P)
    q = q.astype(getattr(mx, qdt))
    sink, window, k_signs, v_signs, mean, count = _exact_step_inputs(B, H, P, n_sink, n_win, seed=P)
    scale = P**-0.5
    parts = da.decode_attend_partials(q, keys, values, kt, kt, k_signs, key_bits=4, value_bits=4, scale=scale)
    want = np.array(dfin.decode_finish_reference(*parts, q, sink, window, v_signs, mean, scale, mx.float32, count))
    folded = dfin.exact_into_partials(*parts, q, sink, window, v_signs, scale, count)
    ref = np.array(dfin.decode_finish_reference(*folded, q, None, None, v_signs, mean, scale, mx.float32))
    assert np.linalg.norm(ref - want) / np.linalg.norm(want) < 1e-5
    if sm:
        monkeypatch.setattr(da, "SM_COUNT", sm)
    with _prelude.executor(kernel_emu.emulator()):
        got = ds.decode_step_mma_partials(
            q, keys, values, kt, k_signs, scale=scale, sink=sink, window=window, v_signs=v_signs, valid_array=count
        )
        assert not _prelude.failed(dm.NAME)
    assert got[0].shape == (B * H, dm.splits(L, B * H, P)[1], R)
    out = np.array(dfin.decode_finish_reference(*got, q, None, None, v_signs, mean, scale, mx.float32))
    assert np.isfinite(out).all() and np.linalg.norm(out - want) / np.linalg.norm(want) < 2e-3


PORTABLE_EXACT_CASES = [  # B, H, R, P, L, n_sink, n_win (of a 2x longer buffer), q dtype,
    # SM_COUNT, value bits
    (1, 2, 3, 64, 700, 4, 150, "float16", 1, 4),  # SmolLM2's head dim; several rounds per split
    (1, 1, 4, 128, 2000, 0, 5, "bfloat16", None, 4),  # fewer exact keys than splits
    (2, 1, 2, 256, 600, 2, 70, "float32", 1, 4),  # Gemma's head dim
    (1, 1, 1, 128, 300, 3, 40, "float16", 1, 3),  # one row: three keys a round; 3-bit values
    (1, 1, 16, 64, 500, 0, 33, "float32", 1, 4),  # 16 rows a threadgroup (two dims a thread)
    (1, 1, 20, 64, 400, 1, 9, "float16", 1, 4),  # two row blocks of 10
]


@pytest.mark.parametrize("case", PORTABLE_EXACT_CASES, ids=lambda c: f"P{c[3]}-R{c[2]}-L{c[4]}-v{c[9]}")
def test_decode_attend_partials_take_the_exact_tokens(monkeypatch, case):
    """The portable kernel (the one Metal runs) with the exact tokens folded into its splits,
    merged by a finish without exact tokens, gives the step's output: the reference partials
    then the finish with the sink and the window; the sink and the window's valid slots only
    (the buffer's other slots hold garbage)."""
    from longctx.kernels import decode_finish as dfin

    B, H, R, P, L, n_sink, n_win, qdt, sm, bv = case
    q, _, keys, values, kt, vt = random_segment(B, H, R, P, L, 4, 0, bv, False, seed=L + P)
    q = q.astype(getattr(mx, qdt))
    sink, window, k_signs, v_signs, mean, _ = _exact_step_inputs(B, H, P, n_sink, n_win, seed=P)
    if window is not None:  # a buffer twice as long, its valid prefix n_win - 2 slots
        count = dfin.count(n_win - 2)
    else:
        count = dfin.count(0)
    scale = P**-0.5
    assert da.exact_fits(P, R, bv)
    parts = da.decode_attend_partials(q, keys, values, kt, vt, k_signs, key_bits=4, value_bits=bv, scale=scale)
    want = np.array(dfin.decode_finish_reference(*parts, q, sink, window, v_signs, mean, scale, mx.float32, count))
    if sm:
        monkeypatch.setattr(da, "SM_COUNT", sm)
    launched = []
    with _prelude.executor(_Recording(kernel_emu.emulator(), launched)):
        got = da.decode_attend_partials(
            q,
            keys,
            values,
            kt,
            vt,
            k_signs,
            key_bits=4,
            value_bits=bv,
            scale=scale,
            sink=sink,
            window=window,
            v_signs=v_signs,
            valid_array=count,
        )
        assert not _prelude.failed(da.EXACT_NAME)
    assert launched == [da.EXACT_NAME] and got[0].shape[1] > 1
    out = np.array(dfin.decode_finish_reference(*got, q, None, None, v_signs, mean, scale, mx.float32))
    assert np.isfinite(out).all() and np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-4


WHOLE_CASES = [  # B, H, R, P, L, n_sink, n_win (of a 2x longer buffer), q dtype, SM_COUNT
    (1, 2, 4, 128, 999, 2, 9, "float32", 1),  # several splits a head, in a shuffled order
    (2, 1, 8, 128, 300, 0, 0, "float16", None),  # GQA 8, no exact tokens
    (1, 3, 1, 128, 77, 1, 0, "bfloat16", None),  # fewer keys than one split's tile
    # an answer's long window over few splits: each split's exact keys take several rounds
    (1, 2, 4, 128, 300, 3, 150, "float16", 1),
]


def _whole_case(case):
    """A WHOLE_CASES row's whole-step arguments (before its count array; fp32 output) and its
    reference, the partials' then the finish's: (args, want)."""
    from longctx.kernels import decode_finish as dfin

    B, H, R, P, L, n_sink, n_win, qdt, _ = case
    q, _, keys, values, kt, _ = random_segment(B, H, R, P, L, 4, 0, 4, False, seed=L + R)
    q = q.astype(getattr(mx, qdt))
    sink, window, k_signs, v_signs, mean, count = _exact_step_inputs(B, H, P, n_sink, n_win, seed=L)
    args = (q, keys, values, kt, k_signs, sink, window, v_signs, mean, P**-0.5, mx.float32, count)
    parts = da.decode_attend_partials(q, keys, values, kt, kt, k_signs, key_bits=4, value_bits=4, scale=P**-0.5)
    want = dfin.decode_finish_reference(*parts, q, sink, window, v_signs, mean, P**-0.5, mx.float32, count)
    return args, want


@pytest.mark.parametrize("case", WHOLE_CASES, ids=lambda c: f"P{c[3]}-R{c[2]}-L{c[4]}-{c[7]}")
def test_decode_step_mma_whole(monkeypatch, case):
    """The whole step in one launch (the tensor-core kernel whose last threadgroup per KV head
    runs the finish; the exact tokens folded into the splits' states) equals its reference, the
    partials' reference then the finish's, within fp16 rounding; its count output is zeros,
    which the next launch takes, and that launch gives the same output (threadgroups in another
    order: the emulator shuffles them per grid size)."""
    B, H, R, P, L, n_sink, n_win, qdt, sm = case
    if sm:
        monkeypatch.setattr(da, "SM_COUNT", sm)
    args, want = _whole_case(case)
    assert ds.fuses_finish(P, R) and not ds.hands_out(L)
    launched = []
    with _prelude.executor(_Recording(kernel_emu.emulator(), launched)):
        got, counts = ds.decode_step_mma(*args, ds.counter(B * H))
        again, counts2 = ds.decode_step_mma(*args, counts)
    assert launched == [ds.STEP_NAME] * 2 and not _prelude.failed(ds.STEP_NAME)
    assert dm.splits(L, B * H, P)[1] > 1 or L < 64 * dm.WARPS
    assert counts.shape == (33 * max(4, B * H),) and not np.array(counts).any()
    assert not np.array(counts2).any()
    a, b = np.array(got), np.array(want)
    assert np.isfinite(a).all() and np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-3
    assert np.array_equal(np.array(again), a)


DYNAMIC_CASES = [  # WHOLE_CASES rows
    WHOLE_CASES[0],  # static chunks, then one-block grants; the first threadgroup run takes most
    WHOLE_CASES[3],  # an answer's long window (exact keys: each split's share)
    (2, 3, 4, 128, 4000, 2, 9, "float16", 4),  # 6 heads' grant lines
    (1, 1, 8, 128, 2500, 0, 0, "bfloat16", 2),  # no exact tokens
]


@pytest.mark.parametrize("case", DYNAMIC_CASES, ids=lambda c: f"P{c[3]}-L{c[4]}-{c[7]}")
def test_decode_step_mma_dynamic(monkeypatch, case):
    """The whole step with its keys handed out while it runs (`dynamic=True`, at a length below
    DYNAMIC_MIN_KEYS) equals the reference within fp16 rounding, whichever threadgroup takes
    which grants (the emulator runs them one after another in a shuffled order, so the first
    takes every grant left after the static chunks); its counter output (counts and grant lines)
    is zeros, and the next launch, taking it, gives the same output within rounding (its warps,
    threads here, race for the grants)."""
    B, H, R, P, L, n_sink, n_win, qdt, sm = case
    if sm:
        monkeypatch.setattr(da, "SM_COUNT", sm)
    args, want = _whole_case(case)
    c0 = ds.counter(B * H)
    assert c0.shape == (33 * max(4, B * H),)
    launched = []
    with _prelude.executor(_Recording(kernel_emu.emulator(), launched)):
        with pytest.raises(ValueError, match="counter"):  # a count array without grant lines
            ds.decode_step_mma(*args, mx.zeros((max(4, B * H),), dtype=mx.int32), dynamic=True)
        got, counts = ds.decode_step_mma(*args, c0, dynamic=True)
        again, counts2 = ds.decode_step_mma(*args, counts, dynamic=True)
    assert launched == [ds.STEP_NAME] * 2 and not _prelude.failed(ds.STEP_NAME)
    n_split = dm.splits(L, B * H, P)[1]
    tile = 16 * dm.WARPS
    chunk = L * ds.STATIC_PERCENT // 100 // n_split // tile * tile  # each split's static chunk
    assert L > n_split * chunk  # some keys are handed out at run time
    assert counts.shape == c0.shape and not np.array(counts).any()
    assert not np.array(counts2).any()
    a, b = np.array(got), np.array(want)
    assert np.isfinite(a).all() and np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-3
    # (not bit for bit: which warp takes which grant changes the fp16 roundings' grouping)
    assert np.linalg.norm(np.array(again) - a) / np.linalg.norm(a) < 1e-4


def test_decode_step_mma_static_and_dynamic_share_a_count_array(monkeypatch):
    """A model's layers may take either variant (by length: `hands_out`): one count array serves
    both, in either order, and each gives the reference within fp16 rounding."""
    from longctx.kernels import decode_finish as dfin

    B, H, R, P = 1, 3, 4, 128
    assert not ds.hands_out(ds.DYNAMIC_MIN_KEYS - 1) and ds.hands_out(ds.DYNAMIC_MIN_KEYS)
    monkeypatch.setattr(da, "SM_COUNT", 2)
    counts = ds.counter(B * H)
    for L, dynamic in ((2500, True), (1500, False), (2500, True)):
        q, _, keys, values, kt, _ = random_segment(B, H, R, P, L, 4, 0, 4, False, seed=L)
        sink, window, k_signs, v_signs, mean, count = _exact_step_inputs(B, H, P, 2, 9, seed=L)
        args = (q, keys, values, kt, k_signs, sink, window, v_signs, mean, P**-0.5, mx.float32, count)
        parts = da.decode_attend_partials(q, keys, values, kt, kt, k_signs, key_bits=4, value_bits=4, scale=P**-0.5)
        want = dfin.decode_finish_reference(*parts, q, sink, window, v_signs, mean, P**-0.5, mx.float32, count)
        launched = []
        with _prelude.executor(_Recording(kernel_emu.emulator(), launched)):
            got, counts = ds.decode_step_mma(*args, counts, dynamic=dynamic)
        assert launched == [ds.STEP_NAME] and not np.array(counts).any()
        a, b = np.array(got), np.array(want)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-3


@pytest.mark.parametrize("broken", [ds.STEP_NAME, dm.NAME, da.EXACT_NAME])
def test_decode_step_falls_back_to_the_portable_kernel(broken):
    """A kernel that fails to build (one KernelFallbackWarning) costs its first step the
    reference; every later step takes the next kernels, not the reference: the tensor-core
    kernel and the finish after the whole step (P = 128), the portable kernel (the exact tokens
    in its splits) after the tensor-core kernel (P = 64: two launches), and after the portable
    kernel's variant with the exact tokens the plain one (the finish attending them)."""
    import warnings

    from longctx.kvcache import attend_step, attention

    H, R, P, L = 2, 4, 64 if broken == dm.NAME else 128, 300
    view = _step_view(H, R, P, L, "tq4", 2, 9, seed=3)
    q = mx.array(np.random.default_rng(4).normal(size=(1, H * R, 1, P)).astype("float32"))
    want = attention.compressed_attention(q, view, P**-0.5, fused=False)
    inner, launched = kernel_emu.emulator(), []

    def failing(spec, launch):
        launched.append(spec.name)
        if spec.name == broken:
            raise RuntimeError("nvrtc: simulated build failure")
        return inner(spec, launch)

    tensor_cores = broken != da.EXACT_NAME
    attend_step._COMPILED.clear()
    with _prelude.executor(failing):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = attend_step.attention(q, view, P**-0.5, tensor_cores=tensor_cores)
        assert [w.category.__name__ for w in caught] == ["KernelFallbackWarning"]
        assert _prelude.failed(broken)
        launched.clear()
        second = attend_step.attention(q, view, P**-0.5, tensor_cores=tensor_cores)
        assert launched == [
            {ds.STEP_NAME: dm.NAME, dm.NAME: da.EXACT_NAME, da.EXACT_NAME: da._SPEC.name}[broken],
            "lc_decode_finish",
        ]
    # the tensor-core kernel's products are fp16
    for got, tol in ((first, 2e-5), (second, 2e-3 if broken == ds.STEP_NAME else 2e-5)):
        a, b = np.array(got), np.array(want)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < tol


@pytest.mark.parametrize("dim,bits,dtype", [(64, 3, mx.float32), (128, 4, mx.bfloat16), (256, 2, mx.float16)])
@pytest.mark.parametrize("prev,old", [(0, 0), (2, 5)])
def test_prefill_encode(emulated, dim, bits, dtype, prev, old):
    from longctx.kernels import prefill_encode as pe

    codec = VectorCodec(dim, QuantSpec(bits), seed=3)
    rng = np.random.default_rng(dim + prev)
    x = mx.array(rng.normal(size=(1, 3, 5, dim)).astype(np.float32) * 2.0).astype(dtype)
    mu = mx.array(rng.normal(size=(1, 3, 1, dim)).astype(np.float32) * 0.3)
    bounds = as_mx(codec.codebook)[1]
    kw = {}
    if prev:
        kw["prev"] = mx.array(rng.normal(size=(1, 3, prev, dim)).astype(np.float16))
    if old:
        kw["old_idx"] = mx.array(rng.integers(0, 2**32, size=(1, 3, old, bits * dim // 32), dtype=np.uint32))
        kw["old_norm"] = mx.array(rng.random(size=(1, 3, old)).astype(np.float16))
    rot, idx, norm = pe.prefill_encode(x, mu, codec.rotation.signs, bounds, **kw)
    want = pe.prefill_encode_reference(x, mu, codec.rotation.signs, bounds, **kw)
    assert rot.shape == want[0].shape and idx.shape == want[1].shape and norm.shape == want[2].shape
    # the kernel's sums associate differently from MLX's: a norm may round to the next fp16
    assert np.allclose(np.array(norm), np.array(want[2]), rtol=1e-3, atol=0)
    assert (np.array(idx) == np.array(want[1])).mean() > 0.95  # a code next to a boundary may flip
    assert mx.array_equal(idx[:, :, :old], want[1][:, :, :old])  # copied rows: exact
    assert mx.array_equal(norm[:, :, :old], want[2][:, :, :old])
    assert mx.array_equal(rot[:, :, :prev], want[0][:, :, :prev])
    assert np.abs(np.array(rot, dtype=np.float32) - np.array(want[0], dtype=np.float32)).max() < 2e-3
    # the codes are hadamard_quantize's (the kernel the unfused path launches), bit for bit
    c = (x.astype(mx.float32) - mu).reshape(-1, dim)
    hi, hn = hq.hadamard_quantize(c, codec.rotation.signs, bounds)
    assert mx.array_equal(idx[:, :, old:].reshape(-1, hi.shape[-1]), hi)
    assert mx.array_equal(norm[:, :, old:].reshape(-1), hn)


@pytest.mark.parametrize("p", [64, 128, 256])
@pytest.mark.parametrize("inverse,mean,dtype", [(False, False, mx.float16), (True, True, mx.bfloat16), (True, False, mx.float32)])
def test_rotate(emulated, p, inverse, mean, dtype):
    from longctx.kernels import rotate as rt

    codec = VectorCodec(p, QuantSpec(4), seed=p)
    rng = np.random.default_rng(p)
    x = mx.array(rng.normal(size=(1, 6, 3, p)).astype(np.float32)).astype(mx.float16 if inverse else mx.bfloat16)
    m = mx.array(rng.normal(size=(1, 2, 1, p)).astype(np.float32)) if mean else None
    got = rt.rotate(x, codec.rotation.signs, inverse=inverse, mean=m, out_dtype=dtype)
    want = rt.rotate_reference(x, codec.rotation.signs, inverse=inverse, mean=m, out_dtype=dtype)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-2 if dtype == mx.bfloat16 else 2e-3
    assert np.abs(np.array(got.astype(mx.float32)) - np.array(want.astype(mx.float32))).max() < tol
    # the reference is the codec's own rotation
    ref = codec.unrotate(x) if inverse else codec.rotate(x)
    if mean:
        ref = (ref.reshape(1, 2, 3, 3, p) + m[:, :, None]).reshape(1, 6, 3, p)
    assert np.abs(np.array(want.astype(mx.float32)) - np.array(ref.astype(dtype).astype(mx.float32))).max() < tol


def test_layer_major_prefill_through_the_fused_encode(tmp_path, monkeypatch):
    """The GPU's default prefill (layer-major: the fused `prefill_encode` appends in spans, the
    window copied out of them) with the kernels emulated: it stores what an fp16 prefill's keys
    and values give appended chunk by chunk through the same kernels (`update_and_fetch`)."""
    from conftest import make_tiny_model

    from longctx import engine, kvcache
    from longctx.kvcache import turbo
    from longctx.runtime import models

    path = make_tiny_model(tmp_path / "tiny-2", layers=2, attn_gain=2.0, head_dim=64)
    model = models.load(models.resolve(str(path))).model
    preset = kvcache.get_preset("tq4")
    chunk = 256  # past the window (128): the fused appends take the chunks
    tokens = np.random.default_rng(0).integers(3, 200, 2 * chunk + 37).tolist()

    def arrays(cache):
        kvcache.seal(cache)
        return {k: np.array(v.astype(mx.float32)) for k, v in kvcache.to_arrays(cache, preset).items()}

    # each layer called chunk by chunk (not on runs of chunks), so that its keys and values are
    # the fp16 prefill's bit for bit: the comparison is of the encode alone
    eager = turbo.Paths(compile="0")
    with _prelude.executor(kernel_emu.emulator()):
        layered = kvcache.make(model, preset, eager)
        engine.prefill(model, tokens, layered, chunk=chunk, layer_call_tokens=0)
        assert layered[0]._rot_window is not None  # the fused path's window
        exact = kvcache.make(model, kvcache.get_preset("fp16"))
        engine.prefill(model, tokens, exact, chunk=chunk)
        oracle = kvcache.make(model, preset, eager)
        for c, e in zip(oracle, exact):
            k, v = e.keys[..., : e.offset, :], e.values[..., : e.offset, :]
            for lo in range(0, len(tokens), chunk):
                c.update_and_fetch(k[:, :, lo : lo + chunk], v[:, :, lo : lo + chunk])
        got, want = arrays(layered), arrays(oracle)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# --- Metal's simdgroup-matrix decode step (kernels/decode_attend_simdgroup.py) ---------------


def test_simdgroup_matrix_emulation():
    """The emulator's simdgroup matrices do what MSL says: a load with a row stride (from
    threadgroup and device memory, transposed or not), d = a b + c with fp16 operands and an fp32
    accumulator, a diagonal matrix's constructor, a store plain and transposed."""
    from longctx.kernels._prelude import KernelSpec, Launch

    spec = KernelSpec(
        name="lc_test_simdgroup",
        inputs=("a", "b", "c"),
        outputs=("d_out", "e_out", "f_out"),
        header="#if defined(LC_METAL)\n#define LC_HALF half\n#endif\n",
        source=r"""
  LC_SHARED LC_HALF a_s[8 * 12];
  LC_SHARED LC_HALF b_s[8 * 12];
  for (int i = (int)lc_lane; i < 96; i += 32) {
    a_s[i] = a[i];
    b_s[i] = b[i];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_half8x8 am;
  simdgroup_half8x8 bm;
  simdgroup_float8x8 cm;
  simdgroup_float8x8 dm;
  simdgroup_load(am, a_s + 3, 12);
  simdgroup_load(bm, b_s + 1, 12, 0, true);
  simdgroup_load(cm, c, 8);
  simdgroup_multiply_accumulate(dm, am, bm, cm);
  simdgroup_store(dm, d_out, 8);
  simdgroup_store(dm, e_out, 8, 0, true);
  simdgroup_float8x8 gm(2.0f);
  simdgroup_multiply(dm, gm, cm);
  simdgroup_store(dm, f_out, 8);
""",
    )
    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, 12)).astype(np.float16)
    b = rng.normal(size=(8, 12)).astype(np.float16)
    c = rng.normal(size=(8, 8)).astype(np.float32)
    launch = Launch(
        [mx.array(a.ravel()), mx.array(b.ravel()), mx.array(c.ravel())], [], (32, 1, 1), (32, 1, 1), [(64,)] * 3, [mx.float32] * 3
    )
    d, e, f = (np.array(x).reshape(8, 8) for x in kernel_emu.emulator()(spec, launch))
    want = a[:, 3:11].astype(np.float64) @ b[:, 1:9].astype(np.float64).T + c
    assert np.abs(d - want).max() < 1e-5
    assert np.array_equal(e, d.T)
    assert np.array_equal(f, 2 * c)


SG_CASES = [  # B, H, R, P, L, capacity, q dtype, TARGET_GROUPS (small: several blocks a warp)
    (1, 2, 4, 128, 300, None, "float32", None),
    (1, 1, 7, 128, 77, 96, "float16", None),  # a slice of a longer tail; GQA 7
    (2, 1, 3, 64, 999, 1200, "float32", 2),  # ragged last block, many blocks per warp
    (1, 2, 8, 64, 130, None, "bfloat16", None),
    (1, 1, 1, 128, 3, None, "float32", None),  # fewer keys than one block
    (1, 1, 6, 128, 500, None, "float16", 1),  # one split: each simdgroup rescales its blocks
]


@pytest.mark.parametrize("odd_rows", [False, True], ids=["aligned", "odd-rows"])
@pytest.mark.parametrize("case", SG_CASES, ids=lambda c: f"P{c[3]}-R{c[2]}-L{c[4]}")
def test_decode_attend_simdgroup(monkeypatch, case, odd_rows):
    """The simdgroup-matrix kernel's split states, merged, equal the portable kernel's
    reference within fp16 rounding. Norms ramp up along the segment, so the running maxima move
    late and the accumulators are rescaled (the diagonal matrix's product)."""
    from longctx.kernels import decode_attend_simdgroup as dsg
    from longctx.kernels.split_combine import split_combine_reference
    from longctx.quant.rotation import rademacher_signs

    B, H, R, P, L, cap, qdt, target = case
    if target:
        monkeypatch.setattr(dsg, "TARGET_GROUPS", target)
    q, _, keys, values, kt, _ = random_segment(B, H, R, P, L, 4, 0, 4, False, seed=L, capacity=cap)
    q = q.astype(getattr(mx, qdt))
    keys["norm"] = (keys["norm"].astype(mx.float32) * mx.linspace(0.2, 2.0, L)).astype(mx.float16)
    signs = mx.array(rademacher_signs(P, 5))
    ref = da.decode_attend_partials(q, keys, values, kt, kt, signs, key_bits=4, value_bits=4, scale=P**-0.5)
    with _prelude.executor(kernel_emu.emulator(True, odd_rows), as_backend="metal"):
        got = dsg.decode_attend_simdgroup_partials(q, keys, values, kt, signs, scale=P**-0.5)
        assert not _prelude.failed(dsg.NAME)
    chunk, n_split = dsg.splits(L, B * H)
    assert got[0].shape == (B * H, n_split, R) and got[2].shape == (B * H, n_split, R, P)
    assert chunk % (dsg.BLOCK * dsg.WARPS) == 0 and (n_split - 1) * chunk < L

    def merged(state):
        m, l, acc = split_combine_reference(*state)
        return m[..., None], l[..., None], acc

    errs = state_errors(merged(got), merged(ref))
    assert errs["finite"] and errs["unseen_ok"], errs
    assert errs["out_rel"] < 1e-3 and errs["l_rel"] < 3e-3 and errs["m_abs"] < 3e-3, errs
    m_g, l_g = np.array(got[0]), np.array(got[1])
    assert np.isfinite(m_g).all() and (l_g > 0).all()  # every split saw keys


@pytest.mark.parametrize(
    "case",
    [(2, 4, 128, 300, 4, 37, "float16"), (1, 3, 64, 200, 0, 0, "float32")],
    ids=lambda c: f"P{c[2]}-R{c[1]}-sink{c[4]}-win{c[5]}",
)
def test_decode_step_simdgroup_on_metal(case):
    """On Metal the decode step launches the simdgroup-matrix kernel and the finish (which
    attends the sink and the window), and equals the pure-MLX blocked path."""
    from longctx.kernels import decode_attend_simdgroup as dsg
    from longctx.kvcache import attend_step, attention

    H, R, P, L, n_sink, n_win, qdt = case
    view = _step_view(H, R, P, L, "tq4", n_sink, n_win, seed=L + P)
    q = mx.array(np.random.default_rng(R).normal(size=(1, H * R, 1, P)).astype(qdt)) * 2
    want = attention.compressed_attention(q, view, P**-0.5, fused=False)
    launched = []
    with _prelude.executor(_Recording(kernel_emu.emulator(), launched), as_backend="metal"):
        got = attend_step.attention(q, view, P**-0.5)
    assert launched == [dsg.NAME, "lc_decode_finish"]
    assert got.dtype == q.dtype and got.shape == q.shape
    a, b = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-3


@pytest.mark.parametrize("which", ["cuda", "cpu"])
def test_simdgroup_kernel_is_chosen_only_on_metal(which):
    """The simdgroup-matrix kernel applies on Metal only: CUDA's decode step launches the
    tensor-core kernels, the CPU's the references (no launch)."""
    from longctx.kernels import decode_attend_simdgroup as dsg
    from longctx.kvcache import attend_step

    view = _step_view(2, 4, 128, 300, "tq4", 2, 9, seed=3)
    q = mx.array(np.random.default_rng(4).normal(size=(1, 8, 1, 128)).astype("float32"))
    kc, vc = view.key_codec, view.value_codec
    cap = _Capture()
    with _prelude.executor(cap, as_backend="metal"):
        assert dsg.applies(128, 4, kc, vc)
    if which == "cpu":  # no kernel at all: the decode step is not taken
        with _prelude.force_backend("cpu"):
            assert not dsg.applies(128, 4, kc, vc) and not attend_step.applies(view, None, 1, 4)
        return
    with _prelude.executor(cap, as_backend=which):
        assert not dsg.applies(128, 4, kc, vc)
        attend_step.attention(q, view, 128**-0.5)
    names = {name for name, _ in cap.launches}
    assert names and dsg.NAME not in names


def test_simdgroup_kernel_falls_back_to_the_portable_kernel():
    """A simdgroup-matrix kernel that fails to build (one KernelFallbackWarning) costs its first
    step the reference; every later step runs the portable kernel (the exact tokens in its
    splits) and the finish."""
    import warnings

    from longctx.kernels import decode_attend_simdgroup as dsg
    from longctx.kvcache import attend_step, attention

    H, R, P, L = 2, 4, 128, 300
    view = _step_view(H, R, P, L, "tq4", 2, 9, seed=3)
    q = mx.array(np.random.default_rng(4).normal(size=(1, H * R, 1, P)).astype("float32"))
    want = attention.compressed_attention(q, view, P**-0.5, fused=False)
    inner, launched = kernel_emu.emulator(), []

    def failing(spec, launch):
        launched.append(spec.name)
        if spec.name == dsg.NAME:
            raise RuntimeError("metal: simulated build failure")
        return inner(spec, launch)

    attend_step._COMPILED.clear()
    with _prelude.executor(failing, as_backend="metal"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = attend_step.attention(q, view, P**-0.5)
        assert [w.category.__name__ for w in caught] == ["KernelFallbackWarning"]
        assert _prelude.failed(dsg.NAME)
        launched.clear()
        second = attend_step.attention(q, view, P**-0.5)
        assert launched == [da.EXACT_NAME, "lc_decode_finish"]
    for got in (first, second):
        a, b = np.array(got), np.array(want)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-5
