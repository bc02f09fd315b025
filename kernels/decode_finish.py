"""The end of one decode step: split merge, rotation back, exact tokens, normalize, in one launch.

After `decode_attend_partials` each split of the compressed segment holds a softmax state
(m_s, l_s, acc_s) in the value codec's rotated frame. This kernel finishes the step:

    m_c = max_s m_s,  l_c = sum_s l_s e^(m_s - m_c),  a_c = R_v^-1 (sum_s acc_s e^(m_s - m_c))
    over the exact tokens j (sink, then window; centered, original frame):
        s_j = scale * q . k_j,  m_e = max_j s_j,  l_e = sum_j e^(s_j - m_e),  a_e = sum_j e^(..) v_j
    out = (a_c e^(m_c - M) + a_e e^(m_e - M)) / (l_c e^(m_c - M) + l_e e^(m_e - M)) + mean_v,
    M = max(m_c, m_e), written in the queries' dtype.

R_v^-1 y = signs * H y / sqrt(P) (`RandomHadamard.inverse` at D = P). Exactly what
`attend_blocked.attend` does after its segments for one query token and no mask (the rotation is
linear, so it commutes with the merge), in one launch instead of ~12.

Shapes: m_p, l_p (N, S, R), acc_p (N, S, R, P) float32 (N = B * H); q (B, H, R, P) any float
(rows grouped per KV head, as the partials); sink_k, sink_v (B, H, Ns, P) and win_k, win_v
(B, H, W, P) any float, any strides (the window is the valid prefix of its buffers, a view);
win_n int32 (first entry): the window's valid slots (the first win_n of its buffers, so that a
compiled step's input shapes stay the same while the window fills); signs (P,) float32;
mean (B, H, 1, P) float32 -> out (B, H, R, P) in `out_dtype`.

Thread plan: one threadgroup of P threads per (b, h, group of ROWS_PER_GROUP rows); thread d
owns dim d of each of the group's rows (template R: the group's rows, RA: all rows).
  1. merge the S splits into threadgroup memory: the row maxima and the weights e^(m_s - m_c)
     computed with the splits spread over the threads, then each thread sums the weighted acc
     of its dim over blocks of P splits, 64 / R splits' loads issued together (consecutive
     reads across threads; the launch is B * H * RA / R threadgroups, so memory latency is
     its cost: one round trip per split, as it first waited, made it several times slower,
     docs/performance.md); the first 64 / R splits' acc loads are issued with the m and l loads;
  2. the inverse butterfly over each row: the stages between dims of one warp as lane exchanges
     (`lc_simd_xor`), the others through threadgroup memory (4 barriers at P = 128, was 14);
  3. the exact tokens in tiles of P keys: thread t scores key t against the R rows, walking its
     row, tile max through
     simdgroup max and the warps' partials, weights to threadgroup memory, then thread d adds
     w[key][row] * v[key][d] (consecutive reads across threads);
  4. the two states merged, normalized, the mean added, written.

`decode_step_mma.decode_step_mma` runs steps 1, 2 and 4 (`MERGE`, `END`) as its last
threadgroup's tail; its splits have folded the exact tokens into their states already.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, constant, run
from .split_combine import split_combine_reference

LOG2E = 1.4426950408889634
DIMS = (32, 64, 128, 256)
MAX_ROWS = 16
MAX_ROW_DIMS = 2048  # rows x P: 3 x 2048 floats = 24 KiB of threadgroup memory
# rows of a KV head each threadgroup finishes (0: all): the launch is B * H * rows / this
# threadgroups, and memory latency is its cost (all rows: 8 threadgroups at one token of
# Llama-3.1-8B, too few to hide it; one row each measured faster at every length:
# benchmarks/diagnostics/step_timeline.py, its results in git history)
ROWS_PER_GROUP = 1

# The kernel in three parts: its threadgroup arrays, which rows a threadgroup takes, and the body,
# which `decode_step_mma`'s whole step runs as its last threadgroup's tail (arrays
# there in its dynamic shared memory, the partials its own outputs)
_DECLS = r"""
  constexpr int NW = P / 32;
  constexpr bool FIN_EXACT = true;  // this launch attends the exact tokens (step 3)
#define LC_PART(p, i) ((p)[i])
  LC_SHARED float buf[R * P];   // the compressed part's acc (rotated, then original frame)
  LC_SHARED float qs[R * P];    // q * scale * log2(e)
  LC_SHARED float wts[P * R];   // a tile's weights [key][row]
  LC_SHARED float red[NW * R];
  LC_SHARED float mlc[2 * R];   // m_c (base 2), l_c

