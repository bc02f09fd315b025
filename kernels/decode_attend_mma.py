"""One decode step's compressed attention on tensor cores (CUDA): 4-bit keys and values, <= 8 rows.

The same function as `decode_attend.decode_attend_partials` (unrotated queries in, each split's
softmax state out, merged by `decode_finish`), for the default preset's shape of work: single-stage
4-bit keys and values with one codebook, no QJL, D = P in 64/128/256, up to 8 query rows per KV
head (GQA 1..8 at one token). Both products run as `mma.sync.m16n8k16` (fp16 in, fp32
accumulate) instead of CUDA-core FMAs: the portable kernel spends ~20 instructions per key-dim
pair (8 FMAs for 4 rows, two table reads, a q read, code extraction) and is issue-bound at 128k.

    s^T (16 keys x 8 rows) = K^T (16 keys x 16 dims) . Qs^T (16 dims x 8 rows), P/16 steps
    O^T (16 dims x 8 rows) += V^T (16 dims x 16 keys) . P'^T (16 keys x 8 rows), P/16 tiles

with Qs = q rotated, times scale * log2(e) (scores in base 2), s = s^T * norm_k, P' = exp2(s - m)
* norm_v (the value norm folded into the weights, fp16). Rows past R are zero queries whose
states are never written.

Decoding codes into fragments. A 4-bit code table T (16 centroids) becomes a pair table in shared
memory: entry x (one byte, two codes) holds the fp16 pair (T[x & 15], T[x >> 4]), one half2
register of an MMA operand. The table is replicated 32 times (entry x of copy l at word 32 x + l,
lane l reads copy l), so any 32 lookups hit 32 distinct banks; a lookup is a byte extract
(`prmt`), one IMAD/LEA from a 32-bit shared address and one shared load. It is written with
16-byte stores of four copies, 16 per thread at 4 warps.
- Keys: a register of the score MMA's A operand holds two adjacent dims of one key, i.e. one
  byte of the packed row (byte t of words 2s and 2s + 1 for lane t of a quad).
- Values: a register of the V^T operand holds ONE dim of TWO keys (the MMA reduces over keys),
  so its byte comes from two rows. The PV MMA's output rows are assigned to dims so that a
  thread reads few words at compile-time nibble positions: row m of tile j is dim 8 w + n with
  (P >= 128) w = m + 16 (j % (P / 128)), n = j / (P / 128), or (P = 64) w = m % 8,
  n = 2 j + m / 8. Per block a thread reads 2 P / 128 words of each of its 4 key rows and turns
  each key pair's word into two words of pair indices with 2 logic ops each, (x0 & 0x0F0F0F0F) |
  ((x1 << 4) & 0xF0F0F0F0) and the odd nibbles likewise: one byte per nibble position.

Thread plan. One threadgroup of WARPS warps (4) per (b, h, split); a split is a multiple of
16 x WARPS keys, the launch about one wave (4 threadgroups per SM: 55 KiB of shared memory and
128 registers a thread at P = 128; 3 at P = 256). Each warp owns every WARPS-th block of 16 keys
of its split and keeps its own online softmax state; it stages its blocks' packed key and value
rows with 16-byte `cp.async` copies (word by word where strides or alignment forbid: the main
loop is instantiated once per way), STAGES blocks deep (2: double-buffered), and loads their
norms a block ahead, so the next block is in flight while this one computes (warp-private: no
threadgroup barrier in the loop). The first blocks are requested before q's rotation and the
pair table (q is staged in the table's space), so their latency overlaps that work. Per block: the
score MMAs, norms and mask, the row maxima over the 16 keys (3 shuffles), the accumulator rescale
only when a maximum moved (warp vote), P' through 256 bytes of shared memory into the PV operand
layout, the PV MMAs. At the end the 4 warps' states are merged in shared memory (the pair table's
space) and the split's (m, l, acc) written, m in natural-log units as `decode_attend` writes it.

The whole step in one launch (`decode_step_mma`): each split also takes its share of the exact
tokens (the sink, the question and the answer so far: ceil(E / S) keys), scored a warp per key
and their values turned into the value frame with a lane butterfly, folded into the split's
state before it is written; the last threadgroup of each KV head (a count of finished ones)
merges the head's splits, rotates back and adds the mean. Its split states go to one scratch
output (`parts`: m, l, then acc) rather than three: MLX builds every output array of a launch at
each step, each holding the launch's inputs (a replayed step's host time,
`benchmarks/diagnostics/plan_call.py`).
Attended by that last threadgroup alone, the exact tokens had been a large part of an answer's
step, one threadgroup per head doing what the splits now share (docs/performance.md). The
two-launch step (P = 64 / 256, or FUSE_FINISH off) folds them into its partials the same way
(`decode_attend_mma_partials(..., sink=, window=)`), and `decode_finish` then only merges.

Where its time goes (Llama-3.1-8B shapes, 128k, tq4, the one-launch step; ncu, its
reports in git history; the step against MLX's fp16 SDPA in attend_h200.json / attend_h100.json
from benchmarks/attend.py; docs/performance.md):
128 registers, 16 warps per SM, DRAM below its peak; the SMs idle for part of the elapsed cycles
(the heads' last threadgroups finishing, and the wave's ramp). The main loop is 453 SASS
instructions per 16-key block (nvcc sm_90), 192 of them the 64 table lookups (byte extract,
address, shared load); it was 562 while it also carried the word-by-word staging. At 4k a warp
walks one block and the fixed costs dominate.

CUDA only: `mma.sync` and `cp.async` have no Metal spelling in the prelude (a
`simdgroup_matrix` port is the Metal counterpart still to write). Metal, and every shape this
kernel does not take, use the portable kernel; `decode_attend.decode_attend_partials` is the
reference of both. The emulator (tests/kernel_emu.py) runs this body with the MMA's PTX fragment
layouts, so its indexing is tested on the CPU.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, constant, failed, groups, run, watch
from . import decode_attend as da
from . import decode_finish as df

LOG2E = 1.4426950408889634
WARPS = 4  # warps per threadgroup (each owns every WARPS-th block of its split)
STAGES = 2  # blocks of rows each warp has staged or in flight (2: double-buffered)
BLOCK = 16  # keys per warp block (the MMA's M)
DIMS = (64, 128, 256)
MAX_ROWS = 8  # the MMA's N
MIN_WARP_BLOCKS = 1  # fewest 16-key blocks each warp of a split walks (more: fewer splits)
# threadgroups per SM the launch is sized for and the register cap fits (0: 16 warps' worth,
# as shared memory allows; `resident`). E.g. 5 with STAGES 1 (43 KiB): 102 registers a thread.
# (STAGES 1 fits P <= 128 only: at P = 256 the exact tokens' rounds need two stages' space.)
# A benchmark knob (benchmarks/attend.py --mma-variants 4,1,1,5): one stage and 5 threadgroups
# measured slower than the default at 128k (docs/performance.md)
RESIDENT = 0
ENABLED = True  # benchmarks/attend.py turns it off for the portable kernel's rows
# the whole step in one launch where it applies (`decode_step_mma`; False: the partials, then
# `decode_finish`, two launches)
FUSE_FINISH = True
# the whole step's exact tokens (sink, window) spread over the head's splits, each folding its
# share into its state (False: the last threadgroup attends them all in the finish's body)
EXACT_IN_SPLITS = True
# conflict-free shared layouts for the staged rows' copies and P' (template BK; False: the
# layouts before, for benchmarks/attend.py's A/B rows)
BANKS = True
# waves of threadgroups a launch is sized for (`splits`): 1, about one wave (at 128k on 132 SMs,
# 512 threadgroups for 528 slots); more: shorter splits, more of them to merge (2 measured
# slower at 128k: docs/performance.md)
WAVES = 1
SMEM_PER_SM = 233472  # bytes of shared memory an H200 SM gives its threadgroups (228 KiB)
# the whole step's keys handed out while it runs (`_dynamic`): each warp starts on a grant of
# GRANT_BLOCKS 16-key blocks of its own, then takes the head's next grant from a count in the
# counter array, so warps on busier SMs walk fewer blocks. False: each split walks a fixed chunk
# (the threadgroups' main loops then end unevenly, the slowest well after the median:
# benchmarks/diagnostics/step_stamps.py, its results in git history)
DYNAMIC = False
# ... and from this many keys on, whatever DYNAMIC says (0: only with DYNAMIC). The grants (75%
# static, split-major) measured faster at 32k and 128k, bare and answering, but slower at 4k,
# where the grant bookkeeping outweighs the balance (benchmarks/diagnostics/step_stamps.py,
# docs/performance.md). Handed-out keys make the step's output vary in its last bits from launch
# to launch (which warp takes which grant, and so the order of its fp32 sums, varies: ~1e-7
# relative; a bf16 output may differ by one rounding step): a greedy answer can change only where
# two tokens' logits tie that closely
DYNAMIC_MIN_KEYS = 32768
GRANT_BLOCKS = 1
# with DYNAMIC: the share of the head's keys (percent) its splits walk as the static kernel
# does (each a chunk of whole 64-key tiles), before their warps take the rest in grants of
# GRANT_BLOCKS blocks. (Every grant handed out, 4 blocks each, static first grants a warp, was
# slower than static at every length: its last 64-key grants a long tail of a warp's loop at
# 128k, at 4k most warps idle behind 64-key first grants, and the grant bookkeeping in every
# block: step_stamps_h100.json, in git history)
STATIC_PERCENT = 75
# with DYNAMIC: threadgroups numbered split-major (threadgroup i: head i % BH, split i / BH), so
# each head's splits are spread over the launch's order. SMs take threadgroups in launch order and
# an SM's first-placed threadgroups issue first: their loops end sooner than those of the
# threadgroups placed last (step_stamps_h100.json's `per_threadgroup`, in git history). Numbered
# head-major (False), head 0's splits all sat in the oldest slots and the last head's all in the
# youngest, so a head's grants could not pass from slow threadgroups to fast ones (the heads' loops
# then ended unevenly, 75% static).
HEADS_INTERLEAVED = True

_HEADER = r"""
#ifndef LC_STAMP
#define LC_STAMP(i)
#define LC_GSTAMP(i)
#define LC_WSTAMP(i)
#define LC_SMSTAMP(i)
#endif
#if defined(LC_METAL)
#error "decode_attend_mma is CUDA only"
#endif
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
#define LC_BYTE(w, i) __byte_perm((w), 0u, 0x4440u | (uint32_t)(i))
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
// the whole-step variant's count of finished threadgroups per KV head (an input it updates).
// Every thread fences its partials device-wide before the arrival, and again after it. A
// release/acquire through one thread after a barrier (CUTLASS's semaphore) was tried and
// reverted: the CPU emulator runs threadgroups one after another, so it cannot test the
// ordering, and that code's GPU test run had two unnamed failures (docs/performance.md).
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

