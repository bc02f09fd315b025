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

Thread plan (GPU). The kernel multiplies q (and q_proj) by scale * log2(e) (the `scales` input)
as it stages them, so it works in base 2 (exp2). Grid, one launch: one threadgroup of NT = 128
threads per (b, h, split, row block); a row block is up to R <= max_rows rows (48 rows at P = 64:
three blocks of 16, evenly filled); a split is a chunk of whole tiles, chosen so the launch is
about one wave (SM_COUNT x the threadgroups an SM holds). A threadgroup stages its rows' q
(transposed, [d][4 rows] as float4) and the two tables in threadgroup memory and walks its chunk
in tiles of TK keys (NT, or fewer where the staged rows would pass STAGE_WORDS):
  0. staging: the tile's packed key rows are read coalesced (consecutive threads, consecutive
     16-byte units; word by word where strides forbid) into registers and stored in threadgroup
     memory at an odd row stride (conflict-free per-row reads). The next tile's
     rows and this tile's value words are issued before the scores, so they are in flight while
     the tile computes; the rows are stored after the max barrier, when nobody reads the tile.
  1. scores: single-stage keys without QJL (P >= 64, full tiles; `PAIR`): the two half-warps
     split the dims and each lane scores two staged rows over its half, so that one 16-byte
     read of q (a dim, 4 rows) serves two keys; a shuffle adds the halves, and each lane keeps
     one of the two keys for the softmax. Otherwise thread t scores staged row t over all dims.
     Codes are decoded with compile-time shifts (a 3- or 5-bit code may straddle two words), each
     looked up in the table, R dot products accumulated; then norm, QJL term, causal mask.
     4-bit codes (keys and values) are read as byte offsets into their table: two masks turn a
     word's 8 codes into 4 * code per byte (even codes, odd codes), then one byte extract
     (CUDA: PRMT) per code replaces a shift, a mask and an address computation.
  2. softmax: per-row tile max by simdgroup max + a fixed-order max over the 4 warp partials; the
     running max m (identical in every thread) moves, acc and each thread's partial l are scaled by
     exp2(m_old - m_new), and w = exp2(s - m) * norm_v goes to threadgroup memory.
  3. values: thread t owns DPT consecutive dims (DPT * bv <= 32 bits: one or two words) of every
     G-th key (G = NT / (P / DPT) key groups); for each key it decodes its DPT codes and adds
     w[row] * T_v[code] into R x DPT register accumulators.
Two barriers per tile. At the end the G groups' accumulators are summed through threadgroup memory
and each split writes (m, l, acc) partials; `split_combine` merges the splits (a second kernel).
On CUDA, single-stage keys without QJL at <= 4 rows, `__launch_bounds__(NT, MIN_BLOCKS)` caps the
registers (MLX writes the signature, so the header redefines `__global__`).
Limits: P in 32/64/128/256; rows per threadgroup <= min(16, 1024 / max(P, M)) (more rows: more
row blocks in the same launch); b1 + b2 <= 8, bv <= 8.

Where its time goes (CUDA, Llama-3.1-8B shapes, 128k, tq4; ncu on an H100, figures in
docs/performance.md): one wave, DRAM at a third of its peak; ~19 thread instructions per key-dim
pair (K and V: 8 FMAs, 2.9 threadgroup-memory reads, 2 byte extracts, the rest addressing and
softmax): issue-bound, not bandwidth-bound (hence `decode_attend_mma`'s tensor cores for the
default preset on CUDA).
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, constant, groups, run
from .decode_finish import count, exact_inputs, exact_into_partials
from .pack import unpack_reference
from .split_combine import split_combine

LOG2E = 1.4426950408889634
NT = 128  # threads per threadgroup
# Launch constants (chosen by the sweeps in git history; variants in docs/experiments/).
SM_COUNT = 132  # multiprocessors to fill (MLX exposes no count; an H200 has 132)
MIN_BLOCKS = 4  # CUDA, single-stage keys, <= 4 rows per threadgroup: threadgroups per SM to
#                 fit (__launch_bounds__ caps registers: 4 -> 128); 0: uncapped
TARGET_GROUPS = 0  # threadgroups per launch to aim for; 0: SM_COUNT x resident threadgroups
MIN_SPLIT_TILES = 1  # fewest tiles one split walks (more: fewer splits where the cache is short)
STAGE_WORDS = 2304  # threadgroup words for a tile's staged key rows (sets keys per tile)
# a decode step's exact tokens (sink, window) spread over the splits of `decode_attend_partials`
# (`attend_step`; False: `decode_finish` attends them, one threadgroup per KV head)
EXACT_IN_SPLITS = True


def four_bit_pair(p: int, key_codec, value_codec) -> bool:
    """Whether keys and values are single-stage 4-bit codes of one codebook with no QJL, at
    D = P = `p`: what the pair-table kernels (`decode_attend_mma`, `decode_attend_simdgroup`) take."""
    kc, vc = key_codec, value_codec
    return (
        kc.rvq is None
        and vc.rvq is None
        and not kc.spec.qjl
        and not vc.spec.qjl
        and kc.spec.bits == 4
        and vc.spec.bits == 4
        and kc.codebook is vc.codebook
        and kc.dim == vc.dim == kc.padded_dim == vc.padded_dim == p
    )