"""

_ROWS = r"""
  // threadgroup lc_tg: rows r0 .. r0 + R - 1 (of RA) of KV head n = b * H + h
  const int n = (int)lc_tg / (RA / R);
  const int r0 = ((int)lc_tg % (RA / R)) * R;
  const int d = (int)lc_tid;
"""

# the parts of the body: 1-2, the split merge and the rotation back; 3, the exact tokens; 4, the
# states merged and written (`decode_step_mma`'s whole step folds the exact tokens into its
# splits and runs 1-2 and 4 only, after `NO_EXACT`)
MERGE = r"""
  const int H = q_shape[1];
  const int hh = n % H;
  const int bb = n / H;
  const int S = m_p_shape[1];
  const float qscale = scales[0];
  const float hs = scales[1];
  // this dim's sign (with the codec's scale) and value mean, asked for now: used only at the end,
  // after the merge's barriers, where their loads would be two more round trips in the tail
  const float sg = signs[d] * hs;
  const float mean_d = mean[bb * mean_strides[0] + hh * mean_strides[1] + d * mean_strides[3]];

  // 1. The splits of the compressed segment (m in natural-log units), merged. The S splits are
  // spread over the threads: thread t reads the states of splits t, t + P, ... (per-row maxima,
  // then weights and l), and every thread then sums the weighted acc of a block of P splits at a
  // time, all rows per split: loads that do not wait on each other, not a chain of S per row.
  const int64_t mo = m_p_strides[0] * n;
  const int64_t lpo = l_p_strides[0] * n;
  const int64_t ao = acc_p_strides[0] * n;
  // NB splits' acc loads are issued together (NB x R independent loads per thread, ~64): the
  // merge is a few memory round trips, not one per split (this launch is a few threadgroups a
  // KV head, all the GPU runs meanwhile, so latency is its whole cost). The first NB splits'
  // are requested with the m and l loads, before the maxima are known. (LC_PART: how the
  // partials are read; the whole step's tail reads them volatile, past L1.)
  constexpr int NB = R >= 64 ? 1 : 64 / R;
  float v[NB][R];
  LC_UNROLL for (int b = 0; b < NB; ++b) {
    const int64_t so = ao + (int64_t)b * acc_p_strides[1] + d * acc_p_strides[3];
    LC_UNROLL for (int r = 0; r < R; ++r)
      v[b][r] = b < S ? LC_PART(acc_p, so + (r0 + r) * acc_p_strides[2]) : 0.0f;
  }
  float mx_r[R];
  float m0[R];  // split d's m and l, kept for the weights (the first block of P splits)
  float l0[R];
  LC_UNROLL for (int r = 0; r < R; ++r) {
    m0[r] = d < S ? LC_PART(m_p, mo + d * m_p_strides[1] + (r0 + r) * m_p_strides[2]) : -LC_INF;
    l0[r] = d < S ? LC_PART(l_p, lpo + d * l_p_strides[1] + (r0 + r) * l_p_strides[2]) : 0.0f;
    mx_r[r] = m0[r];
  }
  for (int s = d + P; s < S; s += P) {
    LC_UNROLL for (int r = 0; r < R; ++r)
      mx_r[r] = LC_MAX(mx_r[r], LC_PART(m_p, mo + s * m_p_strides[1] + (r0 + r) * m_p_strides[2]));
  }
  LC_UNROLL for (int r = 0; r < R; ++r) {
    const float tm = lc_simd_max(mx_r[r]);
    if (lc_lane == 0u) red[(int)lc_warp * R + r] = tm;
  }
  LC_BARRIER();
  LC_UNROLL for (int r = 0; r < R; ++r) {
    float M = red[r];
    for (int w = 1; w < NW; ++w) M = LC_MAX(M, red[w * R + r]);
    mx_r[r] = M;  // -inf: no split saw a key
  }
  LC_BARRIER();  // red is rewritten below
  float a[R];
  float lt[R];
  LC_UNROLL for (int r = 0; r < R; ++r) {
    a[r] = 0.0f;
    lt[r] = 0.0f;
  }
  for (int s0 = 0; s0 < S; s0 += P) {
    const int s = s0 + d;
    if (s < S) {
      LC_UNROLL for (int r = 0; r < R; ++r) {
        const float Mu = mx_r[r] == -LC_INF ? 0.0f : mx_r[r];
        const int64_t mi = mo + s * m_p_strides[1] + (r0 + r) * m_p_strides[2];
        const int64_t li = lpo + s * l_p_strides[1] + (r0 + r) * l_p_strides[2];
        const float ms = s0 == 0 ? m0[r] : LC_PART(m_p, mi);
        const float ls = s0 == 0 ? l0[r] : LC_PART(l_p, li);
        const float w = LC_EXP(ms - Mu);
        wts[d * R + r] = w;
        lt[r] += ls * w;
      }
    }
    LC_BARRIER();
    const int ns_ = S - s0 < P ? S - s0 : P;
    for (int k = 0; k < ns_; k += NB) {
      if (s0 + k > 0) {  // (the first NB splits' are in v already)
        LC_UNROLL for (int b = 0; b < NB; ++b) {
          const int64_t so =
              ao + (int64_t)(s0 + k + b) * acc_p_strides[1] + d * acc_p_strides[3];
          LC_UNROLL for (int r = 0; r < R; ++r)
            v[b][r] = k + b < ns_ ? LC_PART(acc_p, so + (r0 + r) * acc_p_strides[2]) : 0.0f;
        }
      }
      LC_UNROLL for (int b = 0; b < NB; ++b) {
        if (k + b < ns_) {
          LC_UNROLL for (int r = 0; r < R; ++r) a[r] += v[b][r] * wts[(k + b) * R + r];
        }
      }
    }
    LC_BARRIER();  // wts is rewritten by the next block (and by the exact tokens' tiles)
  }
  LC_UNROLL for (int r = 0; r < R; ++r) {
    const float ls = lc_simd_sum(lt[r]);
    if (lc_lane == 0u) red[(int)lc_warp * R + r] = ls;
  }

  // 2. Back from the value codec's rotated frame: H (symmetric) then the signs. The butterfly's
  // stages between dims of one warp (d ^ h, h < 32) are lane exchanges; the others go through
  // buf (two barriers each, P / 32 - 1 of them).
  constexpr int HL = P < 32 ? P : 32;
  LC_UNROLL for (int h = 1; h < HL; h <<= 1) {
    const bool upper = (d & h) != 0;
    LC_UNROLL for (int r = 0; r < R; ++r) {
      const float o = lc_simd_xor(a[r], h);
      a[r] = upper ? o - a[r] : a[r] + o;
    }
  }
  LC_BARRIER();  // red's l sums are written
  LC_UNROLL for (int r = 0; r < R; ++r) {
    buf[r * P + d] = a[r];
    if (d == 0) {
      float l_sum = 0.0f;
      for (int w = 0; w < NW; ++w) l_sum += red[w * R + r];
      mlc[r] = mx_r[r] * 1.4426950408889634f;  // -inf stays -inf
      mlc[R + r] = l_sum;
    }
    if (FIN_EXACT) {  // the exact tokens' queries (the whole step has none to attend here)
      const int64_t qo =
          bb * q_strides[0] + hh * q_strides[1] + (r0 + r) * q_strides[2] + d * q_strides[3];
      qs[r * P + d] = LC_TOF(q[qo]) * qscale;
    }
  }
  LC_BARRIER();
  LC_UNROLL for (int h = HL; h < P; h <<= 1) {
    const bool upper = (d & h) != 0;
    float nv[R];
    LC_UNROLL for (int r = 0; r < R; ++r) {
      const float o = buf[r * P + (d ^ h)];
      nv[r] = upper ? o - a[r] : a[r] + o;
    }
    LC_UNROLL for (int r = 0; r < R; ++r) a[r] = nv[r];
    if (2 * h < P) {
      LC_BARRIER();
      LC_UNROLL for (int r = 0; r < R; ++r) buf[r * P + d] = a[r];
      LC_BARRIER();
    }
  }
  float acc_c[R];
  LC_UNROLL for (int r = 0; r < R; ++r) acc_c[r] = a[r] * sg;

