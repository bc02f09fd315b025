"""Encode-side kernels vs their pure-MLX references vs numpy, across sizes, with crossovers.

Ops (element counts from 2^10 to 2^24 values):
- pack / unpack, 3 bits (the straddling case);
- quantize, 4 bits (15 boundaries) and dequantize;
- hadamard_quantize: D = 128, 4 bits (vectors = elements / 128);
- qjl_encode: P = M = 128 (vectors = elements / 128).

`kernel` is the public function on the current backend (the GPU kernel on Metal/CUDA), `mlx_ref`
the pure-MLX reference on the same device, `numpy` a vectorized numpy version on the CPU (inputs
already in host memory, outputs left there). Each time is the median of repeated calls after a
warm-up (GPU: mx.eval after each call). The crossover is the smallest size at which the kernel
beats numpy (and the reference) and keeps beating it at every larger size.

Usage: python benchmarks/kernels.py [--max-log2 24] [--name kernels_h200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402

from longctx.kernels import _prelude  # noqa: E402
from longctx.kernels import hadamard_quant as hq  # noqa: E402
from longctx.kernels import pack as kp  # noqa: E402
from longctx.kernels import qjl_encode as qe  # noqa: E402
from longctx.kernels import scalar_quant as sq  # noqa: E402
from longctx.quant.codebooks import as_mx, lloyd_max  # noqa: E402
from longctx.quant.qjl import QJLSketch  # noqa: E402
from longctx.quant.rotation import rademacher_signs  # noqa: E402

BITS, DIM = 3, 128


def _median_ms(fn, n) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _gpu(fn, *args):
    return lambda: mx.eval(fn(*args))


# numpy versions ------------------------------------------------------------------------------


def np_pack(v: np.ndarray, bits: int) -> np.ndarray:
    """Word k of a group holds bits [32k, 32k + 32) of the group's little-endian bit stream."""
    rows, n = v.shape
    g = -(-n // 32)
    start = np.arange(32) * bits
    words = np.zeros((rows, g, bits), dtype=np.uint64)
    vv = np.zeros((rows, g * 32), dtype=np.uint64)
    vv[:, :n] = v
    vv = vv.reshape(rows, g, 32)
    for i in range(32):
        w, sh = divmod(int(start[i]), 32)
        words[:, :, w] |= (vv[:, :, i] << np.uint64(sh)) & np.uint64(0xFFFFFFFF)
        if sh + bits > 32:
            words[:, :, w + 1] |= vv[:, :, i] >> np.uint64(32 - sh)
    return words.astype(np.uint32).reshape(rows, g * bits)


def np_unpack(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    rows = words.shape[0]
    g = -(-n // 32)
    w = words.reshape(rows, g, bits).astype(np.uint64)
    out = np.empty((rows, g, 32), dtype=np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for i in range(32):
        wi, sh = divmod(i * bits, 32)
        val = w[:, :, wi] >> np.uint64(sh)
        if sh + bits > 32:
            val |= w[:, :, wi + 1] << np.uint64(32 - sh)
        out[:, :, i] = (val & mask).astype(np.uint8)
    return out.reshape(rows, g * 32)[:, :n]


def np_fwht(x: np.ndarray) -> np.ndarray:
    n = x.shape[-1]
    y = x.copy()
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :].copy(), y[:, :, 1, :].copy()
        y[:, :, 0, :], y[:, :, 1, :] = a + b, a - b
        y = y.reshape(-1, n)
        h *= 2
    return y


def np_hadamard_quantize(x, signs, bounds, bits):
    nrm = np.sqrt((x * x).sum(-1))
    y = np_fwht(x / np.maximum(nrm, 1e-30)[:, None] * signs) / np.sqrt(x.shape[-1])
    return np_pack(np.searchsorted(bounds, y, side="left").astype(np.uint8), bits), np.minimum(nrm, 65504).astype(np.float16)


def np_qjl(r, st):
    bits = (r @ st >= 0).astype(np.uint8)
    return np_pack(bits, 1), np.minimum(np.sqrt((r * r).sum(-1)), 65504).astype(np.float16)


# ---------------------------------------------------------------------------------------------


def cases(n: int) -> dict:
    """op -> (kernel fn, reference fn, numpy fn), for n values."""
    rng = np.random.default_rng(n)
    rows = n // 128
    codes = rng.integers(0, 1 << BITS, size=(rows, 128)).astype(np.uint8)
    codes_mx = mx.array(codes)
    words_np = np_pack(codes, BITS)
    words_mx = mx.array(words_np)
    cents, bounds = as_mx(lloyd_max(DIM, 4))
    x_np = (rng.normal(size=(n,)) * 0.09).astype(np.float32)
    x_mx = mx.array(x_np)
    b_np = np.array(bounds)
    idx_mx = sq.quantize_reference(x_mx, bounds)
    idx_np = np.array(idx_mx)
    c_np = np.array(cents)
    v_np = rng.normal(size=(rows, DIM)).astype(np.float32)
    v_mx = mx.array(v_np)
    signs_np = rademacher_signs(DIM, 1)
    signs = mx.array(signs_np)
    st = QJLSketch(DIM, 1)._st
    st_np = np.array(st)
    mx.eval(codes_mx, words_mx, x_mx, idx_mx, v_mx, signs, st)
    return {
        "pack_b3": (_gpu(kp.pack, codes_mx, BITS), _gpu(kp.pack_reference, codes_mx, BITS), lambda: np_pack(codes, BITS)),
        "unpack_b3": (
            _gpu(kp.unpack, words_mx, BITS, 128),
            _gpu(kp.unpack_reference, words_mx, BITS, 128),
            lambda: np_unpack(words_np, BITS, 128),
        ),
        "quantize_b4": (
            _gpu(sq.quantize, x_mx, bounds),
            _gpu(sq.quantize_reference, x_mx, bounds),
            lambda: np.searchsorted(b_np, x_np, side="left").astype(np.uint8),
        ),
        "dequantize_b4": (_gpu(sq.dequantize, idx_mx, cents), _gpu(sq.dequantize_reference, idx_mx, cents), lambda: c_np[idx_np]),
        "hadamard_quantize_d128_b4": (
            _gpu(hq.hadamard_quantize, v_mx, signs, bounds),
            _gpu(hq.hadamard_quantize_reference, v_mx, signs, bounds),
            lambda: np_hadamard_quantize(v_np, signs_np, b_np, 4),
        ),
        "qjl_encode_d128": (_gpu(qe.qjl_encode, v_mx, st), _gpu(qe.qjl_encode_reference, v_mx, st), lambda: np_qjl(v_np, st_np)),
    }


def crossover(rows, a, b):
    """Smallest n from which `a` is faster than `b` at every n >= it (None if never)."""
    best = None
    for r in sorted(rows, key=lambda r: -r["n"]):
        if r[a] < r[b]:
            best = r["n"]
        else:
            break
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--min-log2", type=int, default=10)
    ap.add_argument("--max-log2", type=int, default=24)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    backend = _prelude.backend()
    results: dict = {}
    for lg in range(args.min_log2, args.max_log2 + 1, 2):
        n = 1 << lg
        reps = 30 if lg <= 18 else 8
        for op, (kern, ref, npy) in cases(n).items():
            row = {
                "n": n,
                "kernel_ms": _median_ms(kern, reps),
                "mlx_ref_ms": _median_ms(ref, reps),
                "numpy_ms": _median_ms(npy, max(3, reps // 3)),
            }
            results.setdefault(op, []).append(row)
            print(
                f"{op:<26} n=2^{lg:<2} kernel {row['kernel_ms']:8.3f} ms  mlx_ref "
                f"{row['mlx_ref_ms']:8.3f} ms  numpy {row['numpy_ms']:9.3f} ms",
                flush=True,
            )
    summary = {
        op: {
            "kernel_beats_numpy_from": crossover(rows, "kernel_ms", "numpy_ms"),
            "kernel_beats_mlx_ref_from": crossover(rows, "kernel_ms", "mlx_ref_ms"),
        }
        for op, rows in results.items()
    }
    print("\n| op | kernel beats numpy from n = | kernel beats MLX reference from n = |")
    print("|---|---|---|")
    for op, s in summary.items():
        print(f"| {op} | {s['kernel_beats_numpy_from']} | {s['kernel_beats_mlx_ref_from']} |")
    path = write(args.name or f"kernels_{backend}", {"kernel_backend": backend, "results": results, "crossover": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
