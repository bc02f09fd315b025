"""One decode step's compressed attention on tensor cores (CUDA): 4-bit keys and values, <= 8 rows.

The same function as `decode_attend.decode_attend_partials` (unrotated queries in, each split's
softmax state out, merged by `decode_finish`), for the default preset's shape of work: single-stage
4-bit keys and values with one codebook, no QJL, D = P in 64/128/256, up to 8 query rows per KV
head (GQA 1..8 at one token). Both products run as `mma.sync.m16n8k16` (fp16 in, fp32
accumulate) instead of CUDA-core FMAs (the portable kernel is issue-bound on its per-dim work):

    s^T (16 keys x 8 rows) = K^T (16 keys x 16 dims) . Qs^T (16 dims x 8 rows), P/16 steps
    O^T (16 dims x 8 rows) += V^T (16 dims x 16 keys) . P'^T (16 keys x 8 rows), P/16 tiles

with Qs = q rotated, times scale * log2(e) (scores in base 2), s = s^T * norm_k, P' = exp2(s - m)
* norm_v (the value norm folded into the weights, fp16). Rows past R are zero queries whose
states are never written.

Decoding codes into fragments. A 4-bit code table T (16 centroids) becomes a pair table in shared
memory: entry x (one byte, two codes) holds the fp16 pair (T[x & 15], T[x >> 4]), one half2
register of an MMA operand, replicated 32 times (entry x of copy l at word 32 x + l, lane l reads
copy l) so that any 32 lookups hit 32 distinct banks; a lookup is a byte extract (`prmt`), one
address and one shared load.
- Keys: a register of the score MMA's A operand holds two adjacent dims of one key, i.e. one
  byte of the packed row (byte t of words 2s and 2s + 1 for lane t of a quad).
- Values: a register of the V^T operand holds ONE dim of TWO keys (the MMA reduces over keys),
  so its byte comes from two rows. Row m of tile j is dim 8 w + n with (P >= 128)
  w = m + 16 (j % (P / 128)), n = j / (P / 128), or (P = 64) w = m % 8, n = 2 j + m / 8, so a
  thread reads 2 P / 128 words of each of its 4 key rows per block at compile-time nibble
  positions and turns each key pair's word into two words of pair indices with 2 logic ops each.

Thread plan. One threadgroup of WARPS (4) warps per (b, h, split); a split is a multiple of
16 x WARPS keys, the launch about one wave of threadgroups (`resident`). Each warp owns every
WARPS-th block of 16 keys of its split and keeps its own online softmax state; it stages its
blocks' packed key and value rows with 16-byte `cp.async` copies (word by word where strides or
alignment forbid: the main loop is instantiated once per way), STAGES (2) blocks deep, and loads
their norms a block ahead (warp-private: no threadgroup barrier in the loop). The first blocks are
requested before q's rotation and the pair table (q is staged in the table's space). Per block:
the score MMAs, norms and mask, the row maxima (3 shuffles), the accumulator rescale only when a
maximum moved (warp vote), P' through shared memory into the PV operand layout, the PV MMAs. At
the end the warps' states are merged in shared memory and the split's (m, l, acc) written, m in
natural-log units as `decode_attend` writes it.

The decode step built on this body (`decode_step_mma`: the exact tokens folded into the splits,
the finish in the same launch, keys handed out while it runs) fills the hooks it leaves: DYN,
`lc_grants` (null here) and what follows `MAIN`. The variants measured and not shipped (stage
counts, warps, register caps, waves, shared layouts, timing stamps) are in
docs/experiments/2026-12-07-mma-variants.diff; their measurements in docs/performance.md.

CUDA only: `mma.sync` and `cp.async` have no Metal spelling in the prelude. Metal, and every shape
this kernel does not take, use the portable kernel; `decode_attend.decode_attend_partials` is
the reference of both. The emulator (tests/kernel_emu.py) runs this body with the MMA's PTX
fragment layouts, so its indexing is tested on the CPU.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, constant, groups, run
from . import decode_attend as da

LOG2E = 1.4426950408889634
WARPS = 4  # warps per threadgroup (each owns every WARPS-th block of its split)
STAGES = 2  # blocks of rows each warp has staged or in flight (double-buffered)
BLOCK = 16  # keys per warp block (the MMA's M)
DIMS = (64, 128, 256)
MAX_ROWS = 8  # the MMA's N
MIN_WARP_BLOCKS = 1  # fewest 16-key blocks each warp of a split walks (more: fewer splits)
SMEM_PER_SM = 233472  # bytes of shared memory an H200 SM gives its threadgroups (228 KiB)

HEADER = r"""
#if defined(LC_METAL)
#error "decode_attend_mma is CUDA only"
#endif
template <bool B> struct lc_bool { static constexpr bool value = B; };
#if defined(LC_CUDA)
#define LC_DYN_SHARED(name) extern __shared__ __align__(16) uint32_t name[]
#define LC_HALF __half
LC_FN void lc_mma_16816(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
LC_FN void lc_cp_async16(uint32_t* smem, const uint32_t* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
#define LC_CP_COMMIT() asm volatile("cp.async.commit_group;\n" ::)
#define LC_CP_WAIT(n) asm volatile("cp.async.wait_group %0;\n" ::"n"(n))
#define LC_CP_WAIT0() asm volatile("cp.async.wait_all;\n" ::)
#define LC_SYNCWARP() __syncwarp()
#define LC_U2 uint2
#define LC_LD_U2(p) (*reinterpret_cast<const uint2*>(p))
#define LC_ST_X4(p, v) (*reinterpret_cast<uint4*>(p) = make_uint4((v), (v), (v), (v)))
LC_FN uint32_t lc_pack_h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// A shared-memory load from a 32-bit shared-window address (no side effects: the compiler may
// schedule it freely; the table it reads is written once, before the first barrier).
LC_FN uint32_t lc_lds_u32(uint32_t addr) {
  uint32_t v;
  asm("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
// 2^x for the online softmax: MUFU.EX2 with subnormals flushed (exp2f adds a range fix-up)
LC_FN float lc_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
#define LC_MIN_I(a, b) min((a), (b))
LC_FN float lc_shfl_xor(float x, int m) { return __shfl_xor_sync(0xffffffffu, x, m); }
// the whole step's count of finished threadgroups per KV head (an input it updates). Every
// thread fences its partials device-wide before the arrival, and again after it (a
// release/acquire through one thread, CUTLASS's semaphore, failed its GPU test run:
// docs/performance.md).
#define LC_FENCE() __threadfence()
LC_FN int lc_atomic_add(const int32_t* p, int v) {
  return atomicAdd(reinterpret_cast<int*>(const_cast<int32_t*>(p)), v);
}
LC_FN void lc_atomic_zero(const int32_t* p) {
  atomicExch(reinterpret_cast<int*>(const_cast<int32_t*>(p)), 0);
}
LC_FN bool lc_any(bool p) { return __any_sync(0xffffffffu, p) != 0; }
#endif
"""

NAME = "lc_decode_attend_mma"

# The body up to q's staging loads. `lc_grants` (the grant lines of the whole step's count array,
# null in the partials: `NO_GRANTS`) precedes it; DYN: the step hands keys out (`decode_step_mma`).
PRE = r"""
  constexpr int WK = P / 8;          // words of a packed 4-bit row
  constexpr int RS = WK + 4;         // staged row stride: 16-byte rows; 8 rows' LDS.64 free of
                                     // bank conflicts
  constexpr int KS = P / 16;         // 16-dim steps of the score MMA = 16-dim tiles of the output
  constexpr int CH = WK / 4;         // 16-byte chunks per row
  constexpr int NWP = NT / 32;
  constexpr int STG = 32 * RS;       // one stage: 16 key rows, then 16 value rows (NST per warp)
  constexpr int TAB = 256 * 32;      // pair table, 32 copies
  constexpr int PTW = 72;            // words of a warp's P' (8 rows of 8 words; rows 4..7 of
                                     // them 4 words further: `PSK`)
  // Output rows of the PV MMA: row m (0..15) of tile j is dim 8 VW + VN, chosen so that a
  // thread's value codes come from few words at nibble positions known at compile time:
  //   P = 64:   VW = m % 8,                  VN = 2 j + m / 8  (one word per key row)
  //   P >= 128: VW = m + 16 (j % (P / 128)), VN = j / (P / 128) (2 P / 128 words per key row)
  constexpr int NSL = P == 64 ? 1 : 2 * (P / 128);  // words per key row a thread reads
#define SLOTW(u) (P == 64 ? g : g + 8 * ((u) & 1) + 16 * ((u) >> 1))
#define VDIM(j, m) (P == 64 ? 8 * ((m) & 7) + 2 * (j) + ((m) >> 3) \
                             : 8 * ((m) + 16 * ((j) % (P / 128))) + (j) / (P / 128))
  static_assert(NWP * 8 * P <= TAB + NWP * NST * STG, "the merge buffer fits the table + stages");
  LC_DYN_SHARED(lc_smem);
  uint32_t* tab = lc_smem;
  uint32_t* stg = lc_smem + TAB;                   // [warp][NST][STG]
  uint32_t* ptb = stg + NWP * NST * STG;           // [warp][PTW words]: P' fp16
                                                   // [row 0..7][key 0..15]
  float* mlb = (float*)(ptb + NWP * PTW);          // m [warp][8], then l [warp][8]
  float* qst = (float*)tab;                        // q staging, before the table
  float* red = (float*)tab;                        // [warp][8][P], after the loop

  const int L = params[0];
  const int chunk = params[1];
  const int S = params[2];
  // read first, beside params: its first use is after q's rotation and its barriers, which a
  // later load cannot be hoisted across
  const float qs_all = scales[0] * scales[1];  // scale * log2(e) / sqrt(P)
  const int H = q_shape[1];
  const int tid = (int)lc_tid;
  const int lane = (int)lc_lane;
  const int warp = (int)lc_warp;
  const int g = lane >> 2;
  const int t = lane & 3;
  // DYN: threadgroups numbered split-major, so that each head's splits are spread over the
  // launch's order (SMs take threadgroups in order, the first placed finish first: a head's
  // grants then pass from slow threadgroups to fast ones)
  const int split = DYN ? (int)(lc_tg / (uint32_t)(q_shape[0] * H)) : (int)(lc_tg % (uint32_t)S);
  const int bh = DYN ? (int)(lc_tg % (uint32_t)(q_shape[0] * H)) : (int)(lc_tg / (uint32_t)S);
  const int hh = bh % H;
  const int bb = bh / H;
  const int k0 = split * chunk;
  int k1 = (k0 + chunk < L) ? k0 + chunk : L;  // (DYN: L in the handed-out tail)
  constexpr int GR = BLK * GB;           // keys per grant
  constexpr int NA = NST > 1 ? NST : 2;  // block starts known ahead: [0] now, [1] the norms',
                                         // [NST - 1] the stage's
  // DYN: the warp's first grant, in flight through the static loop
  int tick = DYN && lane == 0 ? lc_atomic_add(lc_grants + 32 * bh, 1) : 0;

  // per-head base pointers, 32-bit strides within a head (fewer live registers)
  const auto kip = k_idx + (bb * k_idx_strides[0] + hh * k_idx_strides[1]);
  const int kis = (int)k_idx_strides[2];
  const int kiw = (int)k_idx_strides[3];
  const auto vip = v_idx + (bb * v_idx_strides[0] + hh * v_idx_strides[1]);
  const int vis = (int)v_idx_strides[2];
  const int viw = (int)v_idx_strides[3];
  const auto knp = k_norm + (bb * k_norm_strides[0] + hh * k_norm_strides[1]);
  const int kns = (int)k_norm_strides[2];
  const auto vnp = v_norm + (bb * v_norm_strides[0] + hh * v_norm_strides[1]);
  const int vns = (int)v_norm_strides[2];
  // 16-byte copies need 16-byte aligned rows: unit word stride, row strides of 4 words
  const bool vec = kiw == 1 && viw == 1 && kis % 4 == 0 && vis % 4 == 0
                   && reinterpret_cast<uintptr_t>(kip) % 16 == 0
                   && reinterpret_cast<uintptr_t>(vip) % 16 == 0;

  // 0. The first blocks' rows and norms are requested first: their latency (DRAM, at a
  // decode step's cold L2) passes while q is rotated and the pair table is written.
  // Copy block kb's key and value rows (keys past the split read the split's last row, masked
  // below) into this warp's stage buf.
  // Lane l copies chunk (l % CH) of rows l / CH + RPJ j: key rows for j < CH / 2, value rows
  // after; a block that ends past the split clamps its rows to the split's last.
  constexpr int STEP = BLK * NWP;
  constexpr int RPJ = 32 / CH;
  // lane -> (row, chunk) of a copy: each quarter-warp's eight 16-byte chunks land on distinct
  // banks (a 16-byte store is served 8 lanes at a time): rows r and r + 4 (P = 128, RS = 20
  // words) or rows of one parity (P = 64, RS = 12) fill the 32 banks. (P = 256: a quarter is
  // one row's 8 chunks.)
  const int crow = CH == 8 ? lane / CH
                   : CH == 4 ? (lane >> 3) + 4 * ((lane >> 2) & 1)
                             : 8 * (lane >> 4) + ((lane >> 3) & 1) + 2 * ((lane >> 1) & 3);
  const int cpart = lane & (CH - 1);
  // (`vec_path`: 16-byte `cp.async` copies where strides and alignment allow, `vec`, else word
  // by word; the main loop below is instantiated once per way with a constant `vec_path`, so
  // neither instance carries the other's address arithmetic)
  auto stage = [&](int kb, int buf, bool vec_path) {
    uint32_t* dst = stg + (warp * NST + buf) * STG + crow * RS + 4 * cpart;
    const bool full = kb + BLK <= k1;
    LC_UNROLL for (int j = 0; j < CH; ++j) {
      const bool isv = j >= CH / 2;
      const int kr = crow + RPJ * (isv ? j - CH / 2 : j);  // key within the block
      const int key = full ? kb + kr : LC_MIN_I(kb + kr, k1 - 1);
      uint32_t* d = dst + (isv ? 16 * RS : 0) + RPJ * (isv ? j - CH / 2 : j) * RS;
      if (vec_path) {
        lc_cp_async16(d, isv ? vip + (key * vis + 4 * cpart) : kip + (key * kis + 4 * cpart));
      } else {
        LC_UNROLL for (int w = 0; w < 4; ++w)
          d[w] = isv ? vip[key * vis + (4 * cpart + w) * viw]
                     : kip[key * kis + (4 * cpart + w) * kiw];
      }
    }
  };

  // The norms of keys g and g + 8 of a block (past the split: the split's last key, masked),
  // loaded a block ahead like the rows, converted when used.
  auto norms = [&](int kb, LC_HALF* n) {
    const int ka = LC_MIN_I(kb + g, k1 - 1);
    const int kc = LC_MIN_I(kb + g + 8, k1 - 1);
    n[0] = knp[ka * kns];
    n[1] = knp[kc * kns];
    n[2] = vnp[ka * vns];
    n[3] = vnp[kc * vns];
  };
  int kb = k0 + BLK * warp;
  LC_HALF nc[4];
  if (kb < k1) norms(kb, nc);
  LC_UNROLL for (int b = 0; b < NST - 1; ++b) {  // the first NST - 1 blocks' rows
    if (kb + b * STEP < k1) stage(kb + b * STEP, b, vec);
    LC_CP_COMMIT();
  }

  // 1. q, staged in the pair table's space: signs, the Walsh-Hadamard butterfly over each row,
  // scale; then the score MMA's B fragments (row g, dims 16 s + 2 t, +1, +8, +9), kept in
  // registers.
  const int64_t qo = bb * q_strides[0] + hh * q_strides[1];
  LC_UNROLL for (int o = 0; o < R * P; o += NT) {  // (unrolled: every load issued at once)
    const int i = o + tid;
    if ((R * P) % NT == 0 || i < R * P) {
      const int r = i / P;
      const int d = i - r * P;
      qst[i] = LC_TOF(q[qo + r * q_strides[2] + d * q_strides[3]]) * q_signs[d];
    }
  }
"""

# q's rotation and fragments, the pair table, the main loop (`walk`), the warps' merge; then
# the split's state is written (`_WRITE`, or `decode_step_mma`'s write with the exact tokens)
MAIN = r"""
  LC_BARRIER();
  LC_WHT_ROWS_N(qst, R, P, NT, tid)
  uint32_t qf[KS][2];
  LC_UNROLL for (int s = 0; s < KS; ++s) {
    const int d = g * P + 16 * s + 2 * t;
    qf[s][0] = g < R ? lc_pack_h2(qst[d] * qs_all, qst[d + 1] * qs_all) : 0u;
    qf[s][1] = g < R ? lc_pack_h2(qst[d + 8] * qs_all, qst[d + 9] * qs_all) : 0u;
  }
  LC_BARRIER();  // the table overwrites qst

  // 2. The pair table: entry x = (T[x & 15], T[x >> 4]) as fp16, copy l at word 32 x + l,
  // written 4 copies per 16-byte store: quad e (words 4 e .. 4 e + 3) holds entry e / 8, and
  // thread tid writes quads tid + NT i, so its entries share x & 15 (NT a multiple of 128) and
  // walk x >> 4 (one store per entry copy was most of a short split's time)
  static_assert(NT % 128 == 0, "a thread's pair-table entries share their low code");
  {
    const float lo = table[(tid >> 3) & 15];
    LC_UNROLL for (int i = 0; i < TAB / 4 / NT; ++i) {
      const int x = (tid + NT * i) >> 3;
      LC_ST_X4(tab + 4 * (tid + NT * i), lc_pack_h2(lo, table[x >> 4]));
    }
  }
  LC_BARRIER();  // the table is written

  float m0 = -LC_INF, m1 = -LC_INF, l0 = 0.0f, l1 = 0.0f;  // rows 2t, 2t+1
  float acc[KS][4];  // O^T [dims VDIM(j, g), VDIM(j, g + 8)] x [rows 2t, 2t + 1]
  LC_UNROLL for (int j = 0; j < KS; ++j) {
    acc[j][0] = 0.0f;
    acc[j][1] = 0.0f;
    acc[j][2] = 0.0f;
    acc[j][3] = 0.0f;
  }
  // entry x of this lane's copy of the pair table (CUDA: a shared-window address, one LEA)
#if defined(LC_CUDA)
  const uint32_t tabl = (uint32_t)__cvta_generic_to_shared(tab + lane);
#define LC_TAB(x) lc_lds_u32(tabl + ((uint32_t)(x) << 7))
#else
  const uint32_t* tabl = tab + lane;
#define LC_TAB(x) tabl[(x) * 32u]
#endif
  uint32_t* ptw = ptb + warp * PTW;
  uint16_t* pth = reinterpret_cast<uint16_t*>(ptw);
  // P' row r starts at word 8 r + PSK(r): rows 4..7 four words (banks) on, so that the stores of
  // rows 2t (t = 0..3) and the loads of rows g (g = 0..7) each hit 32 distinct banks
#define PSK(r) (4 * (((r) >> 2) & 1))
  // (loop-invariant: this lane's P' offsets, halfwords for the stores, words for the loads)
  const int pso = (2 * t) * 16 + 2 * PSK(2 * t) + g;
  const int plo = g * 8 + PSK(g) + t;

  // DYN: after its static chunk each split's warps take the rest of the head (from gbase = S *
  // chunk) in grants of GR keys, in the order the head's warps ask: lane 0 adds one to the
  // head's grant count (a 128-byte line per head), a grant ahead of need, so that the atomic's
  // latency passes under other work; lane 0's ticket is broadcast when the warp's lookahead
  // reaches its grant's end. The split's exact tokens stay its own share.
  const int gbase = S * chunk;  // the handed-out keys start here
  int gend = 0;
  int ahead[NA];  // the next block starts (GT: the grants')
  // the block after the one starting at key b in this warp's sequence (warp-uniform)
  auto next_block = [&](int b) {
    int nb = b + BLK;
    if (nb >= gend) {
      nb = gbase + (int)lc_shfl_xor((float)tick, lane) * GR;  // lane 0's ticket
      gend = nb + GR;
      if (nb < L) tick = lane == 0 ? lc_atomic_add(lc_grants + 32 * bh, 1) : 0;
    }
    return nb;
  };

  // The main loop over this warp's blocks: VP, the rows' 16-byte copies (else word by word);
  // GT, the blocks of its grants (`ahead`), else every STEP-th block of its split.
  auto walk = [&](auto vp_c, auto gt_c) {
    constexpr bool VP = decltype(vp_c)::value;
    constexpr bool GT = decltype(gt_c)::value;
    for (int it = 0; kb < k1; ++it) {
      LC_HALF nn[4] = {nc[0], nc[1], nc[2], nc[3]};  // (the last block: never read)
      const int kst = GT ? ahead[NST - 1] : kb + (NST - 1) * STEP;
      if (kst < k1) stage(kst, (it + NST - 1) % NST, VP);
      const int knx = GT ? ahead[1] : kb + STEP;
      if (knx < k1) norms(knx, nn);
      LC_CP_COMMIT();  // (an empty group past the split: the count stays in step)
      LC_CP_WAIT(NST - 1);  // this block's rows have landed (this lane's copies)
      LC_SYNCWARP();        // and every lane's; also the compiler fence for the stage reads
      const uint32_t* ks = stg + (warp * NST + it % NST) * STG;
      const uint32_t* vs = ks + 16 * RS;
      const int ka = kb + g;
      const int kc = ka + 8;
      const float nka = LC_TOF(nc[0]);
      const float nkc = LC_TOF(nc[1]);
      const float nva = ka < k1 ? LC_TOF(nc[2]) : 0.0f;
      const float nvc = kc < k1 ? LC_TOF(nc[3]) : 0.0f;
      LC_UNROLL for (int i = 0; i < 4; ++i) nc[i] = nn[i];

      // scores: keys g and g + 8 of the block, rows 2t and 2t + 1
      float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      float sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // a second chain (SC = 2) where registers allow
      LC_UNROLL for (int s = 0; s < KS; ++s) {
        const LC_U2 wa = LC_LD_U2(ks + g * RS + 2 * s);
        const LC_U2 wc = LC_LD_U2(ks + (g + 8) * RS + 2 * s);
        uint32_t a[4];
        a[0] = LC_TAB(LC_BYTE(wa.x, t));
        a[1] = LC_TAB(LC_BYTE(wc.x, t));
        a[2] = LC_TAB(LC_BYTE(wa.y, t));
        a[3] = LC_TAB(LC_BYTE(wc.y, t));
        if (SC == 2 && (s & 1)) lc_mma_16816(sb, a, qf[s]);
        else lc_mma_16816(sa, a, qf[s]);
      }
      if (SC == 2) {
        LC_UNROLL for (int i = 0; i < 4; ++i) sa[i] += sb[i];
      }
      float s0 = sa[0] * nka;
      float s1 = sa[1] * nka;
      float s2 = sa[2] * nkc;
      float s3 = sa[3] * nkc;
      if (ka >= k1) { s0 = -LC_INF; s1 = -LC_INF; }
      if (kc >= k1) { s2 = -LC_INF; s3 = -LC_INF; }

      // online softmax per row over the warp's blocks
      float b0 = LC_MAX(s0, s2);
      float b1 = LC_MAX(s1, s3);
      LC_UNROLL for (int o = 4; o < 32; o <<= 1) {
        b0 = LC_MAX(b0, lc_shfl_xor(b0, o));
        b1 = LC_MAX(b1, lc_shfl_xor(b1, o));
      }
      const float n0 = LC_MAX(m0, b0);
      const float n1 = LC_MAX(m1, b1);
      const float u0 = n0 == -LC_INF ? 0.0f : n0;
      const float u1 = n1 == -LC_INF ? 0.0f : n1;
      if (lc_any(n0 > m0 || n1 > m1)) {
        const float c0 = lc_ex2(m0 - u0);  // m = -inf: 0
        const float c1 = lc_ex2(m1 - u1);
        l0 *= c0;
        l1 *= c1;
        LC_UNROLL for (int j = 0; j < KS; ++j) {
          acc[j][0] *= c0;
          acc[j][1] *= c1;
          acc[j][2] *= c0;
          acc[j][3] *= c1;
        }
        m0 = n0;
        m1 = n1;
      }
      const float p0 = lc_ex2(s0 - u0);
      const float p1 = lc_ex2(s1 - u1);
      const float p2 = lc_ex2(s2 - u0);
      const float p3 = lc_ex2(s3 - u1);
      l0 += p0 + p2;
      l1 += p1 + p3;
      // P' (keys g, g + 8 x rows 2t, 2t + 1) -> [row][key] fp16 -> the PV MMA's B fragment
      pth[pso] = (uint16_t)LC_F2H_BITS(p0 * nva);           // row 2t, key g
      pth[pso + 16] = (uint16_t)LC_F2H_BITS(p1 * nva);      // row 2t + 1 (same PSK)
      pth[pso + 8] = (uint16_t)LC_F2H_BITS(p2 * nvc);       // row 2t, key g + 8
      pth[pso + 24] = (uint16_t)LC_F2H_BITS(p3 * nvc);
      LC_SYNCWARP();
      uint32_t pb[2];
      pb[0] = ptw[plo];      // row g, keys 2t, 2t + 1
      pb[1] = ptw[plo + 4];  // row g, keys 2t + 8, 2t + 9

      // values: a register of the V^T operand is one dim of keys (2t, 2t + 1) or (2t + 8,
      // 2t + 9); its row m of tile j is the dim at word VW(j, m), nibble VN(j, m) (see the
      // top): NSL words of each of this thread's 4 key rows, each key pair's words turned into
      // two words of pair-table indices, one byte per nibble position.
      uint32_t pa[NSL][2], pc[NSL][2];  // keys (2t, 2t + 1), (2t + 8, 2t + 9): [slot][even, odd]
      LC_UNROLL for (int u = 0; u < NSL; ++u) {
        const int w = SLOTW(u);
        const uint32_t x0 = vs[(2 * t) * RS + w];
        const uint32_t x1 = vs[(2 * t + 1) * RS + w];
        const uint32_t x2 = vs[(2 * t + 8) * RS + w];
        const uint32_t x3 = vs[(2 * t + 9) * RS + w];
        pa[u][0] = (x0 & 0x0F0F0F0Fu) | ((x1 << 4) & 0xF0F0F0F0u);
        pa[u][1] = ((x0 >> 4) & 0x0F0F0F0Fu) | (x1 & 0xF0F0F0F0u);
        pc[u][0] = (x2 & 0x0F0F0F0Fu) | ((x3 << 4) & 0xF0F0F0F0u);
        pc[u][1] = ((x2 >> 4) & 0x0F0F0F0Fu) | (x3 & 0xF0F0F0F0u);
      }
      LC_UNROLL for (int j = 0; j < KS; ++j) {
        uint32_t a[4];
        if constexpr (P == 64) {  // rows g, g + 8: nibbles 2j, 2j + 1 of word g
          a[0] = LC_TAB(LC_BYTE(pa[0][0], j));
          a[1] = LC_TAB(LC_BYTE(pa[0][1], j));
          a[2] = LC_TAB(LC_BYTE(pc[0][0], j));
          a[3] = LC_TAB(LC_BYTE(pc[0][1], j));
        } else {  // rows g, g + 8: words g + 16 (j % A), + 8; nibble j / A
          constexpr int A = WK / 16 > 0 ? WK / 16 : 1;
          const int u = 2 * (j % A);
          const int nb = j / A;
          a[0] = LC_TAB(LC_BYTE(pa[u][nb & 1], nb >> 1));
          a[1] = LC_TAB(LC_BYTE(pa[u + 1][nb & 1], nb >> 1));
          a[2] = LC_TAB(LC_BYTE(pc[u][nb & 1], nb >> 1));
          a[3] = LC_TAB(LC_BYTE(pc[u + 1][nb & 1], nb >> 1));
        }
        lc_mma_16816(acc[j], a, pb);
      }
      LC_SYNCWARP();  // the stage and P' are rewritten by the next blocks
      if constexpr (GT) {
        LC_UNROLL for (int b = 0; b < NA - 1; ++b) ahead[b] = ahead[b + 1];
        ahead[NA - 1] = next_block(ahead[NA - 2]);
        kb = ahead[0];
      } else {
        kb += STEP;
      }
    }
  };
  // the split's static blocks, then (DYN) the grants, each way of staging instantiated once
  auto walk_all = [&](auto vp_c) {
    walk(vp_c, lc_bool<false>());
    if constexpr (DYN) {
      k1 = L;
      ahead[0] = next_block(-BLK);
      LC_UNROLL for (int b = 1; b < NA; ++b) ahead[b] = next_block(ahead[b - 1]);
      kb = ahead[0];
      if (kb < k1) norms(kb, nc);
      LC_UNROLL for (int b = 0; b < NST - 1; ++b) {  // the first NST - 1 blocks' rows
        if (ahead[b] < k1) stage(ahead[b], b, decltype(vp_c)::value);
        LC_CP_COMMIT();
      }
      walk(vp_c, lc_bool<true>());
    }
  };
  if (vec) walk_all(lc_bool<true>());
  else walk_all(lc_bool<false>());
  LC_CP_WAIT0();

  // 3. The warps' states merged: l over the 8 lanes of a row, then through shared memory.
  LC_UNROLL for (int o = 4; o < 32; o <<= 1) {
    l0 += lc_shfl_xor(l0, o);
    l1 += lc_shfl_xor(l1, o);
  }
  LC_BARRIER();  // every warp is done with the table and its stages
  if (g == 0) {
    mlb[warp * 8 + 2 * t] = m0;
    mlb[warp * 8 + 2 * t + 1] = m1;
    mlb[NWP * 8 + warp * 8 + 2 * t] = l0;
    mlb[NWP * 8 + warp * 8 + 2 * t + 1] = l1;
  }
  LC_BARRIER();
  float M0 = -LC_INF, M1 = -LC_INF;
  LC_UNROLL for (int w = 0; w < NWP; ++w) {
    M0 = LC_MAX(M0, mlb[w * 8 + 2 * t]);
    M1 = LC_MAX(M1, mlb[w * 8 + 2 * t + 1]);
  }
  const float f0 = m0 == -LC_INF ? 0.0f : LC_EXP2(m0 - M0);
  const float f1 = m1 == -LC_INF ? 0.0f : LC_EXP2(m1 - M1);
  LC_UNROLL for (int j = 0; j < KS; ++j) {
    const int r0 = (warp * 8 + 2 * t) * P;
    red[r0 + VDIM(j, g)] = acc[j][0] * f0;
    red[r0 + P + VDIM(j, g)] = acc[j][1] * f1;
    red[r0 + VDIM(j, g + 8)] = acc[j][2] * f0;
    red[r0 + P + VDIM(j, g + 8)] = acc[j][3] * f1;
  }
#undef SLOTW
#undef VDIM
#undef LC_TAB
#undef PSK
  LC_BARRIER();
  const int64_t so = (int64_t)bh * S + split;
"""

# The partials' write of the split's state as it is (without exact tokens)
_WRITE = r"""
  for (int i = tid; i < R * P; i += NT) {
    const int r = i / P;
    const int d = i - r * P;
    float a = 0.0f;
    LC_UNROLL for (int w = 0; w < NWP; ++w) a += red[(w * 8 + r) * P + d];
    acc_out[so * (R * P) + i] = a;
  }
  if (tid < R) {
    float M = -LC_INF;
    LC_UNROLL for (int w = 0; w < NWP; ++w) M = LC_MAX(M, mlb[w * 8 + tid]);
    float l = 0.0f;
    LC_UNROLL for (int w = 0; w < NWP; ++w) {
      const float mw = mlb[w * 8 + tid];
      if (mw != -LC_INF) l += mlb[NWP * 8 + w * 8 + tid] * LC_EXP2(mw - M);
    }
    m_out[so * R + tid] = M == -LC_INF ? -LC_INF : M * 0.6931471805599453f;  // natural log
    l_out[so * R + tid] = l;
  }
"""


NO_GRANTS = "\n  const int32_t* lc_grants = nullptr;  // (the partials never hand keys out)\n"

SPEC = KernelSpec(
    name=NAME,
    inputs=("q", "k_idx", "k_norm", "v_idx", "v_norm", "table", "params", "scales", "q_signs"),
    outputs=("m_out", "l_out", "acc_out"),
    row_contiguous=False,
    header=HEADER,
    source=NO_GRANTS + PRE + MAIN + _WRITE,
)
_SPECS: dict = {}


def shared_bytes(p: int) -> int:
    """Dynamic shared memory of one threadgroup at head dim p: the pair table, each warp's stages
    of 16 key and 16 value rows, P' and the merge's m and l."""
    rs = p // 8 + 4
    return 4 * (256 * 32 + WARPS * STAGES * 32 * rs + WARPS * 72 + 2 * WARPS * 8)


def resident(p: int) -> int:
    """Threadgroups per SM the launch is sized for, and the register cap fits: 16 warps of 128
    registers (12 of 168 at P = 256, whose fragments need them), as shared memory allows (one
    KiB per threadgroup is the driver's)."""
    warps = (16 if p <= 128 else 12) // WARPS
    return max(1, min(warps, SMEM_PER_SM // (shared_bytes(p) + 1024)))


def kernel_spec(p: int, base: KernelSpec = SPEC) -> KernelSpec:
    """`base` (the partials' kernel, or one built on their body: `decode_step_mma`) at head dim
    p: its dynamic shared memory and register cap (MLX writes the kernel's signature itself, so
    its `__global__` is redefined to carry `__launch_bounds__`)."""
    if (base, p) not in _SPECS:
        bounds = (
            "#ifdef LC_CUDA\n#undef __global__\n#define __global__ __attribute__((global)) "
            f"__launch_bounds__({32 * WARPS}, {resident(p)})\n#endif\n"
        )
        _SPECS[(base, p)] = dataclasses.replace(base, shared_memory=shared_bytes(p), header=base.header + bounds)
    return _SPECS[(base, p)]


def applies(p: int, rows: int, key_codec, value_codec) -> bool:
    """Whether a decode step's partials can run here: a CUDA backend (or an executor standing in
    for it), single-stage 4-bit keys and values sharing one codebook (the pair table), no QJL,
    D = P in DIMS, 1..8 rows."""
    return backend() == "cuda" and p in DIMS and 1 <= rows <= MAX_ROWS and da.four_bit_pair(p, key_codec, value_codec)


def applies_shape(queries, keys, values, table) -> bool:
    _, _, R, P = queries.shape
    return (
        P in DIMS
        and 1 <= R <= MAX_ROWS
        and keys["idx"].shape[-1] == P // 8
        and values["idx"].shape[-1] == P // 8
        and table.shape == (16,)
    )


def splits(length: int, bh: int, p: int = 128) -> tuple[int, int]:
    """(chunk, splits): chunks of whole 64-key tiles, about one wave of threadgroups in all, each
    warp walking at least MIN_WARP_BLOCKS blocks (a split's fixed costs, the pair table, q's
    rotation, the warps' merge, and the finish's merge of every split, against its blocks)."""
    tile = BLOCK * WARPS
    tiles = groups(length, tile)
    want = max(1, min(tiles // max(1, MIN_WARP_BLOCKS), groups(da.SM_COUNT * resident(p), bh)))
    chunk = groups(tiles, want) * tile
    return chunk, groups(length, chunk)


def launch_args(
    queries, keys, values, table, signs, scale, chunk, n_split, dynamic: bool = False, grant_blocks: int = 1
) -> tuple[list, list]:
    """(inputs, template) of the partials' kernel, which kernels built on its body extend."""
    _, _, R, P = queries.shape
    params = constant((keys["norm"].shape[2], chunk, n_split), mx.int32)
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
    # two score chains only at P = 256: at 128 the second spills under the 128-register cap
    template = [
        ("P", P),
        ("R", R),
        ("NT", 32 * WARPS),
        ("NST", STAGES),
        ("BLK", BLOCK),
        ("SC", 2 if P == 256 else 1),
        ("DYN", int(dynamic)),
        ("GB", grant_blocks),
        ("QT", queries.dtype),
    ]
    return inputs, template


def decode_attend_mma_partials(queries, keys, values, table, signs, *, scale):
    """Each split's softmax state of a decode step's rows over one 4-bit compressed segment
    (with the exact tokens as well: `decode_step_mma.decode_step_mma_partials`).

    Args:
        queries: (B, H, R, P) unrotated, any float dtype, rows grouped per KV head, R <= 8.
        keys, values: dicts with idx (B, H, L, P/8) uint32 and norm (B, H, L), as
            `VectorCodec.encode` stores them (any strides).
        table: (16,) float32, the one codebook of keys and values.
        signs: (P,) float32, the key rotation's +-1 diagonal.
        scale: score scale.

    Returns:
        (m_p (B*H, S, R), l_p (B*H, S, R), acc_p (B*H, S, R, P)) float32, natural-log units, in
        the values' rotated frame: `decode_attend.decode_attend_partials`' outputs (the products
        in fp16 with fp32 accumulation, so equal to them within fp16 rounding).
    """
    B, H, R, P = queries.shape
    L = keys["norm"].shape[2]
    if not applies_shape(queries, keys, values, table):
        raise ValueError(
            f"decode_attend_mma takes 4-bit rows, P in {DIMS}, 1..{MAX_ROWS} rows; "
            f"got q {queries.shape}, idx {keys['idx'].shape} / "
            f"{values['idx'].shape}, table {table.shape}"
        )
    kw = dict(key_bits=4, value_bits=4, scale=scale)
    if backend() == "cpu" or L == 0:
        return da.decode_attend_partials(queries, keys, values, table, table, signs, **kw)
    chunk, n_split = splits(L, B * H, P)
    inputs, template = launch_args(queries, keys, values, table, signs, scale, chunk, n_split)

    n, nt = B * H * n_split, 32 * WARPS
    shapes = [(B * H, n_split, R), (B * H, n_split, R), (B * H, n_split, R, P)]
    return run(
        kernel_spec(P),
        Launch(inputs, template, (n * nt, 1, 1), (nt, 1, 1), shapes, [mx.float32] * 3),
        reference=lambda: reference(queries, keys, values, table, signs, scale, n_split),
    )


def reference(queries, keys, values, table, signs, scale, n_split: int) -> list:
    """The partials' outputs in pure MLX (a failed launch's stand-in): q rotated as the kernel
    rotates it, the segment's state from `decode_attend_reference` in split 0, "nothing seen"
    (m = -inf, l = 0, acc = 0) in the others, which the merge passes over."""
    B, H, R, P = queries.shape
    q_rot = mx.hadamard_transform(queries.astype(mx.float32) * signs, scale=1.0 / math.sqrt(P))
    m, l, acc = da.decode_attend_reference(q_rot, keys, values, table, table, key_bits=4, value_bits=4, scale=scale)
    n, pad = B * H, n_split - 1
    return [
        mx.concatenate([m.reshape(n, 1, R), mx.full((n, pad, R), -mx.inf)], axis=1),
        mx.concatenate([l.reshape(n, 1, R), mx.zeros((n, pad, R))], axis=1),
        mx.concatenate([acc.reshape(n, 1, R, P), mx.zeros((n, pad, R, P))], axis=1),
    ]


def _as(a: mx.array, dtype) -> mx.array:
    return a if a.dtype == dtype else a.astype(dtype)
