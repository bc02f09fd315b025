"""Fused decode + attend over a TurboQuant-compressed KV segment (flash-decoding), for a few queries.

Reads the compressed cache directly: K-hat and V-hat are never written to memory. For every query
row (GQA: the r query heads of a KV head times the Lq query tokens, row = head * Lq + token) and
every key l of the segment, in the rotated frames of the key and value codecs:

    s[row, l] = scale * (norm_k[l] * sum_d q[row, d] * T_k[code_k(l, d)]          stage 1 (+2)
                         + sqrt(pi/2)/M * rnorm[l] * sum_j qp[row, j] * sign(l, j))  QJL, optional
    acc[row]  = sum_l exp(s[row, l] - m[row]) * norm_v[l] * T_v[code_v(l, :)]

with code_k = (i1 << b2) | i2 and T_k[code] = c1[i1] + c2[i1, i2] (a single-stage codec has
b2 = 0, T_k = c1). Causal masking (Lq > 1): key l is visible to row iff l <= causal_base + row % Lq.

Inputs (as the cache stores them; any strides, so slices of a preallocated tail cost no copy):
    q_rot   (B, H, R, P) float32   queries rotated into the key frame (R = r * Lq rows)
    keys    idx (B, H, L, b1*P/32) uint32, norm (B, H, L) float16,
            [idx2 (B, H, L, b2*P/32) uint32], [qjl (B, H, L, M/32) uint32, rnorm (B, H, L) float16]
    values  idx (B, H, L, bv*P/32) uint32, norm (B, H, L) float16
    key_table (2^(b1+b2),) float32, value_table (2^bv,) float32; q_proj (B, H, R, M) float32
Returns the segment's softmax state, natural-log units, float32, to merge with other segments:
    m (B, H, R, 1) running max, l (B, H, R, 1) sum of exp(s - m), acc (B, H, R, P) unnormalized.

Thread plan (GPU). The dispatcher pre-multiplies q (and q_proj) by scale * log2(e), so the kernel
works in base 2 (exp2). Grid, one launch: one threadgroup of NT = 128 threads per (b, h, split, row
block); a row block is up to R <= max_rows rows (48 rows at P = 64: three blocks of 16, evenly
filled); a split is a chunk of keys (a multiple of 128; chosen so about TARGET_GROUPS threadgroups
cover the sequence). A threadgroup stages its rows' q (transposed, [d][row]) and the two tables in
threadgroup memory and walks its chunk in tiles of NT * KPT keys:
  1. scores: thread t owns keys t + j * 128 (j < KPT) of the tile: it reads each key's packed
     words (optionally whole rows through 16-byte loads, VECTOR_ROWS), decodes 32 codes
     per group with compile-time shifts (a 3-bit code may straddle two words), looks each code up
     in the table and accumulates R dot products (q read as a broadcast from threadgroup memory);
     then norm, QJL term, causal mask.
  2. softmax: per-row tile max by simdgroup max + a fixed-order max over the 4 warp partials; the
     running max m (identical in every thread) moves, acc and each thread's partial l are scaled by
     exp2(m_old - m_new), and w = exp2(s - m) * norm_v goes to threadgroup memory.
  3. values: thread t owns DPT consecutive dims (DPT * bv <= 32 bits: one or two words) of every
     G-th key (G = NT / (P / DPT) key groups); for each key it decodes its DPT codes and adds
     w[row] * T_v[code] into R x DPT register accumulators.
Two barriers per tile. At the end the G groups' accumulators are summed through threadgroup memory
and each split writes (m, l, acc) partials; `split_combine` merges the splits (a second kernel).
Limits: P in 32/64/128/256; rows per threadgroup <= min(16, 1024 / max(P, M)) (more rows: more
row blocks in the same launch); b1 + b2 <= 8, bv <= 8.

Measured (H200, MLX 0.32.4 CUDA, Llama-3.1-8B shapes, 128k, tq4; benchmarks/attend.py, ncu):
the kernel takes ~0.2 ms where its 138 MB of packed cache would take ~0.03 ms at copy bandwidth.
ncu: ~79M warp instructions (~20 per key-dim pair for K and V together: unpack, table lookup and
q / weight reads from threadgroup memory, 4 FMAs, 64-bit strided addressing), issued at ~1.6 per
SM-cycle; 128 registers cap occupancy at 25%, and half the stall cycles wait on the per-thread key
row loads (L1TEX scoreboard). DRAM ran at 15% of peak: this kernel is issue/latency bound.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, groups, run
from .pack import unpack_reference
from .split_combine import split_combine

LOG2E = 1.4426950408889634
NT = 128  # threads per threadgroup = keys per tile
# Launch knobs. Defaults = the fastest of the 18 configurations benchmarks/attend.py swept on an
# H200 at 128k, tq4, 4 rows (benchmarks/attend.py, its sweep): 512 groups, KPT 4, scalar loads
# 0.213 ms per pipelined step; 16-byte row loads with KPT 1 0.215; with KPT 2 (142 registers,
# 17% occupancy) 0.305, the slowest.
TARGET_GROUPS = 512  # threadgroups per launch to aim for (132 SMs on an H200)
KPT = 0  # keys per thread in the score phase; 0: `_kpt(rows)`
VECTOR_ROWS = False  # whole key rows through 16-byte loads where they fit in 32 registers

_SPEC = KernelSpec(
    name="lc_decode_attend",
    inputs=("q", "qp", "k_idx", "k_idx2", "k_norm", "k_qjl", "k_rnorm", "v_idx", "v_norm",
            "k_table", "v_table", "params"),
    outputs=("m_out", "l_out", "acc_out"),
    row_contiguous=False,
    source=r"""
  constexpr int B2X = B2 > 0 ? B2 : 1;
  constexpr int TPK = P / DPT;   // threads per key in the value phase
  constexpr int G = NT / TPK;    // key groups in the value phase
  constexpr int NW = NT / 32;
  constexpr int TK = NT * KPT;   // keys per tile
  constexpr int WK = B1 * P / 32;   // words of a key's stage-1 row
  constexpr int WK2 = B2X * P / 32;
  // Whole key rows in registers through 16-byte loads, when they fit (<= 32 words per thread).
  constexpr bool VROW = VEC && (WK % 4 == 0) && (B2 == 0 || WK2 % 4 == 0)
                        && (WK + (B2 > 0 ? WK2 : 0)) * KPT <= 32;
  constexpr uint32_t MASK1 = (1u << B1) - 1u;
  constexpr uint32_t MASK2 = (1u << B2X) - 1u;
  constexpr uint32_t MASKV = (1u << BV) - 1u;

  LC_SHARED float q_s[P * R];
  LC_SHARED float qp_s[QJL ? M * R : 1];
  LC_SHARED float qsum_s[R];
  LC_SHARED float ktab_s[1 << (B1 + B2)];
  LC_SHARED float vtab_s[1 << BV];
  LC_SHARED float scratch[NT * R * (DPT > KPT ? DPT : KPT)];
  LC_SHARED float red_s[NW * R];

  const int L = params[0];
  const int chunk = params[1];
  const int causal_base = params[2];
  const int S = params[3];
  const int RT = params[4];  // rows in all; this threadgroup takes the R rows from row0
  const int NRB = (RT + R - 1) / R;
  const int H = q_shape[1];
  const int rb = (int)(lc_tg % (uint32_t)NRB);
  const int sg = (int)(lc_tg / (uint32_t)NRB);  // bh * S + split
  const int split = sg % S;
  const int bh = sg / S;
  const int row0 = rb * R;
  const int nr = RT - row0 < R ? RT - row0 : R;  // rows of this block that exist (the rest: q = 0)
  const int hh = bh % H;
  const int bb = bh / H;
  const int k0 = split * chunk;
  const int k1 = (k0 + chunk < L) ? k0 + chunk : L;
  const int tid = (int)lc_tid;

  // Stage q (transposed to [d][row]), q_proj and the tables.
  const int64_t qo = bb * q_strides[0] + hh * q_strides[1];
  for (int i = tid; i < R * P; i += NT) {
    const int r = i / P;
    const int d = i - r * P;
    q_s[d * R + r] = r < nr ? q[qo + (row0 + r) * q_strides[2] + d * q_strides[3]] : 0.0f;
  }
  if (QJL) {
    const int64_t po = bb * qp_strides[0] + hh * qp_strides[1];
    for (int i = tid; i < R * M; i += NT) {
      const int r = i / M;
      const int j = i - r * M;
      qp_s[j * R + r] = r < nr ? qp[po + (row0 + r) * qp_strides[2] + j * qp_strides[3]] : 0.0f;
    }
  }
  for (int i = tid; i < (1 << (B1 + B2)); i += NT) ktab_s[i] = k_table[i];
  for (int i = tid; i < (1 << BV); i += NT) vtab_s[i] = v_table[i];
  LC_BARRIER();
  if (QJL && tid < R) {
    float t = 0.0f;
    for (int j = 0; j < M; ++j) t += qp_s[j * R + tid];
    qsum_s[tid] = t;
  }
  LC_BARRIER();

  const int64_t kib = bb * k_idx_strides[0] + hh * k_idx_strides[1];
  const int64_t kis = k_idx_strides[2];
  const int64_t kiw = k_idx_strides[3];
  const int64_t k2b = bb * k_idx2_strides[0] + hh * k_idx2_strides[1];
  const int64_t k2s = k_idx2_strides[2];
  const int64_t k2w = k_idx2_strides[3];
  const int64_t knb = bb * k_norm_strides[0] + hh * k_norm_strides[1];
  const int64_t kns = k_norm_strides[2];
  const int64_t kqb = bb * k_qjl_strides[0] + hh * k_qjl_strides[1];
  const int64_t kqs = k_qjl_strides[2];
  const int64_t kqw = k_qjl_strides[3];
  const int64_t krb = bb * k_rnorm_strides[0] + hh * k_rnorm_strides[1];
  const int64_t krs = k_rnorm_strides[2];
  const int64_t vib = bb * v_idx_strides[0] + hh * v_idx_strides[1];
  const int64_t vis = v_idx_strides[2];
  const int64_t viw = v_idx_strides[3];
  const int64_t vnb = bb * v_norm_strides[0] + hh * v_norm_strides[1];
  const int64_t vns = v_norm_strides[2];
  // 16-byte loads need rows of whole 16-byte units: unit word stride, row strides multiples of 4.
  const bool vec = VROW && kiw == 1 && kis % 4 == 0 && kib % 4 == 0
                   && (B2 == 0 || (k2w == 1 && k2s % 4 == 0 && k2b % 4 == 0));

  float m_run[R];
  float l_loc[R];
  float acc[R * DPT];
  LC_UNROLL for (int r = 0; r < R; ++r) {
    m_run[r] = -LC_INF;
    l_loc[r] = 0.0f;
  }
  LC_UNROLL for (int i = 0; i < R * DPT; ++i) acc[i] = 0.0f;
  const int vg = tid / TPK;
  const int d0 = (tid - vg * TPK) * DPT;
  const int vwi = (d0 * BV) >> 5;
  const int vsh = (d0 * BV) & 31;
  const bool vstraddle = vsh + DPT * BV > 32;

  for (int t0 = k0; t0 < k1; t0 += TK) {
    // 1. Scores (base-2 logits). Thread tid owns keys t0 + tid + j * NT, j < KPT: every q value
    //    read from threadgroup memory serves KPT keys. Keys past the chunk read a valid row
    //    (the chunk's first) and are masked afterwards, so the loads need no branches.
    float s[KPT * R];
    float vn[KPT];
    int kc[KPT];
    bool ok[KPT];
    LC_UNROLL for (int j = 0; j < KPT; ++j) {
      const int key = t0 + tid + j * NT;
      ok[j] = key < k1;
      kc[j] = ok[j] ? key : k0;
      LC_UNROLL for (int r = 0; r < R; ++r) s[j * R + r] = 0.0f;
    }
    uint32_t kw[VROW ? KPT * WK : 1];
    uint32_t kw2[VROW && B2 > 0 ? KPT * WK2 : 1];
    if (VROW && vec) {
      LC_UNROLL for (int j = 0; j < KPT; ++j) {
        LC_UNROLL for (int u = 0; u < (VROW ? WK / 4 : 0); ++u) {
          const LC_U4 t = LC_LD_U4(k_idx, kib + kc[j] * kis + 4 * u);
          kw[VROW ? j * WK + 4 * u : 0] = t.x;
          kw[VROW ? j * WK + 4 * u + 1 : 0] = t.y;
          kw[VROW ? j * WK + 4 * u + 2 : 0] = t.z;
          kw[VROW ? j * WK + 4 * u + 3 : 0] = t.w;
        }
        if (B2 > 0) {
          LC_UNROLL for (int u = 0; u < (VROW && B2 > 0 ? WK2 / 4 : 0); ++u) {
            const LC_U4 t = LC_LD_U4(k_idx2, k2b + kc[j] * k2s + 4 * u);
            kw2[VROW && B2 > 0 ? j * WK2 + 4 * u : 0] = t.x;
            kw2[VROW && B2 > 0 ? j * WK2 + 4 * u + 1 : 0] = t.y;
            kw2[VROW && B2 > 0 ? j * WK2 + 4 * u + 2 : 0] = t.z;
            kw2[VROW && B2 > 0 ? j * WK2 + 4 * u + 3 : 0] = t.w;
          }
        }
      }
    }
    LC_UNROLL for (int g = 0; g < P / 32; ++g) {
      uint32_t w1[KPT * B1];
      uint32_t w2[KPT * B2X];
      LC_UNROLL for (int j = 0; j < KPT; ++j) {
        LC_UNROLL for (int b = 0; b < B1; ++b) {
          w1[j * B1 + b] = (VROW && vec) ? kw[VROW ? j * WK + g * B1 + b : 0]
                                         : k_idx[kib + kc[j] * kis + (g * B1 + b) * kiw];
        }
        if (B2 > 0) {
          LC_UNROLL for (int b = 0; b < B2X; ++b) {
            w2[j * B2X + b] = (VROW && vec) ? kw2[VROW && B2 > 0 ? j * WK2 + g * B2X + b : 0]
                                            : k_idx2[k2b + kc[j] * k2s + (g * B2X + b) * k2w];
          }
        }
      }
      LC_UNROLL for (int i = 0; i < 32; ++i) {
        const int sh = (i * B1) & 31;
        const int wi = (i * B1) >> 5;
        const int sh2 = (i * B2X) & 31;
        const int wi2 = (i * B2X) >> 5;
        float kv[KPT];
        LC_UNROLL for (int j = 0; j < KPT; ++j) {
          uint32_t c = w1[j * B1 + wi] >> sh;
          if (sh + B1 > 32) c |= w1[j * B1 + wi + 1] << (32 - sh);
          c &= MASK1;
          if (B2 > 0) {
            uint32_t c2 = w2[j * B2X + wi2] >> sh2;
            if (sh2 + B2X > 32) c2 |= w2[j * B2X + wi2 + 1] << (32 - sh2);
            c = (c << B2X) | (c2 & MASK2);
          }
          kv[j] = ktab_s[c];
        }
        LC_UNROLL for (int r = 0; r < R; ++r) {
          const float qv = q_s[(g * 32 + i) * R + r];
          LC_UNROLL for (int j = 0; j < KPT; ++j) s[j * R + r] += qv * kv[j];
        }
      }
    }
    LC_UNROLL for (int j = 0; j < KPT; ++j) {
      const float kn = LC_H2F(k_norm[knb + kc[j] * kns]);
      LC_UNROLL for (int r = 0; r < R; ++r) s[j * R + r] *= kn;
      vn[j] = LC_H2F(v_norm[vnb + kc[j] * vns]);
    }
    if (QJL) {
      float cq[KPT * R];
      LC_UNROLL for (int i = 0; i < KPT * R; ++i) cq[i] = 0.0f;
      LC_UNROLL for (int w = 0; w < M / 32; ++w) {
        uint32_t wq[KPT];
        LC_UNROLL for (int j = 0; j < KPT; ++j) wq[j] = k_qjl[kqb + kc[j] * kqs + w * kqw];
        LC_UNROLL for (int i = 0; i < 32; ++i) {
          float bit[KPT];
          LC_UNROLL for (int j = 0; j < KPT; ++j) bit[j] = (float)((wq[j] >> i) & 1u);
          LC_UNROLL for (int r = 0; r < R; ++r) {
            const float qv = qp_s[(w * 32 + i) * R + r];
            LC_UNROLL for (int j = 0; j < KPT; ++j) cq[j * R + r] += bit[j] * qv;
          }
        }
      }
      LC_UNROLL for (int j = 0; j < KPT; ++j) {
        const float rn = LC_H2F(k_rnorm[krb + kc[j] * krs]);
        LC_UNROLL for (int r = 0; r < R; ++r) s[j * R + r] += rn * (2.0f * cq[j * R + r] - qsum_s[r]);
      }
    }
    LC_UNROLL for (int j = 0; j < KPT; ++j) {
      LC_UNROLL for (int r = 0; r < R; ++r) {
        bool visible = ok[j];
        if (CAUSAL) visible = visible && (t0 + tid + j * NT <= causal_base + (row0 + r) % LQ);
        if (!visible) s[j * R + r] = -LC_INF;
      }
    }

    // 2. Online softmax: tile max, rescale, weights w = exp2(s - m) * norm_v.
    LC_UNROLL for (int r = 0; r < R; ++r) {
      float tm = s[r];
      LC_UNROLL for (int j = 1; j < KPT; ++j) tm = LC_MAX(tm, s[j * R + r]);
      tm = lc_simd_max(tm);
      if (lc_lane == 0u) red_s[(int)lc_warp * R + r] = tm;
    }
    LC_BARRIER();
    LC_UNROLL for (int r = 0; r < R; ++r) {
      float tm = red_s[r];
      for (int w = 1; w < NW; ++w) tm = LC_MAX(tm, red_s[w * R + r]);
      const float mn = LC_MAX(m_run[r], tm);
      const float mu = mn == -LC_INF ? 0.0f : mn;
      const float alpha = LC_EXP2(m_run[r] - mu);
      float ps = 0.0f;
      LC_UNROLL for (int j = 0; j < KPT; ++j) {
        const float p = LC_EXP2(s[j * R + r] - mu);
        ps += p;
        scratch[(tid + j * NT) * R + r] = p * vn[j];
      }
      l_loc[r] = l_loc[r] * alpha + ps;
      m_run[r] = mn;
      LC_UNROLL for (int i = 0; i < DPT; ++i) acc[r * DPT + i] *= alpha;
    }
    LC_BARRIER();

    // 3. Values: DPT dims of every G-th key of the tile.
    const int nk = (k1 - t0) < TK ? (k1 - t0) : TK;
    for (int kk = vg; kk < nk; kk += G) {
      const int64_t vo = vib + (t0 + kk) * vis;
      uint32_t bits = v_idx[vo + vwi * viw] >> vsh;
      if (vstraddle) bits |= v_idx[vo + (vwi + 1) * viw] << (32 - vsh);
      float wv[R];
      LC_UNROLL for (int r = 0; r < R; ++r) wv[r] = scratch[kk * R + r];
      LC_UNROLL for (int i = 0; i < DPT; ++i) {
        const float cv = vtab_s[(bits >> (i * BV)) & MASKV];
        LC_UNROLL for (int r = 0; r < R; ++r) acc[r * DPT + i] += wv[r] * cv;
      }
    }
  }

  // Sum the G key groups' accumulators and the threads' partial l; write this split's state.
  LC_BARRIER();
  LC_UNROLL for (int r = 0; r < R; ++r) {
    LC_UNROLL for (int i = 0; i < DPT; ++i) scratch[(vg * R + r) * P + d0 + i] = acc[r * DPT + i];
  }
  LC_UNROLL for (int r = 0; r < R; ++r) {
    const float ls = lc_simd_sum(l_loc[r]);
    if (lc_lane == 0u) red_s[(int)lc_warp * R + r] = ls;
  }
  LC_BARRIER();
  const int64_t ob = (int64_t)sg * RT + row0;
  for (int i = tid; i < nr * P; i += NT) {
    const int r = i / P;
    const int d = i - r * P;
    float a = 0.0f;
    for (int g = 0; g < G; ++g) a += scratch[(g * R + r) * P + d];
    acc_out[ob * P + i] = a;
  }
  LC_UNROLL for (int r = 0; r < R; ++r) {
    if (tid == r && r < nr) {
      float lt = 0.0f;
      for (int w = 0; w < NW; ++w) lt += red_s[w * R + r];
      l_out[ob + r] = lt;
      m_out[ob + r] = m_run[r] * 0.6931471805599453f;
    }
  }
