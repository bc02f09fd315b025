"""One decode step's attention on tensor cores with its exact tokens (CUDA): the whole step in one launch.

Built on `decode_attend_mma`'s body (4-bit keys and values, <= 8 rows per KV head, P in 64 / 128
/ 256). Each split also takes its share of the exact tokens (the sink, the question and the answer
so far: ceil(E / S) keys), scored a warp per key, their values turned into the value frame with a
lane butterfly, folded into the split's state before it is written (`_EXACT_SPLIT`): attended by
one threadgroup per head, they had been a large part of an answer's step (docs/performance.md).

- `decode_step_mma` (P = 128, one thread per dim of the finish): the whole step in one launch;
  the last threadgroup of each KV head merges the head's splits, rotates back and adds the
  value mean (`decode_finish`'s body). From DYNAMIC_MIN_KEYS keys on (`hands_out`) part of each
  head's keys are handed out while it runs (`decode_attend_mma`'s DYN): each split first walks a
  static chunk (STATIC_PERCENT of the head), then its warps take grants of GRANT_BLOCKS blocks
  from a count per head, so that warps on busier SMs walk fewer blocks.
- `decode_step_mma_partials` (P = 64 / 256): the two-launch step's first launch, the split states
  with the exact tokens folded in; `decode_finish` then only merges.

The reference of both is the portable kernel's (`decode_attend.decode_attend_partials`) then
`decode_finish`'s. CUDA only, as `decode_attend_mma`; the emulator (tests/kernel_emu.py) runs it.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, failed, run
from . import decode_attend as da
from . import decode_attend_mma as dm
from . import decode_finish as df

# From this many keys on, the whole step hands part of them out while it runs (faster at 32k
# and 128k, slower at 4k where the grants' bookkeeping outweighs the balance:
# docs/performance.md). Which warp takes which grant varies from launch to launch, and so the
# order of its fp32 sums: the output may vary in its last bits (a bf16 output by one rounding).
DYNAMIC_MIN_KEYS = 32768
GRANT_BLOCKS = 1  # 16-key blocks per grant
STATIC_PERCENT = 75  # the share of the head's keys its splits walk as static chunks first

# Between q's loads and their barrier (`decode_attend_mma.PRE`, `MAIN`): their count (the
# sink's, plus the window's valid slots, an input the cache update wrote), read by thread 0 into
# shared memory, so that its round trip passes with q's (the exact keys' addresses wait on it)
_EXACT_COUNT = r"""
  LC_SHARED int lc_exact_n[1];
  if (tid == 0) lc_exact_n[0] = (HAS_SINK ? sink_k_shape[2] : 0) + (HAS_WIN ? win_n[0] : 0);
"""


# The write with the exact tokens (sink, then window; centered, in the original frame): split s
# takes exact keys s * per .. (s + 1) * per - 1 of the E, per = ceil(E / S), in rounds of XK:
# warp w scores keys w, w + NWP, ... of a round (its lanes split the dims: whole-row loads, one
# warp sum per row) and turns their values into the value codec's frame (R_v v = H (signs v) /
# sqrt(P): the butterfly's low five stages across lanes, the rest within a lane's dims
# lane + 32 i); thread t then folds the round into the accumulators of its dims t + NT j.
_EXACT_SPLIT = r"""
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

_EXACT_INPUTS = ("sink_k", "sink_v", "win_k", "win_v", "win_n", "signs")
# the partials' kernel (`decode_attend_mma`'s name: a failure sends the step to the portable one)
# with the exact tokens
_PARTIALS_SOURCE = dm.NO_GRANTS + dm.PRE + _EXACT_COUNT + dm.MAIN + _EXACT_SPLIT