"""

# the exact tokens' state (base-2 m, l, acc of each row at this thread's dim), empty: where step
# 3 starts from, and all of it when the exact tokens are already in the splits' states
NO_EXACT = r"""
  float m_e[R];
  float l_e[R];
  float acc_e[R];
  LC_UNROLL for (int r = 0; r < R; ++r) {
    m_e[r] = -LC_INF;
    l_e[r] = 0.0f;
    acc_e[r] = 0.0f;
  }
"""

EXACT = (
    NO_EXACT
    + r"""
  // 3. The exact tokens (sink, then window), base-2 online softmax over tiles of P keys.
  const int ns = HAS_SINK ? sink_k_shape[2] : 0;
  const int nw = HAS_WIN ? win_n[0] : 0;  // the window's valid slots (its buffers may be longer)
  const int E = ns + nw;
  const int64_t sko = bb * sink_k_strides[0] + hh * sink_k_strides[1];
  const int64_t svo = bb * sink_v_strides[0] + hh * sink_v_strides[1];
  const int64_t wko = bb * win_k_strides[0] + hh * win_k_strides[1];
  const int64_t wvo = bb * win_v_strides[0] + hh * win_v_strides[1];
  // Scores: thread d walks key d's row, 8 dims' loads in flight (a warp per key, whole-row
  // loads and a warp sum, measured no faster: docs/experiments/2026-12-07-finish-warp-keys.diff).
  for (int t0 = 0; t0 < E; t0 += P) {
    const int key = t0 + d;
    float s[R];
    LC_UNROLL for (int r = 0; r < R; ++r) s[r] = 0.0f;
    if (key < ns) {
      LC_UNROLL_N(8) for (int i = 0; i < P; ++i) {
        const float kv = LC_TOF(sink_k[sko + key * sink_k_strides[2] + i * sink_k_strides[3]]);
        LC_UNROLL for (int r = 0; r < R; ++r) s[r] += qs[r * P + i] * kv;
      }
    } else if (key < E) {
      const int w = key - ns;
      LC_UNROLL_N(8) for (int i = 0; i < P; ++i) {
        const float kv = LC_TOF(win_k[wko + w * win_k_strides[2] + i * win_k_strides[3]]);
        LC_UNROLL for (int r = 0; r < R; ++r) s[r] += qs[r * P + i] * kv;
      }
    }
    if (key >= E) {
      LC_UNROLL for (int r = 0; r < R; ++r) s[r] = -LC_INF;
    }
    LC_UNROLL for (int r = 0; r < R; ++r) {
      const float tm = lc_simd_max(s[r]);
      if (lc_lane == 0u) red[(int)lc_warp * R + r] = tm;
    }
    LC_BARRIER();
    LC_UNROLL for (int r = 0; r < R; ++r) {
      float tm = red[r];
      for (int w = 1; w < NW; ++w) tm = LC_MAX(tm, red[w * R + r]);
      const float mn = LC_MAX(m_e[r], tm);  // finite: the tile has a key
      const float alpha = LC_EXP2(m_e[r] - mn);
      const float p = key < E ? LC_EXP2(s[r] - mn) : 0.0f;
      wts[d * R + r] = p;
      l_e[r] = l_e[r] * alpha + p;
      acc_e[r] *= alpha;
      m_e[r] = mn;
    }
    LC_BARRIER();
    const int nk = E - t0 < P ? E - t0 : P;
    // the tile's sink keys, then its window keys: 8 keys' value loads in flight in each loop
    // (they come from L2; one round trip per key made the exact tokens most of a step once a
    // window held an answer's tokens)
    const int nks = ns - t0 < 0 ? 0 : (ns - t0 < nk ? ns - t0 : nk);
    LC_UNROLL_N(8) for (int k = 0; k < nks; ++k) {
      const float vv = LC_TOF(sink_v[svo + (t0 + k) * sink_v_strides[2] + d * sink_v_strides[3]]);
      LC_UNROLL for (int r = 0; r < R; ++r) acc_e[r] += wts[k * R + r] * vv;
    }
    LC_UNROLL_N(8) for (int k = nks; k < nk; ++k) {
      const float vv =
          LC_TOF(win_v[wvo + (t0 + k - ns) * win_v_strides[2] + d * win_v_strides[3]]);
      LC_UNROLL for (int r = 0; r < R; ++r) acc_e[r] += wts[k * R + r] * vv;
    }
    LC_BARRIER();  // wts and red are rewritten by the next tile
  }