_SPEC = KernelSpec(
    name="lc_decode_attend",
    inputs=(
        "q",
        "qp",
        "k_idx",
        "k_idx2",
        "k_norm",
        "k_qjl",
        "k_rnorm",
        "v_idx",
        "v_norm",
        "k_table",
        "v_table",
        "params",
        "scales",
        "q_signs",
    ),
    outputs=("m_out", "l_out", "acc_out"),
    row_contiguous=False,
    source=r"""
  constexpr int B2X = B2 > 0 ? B2 : 1;
  constexpr int TPK = P / DPT;   // threads per key in the value phase
  constexpr int G = NT / TPK;    // key groups in the value phase
  constexpr int NW = NT / 32;
  constexpr int WK = B1 * P / 32;   // words of a key's stage-1 row
  constexpr int WK2 = B2 * P / 32;
  constexpr int WKP = WK | 1;       // odd staged row strides: a thread per row reads no conflicts
  constexpr int WK2P = B2 > 0 ? (WK2 | 1) : 0;
  constexpr int UW = (WK % 4 == 0 && WK2 % 4 == 0) ? 4 : 1;  // words per staging unit
  constexpr int UPR = WK / UW;      // units per key row
  constexpr int UPR2 = B2 > 0 ? WK2 / UW : 1;
  constexpr int UK = (TK * UPR + NT - 1) / NT;  // staging units per thread and tile
  constexpr int UK2 = B2 > 0 ? (TK * UPR2 + NT - 1) / NT : 0;  // no stage 2: no units
  constexpr int R4 = (R + 3) / 4;   // float4s of q per dim (rows padded to a multiple of 4)
  constexpr int NV = TK / G;        // keys per thread and tile in the value phase
  constexpr bool VSTR = (32 % (DPT * BV)) != 0;  // a thread's value bits may straddle two words
  constexpr int VB = NV < (VSTR ? 8 : 16) ? NV : (VSTR ? 8 : 16);  // value words per batch
  constexpr bool VPRE = VB == NV;  // the tile's value words load before the scores
  constexpr uint32_t MASK1 = (1u << B1) - 1u;
  constexpr uint32_t MASK2 = (1u << B2X) - 1u;
  constexpr uint32_t MASKV = (1u << BV) - 1u;
  // 4-bit codes are read as byte offsets into their table: a word's 8 codes become two words of
  // 4 code * 4 bytes (even codes, odd codes), one mask each, then one byte extract per code.
  constexpr bool NIBK = B1 == 4 && B2 == 0;
  constexpr bool NIBV = BV == 4 && !VSTR;
  constexpr uint32_t NIBM = 0x3c3c3c3cu;
  // Paired scores: the two half-warps split the dims, each lane scores two keys of the tile
  // (A = 16 * warp + lane % 16 and A + NT / 2) over its half, so each read of q serves two keys;
  // a shuffle adds the halves and the lane keeps key A (lanes < 16) or B for the softmax.
  // Single-stage keys without QJL, whole 32-dim groups per half, full tiles.
  constexpr bool PAIR = !QJL && B2 == 0 && P % 64 == 0 && TK == NT && NT == 128;
  constexpr int PH = P / 2;        // dims per half
  constexpr int WKH = B1 * PH / 32;  // words of a key's half row

  LC_SHARED LC_F4 q_s[P * R4];  // q[d][rows 4j..4j+3] (padding rows 0): one 16-byte read
  LC_SHARED float qp_s[QJL ? M * R : 1];
  LC_SHARED float qsum_s[R];
  LC_SHARED float ktab_s[1 << (B1 + B2)];
  LC_SHARED float vtab_s[1 << BV];
  LC_SHARED uint32_t kst_s[TK * (WKP + WK2P)];  // the tile's key rows (stage 1, then stage 2)
  LC_SHARED float scratch[NT * R * DPT];        // weights w[key][row]; at the end, partial acc
  LC_SHARED float red_s[NW * R];

  const int L = params[0];
  const int chunk = params[1];
  const int causal_base = params[2];
  const int S = params[3];
  const int RT = params[4];  // rows in all; this threadgroup takes the R rows from row0
  const float qscale = scales[0];  // scale * log2(e): logits in base 2
  const float pscale = scales[1];  // the same times sqrt(pi / 2) / M, for q_proj
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

  // Per-head base pointers and 32-bit strides within a head (fewer live registers).
  const auto kip = k_idx + (bb * k_idx_strides[0] + hh * k_idx_strides[1]);
  const int kis = (int)k_idx_strides[2];
  const int kiw = (int)k_idx_strides[3];
  const auto k2p = k_idx2 + (bb * k_idx2_strides[0] + hh * k_idx2_strides[1]);
  const int k2s = (int)k_idx2_strides[2];
  const int k2w = (int)k_idx2_strides[3];
  const auto knp = k_norm + (bb * k_norm_strides[0] + hh * k_norm_strides[1]);
  const int kns = (int)k_norm_strides[2];
  const auto kqp = k_qjl + (bb * k_qjl_strides[0] + hh * k_qjl_strides[1]);
  const int kqs = (int)k_qjl_strides[2];
  const int kqw = (int)k_qjl_strides[3];
  const auto krp = k_rnorm + (bb * k_rnorm_strides[0] + hh * k_rnorm_strides[1]);
  const int krs = (int)k_rnorm_strides[2];
  const auto vip = v_idx + (bb * v_idx_strides[0] + hh * v_idx_strides[1]);
  const int vis = (int)v_idx_strides[2];
  const int viw = (int)v_idx_strides[3];
  const auto vnp = v_norm + (bb * v_norm_strides[0] + hh * v_norm_strides[1]);
  const int vns = (int)v_norm_strides[2];
  // 16-byte loads need units of 4 words: unit word stride, row strides and bases multiples of 4.
  const bool vec = UW == 4 && kiw == 1 && kis % 4 == 0
                   && (bb * k_idx_strides[0] + hh * k_idx_strides[1]) % 4 == 0
                   && (B2 == 0 || (k2w == 1 && k2s % 4 == 0
                                   && (bb * k_idx2_strides[0] + hh * k_idx2_strides[1]) % 4 == 0));

  // Staging of a tile's key rows: units of UW words of one row, read coalesced (consecutive
  // threads, consecutive units) into registers, then stored into kst_s. Rows past the chunk read
  // the chunk's first row (masked later), so the loads need no branches.
  uint32_t kr[UK * UW];
  uint32_t kr2[B2 > 0 ? UK2 * UW : 1];
#define LC_DA_LOAD_ROWS(dst, src, rs, ws, N, UPR_, tt)                                       \
  LC_UNROLL for (int j = 0; j < N; ++j) {                                                    \
    const int u = tid + j * NT;                                                              \
    const int key = u / UPR_;                                                                \
    const int part = u - key * UPR_;                                                         \
    const int kg = (u < TK * UPR_ && (tt) + key < k1) ? (tt) + key : k0;                     \
    if (vec) {                                                                               \
      const LC_U4 t = LC_LD_U4(src, kg * rs + 4 * part);                                     \
      dst[j * UW] = t.x;                                                                     \
      dst[j * UW + (UW > 1 ? 1 : 0)] = t.y;                                                  \
      dst[j * UW + (UW > 2 ? 2 : 0)] = t.z;                                                  \
      dst[j * UW + (UW > 3 ? 3 : 0)] = t.w;                                                  \
    } else {                                                                                 \
      LC_UNROLL for (int c = 0; c < UW; ++c)                                                 \
        dst[j * UW + c] = src[kg * rs + (part * UW + c) * ws];                               \
    }                                                                                        \
  }
// Each stage's buffer is named, never selected through a pointer (Metal address spaces).
#define LC_DA_LOAD_K(tt) LC_DA_LOAD_ROWS(kr, kip, kis, kiw, UK, UPR, tt) \
                         LC_DA_LOAD_ROWS(kr2, k2p, k2s, k2w, UK2, UPR2, tt)
#define LC_DA_STORE_ROWS(regs, N, UPR_, base, stride)                                        \
  LC_UNROLL for (int j = 0; j < N; ++j) {                                                    \
    const int u = tid + j * NT;                                                              \
    const int key = u / UPR_;                                                                \
    const int part = u - key * UPR_;                                                         \
    if (u < TK * UPR_) {                                                                     \
      LC_UNROLL for (int c = 0; c < UW; ++c)                                                 \
        kst_s[base + key * stride + part * UW + c] = regs[j * UW + c];                       \
    }                                                                                        \
  }
#define LC_DA_STORE_K() LC_DA_STORE_ROWS(kr, UK, UPR, 0, WKP) \
                       LC_DA_STORE_ROWS(kr2, UK2, UPR2, TK * WKP, WK2P)

  // The first tile's key rows, q (transposed to [d][row]), q_proj and the tables.
  const int64_t qo = bb * q_strides[0] + hh * q_strides[1];
  if (ROTQ) {
    // q arrives unrotated (the model's dtype): signs, then the Walsh-Hadamard butterfly over
    // each row in threadgroup memory (pair j, j + h at stride h; a pair is one thread's).
    LC_UNROLL for (int o = 0; o < R * P; o += NT) {  // (compile-time counts: LC_WHT_ROWS_N)
      const int i = o + tid;
      if ((R * P) % NT == 0 || i < R * P) {
        const int r = i / P;
        const int d = i - r * P;
        const int64_t qd = qo + row0 * q_strides[2] + d * q_strides[3];
        scratch[i] = r < nr ? LC_TOF(q[qd + r * q_strides[2]]) * q_signs[d] : 0.0f;
      }
    }
    LC_BARRIER();
    LC_WHT_ROWS_N(scratch, R, P, NT, tid)
  }
  const float qs_all = ROTQ ? qscale * scales[2] : qscale;  // scales[2]: 1 / sqrt(P)
  for (int i = tid; i < P * R4; i += NT) {
    const int d = i / R4;
    const int r = 4 * (i - d * R4);
    LC_F4 t;
    if (ROTQ) {
      t.x = r < nr ? scratch[r * P + d] * qs_all : 0.0f;
      t.y = r + 1 < nr ? scratch[(r + 1) * P + d] * qs_all : 0.0f;
      t.z = r + 2 < nr ? scratch[(r + 2) * P + d] * qs_all : 0.0f;
      t.w = r + 3 < nr ? scratch[(r + 3) * P + d] * qs_all : 0.0f;
    } else {
      const int64_t qd = qo + row0 * q_strides[2] + d * q_strides[3];
      t.x = r < nr ? LC_TOF(q[qd + r * q_strides[2]]) * qscale : 0.0f;
      t.y = r + 1 < nr ? LC_TOF(q[qd + (r + 1) * q_strides[2]]) * qscale : 0.0f;
      t.z = r + 2 < nr ? LC_TOF(q[qd + (r + 2) * q_strides[2]]) * qscale : 0.0f;
      t.w = r + 3 < nr ? LC_TOF(q[qd + (r + 3) * q_strides[2]]) * qscale : 0.0f;
    }
    q_s[i] = t;
  }
  LC_DA_LOAD_K(k0);
  LC_DA_STORE_K();
  if (QJL) {
    const int64_t po = bb * qp_strides[0] + hh * qp_strides[1];
    for (int i = tid; i < R * M; i += NT) {
      const int r = i / M;
      const int j = i - r * M;
      qp_s[j * R + r] = r < nr ? qp[po + (row0 + r) * qp_strides[2] + j * qp_strides[3]] * pscale
                               : 0.0f;
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
  const bool vstraddle = VSTR && vsh + DPT * BV > 32;
  const int kt = tid < TK ? tid : 0;  // the staged row this thread scores (threads past TK: none)
  const int hf = (int)(lc_lane >> 4u);  // PAIR: the half-warp, the half of the dims
  const int ka = (int)lc_warp * 16 + (int)(lc_lane & 15u);  // PAIR: key A of this lane's pair
  const int myk = PAIR ? ka + hf * (NT / 2) : tid;  // the tile key whose softmax this thread does
  uint32_t vr[VB];
  uint32_t vr2[VSTR ? VB : 1];
#define LC_DA_LOAD_V(tt, jb)                                                                 \
  LC_UNROLL for (int j = 0; j < VB; ++j) {                                                   \
    const int key = (tt) + vg + G * ((jb) + j);                                              \
    const int vo = (key < k1 ? key : k0) * vis;                                    \
    vr[j] = vip[vo + vwi * viw];                                                           \
    if (VSTR) vr2[VSTR ? j : 0] = vstraddle ? vip[vo + (vwi + 1) * viw] : 0u;              \
  }

  for (int t0 = k0; t0 < k1; t0 += TK) {
    const int tn = t0 + TK;  // the next tile
    // Loads in flight during the scores: the next tile's key rows, this tile's value words.
    if (tn < k1) {
      LC_DA_LOAD_K(tn);
    }
    if (VPRE) {
      LC_DA_LOAD_V(t0, 0);
    }
    const int key = t0 + myk;
    const bool ok = myk < TK && key < k1;
    const int kc = ok ? key : k0;
    const float kn = LC_H2F(knp[kc * kns]);
    const float vn = LC_H2F(vnp[kc * vns]);

    // 1. Scores (base-2 logits): thread tid scores staged row tid against the R rows (PAIR:
    // rows ka and ka + NT / 2 over its half of the dims, then keeps row myk's).
    // Table value of single-stage dim d of words `w` (4-bit: the code as a byte offset, see NIBK;
    // otherwise d < 32, `w` the B1 words of its 32-dim group).
#define LC_DA_HTAB(w, d, out)                                                                \
  if (NIBK) {                                                                                \
    const uint32_t eo = ((d) & 1) ? ((w[(d) >> 3] >> 2) & NIBM) : ((w[(d) >> 3] << 2) & NIBM); \
    out = LC_AT_BYTE(ktab_s, LC_BYTE(eo, ((d) & 7) >> 1));                                   \
  } else {                                                                                   \
    const int i_ = (d) & 31;                                                                 \
    const int sh_ = (i_ * B1) & 31;                                                          \
    const int wi_ = (i_ * B1) >> 5;                                                          \
    uint32_t c_ = w[wi_] >> sh_;                                                             \
    if (sh_ + B1 > 32) c_ |= w[wi_ + 1] << (32 - sh_);                                       \
    out = ktab_s[c_ & MASK1];                                                                \
  }
    float s[4 * R4];
    LC_UNROLL for (int r = 0; r < 4 * R4; ++r) s[r] = 0.0f;
    if (PAIR) {
      float sb[4 * R4];
      LC_UNROLL for (int r = 0; r < 4 * R4; ++r) sb[r] = 0.0f;
      LC_UNROLL for (int g = 0; g < PH / 32; ++g) {  // 32 dims at a time: B1 words per row
        uint32_t wa[B1];
        uint32_t wb[B1];
        LC_UNROLL for (int b = 0; b < B1; ++b) {
          wa[b] = kst_s[ka * WKP + hf * WKH + g * B1 + b];
          wb[b] = kst_s[(ka + NT / 2) * WKP + hf * WKH + g * B1 + b];
        }
        LC_UNROLL for (int i = 0; i < 32; ++i) {
          float ta, tb;
          LC_DA_HTAB(wa, i, ta);
          LC_DA_HTAB(wb, i, tb);
          const int dq = (hf * PH + g * 32 + i) * R4;
          LC_UNROLL for (int j = 0; j < R4; ++j) {
            const LC_F4 qv = q_s[dq + j];
            s[4 * j] += qv.x * ta;
            s[4 * j + 1] += qv.y * ta;
            s[4 * j + 2] += qv.z * ta;
            s[4 * j + 3] += qv.w * ta;
            sb[4 * j] += qv.x * tb;
            sb[4 * j + 1] += qv.y * tb;
            sb[4 * j + 2] += qv.z * tb;
            sb[4 * j + 3] += qv.w * tb;
          }
        }
      }
      LC_UNROLL for (int r = 0; r < R; ++r) {
        const float a = s[r] + lc_simd_xor(s[r], 16);
        const float b = sb[r] + lc_simd_xor(sb[r], 16);
        s[r] = hf ? b : a;
      }
    } else {
    uint32_t w1[WK];
    uint32_t w2[B2 > 0 ? WK2 : 1];
    LC_UNROLL for (int b = 0; b < WK; ++b) w1[b] = kst_s[kt * WKP + b];
    if (B2 > 0) {
      LC_UNROLL for (int b = 0; b < (B2 > 0 ? WK2 : 1); ++b) {
        w2[b] = kst_s[TK * WKP + kt * WK2P + b];
      }
    }
    // Code of dim d (compile-time shifts; a code may straddle two words of its 32-dim group).
#define LC_DA_CODE(d, out)                                                                   \
  {                                                                                          \
    const int g = (d) >> 5;                                                                  \
    const int i = (d) & 31;                                                                  \
    const int sh = (i * B1) & 31;                                                            \
    const int wi = g * B1 + ((i * B1) >> 5);                                                 \
    uint32_t c = w1[wi] >> sh;                                                               \
    if (sh + B1 > 32) c |= w1[wi + 1] << (32 - sh);                                          \
    c &= MASK1;                                                                              \
    if (B2 > 0) {                                                                            \
      const int sh2 = (i * B2X) & 31;                                                        \
      const int wi2 = g * B2X + ((i * B2X) >> 5);                                            \
      uint32_t c2 = w2[B2 > 0 ? wi2 : 0] >> sh2;                                             \
      if (sh2 + B2X > 32) c2 |= w2[B2 > 0 ? wi2 + 1 : 0] << (32 - sh2);                      \
      c = (c << B2X) | (c2 & MASK2);                                                         \
    }                                                                                        \
    out = c;                                                                                 \
  }
    // Software-pipelined by one dim: dim d + 1's table value and q are read before dim d's
    // FMAs, so the threadgroup-memory latency overlaps arithmetic within the warp.
    // Dim d's table value (4-bit keys: the code as a byte offset, see NIBK).
#define LC_DA_KTAB(d, out)                                                                   \
  if (NIBK) {                                                                                \
    LC_DA_HTAB(w1, d, out);                                                                  \
  } else {                                                                                   \
    uint32_t c_;                                                                             \
    LC_DA_CODE(d, c_);                                                                       \
    out = ktab_s[c_];                                                                        \
  }
    float kv_n;
    LC_DA_KTAB(0, kv_n);
    LC_F4 q_n[R4];
    LC_UNROLL for (int j = 0; j < R4; ++j) q_n[j] = q_s[j];
    LC_UNROLL for (int g = 0; g < P / 32; ++g) LC_UNROLL for (int i = 0; i < 32; ++i) {
      const int d = g * 32 + i;
      const float kv = kv_n;
      LC_F4 qv[R4];
      LC_UNROLL for (int j = 0; j < R4; ++j) qv[j] = q_n[j];
      if (d + 1 < P) {
        LC_DA_KTAB(d + 1, kv_n);
        LC_UNROLL for (int j = 0; j < R4; ++j) q_n[j] = q_s[(d + 1) * R4 + j];
      }
      LC_UNROLL for (int j = 0; j < R4; ++j) {
        s[4 * j] += qv[j].x * kv;
        s[4 * j + 1] += qv[j].y * kv;
        s[4 * j + 2] += qv[j].z * kv;
        s[4 * j + 3] += qv[j].w * kv;
      }
    }
#undef LC_DA_KTAB
#undef LC_DA_CODE
    }
#undef LC_DA_HTAB
    LC_UNROLL for (int r = 0; r < R; ++r) s[r] *= kn;
    if (QJL) {
      float cq[R];
      LC_UNROLL for (int r = 0; r < R; ++r) cq[r] = 0.0f;
      LC_UNROLL for (int w = 0; w < M / 32; ++w) {
        const uint32_t wq = kqp[kc * kqs + w * kqw];
        LC_UNROLL for (int i = 0; i < 32; ++i) {
          const float bit = (float)((wq >> i) & 1u);
          LC_UNROLL for (int r = 0; r < R; ++r) cq[r] += bit * qp_s[(w * 32 + i) * R + r];
        }
      }
      const float rn = LC_H2F(krp[kc * krs]);
      LC_UNROLL for (int r = 0; r < R; ++r) s[r] += rn * (2.0f * cq[r] - qsum_s[r]);
    }
    LC_UNROLL for (int r = 0; r < R; ++r) {
      bool visible = ok;
      if (CAUSAL) visible = visible && (key <= causal_base + (row0 + r) % LQ);
      if (!visible) s[r] = -LC_INF;
    }

    // 2. Online softmax: tile max, rescale, weights w = exp2(s - m) * norm_v.
    LC_UNROLL for (int r = 0; r < R; ++r) {
      const float tm = lc_simd_max(s[r]);
      if (lc_lane == 0u) red_s[(int)lc_warp * R + r] = tm;
    }
    LC_BARRIER();
    // Every thread is past its reads of the staged rows: stage the next tile's.
    if (tn < k1) {
      LC_DA_STORE_K();
    }
    LC_UNROLL for (int r = 0; r < R; ++r) {
      float tm = red_s[r];
      for (int w = 1; w < NW; ++w) tm = LC_MAX(tm, red_s[w * R + r]);
      const float mn = LC_MAX(m_run[r], tm);
      const float mu = mn == -LC_INF ? 0.0f : mn;
      const float alpha = LC_EXP2(m_run[r] - mu);
      const float p = LC_EXP2(s[r] - mu);
      if (myk < TK) scratch[myk * R + r] = p * vn;
      l_loc[r] = l_loc[r] * alpha + p;
      // (m_run is the same in every thread: a uniform branch; most tiles leave it unchanged)
      if (mn != m_run[r]) {
        LC_UNROLL for (int i = 0; i < DPT; ++i) acc[r * DPT + i] *= alpha;
      }
      m_run[r] = mn;
    }
    LC_BARRIER();

    // 3. Values: DPT dims of keys vg + G * j of the tile (keys past the chunk weigh 0).
    LC_UNROLL for (int jb = 0; jb < NV; jb += VB) {
      if (!VPRE) {
        LC_DA_LOAD_V(t0, jb);
      }
      LC_UNROLL for (int j = 0; j < VB; ++j) {
        const int kk = vg + G * (jb + j);
        uint32_t bits = vr[j] >> vsh;
        if (VSTR && vstraddle) bits |= vr2[VSTR ? j : 0] << (32 - vsh);
        float wv[R];
        LC_UNROLL for (int r = 0; r < R; ++r) wv[r] = scratch[kk * R + r];
        const uint32_t ve = (bits << 2) & NIBM;  // NIBV: even codes' byte offsets
        const uint32_t vo = (bits >> 2) & NIBM;  // odd codes'
        LC_UNROLL for (int i = 0; i < DPT; ++i) {
          const float cv = NIBV ? LC_AT_BYTE(vtab_s, LC_BYTE((i & 1) ? vo : ve, i >> 1))
                                : vtab_s[(bits >> (i * BV)) & MASKV];
          LC_UNROLL for (int r = 0; r < R; ++r) acc[r * DPT + i] += wv[r] * cv;
        }
      }
    }
  }
#undef LC_DA_LOAD_K
#undef LC_DA_STORE_K
#undef LC_DA_LOAD_ROWS
#undef LC_DA_STORE_ROWS
#undef LC_DA_LOAD_V

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


# The exact tokens in the splits (the decode step's variant, `decode_attend_partials(...,
# sink=, window=)`, XE = 1): split s takes exact keys s * per .. (s + 1) * per - 1 of the E
# (sink, then the window's valid slots), per = ceil(E / S), and folds them into its state as
# one more tile each round of up to XK keys: the round's keys and values, times their rotations'
# signs, staged in the weight buffer and turned into the codecs' frames by the Walsh-Hadamard
# butterfly (k: the key frame, where q_s holds q; v: the value frame of the accumulators), a
# warp per key scoring it against the rows (lanes split the dims), then the online-softmax
# update and the values' weighted sum as in the main loop. On the GPU the finish then only
# merges; attended there, by one threadgroup per KV head, an answer's window was a large part of
# a layer's step (docs/performance.md). Reference: `decode_finish.exact_into_partials`.
_EXACT = r"""
  {
    constexpr int XK0 = (NT * R * DPT) / (2 * P + R);  // keys a round stages, up to 32
    constexpr int XK = XK0 < 32 ? XK0 : 32;
    static_assert(XK >= 1, "a round of exact keys fits the weight buffer");
    // the weight buffer, named (Metal: no pointers into threadgroup memory): [2 nk][P] the
    // round's keys then its values, and from 2 XK P on their scores [XK][R] (base 2)
#define LC_XS(i) scratch[2 * XK * P + (i)]
    const int ns = HAS_SINK ? sink_k_shape[2] : 0;
    const int E = ns + (HAS_WIN ? win_n[0] : 0);  // the window's valid slots, not its buffer's
    const int per = (E + S - 1) / S;
    const int e0 = split * per < E ? split * per : E;
    const int e1 = e0 + per < E ? e0 + per : E;
    const float rsp = scales[2];  // 1 / sqrt(P): the butterfly's scale
    const int lane = (int)lc_lane;
    const int wp = (int)lc_warp;
    const int64_t sko = bb * sink_k_strides[0] + hh * sink_k_strides[1];
    const int64_t svo = bb * sink_v_strides[0] + hh * sink_v_strides[1];
    const int64_t wko = bb * win_k_strides[0] + hh * win_k_strides[1];
    const int64_t wvo = bb * win_v_strides[0] + hh * win_v_strides[1];
    LC_BARRIER();  // every thread is done with the last tile's weights
    for (int x0 = e0; x0 < e1; x0 += XK) {  // (uniform: every thread takes every round)
      const int nk = XK < e1 - x0 ? XK : e1 - x0;
      for (int i = tid; i < nk * P; i += NT) {
        const int j = i / P;
        const int d = i - j * P;
        const int e = x0 + j;
        float kx, vx;
        if (e < ns) {
          kx = LC_TOF(sink_k[sko + (int64_t)e * sink_k_strides[2] + d * sink_k_strides[3]]);
          vx = LC_TOF(sink_v[svo + (int64_t)e * sink_v_strides[2] + d * sink_v_strides[3]]);
        } else {
          const int w = e - ns;
          kx = LC_TOF(win_k[wko + (int64_t)w * win_k_strides[2] + d * win_k_strides[3]]);
          vx = LC_TOF(win_v[wvo + (int64_t)w * win_v_strides[2] + d * win_v_strides[3]]);
        }
        scratch[i] = kx * q_signs[d];
        scratch[nk * P + i] = vx * v_signs[d];
      }
      LC_BARRIER();
      LC_WHT_ROWS(scratch, 2 * nk, P, NT, tid)
      for (int j = wp; j < nk; j += NW) {  // warp-uniform: a warp per key, lanes split the dims
        LC_UNROLL for (int r = 0; r < R; ++r) {
          float part = 0.0f;
          LC_UNROLL for (int i = 0; i < P / 32; ++i) {
            const LC_F4 qv = q_s[(lane + 32 * i) * R4 + r / 4];
            const float qr = (r & 3) == 0 ? qv.x : (r & 3) == 1 ? qv.y : (r & 3) == 2 ? qv.z : qv.w;
            part += qr * scratch[j * P + lane + 32 * i];
          }
          const float sr = lc_simd_sum(part);
          if (lane == 0) LC_XS(j * R + r) = sr * rsp;
        }
      }
      LC_BARRIER();
      LC_UNROLL for (int r = 0; r < R; ++r) {
        float tm = -LC_INF;
        for (int j = 0; j < nk; ++j) tm = LC_MAX(tm, LC_XS(j * R + r));
        const float mn = LC_MAX(m_run[r], tm);  // finite: the round has a key
        const float alpha = LC_EXP2(m_run[r] - mn);
        l_loc[r] *= alpha;
        if (tid < nk) l_loc[r] += LC_EXP2(LC_XS(tid * R + r) - mn);
        LC_UNROLL for (int i = 0; i < DPT; ++i) acc[r * DPT + i] *= alpha;
        m_run[r] = mn;
      }
      for (int j = vg; j < nk; j += G) {  // this thread's DPT dims of the round's values
        LC_UNROLL for (int r = 0; r < R; ++r) {
          const float w = LC_EXP2(LC_XS(j * R + r) - m_run[r]) * rsp;
          LC_UNROLL for (int i = 0; i < DPT; ++i) {
            acc[r * DPT + i] += w * scratch[(nk + j) * P + d0 + i];
          }
        }
      }
      LC_BARRIER();  // the next round rewrites the buffer
    }
#undef LC_XS
  }
"""
_EXACT_INPUTS = ("sink_k", "sink_v", "win_k", "win_v", "win_n", "v_signs")
# its own name: a variant that fails to build (one warning) leaves the plain kernel running, and
# the decode step then gives the exact tokens to the finish again (`attend_step`)
EXACT_NAME = "lc_decode_attend_exact"
# The exact variant takes the decode step's shape only (q rotated in the kernel, single-stage keys,
# no QJL), so the inputs that shape leaves unread are not passed: their names stand for inputs
# of the same types (their code is compiled, never run). Metal allows 31 buffers a kernel, and
# with them the variant's inputs, strides and outputs came to 38.
_EXACT_DROPPED = ("qp", "k_idx2", "k_qjl", "k_rnorm")
_EXACT_ALIASES = """#define qp q_signs
#define qp_strides k_idx_strides
#define k_idx2 k_idx
#define k_idx2_strides k_idx_strides
#define k_qjl k_idx
#define k_qjl_strides k_idx_strides
#define k_rnorm k_norm
#define k_rnorm_strides k_norm_strides
  static_assert(ROTQ && B2 == 0 && !QJL, "the exact variant: q rotated here, one stage, no QJL");
"""
_EXACT_UNALIASES = """#undef qp
#undef qp_strides
#undef k_idx2
#undef k_idx2_strides
#undef k_qjl
#undef k_qjl_strides
#undef k_rnorm
#undef k_rnorm_strides
"""


def _min_blocks_header(min_blocks: int, nt: int = NT) -> str:
    """CUDA only: MLX writes the kernel's signature itself, so its `__global__` is redefined to
    carry `__launch_bounds__(nt, min_blocks)` (registers capped to fit min_blocks threadgroups of
    nt threads per SM)."""
    if not min_blocks:
        return ""
    return (
        "#ifdef LC_CUDA\n#undef __global__\n#define __global__ __attribute__((global)) "
        f"__launch_bounds__({nt}, {min_blocks})\n#endif\n"
    )


_SPECS: dict = {}


_MARK = "  // Sum the G key groups' accumulators and the threads' partial l; write this split's state.\n"


def _spec(min_blocks: int, exact: bool = False) -> KernelSpec:
    """The kernel with min_blocks' register cap; `exact`: the variant that folds the exact
    tokens into the splits' states (`_EXACT`, before the final sums)."""
    key = (min_blocks, exact)
    if key not in _SPECS:
        extra = {}
        if exact:
            head, tail = _SPEC.source.split(_MARK)
            inputs = tuple(n for n in _SPEC.inputs if n not in _EXACT_DROPPED) + _EXACT_INPUTS
            extra = dict(name=EXACT_NAME, inputs=inputs, source=_EXACT_ALIASES + head + _EXACT + _MARK + tail + _EXACT_UNALIASES)
        _SPECS[key] = dataclasses.replace(_SPEC, header=_min_blocks_header(min_blocks), **extra)
    return _SPECS[key]


def _unpack_codes(keys: dict, p: int, key_bits: int, key_bits2: int, lo: int, hi: int):
    c = unpack_reference(keys["idx"][:, :, lo:hi], key_bits, p).astype(mx.uint32)
    if key_bits2:
        c2 = unpack_reference(keys["idx2"][:, :, lo:hi], key_bits2, p).astype(mx.uint32)
        c = (c << key_bits2) | c2
    return c  # (B, H, n, P)


def decode_attend_reference(
    q_rot,
    keys,
    values,
    key_table,
    value_table,
    *,
    key_bits,
    value_bits,
    scale,
    key_bits2=0,
    q_proj=None,
    lq=1,
    causal_base=None,
    block=4096,
):
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
            s = s + (q_proj.astype(mx.float32) @ signs.swapaxes(-1, -2)) * (math.sqrt(math.pi / 2) / mq * rn)[:, :, None, :]
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


def tile_keys(p: int, key_bits: int, key_bits2: int = 0) -> int:
    """Keys per tile: NT, halved (down to 32) until the staged key rows fit STAGE_WORDS."""
    words = ((key_bits * p // 32) | 1) + (((key_bits2 * p // 32) | 1) if key_bits2 else 0)
    tk = NT
    while tk > 32 and tk * words > STAGE_WORDS:
        tk //= 2
    return tk


def max_rows(p: int, m_qjl: int = 0) -> int:
    """Rows one threadgroup handles: R * P and R * M <= 1024 floats of threadgroup memory each."""
    return max(1, min(16, 1024 // max(p, m_qjl)))


def _min_blocks(rows: int, key_bits2: int, qjl: bool, p: int) -> int:
    """The register cap in threadgroups per SM: MIN_BLOCKS for single-stage keys without QJL,
    up to 4 rows and P = 128 (where it was measured, and fits: at P = 64 the value phase's
    8 dims per thread spill under it); the others need their registers (0: uncapped)."""
    return MIN_BLOCKS if rows <= 4 and not key_bits2 and not qjl and p == 128 else 0


def _splits(length: int, bh: int, tk: int = NT, min_blocks: int = 0) -> tuple[int, int]:
    """(chunk, splits): chunks are whole tiles, at least MIN_SPLIT_TILES of them; about
    TARGET_GROUPS threadgroups in all, by default one wave: SM_COUNT x the threadgroups an SM
    holds (min_blocks, else 4)."""
    tiles = groups(length, tk)
    target = TARGET_GROUPS or SM_COUNT * (min_blocks or 4)
    want = max(1, min(tiles // max(1, MIN_SPLIT_TILES), groups(target, bh)))
    chunk = groups(tiles, want) * tk
    return chunk, groups(length, chunk)


def _supported(p: int, key_bits: int, key_bits2: int, value_bits: int, m_qjl: int) -> bool:
    return (
        p in (32, 64, 128, 256)
        and 1 <= key_bits
        and key_bits + key_bits2 <= 8
        and 1 <= value_bits <= 8
        and m_qjl % 32 == 0
        and m_qjl <= 1024
    )


def decode_attend(
    q_rot, keys, values, key_table, value_table, *, key_bits, value_bits, scale, key_bits2=0, q_proj=None, lq=1, causal_base=None
):
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
    kw = dict(
        key_bits=key_bits, value_bits=value_bits, scale=scale, key_bits2=key_bits2, q_proj=q_proj, lq=lq, causal_base=causal_base
    )
    m_qjl = q_proj.shape[-1] if q_proj is not None else 32
    if backend() == "cpu" or L == 0 or not _supported(P, key_bits, key_bits2, value_bits, m_qjl):
        return decode_attend_reference(q_rot, keys, values, key_table, value_table, **kw)
    c = scale * LOG2E
    scales = constant((c, c * math.sqrt(math.pi / 2) / m_qjl, 1.0), mx.float32)
    q = _as(q_rot, mx.float32)
    qp = _as(q_proj, mx.float32) if q_proj is not None else None
    ref = dict(kw, q_rot=q_rot, keys=keys, values=values, key_table=key_table, value_table=value_table)
    m_p, l_p, acc_p = _launch(
        q,
        qp,
        None,
        scales,
        keys,
        values,
        key_table,
        value_table,
        key_bits,
        key_bits2,
        value_bits,
        m_qjl,
        lq,
        causal_base,
        lambda splits: _reference_partials(splits, **ref),
    )
    m, l, acc = split_combine(m_p, l_p, acc_p)
    return m.reshape(B, H, R, 1), l.reshape(B, H, R, 1), acc.reshape(B, H, R, P)


def rotates_queries(p: int, rows: int, value_bits: int) -> bool:
    """Whether `decode_attend_partials` can rotate the queries itself at this size (the butterfly
    runs in the kernel's weight buffer: rows x P floats must fit in it)."""
    if p not in (32, 64, 128, 256):
        return False
    per_block, _ = row_blocks(rows, p)
    dpt = _dpt(p, per_block, value_bits)
    return dpt is not None and p <= NT * dpt


def _rotate_reference(q: mx.array, signs: mx.array) -> mx.array:
    """What the kernel's in-place rotation computes: `RandomHadamard.forward` at dim = P."""
    p = q.shape[-1]
    return mx.hadamard_transform(q.astype(mx.float32) * signs, scale=1.0 / math.sqrt(p))


def exact_fits(p: int, rows: int, value_bits: int) -> bool:
    """Whether `decode_attend_partials` can take the exact tokens at this size: a round of at
    least one exact key (its key and value rows and scores) fits the weight buffer. (Whether the
    variant has failed in this process is the caller's to ask: `EXACT_NAME`.)"""
    per_block, _ = row_blocks(rows, p)
    dpt = _dpt(p, per_block, value_bits)
    return dpt is not None and NT * per_block * dpt >= 2 * p + per_block


def decode_attend_partials(
    queries,
    keys,
    values,
    key_table,
    value_table,
    signs,
    *,
    key_bits,
    value_bits,
    scale,
    sink=None,
    window=None,
    v_signs=None,
    valid_array=None,
):
    """The kernel's per-split softmax states for unrotated queries (one decode step), unmerged.

    The queries are rotated in the kernel (signs, then the Walsh-Hadamard transform at 1/sqrt(P)),
    so a decode step needs no rotation launch before it, and the splits are merged by the
    caller's next kernel (`decode_finish`) instead of `split_combine`. Single-stage keys without
    QJL, D = P (no padding), `rotates_queries(P, R, value_bits)`.

    Args:
        queries: (B, H, R, P) any float dtype, rows grouped per KV head (one token: R = r).
        keys, values, key_table, value_table, key_bits, value_bits, scale: as `decode_attend`.
        signs: (P,) float32, the key rotation's +-1 diagonal (`RandomHadamard.signs`).
        sink, window: (keys, values) (B, H, n, P) exact centered tokens in the original frame
            (as `decode_finish.decode_finish` takes them), or None: with either, the splits
            also take the exact tokens (`exact_fits` must hold), and v_signs (P,) float32 is the
            value rotation's diagonal, valid_array the window's valid slots
            (`decode_finish.count`; default: all of `window`).

    Returns:
        (m_p (B*H, S, R), l_p (B*H, S, R), acc_p (B*H, S, R, P)) float32, natural-log units, the
        values' rotated frame; splits that saw nothing hold m = -inf, l = 0, acc = 0. With
        exact tokens their softmax state is merged in (into some splits; a finish without them
        gives the step's output).
    """
    B, H, R, P = queries.shape
    L = keys["norm"].shape[2]
    kw = dict(key_bits=key_bits, value_bits=value_bits, scale=scale)
    sink, window, exact_arrays, exact_template = exact_inputs(sink, window)
    exact = sink is not None or window is not None
    if exact and valid_array is None:
        valid_array = count(window[0].shape[2] if window is not None else 0)

    def with_exact(parts):
        return exact_into_partials(*parts, queries, sink, window, v_signs, scale, valid_array) if exact else parts

    if backend() == "cpu" or L == 0 or not rotates_queries(P, R, value_bits):
        m, l, acc = decode_attend_reference(_rotate_reference(queries, signs), keys, values, key_table, value_table, **kw)
        return with_exact((m.reshape(B * H, 1, R), l.reshape(B * H, 1, R), acc.reshape(B * H, 1, R, P)))
    if exact and v_signs is None:
        raise ValueError("decode_attend_partials takes the exact tokens with v_signs, the value rotation's signs")
    if exact and not exact_fits(P, R, value_bits):
        raise ValueError(
            f"decode_attend_partials cannot take exact tokens at q {queries.shape}, {value_bits}-bit values (exact_fits)"
        )
    c = scale * LOG2E
    scales = constant((c, c, 1.0 / math.sqrt(P)), mx.float32)

    def reference(splits):
        return with_exact(
            _reference_partials(splits, _rotate_reference(queries, signs), keys, values, key_table, value_table, **kw)
        )

    extra = (list(exact_arrays) + [valid_array, _as(v_signs, mx.float32)], exact_template + [("XE", 1)]) if exact else None
    return _launch(
        queries, None, signs, scales, keys, values, key_table, value_table, key_bits, 0, value_bits, 32, 1, None, reference, extra
    )


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
        raise ValueError(
            f"tables: expected ({1 << (key_bits + key_bits2)},), ({1 << value_bits},); got {key_table.shape}, {value_table.shape}"
        )


def _as(a: mx.array, dtype) -> mx.array:
    return a if a.dtype == dtype else a.astype(dtype)


_DUMMIES: list = []


def _dummies():
    """Stand-ins for absent inputs (idx2 / qjl / rnorm / q_proj / q_signs), made once."""
    if not _DUMMIES:
        _DUMMIES.extend(
            [
                mx.zeros((1, 1, 1, 1), dtype=mx.uint32),
                mx.zeros((1, 1, 1), dtype=mx.float16),
                mx.zeros((1, 1, 1, 1), dtype=mx.float32),
                mx.zeros((1,), dtype=mx.float32),
            ]
        )
    return _DUMMIES


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


def _launch(
    q,
    qp,
    signs,
    scales,
    keys,
    values,
    key_table,
    value_table,
    key_bits,
    key_bits2,
    value_bits,
    m_qjl,
    lq,
    causal_base,
    reference,
    exact=None,
):
    """One kernel launch for all rows (row blocks x KV heads x splits threadgroups): the splits'
    partial states. `signs`: the key rotation's, when q is unrotated (the kernel rotates it);
    `reference(splits)`: the same partials in pure MLX, for the fallback; `exact`: (inputs,
    template entries) of the exact tokens' variant."""
    B, H, R, P = q.shape
    L = keys["norm"].shape[2]
    per_block, nrb = row_blocks(R, P, m_qjl if qp is not None else 0)
    tk = tile_keys(P, key_bits, key_bits2)
    min_blocks = _min_blocks(per_block, key_bits2, qp is not None, P)
    chunk, splits = _splits(L, B * H * nrb, tk, min_blocks)
    dummy4, dummy3, dummyf, dummy1 = _dummies()
    params = constant((L, chunk, 0 if causal_base is None else causal_base, splits, R), mx.int32)
    u32, f16, f32 = mx.uint32, mx.float16, mx.float32  # fixed: MLX caches modules by name
    inputs = [
        q,
        qp if qp is not None else dummyf,
        _as(keys["idx"], u32),
        _as(keys["idx2"], u32) if key_bits2 else dummy4,
        _as(keys["norm"], f16),
        _as(keys["qjl"], u32) if qp is not None else dummy4,
        _as(keys["rnorm"], f16) if qp is not None else dummy3,
        _as(values["idx"], u32),
        _as(values["norm"], f16),
        _as(key_table, f32),
        _as(value_table, f32),
        params,
        scales,
        _as(signs, f32) if signs is not None else dummy1,
    ]
    template = [
        ("P", P),
        ("R", per_block),
        ("LQ", lq),
        ("B1", key_bits),
        ("B2", key_bits2),
        ("BV", value_bits),
        ("QJL", int(qp is not None)),
        ("M", m_qjl),
        ("CAUSAL", int(causal_base is not None)),
        ("NT", NT),
        ("DPT", _dpt(P, per_block, value_bits)),
        ("TK", tk),
        ("ROTQ", int(signs is not None)),
        ("QT", q.dtype),
    ]
    if exact is not None:  # (the inputs the exact variant leaves out: `_EXACT_DROPPED`)
        inputs = [a for n, a in zip(_SPEC.inputs, inputs) if n not in _EXACT_DROPPED] + exact[0]
        template += exact[1]
    n = B * H * splits * nrb
    return run(
        _spec(min_blocks, exact is not None),
        Launch(
            inputs,
            template,
            (n * NT, 1, 1),
            (NT, 1, 1),
            [(B * H, splits, R), (B * H, splits, R), (B * H, splits, R, P)],
            [mx.float32] * 3,
        ),
        reference=lambda: reference(splits),
    )