def _f32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def decode_step_mma_partials(queries, keys, values, table, signs, *, scale, sink, window, v_signs, valid_array=None):
    """Each split's softmax state of a decode step's rows over one 4-bit compressed segment and
    the exact tokens, spread over the splits (`decode_attend_mma.decode_attend_mma_partials`
    where there are none).

    Args:
        queries, keys, values, table, signs, scale: as `decode_attend_mma_partials` takes them.
        sink, window: (keys, values) (B, H, n, P) exact centered tokens in the original frame,
            or None (as `decode_finish.decode_finish` takes them).
        v_signs: (P,) float32, the value rotation's diagonal.
        valid_array: the window's valid slots (`decode_finish.count`; default: all of `window`).

    Returns:
        (m_p, l_p, acc_p) as `decode_attend_mma_partials` returns them, with the exact tokens'
        softmax state merged in (into some splits; a finish without them gives the step's
        output).
    """
    B, H, R, P = queries.shape
    L = keys["norm"].shape[2]
    sink, window, exact_arrays, exact_template = df.exact_inputs(sink, window)
    if sink is None and window is None:
        return dm.decode_attend_mma_partials(queries, keys, values, table, signs, scale=scale)
    if not dm.applies_shape(queries, keys, values, table):
        raise ValueError(f"decode_step_mma_partials does not take q {queries.shape}")
    if valid_array is None:
        valid_array = df.count(window[0].shape[2] if window is not None else 0)
    kw = dict(key_bits=4, value_bits=4, scale=scale)

    def with_exact(parts):
        return df.exact_into_partials(*parts, queries, sink, window, v_signs, scale, valid_array)

    if backend() == "cpu" or L == 0:
        return with_exact(da.decode_attend_partials(queries, keys, values, table, table, signs, **kw))
    chunk, n_split = dm.splits(L, B * H, P)
    inputs, template = dm.launch_args(queries, keys, values, table, signs, scale, chunk, n_split)
    inputs += [*exact_arrays, valid_array, _f32(v_signs)]

    def reference():
        return list(with_exact(dm.reference(queries, keys, values, table, signs, scale, n_split)))

    n, nt = B * H * n_split, 32 * dm.WARPS
    shapes = [(B * H, n_split, R), (B * H, n_split, R), (B * H, n_split, R, P)]
    spec = dataclasses.replace(dm.SPEC, inputs=dm.SPEC.inputs + _EXACT_INPUTS, source=_PARTIALS_SOURCE)
    return run(
        dm.kernel_spec(P, spec),
        Launch(inputs, template + exact_template, (n * nt, 1, 1), (nt, 1, 1), shapes, [mx.float32] * 3),
        reference=reference,
    )


# The whole decode step in one launch: the partials with the exact tokens, then the last
# threadgroup of each KV head to finish runs `decode_finish`'s merge over the head's splits (the
# split merge, the rotation back, the value mean). A count per head says which is last: every
# threadgroup makes its partials visible device-wide (fence) and adds one; the one that reads
# S - 1 zeroes the count for the next launch and, after a second fence, reads the partials of
# all the head's splits (volatile: past L1). The count is an input the kernel updates and also
# an output of zeros (`counter_out`): the caller passes each launch's output to the next, so MLX
# orders any two launches that share counts (its CUDA graph orders kernels by the buffers they
# read and write, not by issue order). After the counts, the array holds a 32-word grant line
# per head (`counter_words`), whichever variant runs, so that a model's layers may switch between
# them by length with one array: each head's last threadgroup zeroes its line in `counter_out`
# and head 0's the padding heads' lines. The split states live in one scratch output, `parts`:
# m (N S R), l (N S R), then acc (N S R P), N = B * H (MLX builds a launch's output arrays at
# every step, each holding the launch's inputs: benchmarks/diagnostics/plan_call.py). The
# finish's arrays live in the dynamic shared memory; its body runs one thread per dim: P = NT.
_PARTS = r"""
  const int64_t lc_nsr = (int64_t)q_shape[0] * q_shape[1] * params[2] * R;
  float* m_out = parts;
  float* l_out = parts + lc_nsr;
  float* acc_out = parts + 2 * lc_nsr;
  const int32_t* lc_grants = counter + counter_shape[0] / 33;  // the heads' grant lines
"""

_TAIL = r"""
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
  if (lc_last[0] != 0 && tid < 32) {  // the head's grant line, zeroed for the next launch
    const int n4 = counter_shape[0] / 33;  // (and head 0's: the padding heads' lines)
    counter_out[n4 + 32 * bh + tid] = 0;
    if (bh == 0) {
      for (int j = q_shape[0] * H; j < n4; ++j) counter_out[n4 + 32 * j + tid] = 0;
    }
    if (tid == 0) lc_atomic_zero(counter + n4 + 32 * bh);
  }
  if (lc_last[0] == 0) return;
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
    constexpr bool FIN_EXACT = false;  // (the exact tokens are in the splits' states)
"""

STEP_NAME = "lc_decode_step_mma"

