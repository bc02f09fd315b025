"""Fused normalize + randomized Hadamard rotation + scalar quantize + bit pack of vectors.

What `VectorCodec.encode` does for a scalar spec (no RVQ, no QJL) with a power-of-two dim D:

    norm = ||x||                       stored as fp16, clipped to 65504
    u    = x / max(norm, 1e-30)
    y    = H (signs * u) / sqrt(D)     Sylvester-ordered Walsh-Hadamard (mx.hadamard_transform)
    idx  = #{k : y > boundaries[k]}    per coordinate, packed b bits each (packing.py layout)

Shapes and dtypes: x (N, D) float32 (other floats are cast), signs (D,) float32 of +-1,
boundaries (2^b - 1,) float32 -> idx (N, b * D / 32) uint32, norm (N,) float16. D in 64/128/256.

Thread plan: one threadgroup of D threads per vector, one coordinate per thread. The squared norm
is a simdgroup sum, then a sum over the D/32 simdgroup partials that every thread does in the same
order (so all threads hold the same norm). The butterfly runs in threadgroup memory, log2(D)
stages: at stride h the thread with bit h clear holds a + b, its partner a - b; both values are
read before a barrier and written after it (reading and writing in one phase races). Codes go to
threadgroup memory; then b*D/32 threads each assemble one packed word (LC_PACK_WORD).

Rounding: the kernel's sums (norm, butterfly) associate in a different order from MLX's, so a
coordinate within ~1e-6 of a boundary can land in the neighbouring cell; tests allow that and
nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, run
from .pack import pack_reference
from .scalar_quant import quantize_reference

FP16_MAX = 65504.0
DIMS = (64, 128, 256)

# One vector per threadgroup of D threads, thread t holding coordinate xv: its norm `nrm`, its
# rotated coordinate `y` (of the unit vector) and its code in `codes[t]` (threadgroup memory:
# buf[D], red[D / 32], codes[D]), all threads past the final barrier. Shared with
# `prefill_encode`, whose codes must equal these bit for bit.
ENCODE_ROW = r"""
  const float sq = lc_simd_sum(xv * xv);
  if (lc_lane == 0u) red[lc_warp] = sq;
  LC_BARRIER();
  float tot = 0.0f;
  LC_UNROLL for (int w = 0; w < D / 32; ++w) tot += red[w];
  const float nrm = LC_SQRT(tot);
  buf[t] = (xv / LC_MAX(nrm, 1e-30f)) * signs[t];
  LC_BARRIER();
  LC_UNROLL for (uint32_t h = 1u; h < (uint32_t)D; h <<= 1) {
    const bool upper = (t & h) != 0u;
    const float a = buf[t];
    const float b = buf[upper ? t - h : t + h];
    LC_BARRIER();
    buf[t] = upper ? (b - a) : (a + b);
    LC_BARRIER();
  }
  const float y = buf[t] * HSCALE;
  uint32_t code = 0u;
  LC_UNROLL for (int k = 0; k < (1 << B) - 1; ++k) code += y > boundaries[k] ? 1u : 0u;
  codes[t] = code;
  LC_BARRIER();
"""

_SPEC = KernelSpec(
    name="lc_hadamard_quantize",
    inputs=("x", "signs", "boundaries"),
    outputs=("idx", "norm"),
    source=r"""
  LC_SHARED float buf[D];
  LC_SHARED float red[D / 32];
  LC_SHARED uint32_t codes[D];
  const uint32_t v = lc_tg;
  const uint32_t t = lc_tid;
  const float xv = x[v * D + t];"""
    + ENCODE_ROW
    + r"""  if (t < (uint32_t)(B * D / 32)) {
    const uint32_t g = t / (uint32_t)B;
    const uint32_t k = t % (uint32_t)B;
    uint32_t word;
    LC_PACK_WORD(word, (codes + 32u * g), k, B);
    idx[v * (uint32_t)(B * D / 32) + t] = word;
  }
  if (t == 0u) norm[v] = LC_F2H(LC_MIN(nrm, 65504.0f));
""",
)


def applies(d: int) -> bool:
    """Whether the one-coordinate-per-thread Hadamard kernels (this one, `prefill_encode`,
    `rotate`) take vectors of size `d` on this backend."""
    return backend() != "cpu" and d in DIMS


@functools.lru_cache(maxsize=None)
def scaled(spec: KernelSpec, dim: int) -> KernelSpec:
    """`spec` with the HSCALE of size `dim` in its header (made once per spec and size)."""
    return dataclasses.replace(spec, header=spec.header + _scale_header(dim))


@functools.lru_cache(maxsize=None)
def _scale_header(dim: int) -> str:
    """The float32 1/sqrt(D) that MLX's hadamard_transform uses, as an exact literal (made once
    per D: it evaluates an array, and a prefill chunk asks for it per layer)."""
    s = mx.array(1.0 / math.sqrt(dim), dtype=mx.float32).item()  # rounded to float32
    return f"#define HSCALE {s:.9e}f\n"


def hadamard_quantize_reference(x: mx.array, signs: mx.array, boundaries: mx.array) -> tuple[mx.array, mx.array]:
    """Pure-MLX encode (the CPU path and oracle): same ops as VectorCodec.encode's scalar path."""
    bits = (boundaries.shape[0] + 1).bit_length() - 1
    d = x.shape[-1]
    x = x.astype(mx.float32)
    nrm = mx.sqrt(mx.sum(x * x, axis=-1))  # (N,)
    unit = x / mx.maximum(nrm, 1e-30)[..., None]
    y = mx.hadamard_transform(unit * signs, scale=1.0 / math.sqrt(d))
    idx = pack_reference(quantize_reference(y, boundaries), bits)
    return idx, mx.minimum(nrm, FP16_MAX).astype(mx.float16)


def hadamard_quantize(x: mx.array, signs: mx.array, boundaries: mx.array) -> tuple[mx.array, mx.array]:
    """Normalize, rotate, quantize and pack vectors in one pass.

    Args:
        x: (..., D) vectors, D in 64/128/256 on the GPU path (any D MLX can transform on CPU).
        signs: (D,) the rotation's +-1 diagonal (`RandomHadamard.signs`).
        boundaries: (2^b - 1,) the codebook's decision boundaries.

    Returns:
        (idx (..., b * D / 32) uint32, norm (...) float16), as `VectorCodec.encode` stores them.
    """
    d = x.shape[-1]
    bits = (boundaries.shape[0] + 1).bit_length() - 1
    if signs.shape != (d,) or (1 << bits) - 1 != boundaries.shape[0] or not 1 <= bits <= 8:
        raise ValueError(f"signs must be ({d},) and boundaries (2^b - 1,); got {signs.shape}, {boundaries.shape}")
    if not applies(d) or x.size == 0:
        return hadamard_quantize_reference(x, signs, boundaries)
    lead = x.shape[:-1]
    n = x.size // d
    spec = scaled(_SPEC, d)
    w = bits * d // 32
    flat = x.astype(mx.float32).reshape(n, d)
    idx, norm = run(
        spec,
        Launch(
            [flat, signs.astype(mx.float32), boundaries.astype(mx.float32)],
            [("D", d), ("B", bits)],
            (n * d, 1, 1),
            (d, 1, 1),
            [(n, w), (n,)],
            [mx.uint32, mx.float16],
        ),
        reference=lambda: hadamard_quantize_reference(flat, signs, boundaries),
    )
    return idx.reshape(*lead, w), norm.reshape(lead)
