"""QJL sketch of residuals: packed signs of S r and the residual norm ||r||.

    bit j of the sketch = [<S_j, r> >= 0]      packed 1 bit per sketch row (packing.py layout)
    rnorm               = min(||r||, 65504)     float16

Shapes and dtypes: r (N, P) float32 (other floats are cast); proj_t (P, M) float32 = S^T, the
layout `QJLSketch` keeps (so the reference's matmul is QJLSketch.project's); M a multiple of 32
-> signs (N, M / 32) uint32, rnorm (N,) float16.

Thread plan: one threadgroup of M threads per residual (M <= 1024). The residual is staged in
threadgroup memory; thread j computes <S_j, r> reading column j of proj_t (consecutive threads read
consecutive addresses), then each simdgroup/warp turns its 32 signs into one word with a ballot
and lane 0 stores it. ||r||^2 is a simdgroup sum per warp, then thread 0 adds the M/32 partials.

Rounding: the kernel's dot products associate differently from the matmul, so a sign can differ
where |<S_j, r>| is within rounding of 0; tests allow that and nothing else.
"""

from __future__ import annotations

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, run
from .pack import pack_reference

FP16_MAX = 65504.0

_SPEC = KernelSpec(
    name="lc_qjl_encode",
    inputs=("r", "proj_t"),
    outputs=("signs", "rnorm"),
    source=r"""
  LC_SHARED float r_s[P];
  LC_SHARED float red[(M + 31) / 32];
  const uint32_t v = lc_tg;
  const uint32_t j = lc_tid;
  float sq = 0.0f;
  for (uint32_t d = j; d < (uint32_t)P; d += (uint32_t)M) {
    const float rv = r[v * (uint32_t)P + d];
    r_s[d] = rv;
    sq += rv * rv;
  }
  sq = lc_simd_sum(sq);
  if (lc_lane == 0u) red[lc_warp] = sq;
  LC_BARRIER();
  float dot = 0.0f;
  for (int d = 0; d < P; ++d) dot += proj_t[d * M + (int)j] * r_s[d];
  const uint32_t word = lc_simd_ballot(dot >= 0.0f, lc_lane);
  if (lc_lane == 0u) signs[v * (uint32_t)(M / 32) + lc_warp] = word;
  if (j == 0u) {
    float tot = 0.0f;
    for (int w = 0; w < M / 32; ++w) tot += red[w];
    rnorm[v] = LC_F2H(LC_MIN(LC_SQRT(tot), 65504.0f));
  }
""",
)


def qjl_encode_reference(r: mx.array, proj_t: mx.array) -> tuple[mx.array, mx.array]:
    """Pure-MLX sketch (the CPU path and oracle): same ops as `QJLSketch.sketch`."""
    r = r.astype(mx.float32)
    bits = (r @ proj_t >= 0).astype(mx.uint8)  # (..., M)
    rnorm = mx.minimum(mx.sqrt(mx.sum(r * r, axis=-1)), FP16_MAX).astype(mx.float16)
    return pack_reference(bits, 1), rnorm


def qjl_encode(r: mx.array, proj_t: mx.array) -> tuple[mx.array, mx.array]:
    """Packed QJL signs and norms of residuals.

    Args:
        r: (..., P) residuals (rotated frame, key units).
        proj_t: (P, M) the transposed projection (`QJLSketch._st`); M a multiple of 32, <= 1024.

    Returns:
        (signs (..., M / 32) uint32, rnorm (...) float16), as `QJLSketch.sketch` returns them.
    """
    p, m = proj_t.shape
    if r.shape[-1] != p or m % 32:
        raise ValueError(f"r (..., {p}) and proj_t ({p}, M) with M % 32 == 0 expected; got {r.shape}, {proj_t.shape}")
    if backend() == "cpu" or m > 1024 or r.size == 0:
        return qjl_encode_reference(r, proj_t)
    lead = r.shape[:-1]
    n = r.size // p
    flat = r.astype(mx.float32).reshape(n, p)
    signs, rnorm = run(
        _SPEC,
        Launch(
            [flat, proj_t.astype(mx.float32)],
            [("P", p), ("M", m)],
            (n * m, 1, 1),
            (m, 1, 1),
            [(n, m // 32), (n,)],
            [mx.uint32, mx.float16],
        ),
        reference=lambda: qjl_encode_reference(flat, proj_t),
    )
    return signs.reshape(*lead, m // 32), rnorm.reshape(lead)
