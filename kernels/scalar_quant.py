"""Nearest-centroid scalar quantize and dequantize against a sorted (Lloyd-Max) codebook.

quantize:   x (...) float -> (...) uint8 index = #{k : x > boundaries[k]}, the nearest centroid
            when the boundaries are the midpoints between neighbouring centroids (Lloyd's
            condition), and exactly what `longctx.quant.scalar.quantize` computes.
dequantize: idx (...) integer -> (...) float32 centroids[idx] (a gather).

Inputs: boundaries (2^b - 1,) float32 increasing; centroids (2^b,) float32.

Thread plan: one thread per element, threadgroups of 256. For b <= 4 the <= 15 boundaries are
loaded into registers (bits is a template constant, so the compare loop unrolls into straight-line
code: no (..., 2^b) distance tensor, no memory per element beyond x and the index); for b > 4 a
branch-free binary search reads them from memory (cached: every thread reads the same table).
"""

from __future__ import annotations

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, groups, run

_THREADS = 256

_QUANTIZE = KernelSpec(
    name="lc_scalar_quantize",
    inputs=("x", "boundaries"),
    outputs=("idx",),
    source=r"""
  const uint32_t n = (uint32_t)x_shape[0];
  if (lc_gid < n) {
    const float v = x[lc_gid];
    uint32_t code = 0u;
    if (B <= 4) {
      float bnd[(1 << (B <= 4 ? B : 1)) - 1];
      LC_UNROLL for (int k = 0; k < (1 << (B <= 4 ? B : 1)) - 1; ++k) bnd[k] = boundaries[k];
      LC_UNROLL for (int k = 0; k < (1 << (B <= 4 ? B : 1)) - 1; ++k) code += v > bnd[k] ? 1u : 0u;
    } else {
      for (uint32_t step = 1u << (B - 1); step > 0u; step >>= 1) {
        const uint32_t cand = code + step;
        code = v > boundaries[cand - 1u] ? cand : code;
      }
    }
    idx[lc_gid] = (uint8_t)code;
  }
""",
)

_DEQUANTIZE = KernelSpec(
    name="lc_scalar_dequantize",
    inputs=("idx", "centroids"),
    outputs=("y",),
    source=r"""
  const uint32_t n = (uint32_t)idx_shape[0];
  if (lc_gid < n) y[lc_gid] = centroids[(uint32_t)idx[lc_gid]];
""",
)


def _bits_of(table: mx.array, extra: int) -> int:
    size = table.shape[0] + extra
    bits = size.bit_length() - 1
    if table.ndim != 1 or 1 << bits != size or not 1 <= bits <= 8:
        raise ValueError(f"expected a table of 2^b {'- 1 ' if extra else ''}entries (b in 1..8), got shape {table.shape}")
    return bits


def quantize_reference(x: mx.array, boundaries: mx.array) -> mx.array:
    """Pure-MLX quantize: branch-free binary search over the boundaries (b gathers)."""
    bits = _bits_of(boundaries, 1)
    x = x.astype(mx.float32)
    b = boundaries.astype(mx.float32)
    idx = mx.zeros(x.shape, dtype=mx.uint32)
    step = 1 << (bits - 1)
    while step:
        cand = idx + step
        idx = mx.where(x > mx.take(b, cand - 1), cand, idx)
        step >>= 1
    return idx.astype(mx.uint8)


def dequantize_reference(idx: mx.array, centroids: mx.array) -> mx.array:
    """Pure-MLX dequantize: centroids[idx] as float32."""
    _bits_of(centroids, 0)
    return mx.take(centroids.astype(mx.float32), idx.astype(mx.uint32))


def quantize(x: mx.array, boundaries: mx.array) -> mx.array:
    """Index of the nearest centroid of every element.

    Args:
        x: (...) float array.
        boundaries: (2^b - 1,) increasing decision boundaries.

    Returns:
        (...) uint8 indices in [0, 2^b).
    """
    bits = _bits_of(boundaries, 1)
    if backend() == "cpu" or x.size == 0:
        return quantize_reference(x, boundaries)
    flat = x.astype(mx.float32).reshape(-1)
    (out,) = run(
        _QUANTIZE,
        Launch(
            [flat, boundaries.astype(mx.float32)],
            [("B", bits)],
            (groups(flat.size, _THREADS) * _THREADS, 1, 1),
            (_THREADS, 1, 1),
            [flat.shape],
            [mx.uint8],
        ),
        reference=lambda: [quantize_reference(flat, boundaries)],
    )
    return out.reshape(x.shape)


def dequantize(idx: mx.array, centroids: mx.array) -> mx.array:
    """Centroid values of indices.

    Args:
        idx: (...) integer indices in [0, 2^b).
        centroids: (2^b,) centroids.

    Returns:
        (...) float32.
    """
    _bits_of(centroids, 0)
    if backend() == "cpu" or idx.size == 0:
        return dequantize_reference(idx, centroids)
    flat = idx.astype(mx.uint8).reshape(-1)
    (out,) = run(
        _DEQUANTIZE,
        Launch(
            [flat, centroids.astype(mx.float32)],
            [],
            (groups(flat.size, _THREADS) * _THREADS, 1, 1),
            (_THREADS, 1, 1),
            [flat.shape],
            [mx.float32],
        ),
        reference=lambda: [dequantize_reference(flat, centroids)],
    )
    return out.reshape(idx.shape)