# The body around its main loop; the loop (`_LOOP`) is instantiated twice, LC_VEC_PATH true for
# 16-byte copies of the staged rows and false for word copies (`_source`).
_PRE = r"""
  constexpr int WK = P / 8;          // words of a packed 4-bit row
  constexpr int RS = WK + 4;         // staged row stride: 16-byte rows; 8 rows' LDS.64 free of
                                     // bank conflicts
  constexpr int KS = P / 16;         // 16-dim steps of the score MMA = 16-dim tiles of the output
  constexpr int CH = WK / 4;         // 16-byte chunks per row
  constexpr int NWP = NT / 32;
  constexpr int STG = 32 * RS;       // one stage: 16 key rows, then 16 value rows (NST per warp)
  constexpr int TAB = 256 * 32;      // pair table, 32 copies
  constexpr int PTW = 72;            // words of a warp's P' (8 rows of 8 words; rows 4..7 of
                                     // them 4 words further when BK: `PSK`)
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
  LC_GSTAMP(0);
  LC_STAMP(1);
  LC_SMSTAMP(16);
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
  const int split = (int)(lc_tg % (uint32_t)S);
  const int bh = (int)(lc_tg / (uint32_t)S);
  const int hh = bh % H;
  const int bb = bh / H;
  const int k0 = split * chunk;
  const int k1 = (k0 + chunk < L) ? k0 + chunk : L;

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
  // lane -> (row, chunk) of a copy; BK: each quarter-warp's eight 16-byte chunks land on
  // distinct banks (a 16-byte store is served 8 lanes at a time). Rows r and r + 4 (P = 128,
  // RS = 20 words) or rows of one parity (P = 64, RS = 12) fill the 32 banks; lane / CH (BK 0)
  // put rows 2q and 2q + 1 in quarter q: two of its chunks on one bank group, 8 wavefronts per
  // copy instead of 4. (P = 256: a quarter is one row's 8 chunks either way.)
  const int crow = !BK || CH == 8 ? lane / CH
                   : CH == 4 ? (lane >> 3) + 4 * ((lane >> 2) & 1)
                             : 8 * (lane >> 4) + ((lane >> 3) & 1) + 2 * ((lane >> 1) & 3);
  const int cpart = lane & (CH - 1);
  // (`vec_path`: 16-byte `cp.async` copies where strides and alignment allow, `vec`, else word
  // by word; the main loop below is instantiated once per way with a literal `vec_path`, so
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

  LC_STAMP(2);
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
  LC_BARRIER();
  LC_STAMP(3);
  LC_WHT_ROWS_N(qst, R, P, NT, tid)
  uint32_t qf[KS][2];
  LC_UNROLL for (int s = 0; s < KS; ++s) {
    const int d = g * P + 16 * s + 2 * t;
    qf[s][0] = g < R ? lc_pack_h2(qst[d] * qs_all, qst[d + 1] * qs_all) : 0u;
    qf[s][1] = g < R ? lc_pack_h2(qst[d + 8] * qs_all, qst[d + 9] * qs_all) : 0u;
  }
  LC_BARRIER();  // the table overwrites qst
  LC_STAMP(4);

  // 2. The pair table: entry x = (T[x & 15], T[x >> 4]) as fp16, copy l at word 32 x + l,
  // written 4 copies per 16-byte store: quad e (words 4 e .. 4 e + 3) holds entry e / 8, and
  // thread tid writes quads tid + NT i, so its entries share x & 15 (NT a multiple of 128) and
  // walk x >> 4 (TAB / 4 / NT stores a thread, 16 at 4 warps; one store per entry copy was 64,
  // most of a short split's time)
  static_assert(NT % 128 == 0, "a thread's pair-table entries share their low code");
  {
    const float lo = table[(tid >> 3) & 15];
    LC_UNROLL for (int i = 0; i < TAB / 4 / NT; ++i) {
      const int x = (tid + NT * i) >> 3;
      LC_ST_X4(tab + 4 * (tid + NT * i), lc_pack_h2(lo, table[x >> 4]));
    }
  }
  LC_BARRIER();  // the table is written
  LC_STAMP(5);

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
  // P' row r starts at word 8 r + PSK(r): with BK, rows 4..7 four words (banks) on, so that
  // the stores of rows 2t (t = 0..3) and the loads of rows g (g = 0..7) each hit 32 distinct
  // banks (without: rows r and r + 4 share their banks, two wavefronts per access)
#define PSK(r) (BK ? 4 * (((r) >> 2) & 1) : 0)
  // (loop-invariant: this lane's P' offsets, halfwords for the stores, words for the loads)
  const int pso = (2 * t) * 16 + 2 * PSK(2 * t) + g;
  const int plo = g * 8 + PSK(g) + t;
"""