""",
)


def _unpack_codes(keys: dict, p: int, key_bits: int, key_bits2: int, lo: int, hi: int):
    c = unpack_reference(keys["idx"][:, :, lo:hi], key_bits, p).astype(mx.uint32)
    if key_bits2:
        c2 = unpack_reference(keys["idx2"][:, :, lo:hi], key_bits2, p).astype(mx.uint32)
        c = (c << key_bits2) | c2
    return c  # (B, H, n, P)


def decode_attend_reference(q_rot, keys, values, key_table, value_table, *, key_bits, value_bits,
                            scale, key_bits2=0, q_proj=None, lq=1, causal_base=None, block=4096):
    """Pure-MLX oracle (and CPU path): the same function, blocked over keys with an online softmax.

    Arguments and returns as `decode_attend`.
    """
    B, H, R, P = q_rot.shape
    L = keys["norm"].shape[2]
    q = q_rot.astype(mx.float32)
    m = mx.full((B, H, R, 1), -mx.inf, dtype=mx.float32)
    l = mx.zeros((B, H, R, 1), dtype=mx.float32)
    acc = mx.zeros((B, H, R, P), dtype=mx.float32)
    rows_t = mx.arange(R) % lq  # token of each row
    for lo in range(0, L, block):
        hi = min(lo + block, L)
        k = mx.take(key_table, _unpack_codes(keys, P, key_bits, key_bits2, lo, hi))
        k = k * keys["norm"][:, :, lo:hi].astype(mx.float32)[..., None]  # (B, H, n, P)
        s = q @ k.swapaxes(-1, -2)  # (B, H, R, n)
        if q_proj is not None:
            mq = q_proj.shape[-1]
            signs = unpack_reference(keys["qjl"][:, :, lo:hi], 1, mq).astype(mx.float32) * 2 - 1
            rn = keys["rnorm"][:, :, lo:hi].astype(mx.float32)
            s = s + (q_proj.astype(mx.float32) @ signs.swapaxes(-1, -2)) * (
                math.sqrt(math.pi / 2) / mq * rn)[:, :, None, :]
        s = s * scale
        if causal_base is not None:
            allowed = mx.arange(lo, hi)[None, :] <= (causal_base + rows_t)[:, None]  # (R, n)
            s = mx.where(allowed, s, -mx.inf)
        v = mx.take(value_table, unpack_reference(values["idx"][:, :, lo:hi], value_bits, P))
        v = v * values["norm"][:, :, lo:hi].astype(mx.float32)[..., None]  # (B, H, n, P)
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        safe = mx.where(m_new == -mx.inf, 0.0, m_new)
        p = mx.exp(s - safe)
        corr = mx.exp(m - safe)
        l = l * corr + p.sum(axis=-1, keepdims=True)
        acc = acc * corr + p @ v
        m = m_new
    return m, l, acc


def _dpt(p: int, rows: int, value_bits: int) -> int | None:
    """Value dims per thread: <= 32 code bits, <= 32 accumulators, P/DPT threads dividing NT."""
    for dpt in (8, 4, 2, 1):
        tpk = p // dpt
        if dpt * value_bits <= 32 and dpt * rows <= 32 and p % dpt == 0 and NT % tpk == 0:
            return dpt
    return None


def _kpt(rows: int) -> int:
    """Keys per thread in the score phase: each q read serves KPT keys; <= 16 score registers."""
    return max(1, min(4, 16 // rows))


def max_rows(p: int, m_qjl: int = 0) -> int:
    """Rows one threadgroup handles: R * P and R * M <= 1024 floats of threadgroup memory each."""
    return max(1, min(16, 1024 // max(p, m_qjl)))


def _splits(length: int, bh: int) -> tuple[int, int]:
    """(chunk, splits): chunks are whole tiles; about TARGET_GROUPS threadgroups in all."""
    tiles = groups(length, NT)
    want = max(1, min(tiles, groups(TARGET_GROUPS, bh)))
    chunk = groups(tiles, want) * NT
    return chunk, groups(length, chunk)


def _supported(p: int, key_bits: int, key_bits2: int, value_bits: int, m_qjl: int) -> bool:
    return (p in (32, 64, 128, 256) and 1 <= key_bits and key_bits + key_bits2 <= 8
            and 1 <= value_bits <= 8 and m_qjl % 32 == 0 and m_qjl <= 1024)


def decode_attend(q_rot, keys, values, key_table, value_table, *, key_bits, value_bits, scale,
                  key_bits2=0, q_proj=None, lq=1, causal_base=None):
    """Softmax state of a few query rows over one compressed segment (fused GPU kernel).

    Args:
        q_rot: (B, H, R, P) queries rotated into the key codec's frame, rows grouped per KV head
            (row = query head in group * lq + token).
        keys: dict with idx, norm and (when the codec has them) idx2, qjl, rnorm, each
            (B, H, L, ...) as `VectorCodec.encode` stores them.
        values: dict with idx, norm (B, H, L, ...).
        key_table: (2^(key_bits + key_bits2),) float32, c1[i1] + c2[i1, i2] at (i1 << b2) | i2.
        value_table: (2^value_bits,) float32 value centroids.
        key_bits, key_bits2, value_bits: index widths (key_bits2 = 0: single stage).
        scale: score scale (usually D ** -0.5).
        q_proj: (B, H, R, M) QJL-projected rotated queries, when the keys carry a sketch.
        lq: query tokens per head (for the causal mask).
        causal_base: None, or mask key l of row unless l <= causal_base + row % lq.

    Returns:
        (m (B, H, R, 1), l (B, H, R, 1), acc (B, H, R, P)) float32: running max (natural log
        units), sum of exp(s - m) and the unnormalized sum of weighted values (value frame).
    """
    B, H, R, P = q_rot.shape
    L = keys["norm"].shape[2]
    _check(q_rot, keys, values, key_table, value_table, key_bits, key_bits2, value_bits, q_proj)
    kw = dict(key_bits=key_bits, value_bits=value_bits, scale=scale, key_bits2=key_bits2,
              q_proj=q_proj, lq=lq, causal_base=causal_base)
    m_qjl = q_proj.shape[-1] if q_proj is not None else 32
    if backend() == "cpu" or L == 0 or not _supported(P, key_bits, key_bits2, value_bits, m_qjl):
        return decode_attend_reference(q_rot, keys, values, key_table, value_table, **kw)
    c = scale * LOG2E
    q = _as(q_rot, mx.float32) * c
    qp = (q_proj.astype(mx.float32) * (c * math.sqrt(math.pi / 2) / m_qjl)
          if q_proj is not None else None)
    return _launch(q, qp, keys, values, key_table, value_table, key_bits, key_bits2, value_bits,
                   m_qjl, lq, causal_base, dict(kw, q_rot=q_rot, keys=keys, values=values,
                                                key_table=key_table, value_table=value_table))


def _check(q_rot, keys, values, key_table, value_table, key_bits, key_bits2, value_bits, q_proj):
    B, H, R, P = q_rot.shape
    L = keys["norm"].shape[2]
    want = {"idx": (B, H, L, key_bits * groups(P, 32)), "norm": (B, H, L)}
    if key_bits2:
        want["idx2"] = (B, H, L, key_bits2 * groups(P, 32))
    if q_proj is not None:
        want["qjl"] = (B, H, L, groups(q_proj.shape[-1], 32))
        want["rnorm"] = (B, H, L)
        if q_proj.shape[:3] != (B, H, R):
            raise ValueError(f"q_proj {q_proj.shape} does not match q_rot {q_rot.shape}")
    for name, shape in want.items():
        if name not in keys or tuple(keys[name].shape) != shape:
            got = keys[name].shape if name in keys else "missing"
            raise ValueError(f"keys[{name!r}]: expected {shape}, got {got}")
    for name, shape in {"idx": (B, H, L, value_bits * groups(P, 32)), "norm": (B, H, L)}.items():
        if tuple(values[name].shape) != shape:
            raise ValueError(f"values[{name!r}]: expected {shape}, got {values[name].shape}")
    if key_table.shape != (1 << (key_bits + key_bits2),) or value_table.shape != (1 << value_bits,):
        raise ValueError(f"tables: expected ({1 << (key_bits + key_bits2)},), ({1 << value_bits},);"
                         f" got {key_table.shape}, {value_table.shape}")


def _as(a: mx.array, dtype) -> mx.array:
    return a if a.dtype == dtype else a.astype(dtype)


_DUMMIES: list = []
_PARAMS: dict = {}


def _dummies():
    """Stand-ins for absent inputs (idx2 / qjl / rnorm / q_proj), made once."""
    if not _DUMMIES:
        _DUMMIES.extend([mx.zeros((1, 1, 1, 1), dtype=mx.uint32),
                         mx.zeros((1, 1, 1), dtype=mx.float16),
                         mx.zeros((1, 1, 1, 1), dtype=mx.float32)])
    return _DUMMIES


def _params(values: tuple) -> mx.array:
    """The int32 parameter array, reused across decode steps with the same values."""
    if values not in _PARAMS:
        if len(_PARAMS) > 4096:
            _PARAMS.clear()
        _PARAMS[values] = mx.array(values, dtype=mx.int32)
    return _PARAMS[values]


def row_blocks(rows: int, p: int, m_qjl: int = 0) -> tuple[int, int]:
    """(rows per threadgroup, row blocks): as few blocks of at most max_rows as cover `rows`,
    evenly filled (48 rows at P = 64: 3 x 16; 20: 2 x 10)."""
    blocks = groups(rows, max_rows(p, m_qjl))
    return groups(rows, blocks), blocks


def _reference_partials(splits: int, q_rot, keys, values, key_table, value_table, **kw):
    """The kernel's outputs from the reference: the whole segment's state in split 0, "nothing
    seen" (m = -inf, l = 0, acc = 0) in the others, which `split_combine` merges away."""
    B, H, R, P = q_rot.shape
    m, l, acc = decode_attend_reference(q_rot, keys, values, key_table, value_table, **kw)
    pad = splits - 1
    m_p = mx.concatenate([m.reshape(B * H, 1, R), mx.full((B * H, pad, R), -mx.inf)], axis=1)
    l_p = mx.concatenate([l.reshape(B * H, 1, R), mx.zeros((B * H, pad, R))], axis=1)
    acc_p = mx.concatenate([acc.reshape(B * H, 1, R, P), mx.zeros((B * H, pad, R, P))], axis=1)
    return m_p, l_p, acc_p


