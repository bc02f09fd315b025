"""Merge flash-decoding partials: per-split softmax states (m, l, acc) -> one state per row.

For splits s of one row with running max m_s, denominator l_s and value sum acc_s (all in the
same units, natural log here):

    M = max_s m_s,   l = sum_s l_s exp(m_s - M),   acc = sum_s acc_s exp(m_s - M)

Rows whose every key was masked (all m_s = -inf) come out as m = -inf, l = 0, acc = 0, which the
caller's own online softmax merges as "nothing seen".

Shapes and dtypes (float32): m_p, l_p (N, S, R); acc_p (N, S, R, P) -> m, l (N, R); acc (N, R, P).

Thread plan: one threadgroup of P threads per (n, row); thread d walks the S splits twice (max,
then weighted sums): the m/l reads are the same address for every thread (broadcast), the acc
reads are consecutive across threads.
"""

from __future__ import annotations

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, run

_SPEC = KernelSpec(
    name="lc_split_combine",
    inputs=("m_p", "l_p", "acc_p"),
    outputs=("m", "l", "acc"),
    source=r"""
  const int S = m_p_shape[1];
  const int row = (int)lc_tg;          // n * R + r
  const int n = row / R;
  const int r = row - n * R;
  const int d = (int)lc_tid;
  float M = -LC_INF;
  for (int s = 0; s < S; ++s) M = LC_MAX(M, m_p[(n * S + s) * R + r]);
  const float Mu = M == -LC_INF ? 0.0f : M;
  float lt = 0.0f;
  float a = 0.0f;
  for (int s = 0; s < S; ++s) {
    const int i = (n * S + s) * R + r;
    const float w = LC_EXP(m_p[i] - Mu);
    lt += l_p[i] * w;
    a += acc_p[(int64_t)i * P + d] * w;
  }
  acc[(int64_t)row * P + d] = a;
  if (d == 0) {
    m[row] = M;
    l[row] = lt;
  }
""",
)


def split_combine_reference(m_p: mx.array, l_p: mx.array, acc_p: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Pure-MLX merge of the split axis (axis 1)."""
    big = mx.max(m_p, axis=1, keepdims=True)  # (N, 1, R)
    safe = mx.where(big == -mx.inf, 0.0, big)
    w = mx.exp(m_p - safe)  # (N, S, R)
    l = mx.sum(l_p * w, axis=1)
    acc = mx.sum(acc_p * w[..., None], axis=1)
    return big[:, 0], l, acc


def split_combine(m_p: mx.array, l_p: mx.array, acc_p: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Merge S partial softmax states per row.

    Args:
        m_p, l_p: (N, S, R) float32 running maxima and denominators of each split.
        acc_p: (N, S, R, P) float32 unnormalized value sums of each split.

    Returns:
        (m (N, R), l (N, R), acc (N, R, P)) float32.
    """
    n, s, r = m_p.shape
    p = acc_p.shape[-1]
    if l_p.shape != m_p.shape or acc_p.shape != (n, s, r, p):
        raise ValueError(f"inconsistent partials: {m_p.shape}, {l_p.shape}, {acc_p.shape}")
    if backend() == "cpu" or p % 32 or p > 1024 or m_p.size == 0:
        return split_combine_reference(m_p, l_p, acc_p)
    m, l, acc = run(
        _SPEC,
        Launch(
            [m_p.astype(mx.float32), l_p.astype(mx.float32), acc_p.astype(mx.float32)],
            [("P", p), ("R", r)],
            (n * r * p, 1, 1),
            (p, 1, 1),
            [(n, r), (n, r), (n, r, p)],
            [mx.float32] * 3,
        ),
        reference=lambda: split_combine_reference(m_p, l_p, acc_p),
    )
    return m, l, acc