"""
)

END = r"""
  // 4. Both states merged (each thread's l_e covers its own keys: summed over the threadgroup).
  LC_UNROLL for (int r = 0; r < R; ++r) {
    const float ls = lc_simd_sum(l_e[r]);
    if (lc_lane == 0u) red[(int)lc_warp * R + r] = ls;
  }
  LC_BARRIER();
  LC_UNROLL for (int r = 0; r < R; ++r) {
    float le = 0.0f;
    for (int w = 0; w < NW; ++w) le += red[w * R + r];
    const float mc = mlc[r];
    const float M = LC_MAX(mc, m_e[r]);
    const float Mu = M == -LC_INF ? 0.0f : M;
    const float c1 = LC_EXP2(mc - Mu);
    const float c2 = LC_EXP2(m_e[r] - Mu);
    const float den = mlc[R + r] * c1 + le * c2;
    out[((int64_t)n * RA + r0 + r) * P + d] =
        static_cast<OT>((acc_c[r] * c1 + acc_e[r] * c2) / LC_MAX(den, 1e-30f) + mean_d);
  }
"""


BODY = MERGE + EXACT + END

_SPEC = KernelSpec(
    name="lc_decode_finish",
    inputs=("m_p", "l_p", "acc_p", "q", "sink_k", "sink_v", "win_k", "win_v", "win_n", "signs", "mean", "scales"),
    outputs=("out",),
    row_contiguous=False,
    source=_DECLS + _ROWS + BODY,
)


def decode_finish_reference(m_p, l_p, acc_p, q, sink, window, signs, mean, scale, out_dtype, count=None):
    """Pure-MLX oracle (and CPU path): the same steps as `attend_blocked.attend` after its
    compressed segments, for one query token, no mask. Arguments as `decode_finish`; `count`:
    the window's valid slots as the first entry of an int32 array (None: all), read as an
    array, so that a compiled step's trace serves every count."""
    B, H, R, P = q.shape
    m, l, acc = split_combine_reference(m_p, l_p, acc_p)  # (N, R), (N, R), (N, R, P)
    m, l = m.reshape(B, H, R, 1), l.reshape(B, H, R, 1)
    acc = mx.hadamard_transform(acc.reshape(B, H, R, P), scale=1.0 / math.sqrt(P)) * signs
    exact = exact_scores(q, sink, window, scale, count)
    if exact is not None:
        s, values = exact
        m_e = s.max(axis=-1, keepdims=True)
        m_e = mx.where(m_e == -mx.inf, 0.0, m_e)  # no valid exact token: p = 0
        p = mx.exp(s - m_e)
        big = mx.maximum(m, m_e)
        safe = mx.where(big == -mx.inf, 0.0, big)
        c1, c2 = mx.exp(m - safe), mx.exp(m_e - safe)
        l = l * c1 + p.sum(axis=-1, keepdims=True) * c2
        acc = acc * c1 + (p @ values) * c2
    out = acc / mx.maximum(l, 1e-30) + mean
    return out.astype(out_dtype)