_LOOP = r"""  for (int it = 0; kb < k1; ++it, kb += STEP) {
    LC_HALF nn[4] = {nc[0], nc[1], nc[2], nc[3]};  // (the last block: never read)
    if (kb + (NST - 1) * STEP < k1)
      stage(kb + (NST - 1) * STEP, (it + NST - 1) % NST, LC_VEC_PATH);
    if (kb + STEP < k1) norms(kb + STEP, nn);
    LC_CP_COMMIT();  // (an empty group past the split: the count stays in step)
    LC_CP_WAIT(NST - 1);  // this block's rows have landed (this lane's copies)
    LC_SYNCWARP();        // and every lane's; also the compiler fence for the stage reads below
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

    // values: a register of the V^T operand is one dim of keys (2t, 2t + 1) or (2t + 8, 2t + 9).
    // Its row m of tile j is the dim at word VW(j, m), nibble VN(j, m) (see the top): this
    // thread reads NSL words of each of its 4 key rows once per block, and each key pair's
    // words become two words of pair-table indices, one byte per nibble position.
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
  }
"""

_POST = r"""  LC_CP_WAIT0();

  // 3. The 4 warps' states merged: l over the 8 lanes of a row, then through shared memory.
  LC_UNROLL for (int o = 4; o < 32; o <<= 1) {
    l0 += lc_shfl_xor(l0, o);
    l1 += lc_shfl_xor(l1, o);
  }
  LC_WSTAMP(12 + warp);
  LC_BARRIER();  // every warp is done with the table and its stages
  LC_STAMP(6);
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

# The partials' kernel writes the split's state as it is; the whole step's first adds its share
# of the exact tokens (`_EXACT_SPLIT`)
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


# The write with the exact tokens (the whole step's, and the partials' when they are given): this
# split's share of the exact tokens (sink, then window; centered, in the original frame) joins
# its state, so that the exact tokens are spread over every split of the head and attended while
# the others' blocks stream (the finish, or the last threadgroup's tail, only merges).
# Split s takes exact keys s * per .. (s + 1) * per - 1 of the E, per = ceil(E / S), in rounds
# of XK: warp w scores keys w, w + NWP, ... of a round (its lanes split the dims: whole-row
# loads, one warp sum per row) and turns their values into the value codec's frame
# (R_v v = H (signs v) / sqrt(P): the butterfly's low five stages across lanes, the rest within
# a lane's dims lane + 32 i); thread t then folds the round into the accumulators of its dims
# t + NT j.
_EXACT_SPLIT = r"""
  LC_STAMP(11);
  constexpr int DL = P / 32;
  constexpr int XK = 32;
  constexpr int PD = (P + NT - 1) / NT;  // dims per thread in the fold: tid + NT j
  static_assert(NWP * 8 * P + XK * (P + R) <= TAB + NWP * NST * STG, "a round fits the stages");
  float* xv = red + NWP * 8 * P;  // a round's rotated values [key][P]
  float* xs = xv + XK * P;        // and its scores [key][R] (base 2)
  const int ns = HAS_SINK ? sink_k_shape[2] : 0;
  const int E = lc_exact_n[0];  // read with q (`_EXACT_COUNT`)
  const int per = (E + S - 1) / S;
  const int e0 = LC_MIN_I(split * per, E);
  const int e1 = LC_MIN_I(e0 + per, E);
  float me[R], le[R], ae[R][PD];
  LC_UNROLL for (int r = 0; r < R; ++r) {
    me[r] = -LC_INF;
    le[r] = 0.0f;
    LC_UNROLL for (int j = 0; j < PD; ++j) ae[r][j] = 0.0f;
  }
  if (e0 < e1) {
    float qr[R][DL];
    float sv[DL];
    LC_UNROLL for (int r = 0; r < R; ++r) {
      LC_UNROLL for (int i = 0; i < DL; ++i)
        qr[r][i] = LC_TOF(q[qo + r * q_strides[2] + (lane + 32 * i) * q_strides[3]]) * scales[0];
    }
    LC_UNROLL for (int i = 0; i < DL; ++i) sv[i] = signs[lane + 32 * i] * scales[1];
    const int64_t sko = bb * sink_k_strides[0] + hh * sink_k_strides[1];
    const int64_t svo = bb * sink_v_strides[0] + hh * sink_v_strides[1];
    const int64_t wko = bb * win_k_strides[0] + hh * win_k_strides[1];
    const int64_t wvo = bb * win_v_strides[0] + hh * win_v_strides[1];
    for (int x0 = e0; x0 < e1; x0 += XK) {
      const int nk = LC_MIN_I(XK, e1 - x0);
      // two keys a warp at a time, both rows' loads issued before either is used (one round
      // trip for the pair; past nk the round's last key is loaded again, unused)
      for (int j0 = warp; j0 < nk; j0 += 2 * NWP) {  // warp-uniform
        float kv2[2][DL], vv2[2][DL];
        LC_UNROLL for (int u = 0; u < 2; ++u) {
          const int e = x0 + LC_MIN_I(j0 + u * NWP, nk - 1);
          if (e < ns) {
            LC_UNROLL for (int i = 0; i < DL; ++i) {
              const int64_t o = (int64_t)e * sink_k_strides[2]
                                + (lane + 32 * i) * sink_k_strides[3];
              kv2[u][i] = LC_TOF(sink_k[sko + o]);
              vv2[u][i] = LC_TOF(sink_v[svo + (int64_t)e * sink_v_strides[2]
                                        + (lane + 32 * i) * sink_v_strides[3]]);
            }
          } else {
            const int w = e - ns;
            LC_UNROLL for (int i = 0; i < DL; ++i) {
              kv2[u][i] = LC_TOF(win_k[wko + (int64_t)w * win_k_strides[2]
                                       + (lane + 32 * i) * win_k_strides[3]]);
              vv2[u][i] = LC_TOF(win_v[wvo + (int64_t)w * win_v_strides[2]
                                       + (lane + 32 * i) * win_v_strides[3]]);
            }
          }
        }
        LC_UNROLL for (int u = 0; u < 2; ++u) {
          const int j = j0 + u * NWP;
          if (j >= nk) break;  // (warp-uniform)
          float* kv = kv2[u];
          float* vv = vv2[u];
          LC_UNROLL for (int r = 0; r < R; ++r) {
            float part = 0.0f;
            LC_UNROLL for (int i = 0; i < DL; ++i) part += qr[r][i] * kv[i];
            const float sr = lc_simd_sum(part);
            if (lane == 0) xs[j * R + r] = sr;
          }
          LC_UNROLL for (int i = 0; i < DL; ++i) vv[i] *= sv[i];
          LC_UNROLL for (int h = 1; h < 32; h <<= 1) {
            const bool upper = (lane & h) != 0;
            LC_UNROLL for (int i = 0; i < DL; ++i) {
              const float o = lc_shfl_xor(vv[i], h);
              vv[i] = upper ? o - vv[i] : vv[i] + o;
            }
          }
          LC_UNROLL for (int h = 1; h < DL; h <<= 1) {
            LC_UNROLL for (int i = 0; i < DL; ++i) {
              if ((i & h) == 0) {
                const float a = vv[i];
                const float b = vv[i + h];
                vv[i] = a + b;
                vv[i + h] = a - b;
              }
            }
          }
          LC_UNROLL for (int i = 0; i < DL; ++i) xv[j * P + lane + 32 * i] = vv[i];
        }
      }
      LC_BARRIER();
      LC_UNROLL for (int r = 0; r < R; ++r) {
        float tm = -LC_INF;
        for (int j = 0; j < nk; ++j) tm = LC_MAX(tm, xs[j * R + r]);
        const float mn = LC_MAX(me[r], tm);  // finite: the round has a key
        const float alpha = lc_ex2(me[r] - mn);
        float a[PD], l = 0.0f;
        LC_UNROLL for (int i = 0; i < PD; ++i) a[i] = 0.0f;
        for (int j = 0; j < nk; ++j) {
          const float p = lc_ex2(xs[j * R + r] - mn);
          LC_UNROLL for (int i = 0; i < PD; ++i) {
            if (tid + NT * i < P) a[i] += p * xv[j * P + tid + NT * i];
          }
          l += p;
        }
        LC_UNROLL for (int i = 0; i < PD; ++i) ae[r][i] = ae[r][i] * alpha + a[i];
        le[r] = le[r] * alpha + l;
        me[r] = mn;
      }
      LC_BARRIER();  // the next round rewrites xv and xs
    }
  }
  // the split's state: its compressed keys' (the warps merged) with its exact keys'
  LC_UNROLL for (int r = 0; r < R; ++r) {
    float M = -LC_INF;
    LC_UNROLL for (int w = 0; w < NWP; ++w) M = LC_MAX(M, mlb[w * 8 + r]);
    const float Mt = LC_MAX(M, me[r]);
    const float fc = M == -LC_INF ? 0.0f : LC_EXP2(M - Mt);
    const float fe = me[r] == -LC_INF ? 0.0f : LC_EXP2(me[r] - Mt);
    LC_UNROLL for (int i = 0; i < PD; ++i) {
      const int dd = tid + NT * i;
      if (dd < P) {
        float a = 0.0f;
        LC_UNROLL for (int w = 0; w < NWP; ++w) a += red[(w * 8 + r) * P + dd];
        acc_out[so * (R * P) + r * P + dd] = a * fc + ae[r][i] * fe;
      }
    }
    if (tid == 0) {
      float l = 0.0f;
      LC_UNROLL for (int w = 0; w < NWP; ++w) {
        const float mw = mlb[w * 8 + r];
        if (mw != -LC_INF) l += mlb[NWP * 8 + w * 8 + r] * LC_EXP2(mw - M);
      }
      m_out[so * R + r] = Mt == -LC_INF ? -LC_INF : Mt * 0.6931471805599453f;  // natural log
      l_out[so * R + r] = l * fc + le[r] * fe;
    }
  }