def _launch(q, qp, keys, values, key_table, value_table, key_bits, key_bits2, value_bits, m_qjl,
            lq, causal_base, reference):
    """One kernel launch for all rows (row blocks x KV heads x splits threadgroups), then the
    split merge. `reference`: `decode_attend_reference`'s arguments, for the fallback."""
    B, H, R, P = q.shape
    L = keys["norm"].shape[2]
    per_block, nrb = row_blocks(R, P, m_qjl if qp is not None else 0)
    chunk, splits = _splits(L, B * H * nrb)
    dummy4, dummy3, dummyf = _dummies()
    params = _params((L, chunk, 0 if causal_base is None else causal_base, splits, R))
    u32, f16, f32 = mx.uint32, mx.float16, mx.float32  # fixed: MLX caches modules by name
    inputs = [q, qp if qp is not None else dummyf,
              _as(keys["idx"], u32), _as(keys["idx2"], u32) if key_bits2 else dummy4,
              _as(keys["norm"], f16), _as(keys["qjl"], u32) if qp is not None else dummy4,
              _as(keys["rnorm"], f16) if qp is not None else dummy3, _as(values["idx"], u32),
              _as(values["norm"], f16), _as(key_table, f32), _as(value_table, f32), params]
    template = [("P", P), ("R", per_block), ("LQ", lq), ("B1", key_bits), ("B2", key_bits2),
                ("BV", value_bits), ("QJL", int(qp is not None)), ("M", m_qjl),
                ("CAUSAL", int(causal_base is not None)), ("NT", NT),
                ("DPT", _dpt(P, per_block, value_bits)), ("KPT", KPT if KPT else _kpt(per_block)),
                ("VEC", int(VECTOR_ROWS))]
    n = B * H * splits * nrb
    m_p, l_p, acc_p = run(_SPEC, Launch(inputs, template, (n * NT, 1, 1), (NT, 1, 1),
                                        [(B * H, splits, R), (B * H, splits, R),
                                         (B * H, splits, R, P)], [mx.float32] * 3),
                          reference=lambda: _reference_partials(splits, **reference))
    m, l, acc = split_combine(m_p, l_p, acc_p)
    return m.reshape(B, H, R, 1), l.reshape(B, H, R, 1), acc.reshape(B, H, R, P)