def exact_scores(q, sink, window, scale, count=None):
    """(s, values) of the exact tokens (sink, then window): s (B, H, R, E) float32 scores in
    natural-log units, window slots at or past `count`'s first entry at -inf (None: all
    valid); values (B, H, E, P) float32. None when there are no exact tokens."""
    exact = [part for part in (sink, window) if part is not None and part[0].shape[2]]
    if not exact:
        return None
    keys = mx.concatenate([e[0].astype(mx.float32) for e in exact], axis=2)
    values = mx.concatenate([e[1].astype(mx.float32) for e in exact], axis=2)
    s = (q.astype(mx.float32) @ keys.swapaxes(-1, -2)) * scale  # (B, H, R, E)
    if window is not None and window[0].shape[2] and count is not None:
        ns = keys.shape[2] - window[0].shape[2]
        slot = mx.arange(keys.shape[2]) - ns  # window slot of each key (sink: negative)
        s = mx.where(slot < count[:1], s, -mx.inf)  # (count: zero-padded, `constant`)
    return s, values


def exact_into_partials(m_p, l_p, acc_p, queries, sink, window, v_signs, scale, count):
    """Pure-MLX: the exact tokens' softmax state (natural-log units), its values rotated into
    the value frame (R_v v = H (signs v) / sqrt(P)), merged into the first split of each head:
    partials whose merge without exact tokens is the step's (what the kernel's variant writes,
    up to which splits hold the exact keys)."""
    B, H, R, P = queries.shape
    s, vals = exact_scores(queries, sink, window, scale, count)  # (B, H, R, E), (B, H, E, P)
    m_e = s.max(axis=-1)  # (B, H, R)
    safe = mx.where(m_e == -mx.inf, 0.0, m_e)
    p = mx.exp(s - safe[..., None])
    a_e = mx.hadamard_transform((p @ vals) * v_signs, scale=1.0 / math.sqrt(P))
    m_e, l_e = m_e.reshape(B * H, R), p.sum(axis=-1).reshape(B * H, R)
    a_e = a_e.reshape(B * H, R, P)
    m0, l0, a0 = m_p[:, 0], l_p[:, 0], acc_p[:, 0]
    big = mx.maximum(m0, m_e)
    ref = mx.where(big == -mx.inf, 0.0, big)
    c0, ce = mx.exp(m0 - ref), mx.exp(m_e - ref)
    m_p = mx.concatenate([big[:, None], m_p[:, 1:]], axis=1)
    l_p = mx.concatenate([(l0 * c0 + l_e * ce)[:, None], l_p[:, 1:]], axis=1)
    acc_p = mx.concatenate([(a0 * c0[..., None] + a_e * ce[..., None])[:, None], acc_p[:, 1:]], axis=1)
    return m_p, l_p, acc_p