_STEP_SPEC = KernelSpec(
    name=STEP_NAME,
    inputs=dm.SPEC.inputs + _EXACT_INPUTS + ("mean", "counter"),
    outputs=("parts", "out", "counter_out"),
    row_contiguous=False,
    header=dm.HEADER,
    source=(_PARTS + dm.PRE + _EXACT_COUNT + dm.MAIN + _EXACT_SPLIT + _TAIL + df.MERGE + df.NO_EXACT + df.END + "  }\n"),
)

_COUNTERS: dict = {}  # B * H -> the count array the next whole-step launch takes


def counter_words(n: int) -> int:
    """The counter array's size for a whole-step launch over n KV heads: a count per head (at
    least 4 words: `constant`), then a 32-word grant line per count (`_TAIL`)."""
    return max(n, 4) * 33


def hands_out(length: int) -> bool:
    """Whether a whole step over `length` compressed keys hands part of them out while it runs
    (from DYNAMIC_MIN_KEYS on)."""
    return length >= DYNAMIC_MIN_KEYS


def fuses_finish(p: int, rows: int) -> bool:
    """Whether `decode_step_mma` takes a step of head dim p and `rows` query rows per KV head
    (where `decode_attend_mma.applies` holds): one thread per dim (P = 32 WARPS), rows the
    finish takes, and the kernel has not failed in this process."""
    return p == 32 * dm.WARPS and df.supported(p, rows) and not failed(STEP_NAME)


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


def decode_step_mma(
    queries,
    keys,
    values,
    table,
    k_signs,
    sink,
    window,
    v_signs,
    mean,
    scale,
    out_dtype,
    valid_array,
    count_in,
    *,
    dynamic: bool | None = None,
):
    """One decode step's attention in one launch: `decode_step_mma_partials` then
    `decode_finish.decode_finish` (see there for the arguments; `valid_array`: the window's
    valid slots, `decode_finish.count`), for the shapes `fuses_finish` takes.

    Args:
        count_in: `counter(B * H)`: int32 counts of finished threadgroups per KV head, zeros.
        dynamic: hand part of the keys out while the step runs (None: from DYNAMIC_MIN_KEYS
            keys on, `hands_out`; tests force it at short lengths).

    Returns:
        (out (B, H, R, P) in out_dtype, the count array for the next launch: pass it to
        `keep_counter`).
    """
    B, H, R, P = queries.shape
    L = keys["norm"].shape[2]
    sink, window, exact_arrays, exact_template = df.exact_inputs(sink, window)

    def reference():
        parts = da.decode_attend_partials(queries, keys, values, table, table, k_signs, key_bits=4, value_bits=4, scale=scale)
        out = df.decode_finish_reference(*parts, queries, sink, window, v_signs, mean, scale, out_dtype, valid_array)
        return [mx.concatenate([p.reshape(-1) for p in parts]), out, count_in]

    chunk, n_split = dm.splits(L, B * H, P)
    n = B * H * n_split
    dynamic = hands_out(L) if dynamic is None else dynamic
    if dynamic:  # each split's static chunk: whole tiles, the rest handed out
        tile = dm.BLOCK * dm.WARPS
        chunk = L * STATIC_PERCENT // 100 // n_split // tile * tile
    if backend() == "cpu" or L == 0:
        return tuple(reference()[1:3])
    if not fuses_finish(P, R) or not dm.applies_shape(queries, keys, values, table):
        raise ValueError(f"decode_step_mma does not take q {queries.shape} at {dm.WARPS} warps")
    if count_in.shape != (counter_words(B * H),):
        raise ValueError(f"the whole step takes counter({B * H}), not {count_in.shape}")
    inputs, template = dm.launch_args(queries, keys, values, table, k_signs, scale, chunk, n_split, dynamic, GRANT_BLOCKS)
    inputs += [*exact_arrays, valid_array, _f32(v_signs), mean, count_in]
    template += exact_template + [("OT", out_dtype)]
    nt = 32 * dm.WARPS
    outs = run(
        dm.kernel_spec(P, _STEP_SPEC),
        Launch(
            inputs,
            template,
            (n * nt, 1, 1),
            (nt, 1, 1),
            [(n * R * (P + 2),), (B, H, R, P), count_in.shape],
            [mx.float32, out_dtype, mx.int32],
        ),
        reference=reference,
    )
    return outs[1], outs[2]
