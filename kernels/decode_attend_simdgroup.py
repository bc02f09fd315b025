"""One decode step's compressed attention on Metal's simdgroup matrices: 4-bit keys and values.

The same function as `decode_attend.decode_attend_partials` (unrotated queries in, each split's
softmax state out, merged by `decode_finish`), for the default preset's shape of work: single-stage
4-bit keys and values with one codebook, no QJL, D = P in 64/128, up to 8 query rows per KV head
(GQA 1..8 at one token). It is the Metal counterpart of `decode_attend_mma` (CUDA, `mma.sync`):
both products run as 8x8x8 `simdgroup_multiply_accumulate` (fp16 operands, fp32 accumulators)
instead of the portable kernel's per-thread FMAs.

    S (8 rows x 8 keys)   = sum_t Q_t (8 rows x 8 dims) . K_t^T (8 dims x 8 keys),  P/8 steps
    O_t (8 rows x 8 dims) = diag(alpha) . O_t + P' (8 rows x 8 keys) . V_t (8 keys x 8 dims)

with Q = q rotated, times scale * log2(e) (scores in base 2), s = S * norm_k, P' = exp2(s - m) *
norm_v (the value norm folded into the weights, fp16) and alpha = exp2(m_old - m_new) per row (the
online softmax's rescale, as a product with a diagonal matrix: a simdgroup matrix has no
per-row access). Rows past R are zero queries whose states are never written.

Layout. A 4-bit code table T (16 centroids) becomes a pair table in threadgroup memory: entry x
(one byte of a packed row, two codes) holds the fp16 pair (T[x & 15], T[x >> 4]). Decoding a key or
value row is then one lookup and two fp16 stores per byte, into a row-major [key][dim] tile; the
score product loads K^T from it with `simdgroup_load(..., transpose_matrix = true)`, the value
product loads V_t as it lies.

Thread plan. One threadgroup of WARPS (4) simdgroups per (b, h, split); a split is a whole number
of 8 x WARPS-key tiles, about TARGET_GROUPS threadgroups in all (a guess: no Mac was measured).
The threadgroup rotates q (signs, then the Walsh-Hadamard butterfly in threadgroup memory), stores
it as fp16 and builds the pair table; each simdgroup loads Q's P/8 tiles once and walks every
WARPS-th block of 8 keys of its split with its own online softmax state (no threadgroup barrier in
the loop): lane l decodes a quarter of key l / 4's packed row (P/32 words of keys and of values),
the score MMAs go to an 8x8 float tile, lane l scores keys 2 (l % 4), +1 of row l / 4 (norm, mask,
the row maximum over 4 lanes), writes P' and the row's alpha (the diagonal), and the rescale
(only when a maximum moved: a simdgroup vote) and value MMAs follow. At the end the simdgroups'
states are merged in threadgroup memory, one after another (O scaled by diag(exp2(m_w - M)) and
added through the MMA's accumulator), and the split's (m, l, acc) written, m in natural-log units
as `decode_attend` writes it. Threadgroup memory: ~26 KiB at P = 128 (Metal allows 32).

Not run on a Mac GPU (none was available): its Metal source passes scripts/metal_check.py
(clang under MSL's rules, with a model of the simdgroup-matrix API) and the CPU emulator
(tests/kernel_emu.py, which runs the body with MSL's simdgroup-matrix semantics: collective,
uniform arguments, two elements a lane in Apple's layout, fp32 accumulation) matches the
reference. Its speed is unknown. The exact tokens (sink, window) are left to `decode_finish`.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, constant, groups, run
from . import decode_attend as da

LOG2E = 1.4426950408889634
WARPS = 4  # simdgroups per threadgroup (each owns every WARPS-th block of its split)
BLOCK = 8  # keys per simdgroup block (the matrices' size)
DIMS = (64, 128)  # (P = 256 would pass Metal's 32 KiB of threadgroup memory)
MAX_ROWS = 8
TARGET_GROUPS = 160  # threadgroups a launch aims at (~4 per GPU core of a 40-core Apple GPU)

_HEADER = r"""
#if !defined(LC_METAL) && !defined(LC_EMU)
#error "decode_attend_simdgroup is Metal only (simdgroup matrices)"
#endif
#if defined(LC_METAL)
#define LC_HALF half
#endif
"""

NAME = "lc_decode_attend_simdgroup"

_SOURCE = r"""
  constexpr int NW = NT / 32;
  constexpr int WPL = P / 32;      // words of a packed 4-bit row each lane decodes (a quarter)
  constexpr int KT = P / 8;        // 8-dim tiles of q, of the key rows and of the output
  constexpr int TILE = 8 * P;      // halves of one simdgroup's 8 decoded rows, [key][dim]
  LC_SHARED LC_HALF tab_s[512];          // pair table: entry x at 2x, 2x + 1
  LC_SHARED LC_HALF q_s[8 * P];          // rotated, scaled q, fp16 [row][dim] (rows >= R: 0)
  LC_SHARED float f_s[8 * P];            // q's rotation; at the end the merged O [row][dim]
  LC_SHARED LC_HALF k_s[NW * TILE];      // each simdgroup's decoded key rows
  LC_SHARED LC_HALF v_s[NW * TILE];      // ... and value rows
  LC_SHARED float s_s[NW * 64];          // each simdgroup's scores [row][key]
  LC_SHARED LC_HALF p_s[NW * 64];        // ... its weights P' [row][key]
  LC_SHARED float d_s[NW * 64];          // ... its diagonal matrix (alpha, merge factors)
  LC_SHARED float red_s[2 * NW * 8];     // the simdgroups' m (base 2), then l, per row

  const int L = params[0];
  const int chunk = params[1];
  const int S = params[2];
  const float qscale = scales[0];  // scale * log2(e)
  const float rscale = scales[1];  // 1 / sqrt(P)
  const int H = q_shape[1];
  const int split = (int)(lc_tg % (uint32_t)S);
  const int bh = (int)(lc_tg / (uint32_t)S);
  const int hh = bh % H;
  const int bb = bh / H;
  const int k0 = split * chunk;
  const int k1 = (k0 + chunk < L) ? k0 + chunk : L;
  const int tid = (int)lc_tid;
  const int lane = (int)lc_lane;
  const int warp = (int)lc_warp;

  const auto kip = k_idx + (bb * k_idx_strides[0] + hh * k_idx_strides[1]);
  const int kis = (int)k_idx_strides[2];
  const int kiw = (int)k_idx_strides[3];
  const auto knp = k_norm + (bb * k_norm_strides[0] + hh * k_norm_strides[1]);
  const int kns = (int)k_norm_strides[2];
  const auto vip = v_idx + (bb * v_idx_strides[0] + hh * v_idx_strides[1]);
  const int vis = (int)v_idx_strides[2];
  const int viw = (int)v_idx_strides[3];
  const auto vnp = v_norm + (bb * v_norm_strides[0] + hh * v_norm_strides[1]);
  const int vns = (int)v_norm_strides[2];

  // 1. q: signs, the butterfly over 8 rows (rows >= R zero), scaled to fp16; the pair table;
  // the diagonal matrices' zeros (only their diagonals are written later).
  const int64_t qo = bb * q_strides[0] + hh * q_strides[1];
  for (int i = tid; i < 8 * P; i += NT) {
    const int r = i / P;
    const int d = i - r * P;
    f_s[i] = r < R ? LC_TOF(q[qo + r * q_strides[2] + d * q_strides[3]]) * q_signs[d] : 0.0f;
  }
  for (int x = tid; x < 256; x += NT) {
    tab_s[2 * x] = LC_F2H(LC_TOF(table[x & 15]));
    tab_s[2 * x + 1] = LC_F2H(LC_TOF(table[x >> 4]));
  }
  for (int i = tid; i < NW * 64; i += NT) d_s[i] = 0.0f;
  LC_BARRIER();
  LC_WHT_ROWS_N(f_s, 8, P, NT, tid)
  for (int i = tid; i < 8 * P; i += NT) q_s[i] = LC_F2H(f_s[i] * (qscale * rscale));
  LC_BARRIER();

  simdgroup_half8x8 qm[KT];
  simdgroup_float8x8 om[KT];
  LC_UNROLL for (int t = 0; t < KT; ++t) {
    simdgroup_load(qm[t], q_s + 8 * t, P);
    om[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  // 2. The simdgroup's blocks: keys kb..kb+7, every NW-th block of the split.
  const int kw = warp * TILE;   // this simdgroup's tiles in k_s / v_s
  const int sw = warp * 64;     // ... in s_s, p_s, d_s
  const int dkey = lane >> 2;   // decoding: key dkey, words (lane % 4) * WPL ..
  const int dpart = lane & 3;
  const int srow = lane >> 2;   // scoring: row srow, keys 2 sc, 2 sc + 1
  const int sc = lane & 3;
  float m_run = -LC_INF;        // the row's running maximum (base 2), same in its 4 lanes
  float l_run = 0.0f;           // this lane's share of the row's sum
  for (int kb = k0 + BLK * warp; kb < k1; kb += BLK * NW) {
    {
      // past the split's end: the last key's row (finite), masked in the scores
      const int kg = kb + dkey < k1 ? kb + dkey : k1 - 1;
      LC_UNROLL for (int j = 0; j < WPL; ++j) {
        const int word = dpart * WPL + j;
        const uint32_t kx = kip[kg * kis + word * kiw];
        const uint32_t vx = vip[kg * vis + word * viw];
        LC_UNROLL for (int b = 0; b < 4; ++b) {
          const int at = kw + dkey * P + 8 * word + 2 * b;
          const uint32_t xk = (kx >> (8 * b)) & 255u;
          const uint32_t xv = (vx >> (8 * b)) & 255u;
          k_s[at] = tab_s[2 * xk];
          k_s[at + 1] = tab_s[2 * xk + 1];
          v_s[at] = tab_s[2 * xv];
          v_s[at + 1] = tab_s[2 * xv + 1];
        }
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    {
      simdgroup_float8x8 sm = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      LC_UNROLL for (int t = 0; t < KT; ++t) {
        simdgroup_half8x8 km;  // K^T's dims 8t..8t+7 x the 8 keys
        simdgroup_load(km, k_s + kw + 8 * t, P, 0, true);
        simdgroup_multiply_accumulate(sm, qm[t], km, sm);
      }
      simdgroup_store(sm, s_s + sw, 8);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    {
      const int g0 = kb + 2 * sc;
      const bool ok0 = g0 < k1;
      const bool ok1 = g0 + 1 < k1;
      const float s0 = ok0 ? s_s[sw + srow * 8 + 2 * sc] * LC_TOF(knp[g0 * kns]) : -LC_INF;
      const float s1 = ok1 ? s_s[sw + srow * 8 + 2 * sc + 1] * LC_TOF(knp[(g0 + 1) * kns])
                           : -LC_INF;
      float mx = LC_MAX(s0, s1);
      mx = LC_MAX(mx, lc_simd_xor(mx, 1));
      mx = LC_MAX(mx, lc_simd_xor(mx, 2));
      const float m_new = LC_MAX(m_run, mx);
      const float alpha = m_new == -LC_INF ? 1.0f : LC_EXP2(m_run - m_new);
      const float p0 = ok0 ? LC_EXP2(s0 - m_new) : 0.0f;
      const float p1 = ok1 ? LC_EXP2(s1 - m_new) : 0.0f;
      l_run = l_run * alpha + p0 + p1;
      m_run = m_new;
      p_s[sw + srow * 8 + 2 * sc] = LC_F2H(ok0 ? p0 * LC_TOF(vnp[g0 * vns]) : 0.0f);
      p_s[sw + srow * 8 + 2 * sc + 1] = LC_F2H(ok1 ? p1 * LC_TOF(vnp[(g0 + 1) * vns]) : 0.0f);
      if (sc == 0) d_s[sw + srow * 9] = alpha;
      const bool moved = lc_simd_ballot(alpha != 1.0f, (uint32_t)lane) != 0u;
      simdgroup_barrier(mem_flags::mem_threadgroup);
      if (moved) {  // (uniform: a vote)
        simdgroup_float8x8 dm;
        simdgroup_load(dm, d_s + sw, 8);
        LC_UNROLL for (int t = 0; t < KT; ++t) simdgroup_multiply(om[t], dm, om[t]);
      }
    }
    {
      simdgroup_half8x8 pm;
      simdgroup_load(pm, p_s + sw, 8);
      LC_UNROLL for (int t = 0; t < KT; ++t) {
        simdgroup_half8x8 vm;  // the 8 keys x dims 8t..8t+7
        simdgroup_load(vm, v_s + kw + 8 * t, P);
        simdgroup_multiply_accumulate(om[t], pm, vm, om[t]);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // the tiles are rewritten by the next block
  }

  // 3. The simdgroups' states merged: M = max_w m_w; O = sum_w diag(exp2(m_w - M)) O_w, added
  // one simdgroup after another in f_s (free since the rotation).
  l_run += lc_simd_xor(l_run, 1);
  l_run += lc_simd_xor(l_run, 2);
  if (sc == 0) {
    red_s[warp * 8 + srow] = m_run;
    red_s[NW * 8 + warp * 8 + srow] = l_run;
  }
  LC_BARRIER();
  {
    float mt = -LC_INF;
    LC_UNROLL for (int w = 0; w < NW; ++w) mt = LC_MAX(mt, red_s[w * 8 + srow]);
    const float f = m_run == -LC_INF ? 0.0f : LC_EXP2(m_run - mt);
    if (sc == 0) d_s[sw + srow * 9] = f;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 fm;
  simdgroup_load(fm, d_s + sw, 8);
  LC_UNROLL for (int w = 0; w < NW; ++w) {
    if (warp == w) {
      LC_UNROLL for (int t = 0; t < KT; ++t) {
        if (w == 0) {
          simdgroup_multiply(om[t], fm, om[t]);
        } else {
          simdgroup_float8x8 cm;
          simdgroup_load(cm, f_s + 8 * t, P);
          simdgroup_multiply_accumulate(om[t], fm, om[t], cm);
        }
        simdgroup_store(om[t], f_s + 8 * t, P);
      }
    }
    LC_BARRIER();
  }
  // 4. The split's state: rows < R.
  const int64_t o = (int64_t)bh * S + split;
  for (int i = tid; i < R * P; i += NT) acc_out[o * (R * P) + i] = f_s[i];
  if (tid < R) {
    float mt = -LC_INF;
    LC_UNROLL for (int w = 0; w < NW; ++w) mt = LC_MAX(mt, red_s[w * 8 + tid]);
    float lt = 0.0f;
    LC_UNROLL for (int w = 0; w < NW; ++w) {
      const float mw = red_s[w * 8 + tid];
      lt += mw == -LC_INF ? 0.0f : LC_EXP2(mw - mt) * red_s[NW * 8 + w * 8 + tid];
    }
    m_out[o * R + tid] = mt == -LC_INF ? -LC_INF : mt * 0.6931471805599453f;  // natural log
    l_out[o * R + tid] = lt;
  }
"""

_SPEC = KernelSpec(
    name=NAME,
    inputs=("q", "k_idx", "k_norm", "v_idx", "v_norm", "table", "params", "scales", "q_signs"),
    outputs=("m_out", "l_out", "acc_out"),
    row_contiguous=False,
    header=_HEADER,
    source=_SOURCE,
)


def applies(p: int, rows: int, key_codec, value_codec) -> bool:
    """Whether a decode step's partials take this kernel: the Metal backend (or an executor
    standing in for it), single-stage 4-bit keys and values sharing one codebook (the pair
    table), no QJL, D = P in DIMS, 1..8 rows."""
    return backend() == "metal" and p in DIMS and 1 <= rows <= MAX_ROWS and da.four_bit_pair(p, key_codec, value_codec)


def splits(length: int, bh: int) -> tuple[int, int]:
    """(chunk, splits): chunks of whole 8 x WARPS-key tiles, about TARGET_GROUPS threadgroups."""
    tile = BLOCK * WARPS
    tiles = groups(length, tile)
    want = max(1, min(tiles, groups(TARGET_GROUPS, bh)))
    chunk = groups(tiles, want) * tile
    return chunk, groups(length, chunk)


def _as(a: mx.array, dtype) -> mx.array:
    return a if a.dtype == dtype else a.astype(dtype)


def _reference_partials(splits: int, queries, keys, values, table, signs, kw) -> list:
    """The kernel's outputs in pure MLX (its fallback): q rotated as the kernel rotates it, the
    segment's state from `decode_attend_reference` in split 0, "nothing seen" (m = -inf, l = 0,
    acc = 0) in the others."""
    B, H, R, P = queries.shape
    q_rot = mx.hadamard_transform(queries.astype(mx.float32) * signs, scale=1.0 / math.sqrt(P))
    m, l, acc = da.decode_attend_reference(q_rot, keys, values, table, table, **kw)
    n, pad = B * H, splits - 1
    return [
        mx.concatenate([m.reshape(n, 1, R), mx.full((n, pad, R), -mx.inf)], axis=1),
        mx.concatenate([l.reshape(n, 1, R), mx.zeros((n, pad, R))], axis=1),
        mx.concatenate([acc.reshape(n, 1, R, P), mx.zeros((n, pad, R, P))], axis=1),
    ]


def decode_attend_simdgroup_partials(queries, keys, values, table, signs, *, scale):
    """Each split's softmax state of a decode step's rows over one 4-bit compressed segment.

    Args:
        queries: (B, H, R, P) unrotated, any float dtype, rows grouped per KV head, R <= 8.
        keys, values: dicts with idx (B, H, L, P/8) uint32 and norm (B, H, L), as
            `VectorCodec.encode` stores them (any strides).
        table: (16,) float32, the one codebook of keys and values.
        signs: (P,) float32, the key rotation's +-1 diagonal.
        scale: score scale.

    Returns:
        (m_p (B*H, S, R), l_p (B*H, S, R), acc_p (B*H, S, R, P)) float32, natural-log units, in
        the values' rotated frame: `decode_attend.decode_attend_partials`' outputs (products in
        fp16 with fp32 accumulation, so equal to them within fp16 rounding).
    """
    B, H, R, P = queries.shape
    L = keys["norm"].shape[2]
    if not (
        P in DIMS
        and 1 <= R <= MAX_ROWS
        and keys["idx"].shape[-1] == P // 8
        and values["idx"].shape[-1] == P // 8
        and table.shape == (16,)
    ):
        raise ValueError(
            f"decode_attend_simdgroup takes 4-bit rows, P in {DIMS}, 1..{MAX_ROWS} "
            f"rows; got q {queries.shape}, idx {keys['idx'].shape} / "
            f"{values['idx'].shape}, table {table.shape}"
        )
    kw = dict(key_bits=4, value_bits=4, scale=scale)
    if backend() == "cpu" or L == 0:
        return da.decode_attend_partials(queries, keys, values, table, table, signs, **kw)
    chunk, n_split = splits(L, B * H)
    params = constant((L, chunk, n_split), mx.int32)
    scales = constant((scale * LOG2E, 1.0 / math.sqrt(P)), mx.float32)
    u32, f16, f32 = mx.uint32, mx.float16, mx.float32
    inputs = [
        queries,
        _as(keys["idx"], u32),
        _as(keys["norm"], f16),
        _as(values["idx"], u32),
        _as(values["norm"], f16),
        _as(table, f32),
        params,
        scales,
        _as(signs, f32),
    ]
    nt = 32 * WARPS
    template = [("P", P), ("R", R), ("NT", nt), ("BLK", BLOCK), ("QT", queries.dtype)]

    def reference():
        return _reference_partials(n_split, queries, keys, values, table, signs, kw)

    n = B * H * n_split
    return run(
        _SPEC,
        Launch(
            inputs,
            template,
            (n * nt, 1, 1),
            (nt, 1, 1),
            [(B * H, n_split, R), (B * H, n_split, R), (B * H, n_split, R, P)],
            [f32] * 3,
        ),
        reference=reference,
    )