def supported(p: int, rows: int) -> bool:
    """Whether the kernel takes rows x P: its three rows x P float buffers stay within 24 KiB
    of threadgroup memory (Metal allows 32 KiB, CUDA 48 KiB of static shared memory)."""
    return p in DIMS and 1 <= rows <= MAX_ROWS and rows * p <= MAX_ROW_DIMS


_DUMMY: list = []


def _dummy() -> mx.array:
    if not _DUMMY:
        _DUMMY.append(mx.zeros((1, 1, 1, 1), dtype=mx.float32))
    return _DUMMY[0]


def exact_inputs(sink, window):
    """The exact tokens as a kernel takes them: (sink, window) with empty parts as None; the
    arrays sink_k, sink_v, win_k, win_v (a stand-in, never read, for an absent part); and their
    template entries HAS_SINK, HAS_WIN, ST, WT (input dtypes: MLX versions that key compiled
    modules by name and template values only must not share one module between dtypes)."""
    sink = sink if sink is not None and sink[0].shape[2] else None
    window = window if window is not None and window[0].shape[2] else None
    dummy = _dummy()
    sk, sv = sink if sink is not None else (dummy, dummy)
    wk, wv = window if window is not None else (dummy, dummy)
    template = [("HAS_SINK", int(sink is not None)), ("HAS_WIN", int(window is not None)), ("ST", sk.dtype), ("WT", wk.dtype)]
    return sink, window, [sk, sv, wk, wv], template


def count(n: int) -> mx.array:
    """The int32 array whose first entry is n (the window's valid slots), shared by every layer
    (zero-padded to 4 entries: `_prelude.constant`)."""
    return constant((n,), mx.int32)


def decode_finish(m_p, l_p, acc_p, q, sink, window, signs, mean, scale, out_dtype=None, valid_array=None):
    """Finish one decode step: merge the compressed segment's splits, rotate its values back,
    attend the exact tokens, normalize and add the value mean.

    Args:
        m_p, l_p, acc_p: `decode_attend_partials`' outputs (N = B * H splits states).
        q: (B, H, R, P) the unrotated queries (any float dtype), rows as the partials'.
        sink, window: (keys, values) (B, H, n, P) exact centered tokens in the original frame,
            or None; any float dtype, any strides.
        signs: (P,) float32, the value rotation's +-1 diagonal.
        mean: (B, H, 1, P) float32, the values' centering mean.
        scale: the score scale.
        out_dtype: of the result (default q's).
        valid_array: the window's valid slots as the first entry of an int32 array (`count`),
            when `window` holds preallocated buffers (a compiled step's input: the kernel and
            the reference read the count from it, so the trace does not depend on it);
            default: all of `window`.

    Returns:
        (B, H, R, P) attention output in `out_dtype`.
    """
    B, H, R, P = q.shape
    out_dtype = out_dtype or q.dtype
    sink, window, exact, exact_template = exact_inputs(sink, window)
    window_count = valid_array if valid_array is not None else count(window[0].shape[2] if window is not None else 0)

    def reference():
        return [decode_finish_reference(m_p, l_p, acc_p, q, sink, window, signs, mean, scale, out_dtype, window_count)]

    if backend() == "cpu" or not supported(P, R):
        return reference()[0]
    scales = constant((scale * LOG2E, 1.0 / math.sqrt(P)), mx.float32)
    inputs = [m_p, l_p, acc_p, q, *exact, window_count, signs, mean, scales]
    rt = ROWS_PER_GROUP if ROWS_PER_GROUP and R % ROWS_PER_GROUP == 0 else R
    template = [("P", P), ("R", rt), ("RA", R), *exact_template, ("OT", out_dtype), ("QT", q.dtype)]
    return run(
        _SPEC,
        Launch(inputs, template, (B * H * (R // rt) * P, 1, 1), (P, 1, 1), [(B, H, R, P)], [out_dtype]),
        reference=reference,
    )[0]