"""

# With the exact tokens (`_EXACT_SPLIT`): their count (the sink's, plus the window's valid slots,
# an input the cache update wrote) is read by thread 0 beside q's staging loads, into shared
# memory, so its round trip passes with q's instead of starting the split's exact work after
# the main loop (the exact keys' addresses wait on it)
_EXACT_COUNT = (
    "  LC_BARRIER();\n  LC_STAMP(3);\n",
    """  LC_SHARED int lc_exact_n[1];
  if (tid == 0) lc_exact_n[0] = (HAS_SINK ? sink_k_shape[2] : 0) + (HAS_WIN ? win_n[0] : 0);
  LC_BARRIER();
  LC_STAMP(3);
""")


def _source(write: str) -> str:
    """The body: the main loop once per staging variant, chosen by `vec` at run time, then
    `write` (the split's state to its outputs; with the exact tokens, their count read in the
    prologue, `_EXACT_COUNT`)."""
    pre = _PRE.replace(*_EXACT_COUNT) if write is _EXACT_SPLIT else _PRE
    return (pre + "  if (vec) {\n" + _LOOP.replace("LC_VEC_PATH", "true")
            + "  } else {\n" + _LOOP.replace("LC_VEC_PATH", "false") + "  }\n" + _POST
            + write)


_SPEC = KernelSpec(
    name=NAME,
    inputs=("q", "k_idx", "k_norm", "v_idx", "v_norm", "table", "params", "scales", "q_signs"),
    outputs=("m_out", "l_out", "acc_out"),
    row_contiguous=False,
    header=_HEADER,
    source=_source(_WRITE),
)

_SPECS: dict = {}
_EXACT_INPUTS = ("sink_k", "sink_v", "win_k", "win_v", "win_n", "signs")


def shared_bytes(p: int) -> int:
    """Dynamic shared memory of one threadgroup at head dim p: the pair table, each warp's stages
    of 16 key and 16 value rows, P' and the merge's m and l."""
    rs = p // 8 + 4
    return 4 * (256 * 32 + WARPS * STAGES * 32 * rs + WARPS * 72 + 2 * WARPS * 8)


def resident(p: int) -> int:
    """Threadgroups per SM the launch is sized for, and the register cap fits: 16 warps of 128
    registers (12 of 168 at P = 256, whose fragments need them), as shared memory allows (one
    KiB per threadgroup is the driver's). At P = 128 with the defaults: 4 (55 KiB each).
    `RESIDENT`, when set, instead of the 16 warps at P <= 128 (as shared memory allows; P = 256's
    fragments need their 168 registers)."""
    warps = (RESIDENT if p <= 128 else 0) or (16 if p <= 128 else 12) // WARPS
    return max(1, min(warps, SMEM_PER_SM // (shared_bytes(p) + 1024)))


def _spec(p: int, exact: bool = False) -> KernelSpec:
    """The partials' kernel at head dim p; `exact`: the variant that folds the exact tokens into
    the splits' states (`_EXACT_SPLIT`)."""
    key = (p, WARPS, STAGES, RESIDENT, exact)
    if key not in _SPECS:
        bounds = da._min_blocks_header(resident(p), 32 * WARPS)
        extra = (dict(inputs=_SPEC.inputs + _EXACT_INPUTS, source=_source(_EXACT_SPLIT))
                 if exact else {})
        _SPECS[key] = dataclasses.replace(_SPEC, shared_memory=shared_bytes(p),
                                          header=_HEADER + bounds, **extra)
    return _SPECS[key]


def applies(p: int, rows: int, key_codec, value_codec) -> bool:
    """Whether a decode step's partials can run here: a CUDA backend (or an executor standing in
    for it), `ENABLED`, single-stage 4-bit keys and values sharing one codebook (the pair table),
    no QJL, D = P in DIMS, 1..8 rows."""
    kc, vc = key_codec, value_codec
    return (ENABLED and backend() == "cuda" and p in DIMS and 1 <= rows <= MAX_ROWS
            and kc.rvq is None and vc.rvq is None and not kc.spec.qjl and not vc.spec.qjl
            and kc.spec.bits == 4 and vc.spec.bits == 4 and kc.codebook is vc.codebook
            and kc.dim == p and vc.dim == p and kc.padded_dim == p and vc.padded_dim == p)


def splits(length: int, bh: int, p: int = 128) -> tuple[int, int]:
    """(chunk, splits): chunks of whole 64-key tiles, about one wave of threadgroups in all, each
    warp walking at least MIN_WARP_BLOCKS blocks (a split's fixed costs, the pair table, q's
    rotation, the warps' merge, and the finish's merge of every split, against its blocks)."""
    tile = BLOCK * WARPS
    tiles = groups(length, tile)
    want = max(1, min(tiles // max(1, MIN_WARP_BLOCKS),
                      groups(da.SM_COUNT * resident(p) * max(1, WAVES), bh)))
    chunk = groups(tiles, want) * tile
    return chunk, groups(length, chunk)


def decode_attend_mma_partials(queries, keys, values, table, signs, *, scale, sink=None,
                               window=None, v_signs=None, valid_array=None):
    """Each split's softmax state of a decode step's rows over one 4-bit compressed segment (and,
    when given, the exact tokens, spread over the splits).

    Args:
        queries: (B, H, R, P) unrotated, any float dtype, rows grouped per KV head, R <= 8.
        keys, values: dicts with idx (B, H, L, P/8) uint32 and norm (B, H, L), as
            `VectorCodec.encode` stores them (any strides).
        table: (16,) float32, the one codebook of keys and values.
        signs: (P,) float32, the key rotation's +-1 diagonal.
        scale: score scale.
        sink, window: (keys, values) (B, H, n, P) exact centered tokens in the original frame,
            or None (as `decode_finish.decode_finish` takes them); with either, v_signs (P,)
            float32, the value rotation's diagonal, and valid_array, the window's valid slots
            (`decode_finish.count`; default: all of `window`).

    Returns:
        (m_p (B*H, S, R), l_p (B*H, S, R), acc_p (B*H, S, R, P)) float32, natural-log units, in
        the values' rotated frame: `decode_attend.decode_attend_partials`' outputs (the products
        in fp16 with fp32 accumulation, so equal to them within fp16 rounding), with the exact
        tokens' softmax state merged in (into some splits; a finish without them gives the
        step's output).
    """
    B, H, R, P = queries.shape
    L = keys["norm"].shape[2]
    if not (P in DIMS and 1 <= R <= MAX_ROWS and keys["idx"].shape[-1] == P // 8
            and values["idx"].shape[-1] == P // 8 and table.shape == (16,)):
        raise ValueError(f"decode_attend_mma takes 4-bit rows, P in {DIMS}, 1..{MAX_ROWS} rows; "
                         f"got q {queries.shape}, idx {keys['idx'].shape} / "
                         f"{values['idx'].shape}, table {table.shape}")
    kw = dict(key_bits=4, value_bits=4, scale=scale)
    sink, window, exact_arrays, exact_template = df.exact_inputs(sink, window)
    exact = sink is not None or window is not None
    if exact and valid_array is None:
        valid_array = df.count(window[0].shape[2] if window is not None else 0)

    def with_exact(parts):
        return (df.exact_into_partials(*parts, queries, sink, window, v_signs, scale, valid_array)
                if exact else parts)

    if backend() == "cpu" or L == 0:
        return with_exact(da.decode_attend_partials(queries, keys, values, table, table, signs,
                                                    **kw))
    chunk, n_split = splits(L, B * H, P)
    params = constant((L, chunk, n_split), mx.int32)
    scales = constant((scale * LOG2E, 1.0 / math.sqrt(P)), mx.float32)
    u32, f16, f32 = mx.uint32, mx.float16, mx.float32
    inputs = [queries, da._as(keys["idx"], u32), da._as(keys["norm"], f16),
              da._as(values["idx"], u32), da._as(values["norm"], f16), da._as(table, f32),
              params, scales, da._as(signs, f32)]
    # two score chains only at P = 256: at 128 the second spills under the 128-register cap
    nt = 32 * WARPS
    template = [("P", P), ("R", R), ("NT", nt), ("NST", STAGES), ("BLK", BLOCK),
                ("SC", 2 if P == 256 else 1), ("BK", int(BANKS)),
                ("QT", queries.dtype)]
    if exact:
        inputs += [*exact_arrays, valid_array, da._as(v_signs, f32)]
        template += exact_template

    def reference():
        return list(with_exact(da._reference_partials(
            n_split, da._rotate_reference(queries, signs), keys, values, table, table, **kw)))

    n = B * H * n_split
    return run(_spec(P, exact), Launch(inputs, template, (n * nt, 1, 1), (nt, 1, 1),
                                [(B * H, n_split, R), (B * H, n_split, R),
                                 (B * H, n_split, R, P)], [f32] * 3),
               reference=reference)


# The whole decode step in one launch: the partials above, then the last threadgroup of each KV
# head to finish runs `decode_finish`'s body over the head's splits (the split merge, the
# rotation back, the value mean; the exact tokens are in the splits' states, `_EXACT_SPLIT`,
# unless EXACT_IN_SPLITS is off). A count per head says which is last: every threadgroup makes
# its partials visible device-wide (fence) and adds one; the one that reads S - 1 zeroes the
# count for the next launch and, after a second fence, reads the partials of all the head's
# splits from the outputs they were written to (volatile: past L1). The count is
# an input the kernel updates and also an output of zeros (`counter_out`): the caller passes
# each launch's output to the next launch, so MLX orders any two launches that share counts
# (its CUDA graph orders kernels by the buffers they read and write, not by issue order).
# The count array holds a grant line per head after the counts (`counter_words`; the grants'
# variant, `_dynamic`, takes its keys' grants from them), whichever variant runs, so that a
# model's layers may switch between them by length with one array: each head's last
# threadgroup zeroes its head's line in `counter_out` (a count the static kernel never adds to,
# zero already) and head 0's the padding heads' lines.
# The finish's arrays live in the dynamic shared memory, after the partials are written; its
# body wants one thread per dim: P = NT (128 at 4 warps).
_TAIL = r"""
  LC_STAMP(7);
  LC_SHARED int lc_last[1];
  LC_FENCE();
  LC_BARRIER();
  if (tid == 0) {
    const int seen = lc_atomic_add(counter + bh, 1);
    lc_last[0] = seen == S - 1 ? 1 : 0;
    if (seen == S - 1) {
      lc_atomic_zero(counter + bh);
      counter_out[bh] = 0;
      if (bh == 0) {
        for (int i = q_shape[0] * H; i < counter_shape[0] / 33; ++i) counter_out[i] = 0;
      }
    }
  }
  LC_BARRIER();
  LC_STAMP(8);
  if (lc_last[0] != 0 && tid < 32) {  // the head's grant line, zeroed for the next launch
    const int n4 = counter_shape[0] / 33;  // (and head 0's: the padding heads' lines)
    counter_out[n4 + 32 * bh + tid] = 0;
    if (bh == 0) {
      for (int j = q_shape[0] * H; j < n4; ++j) counter_out[n4 + 32 * j + tid] = 0;
    }
    if (tid == 0) lc_atomic_zero(counter + n4 + 32 * bh);
  }
  if (lc_last[0] == 0) {
    LC_STAMP(9);
    LC_GSTAMP(10);
    return;
  }
  LC_FENCE();
  {
    static_assert(P == NT, "the finish's body runs one thread per dim");
    static_assert(3 * R * P + (P / 32 + 2) * R <= TAB, "the finish's arrays fit the table's space");
    constexpr int NW = P / 32;
    constexpr int RA = R;
    float* buf = reinterpret_cast<float*>(lc_smem);
    float* qs = buf + R * P;
    float* wts = qs + R * P;
    float* red = wts + P * R;
    float* mlc = red + NW * R;
#define LC_PART(p, i) ((p)[i])
    const volatile float* m_p = m_out;  // (volatile: past L1)
    const volatile float* l_p = l_out;
    const volatile float* acc_p = acc_out;
    const int64_t m_p_strides[3] = {(int64_t)S * R, R, 1};
    const int64_t l_p_strides[3] = {(int64_t)S * R, R, 1};
    const int64_t acc_p_strides[4] = {(int64_t)S * R * P, (int64_t)R * P, P, 1};
    const int m_p_shape[2] = {0, S};
    const int n = bh;
    const int r0 = 0;
    const int d = tid;
"""


def _step_source(exact_in_splits: bool) -> str:
    """The whole step's body: the partials' kernel, its write with (`_EXACT_SPLIT`) or without
    the exact tokens, the tail, and the finish's body in the tail's block: its split merge and
    end, or with the exact tokens' step as well (FIN_EXACT)."""
    if exact_in_splits:
        src = (_PARTS + _source(_EXACT_SPLIT) + _TAIL + "    constexpr bool FIN_EXACT = false;\n"
               + df.MERGE + df.NO_EXACT + df.END + "  }\n" + _END_STAMPS)
    else:
        src = (_PARTS + _source(_WRITE) + _TAIL + "    constexpr bool FIN_EXACT = true;\n"
               + df.BODY + "  }\n" + _END_STAMPS)
    for old, new, times in _FINISH_STAMPS:
        src = _sub(src, old, new, times)
    return src


# The finish's own stamps in the whole step (`STAMPS`; empty macros otherwise): 21 after the
# fence before the partials are read, 18 after the splits' maxima (the m loads, the first acc
# loads issued), 19 after the weighted acc sums (every split's acc read), 20 after the rotation
# back (before the exact tokens' merge and the output)
_FINISH_STAMPS = (
    ("""  LC_FENCE();
  {
    static_assert(P == NT,""", """  LC_FENCE();
  LC_STAMP(21);
  {
    static_assert(P == NT,""", 1),
    ("""    mx_r[r] = M;  // -inf: no split saw a key
  }
  LC_BARRIER();  // red is rewritten below
""", """    mx_r[r] = M;  // -inf: no split saw a key
  }
  LC_BARRIER();  // red is rewritten below
  LC_STAMP(18);
""", 1),
    ("""    LC_BARRIER();  // wts is rewritten by the next block (and by the exact tokens' tiles)
  }
""", """    LC_BARRIER();  // wts is rewritten by the next block (and by the exact tokens' tiles)
  }
  LC_STAMP(19);
""", 1),
    ("""  // 4. Both states merged""", """  LC_STAMP(20);
  // 4. Both states merged""", 1),
)


_END_STAMPS = "  LC_STAMP(9);\n  LC_GSTAMP(10);\n"

# `DYNAMIC`: the whole step's text with part of its keys handed out while it runs. Each split
# first walks its static chunk as the static kernel does (the launch's `chunk`: STATIC_PERCENT of
# the head over its splits, whole 64-key tiles; `decode_step_mma`), with the same main loop, so
# that share costs no bookkeeping. Its warps then take the rest of the head (from gbase = S *
# chunk) in grants of GR = GB x 16 keys, in the order the head's warps ask for them: lane 0 adds
# one to the head's grant count (word n4 + 32 bh of the counter array, a 128-byte line per head;
# n4 = its size / 33); the first ticket is asked for before the static loop and each next one a
# grant ahead of need, so the atomic's latency passes under other work, and lane 0's ticket is
# broadcast when the warp's lookahead reaches its grant's end. The tail's loop keeps NA block
# starts ahead (the stages' lookahead and the norms'). The split's exact tokens stay its static
# share. The head's last threadgroup zeroes the head's grant line in `counter_out` (the next
# launch's counts); the arrival count orders it after every warp of the head has left its loops.
_DYN_SETUP = (
    """  const int k0 = split * chunk;
  const int k1 = (k0 + chunk < L) ? k0 + chunk : L;
""", """  const int k0 = split * chunk;
  int k1 = (k0 + chunk < L) ? k0 + chunk : L;  // (DYNAMIC: L in the handed-out tail)
  constexpr int GR = BLK * GB;           // keys per grant
  constexpr int NA = NST > 1 ? NST : 2;  // block starts known ahead: [0] now, [1] the norms',
                                         // [NST - 1] the stage's
  // the warp's first grant, in flight through the static loop (the head's count: `_DYN_TAIL`)
  int tick = lane == 0 ? lc_atomic_add(counter + counter_shape[0] / 33 + 32 * bh, 1) : 0;
""", 1)
# after each instance of the main loop: the tail's set-up, then the main loop walking grants
_LOOP_END = """    LC_SYNCWARP();  // the stage and P' are rewritten by the next blocks
  }
"""
_DYN_TAIL = """  k1 = L;
  {
    const int32_t* gctr = counter + counter_shape[0] / 33 + 32 * bh;  // the head's grant count
    const int gbase = S * chunk;  // the handed-out keys start here
    int gend = 0;
    // the block after the one starting at key b in this warp's sequence (warp-uniform)
    auto next_block = [&](int b) {
      int nb = b + BLK;
      if (nb >= gend) {
        nb = gbase + (int)lc_shfl_xor((float)tick, lane) * GR;  // lane 0's ticket
        gend = nb + GR;
        if (nb < L) tick = lane == 0 ? lc_atomic_add(gctr, 1) : 0;
      }
      return nb;
    };
    int ahead[NA];
    ahead[0] = next_block(-BLK);
    LC_UNROLL for (int b = 1; b < NA; ++b) ahead[b] = next_block(ahead[b - 1]);
    kb = ahead[0];
    if (kb < k1) norms(kb, nc);
    LC_UNROLL for (int b = 0; b < NST - 1; ++b) {  // the first NST - 1 blocks' rows
      if (ahead[b] < k1) stage(ahead[b], b, LC_VEC_PATH);
      LC_CP_COMMIT();
    }
"""
_DYN_LOOP_SUBS = (
    ("  for (int it = 0; kb < k1; ++it, kb += STEP) {\n",
     "  for (int it = 0; kb < k1; ++it) {\n"),
    ("""    if (kb + (NST - 1) * STEP < k1)
      stage(kb + (NST - 1) * STEP, (it + NST - 1) % NST, """,
     """    if (ahead[NST - 1] < k1)
      stage(ahead[NST - 1], (it + NST - 1) % NST, """),
    ("    if (kb + STEP < k1) norms(kb + STEP, nn);\n",
     "    if (ahead[1] < k1) norms(ahead[1], nn);\n"),
    (_LOOP_END, """    LC_SYNCWARP();  // the stage and P' are rewritten by the next blocks
    LC_UNROLL for (int b = 0; b < NA - 1; ++b) ahead[b] = ahead[b + 1];
    ahead[NA - 1] = next_block(ahead[NA - 2]);
    kb = ahead[0];
  }
  }
"""),
)
_DYN_INTERLEAVE = (
    """  const int split = (int)(lc_tg % (uint32_t)S);
  const int bh = (int)(lc_tg / (uint32_t)S);
""", """  const int split = (int)(lc_tg / (uint32_t)(q_shape[0] * H));  // split-major
  const int bh = (int)(lc_tg % (uint32_t)(q_shape[0] * H));     // (`HEADS_INTERLEAVED`)
""", 1)


def _sub(src: str, old: str, new: str, times: int) -> str:
    if src.count(old) != times:
        raise AssertionError(f"an anchor (the dynamic variant's, the finish's stamps) is not in"
                             f" the step's text {times}"
                             f" time(s): {old.splitlines()[0]!r}")
    return src.replace(old, new)


def _dynamic(src: str) -> str:
    """`src` (the whole step's text) with part of its keys handed out while it runs (`DYNAMIC`):
    each instance of the main loop followed by the handed-out tail's loop."""
    for old, new, times in (_DYN_SETUP,) + ((_DYN_INTERLEAVE,) if HEADS_INTERLEAVED else ()):
        src = _sub(src, old, new, times)
    # the two instances of the main loop, 16-byte then word copies (`_source`)
    tails = []
    for literal in ("true", "false"):
        loop = _LOOP.replace("LC_VEC_PATH", literal)
        for old, new in _DYN_LOOP_SUBS:
            loop = _sub(loop, old, new, 1)
        tails.append(_DYN_TAIL.replace("LC_VEC_PATH", literal) + loop)
    parts = src.split(_LOOP_END)
    if len(parts) != 3:
        raise AssertionError("the dynamic variant's anchor is not in the step's text 2 time(s):"
                             " the main loop's end")
    return (parts[0] + _LOOP_END + tails[0] + parts[1] + _LOOP_END + tails[1] + parts[2])


def counter_words(n: int) -> int:
    """The counter array's size for a whole-step launch over n KV heads: a count per head (at
    least 4 words: `constant`), then a 32-word grant line per count (`_TAIL`)."""
    return max(n, 4) * 33


def hands_out(length: int) -> bool:
    """Whether a whole step over `length` compressed keys hands part of them out while it runs
    (`DYNAMIC`, `DYNAMIC_MIN_KEYS`)."""
    return bool(DYNAMIC or (DYNAMIC_MIN_KEYS and length >= DYNAMIC_MIN_KEYS))

# A benchmark's timing variant of the whole step (`STAMPS`, benchmarks/diagnostics/step_stamps.py):
# every threadgroup writes 24 words to an extra output, `stamps` (thread 0 unless said): 0 the
# global timer (ns, low 32 bits) at entry; SM clocks (low 32 bits): 1 at entry, 2 after the first
# blocks' copies are issued, 3 after q is staged, 4 after its rotation and fragments, 5 after the
# pair table, 12 + w when warp w (lane 0, w < 4) left the main loop, 6 after the main loop (every
# warp), 11 at the exact tokens' start, 7 after the split's state is written, 8 after its arrival at
# the head's count, 9 at the end (the last threadgroup: after the finish); 10 the global timer at
# the end; 16 the SM it ran on (%smid), 17 thread 0's warp slot (%warpid); the last threadgroups'
# finish (`_FINISH_STAMPS`): 21 after its fence, 18 after the splits' maxima, 19 after the weighted
# acc sums, 20 after the rotation back. The library's launches have no stamps (empty macros).
_STAMP_HEADER = r"""
#define LC_STAMP(i) do { if (lc_tid == 0u) stamps[lc_tg * 24u + (i)] = (uint32_t)clock64(); } while (0)
#define LC_WSTAMP(i) do { if (lc_lane == 0u && (i) < 16) \
    stamps[lc_tg * 24u + (i)] = (uint32_t)clock64(); } while (0)
#define LC_GSTAMP(i) do { if (lc_tid == 0u) { uint64_t lc_t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(lc_t_)); \
    stamps[lc_tg * 24u + (i)] = (uint32_t)lc_t_; } } while (0)
#define LC_SMSTAMP(i) do { if (lc_tid == 0u) { uint32_t lc_s_; \
    asm volatile("mov.u32 %0, %%smid;" : "=r"(lc_s_)); stamps[lc_tg * 24u + (i)] = lc_s_; \
    asm volatile("mov.u32 %0, %%warpid;" : "=r"(lc_s_)); stamps[lc_tg * 24u + (i) + 1] = lc_s_; \
  } } while (0)
"""
STAMP_WORDS = 24
STAMPS = False  # benchmarks/diagnostics/step_stamps.py: the timing variant (its stamps in `stamped()`)
_STAMPED: list = []  # the last timed launch's stamps (a list: no module assignment per call)


def stamped():
    """The last timing-variant launch's stamps, (threadgroups, STAMP_WORDS) uint32, or None."""
    return _STAMPED[-1] if _STAMPED else None


# The whole step's split states live in one scratch output, `parts`: m (N S R), l (N S R), then
# acc (N S R P), N = B * H, S = params[2]. One output instead of three: MLX builds a launch's
# output arrays at every step (each holding the launch's ~17 inputs and its siblings), and a
# replayed step's host time was mostly that node (benchmarks/diagnostics/plan_call.py).
_PARTS = r"""
  const int64_t lc_nsr = (int64_t)q_shape[0] * q_shape[1] * params[2] * R;
  float* m_out = parts;
  float* l_out = parts + lc_nsr;
  float* acc_out = parts + 2 * lc_nsr;
"""


STEP_NAME = "lc_decode_step_mma"

_STEP_SPEC = KernelSpec(
    name=STEP_NAME,
    inputs=_SPEC.inputs + ("sink_k", "sink_v", "win_k", "win_v", "win_n", "signs", "mean",
                           "counter"),
    outputs=("parts", "out", "counter_out"),
    row_contiguous=False,
    header=_HEADER,
    source=_step_source(True),
)

_COUNTERS: dict = {}  # B * H -> the count array the next whole-step launch takes


def fuses_finish(p: int, rows: int) -> bool:
    """Whether `decode_step_mma` takes a step of head dim p and `rows` query rows per KV head
    (where `applies` holds): FUSE_FINISH, one thread per dim (P = 32 WARPS), rows the finish
    takes, and the variant has not failed in this process."""
    return (FUSE_FINISH and p == 32 * WARPS and df.supported(p, rows)
            and not failed(STEP_NAME))


def counter(n: int) -> mx.array:
    """The count array for a whole-step launch over n = B * H KV heads: zeros, or the previous
    launch's `counter_out` (see `keep_counter`)."""
    size = counter_words(n)
    c = _COUNTERS.get((n, size))
    if c is None:
        c = _COUNTERS[(n, size)] = mx.zeros((size,), dtype=mx.int32)  # > 8 bytes: `constant`
    return c


def keep_counter(n: int, c: mx.array) -> None:
    """Pass a launch's `counter_out` on to the next launch over n heads."""
    _COUNTERS[(n, c.shape[0])] = c


def _step_spec(p: int, dynamic: bool = False) -> KernelSpec:
    key = ("step", p, WARPS, STAGES, RESIDENT, EXACT_IN_SPLITS, STAMPS, dynamic,
           dynamic and HEADS_INTERLEAVED)
    if key not in _SPECS:
        base = _spec(p)
        source = _step_source(EXACT_IN_SPLITS)
        _SPECS[key] = dataclasses.replace(
            _STEP_SPEC, shared_memory=base.shared_memory,
            header=(_STAMP_HEADER if STAMPS else "") + base.header,
            source=_dynamic(source) if dynamic else source,
            outputs=_STEP_SPEC.outputs + (("stamps",) if STAMPS else ()))
    return _SPECS[key]


def decode_step_mma(queries, keys, values, table, k_signs, sink, window, v_signs, mean, scale,
                    out_dtype, valid_array, count_in):
    """One decode step's attention in one launch: `decode_attend_mma_partials` then
    `decode_finish.decode_finish` (see there for the arguments; `valid_array`: the window's
    valid slots, `decode_finish.count`), for the shapes `fuses_finish` takes.

    Args:
        count_in: `counter(B * H)`: int32 counts of finished threadgroups per KV head, zeros.

    Returns:
        (out (B, H, R, P) in out_dtype, the count array for the next launch: pass it to
        `keep_counter`).
    """
    B, H, R, P = queries.shape
    L = keys["norm"].shape[2]
    sink, window, exact_arrays, exact_template = df.exact_inputs(sink, window)

    def reference():
        parts = da.decode_attend_partials(queries, keys, values, table, table, k_signs,
                                          key_bits=4, value_bits=4, scale=scale)
        out = df.decode_finish_reference(*parts, queries, sink, window, v_signs, mean, scale,
                                         out_dtype, valid_array)
        stamps = [mx.zeros((n, STAMP_WORDS), dtype=mx.uint32)] if STAMPS else []
        return [mx.concatenate([p.reshape(-1) for p in parts]), out, count_in, *stamps]

    chunk, n_split = splits(L, B * H, P)
    n = B * H * n_split
    dynamic = hands_out(L)
    if dynamic:  # each split's static chunk (`_dynamic`): whole tiles, the rest handed out
        tile = BLOCK * WARPS
        chunk = L * STATIC_PERCENT // 100 // n_split // tile * tile
    if backend() == "cpu" or L == 0:
        return tuple(reference()[1:3])
    if not fuses_finish(P, R) or not applies_shape(queries, keys, values, table):
        raise ValueError(f"decode_step_mma does not take q {queries.shape} at {WARPS} warps")
    params = constant((L, chunk, n_split), mx.int32)
    scales = constant((scale * LOG2E, 1.0 / math.sqrt(P)), mx.float32)
    u32, f16, f32 = mx.uint32, mx.float16, mx.float32
    inputs = [queries, da._as(keys["idx"], u32), da._as(keys["norm"], f16),
              da._as(values["idx"], u32), da._as(values["norm"], f16), da._as(table, f32),
              params, scales, da._as(k_signs, f32), *exact_arrays, valid_array,
              da._as(v_signs, f32), mean, count_in]
    nt = 32 * WARPS
    template = [("P", P), ("R", R), ("NT", nt), ("NST", STAGES), ("BLK", BLOCK),
                ("SC", 2 if P == 256 else 1), ("BK", int(BANKS)), ("QT", queries.dtype),
                *exact_template,
                ("OT", out_dtype), ("XS", int(EXACT_IN_SPLITS)),  # (the two sources: one name, other templates)
                ("SW", int(df.SCORE_BY_WARP))]  # (the tail's exact tokens, XS = 0)
    if count_in.shape != (counter_words(B * H),):
        raise ValueError(f"the whole step takes counter({B * H}), not {count_in.shape}")
    if dynamic:
        template.append(("GB", GRANT_BLOCKS))
    shapes = ([(n * R * (P + 2),), (B, H, R, P), count_in.shape]
              + ([(n, STAMP_WORDS)] if STAMPS else []))
    dtypes = [f32, out_dtype, mx.int32] + ([mx.uint32] if STAMPS else [])
    outs = run(_step_spec(P, dynamic), Launch(inputs, template, (n * nt, 1, 1), (nt, 1, 1),
                                              shapes, dtypes), reference=reference)
    if STAMPS:
        _STAMPED[:] = [outs[3]]
    return outs[1], outs[2]


def applies_shape(queries, keys, values, table) -> bool:
    _, _, R, P = queries.shape
    return (P in DIMS and 1 <= R <= MAX_ROWS and keys["idx"].shape[-1] == P // 8
            and values["idx"].shape[-1] == P // 8 and table.shape == (16,))


# a decode step's kept launch depends on this module's tunables (`attend_step._env`)
watch(__name__)
