"""A prefill chunk's cache update for one side (keys or values) in one launch.

For a chunk of raw vectors x (B, H, N, D) as the model hands them to the cache (after rope, any
float dtype, any strides) and the cache's centering mean mu (B, H, 1, D), every row is

    c    = x - mu                              (float32)
    norm = ||c||,  y = H (signs * c / norm) / sqrt(D)      (what `hadamard_quantize` does)
    code = #{k : y > boundaries[k]}, packed b bits each (packing.py's layout)
    rot  = y * norm, rounded to fp16           (c in the codec's rotated frame: what fp16 SDPA reads)

and the outputs append the chunk to what the cache already holds, so the caller issues no copies:

    rot  (B, H, W + N, D) float16  = [prev; rot of the chunk]         prev: the window's rotated rows
    idx  (B, H, T + N, b*D/32) uint32 = [old_idx; codes of the chunk]  old_*: the encoded buffer
    norm (B, H, T + N) float16     = [old_norm; norms of the chunk]

This replaces ~40 launches per layer and chunk of the unfused path (centering casts and
subtractions, the window's concatenation, copies of slices, the quantize kernel, the rotations
of the exact rows for SDPA, the tail's growth and writes: `kvcache/turbo.py`, whose prefill
chunks are bound by the host's cost per launch: `benchmarks/diagnostics/prefill_timeline.py`,
docs/performance.md).
The codes and norms equal `hadamard_quantize`'s of c bit for bit (its row code,
`hadamard_quant.ENCODE_ROW`, is shared); rot equals the rotation of c up to fp32 rounding before the fp16 cast.

Inputs: x (B, H, N, D) any float, mu (B, H, 1, D) float32, signs (D,) float32, boundaries
(2^b - 1,) float32, prev (B, H, W, D) float16, old_idx (B, H, T, b*D/32) uint32, old_norm
(B, H, T) float16 (any strides; W = 0 or T = 0: one-element stand-ins), params (2,) int32 =
(W, T). D in 64/128/256.

Thread plan: threadgroups of D threads. The first B*H*N groups encode one row each (one
coordinate per thread, `hadamard_quantize`'s code: simdgroup sums for the norm, the butterfly
in threadgroup memory, codes packed by b*D/32 threads). The remaining groups copy: every thread
moves CPT elements of the concatenated copy list (old idx words, old norms, prev rows), D apart,
so consecutive threads touch consecutive elements.
"""

from __future__ import annotations

import mlx.core as mx

from ._prelude import KernelSpec, Launch, constant, groups, run
from .hadamard_quant import ENCODE_ROW, applies, hadamard_quantize_reference, scaled
from .rotate import rotate_reference

CPT = 8  # elements each copying thread moves

_SPEC = KernelSpec(
    name="lc_prefill_encode",
    inputs=("x", "mu", "signs", "boundaries", "prev", "old_idx", "old_norm", "params"),
    outputs=("rot", "idx", "norm"),
    row_contiguous=False,
    source=r"""
  constexpr int WD = B * D / 32;
  LC_SHARED float buf[D];
  LC_SHARED float red[D / 32];
  LC_SHARED uint32_t codes[D];
  const int W = params[0];
  const int T = params[1];
  const int H = x_shape[1];
  const int N = x_shape[2];
  const uint32_t nbh = (uint32_t)x_shape[0] * (uint32_t)H;
  const uint32_t n_enc = nbh * (uint32_t)N;
  const uint32_t g = lc_tg;
  const uint32_t t = lc_tid;
  if (g < n_enc) {
    const int l = (int)(g % (uint32_t)N);
    const uint32_t bh = g / (uint32_t)N;
    const int hh = (int)(bh % (uint32_t)H);
    const int bb = (int)(bh / (uint32_t)H);
    const float xv = LC_TOF(x[bb * x_strides[0] + hh * x_strides[1] + l * x_strides[2]
                              + (int)t * x_strides[3]])
                     - mu[bb * mu_strides[0] + hh * mu_strides[1] + (int)t * mu_strides[3]];
"""
    + ENCODE_ROW
    + r"""
    rot[((int64_t)bh * (W + N) + W + l) * D + t] = LC_F2H(y * nrm);
    const int64_t row = (int64_t)bh * (T + N) + T + l;
    if (t < (uint32_t)WD) {
      const uint32_t gi = t / (uint32_t)B;
      const uint32_t k = t % (uint32_t)B;
      uint32_t word;
      LC_PACK_WORD(word, (codes + 32u * gi), k, B);
      idx[row * WD + t] = word;
    }
    if (t == 0u) norm[row] = LC_F2H(LC_MIN(nrm, 65504.0f));
  } else {
    const uint32_t n_idx = nbh * (uint32_t)T * (uint32_t)WD;
    const uint32_t n_norm = nbh * (uint32_t)T;
    const uint32_t n_prev = nbh * (uint32_t)W * (uint32_t)D;
    const uint32_t base = (g - n_enc) * (uint32_t)(D * CPT) + t;
    LC_UNROLL for (int k = 0; k < CPT; ++k) {
      uint32_t i = base + (uint32_t)(k * D);
      if (i < n_idx) {
        const uint32_t w = i % (uint32_t)WD;
        const uint32_t r = i / (uint32_t)WD;
        const uint32_t tt = r % (uint32_t)T;
        const uint32_t bh = r / (uint32_t)T;
        const int hh = (int)(bh % (uint32_t)H);
        const int bb = (int)(bh / (uint32_t)H);
        idx[((int64_t)bh * (T + N) + tt) * WD + w] =
            old_idx[bb * old_idx_strides[0] + hh * old_idx_strides[1] + (int64_t)tt * old_idx_strides[2]
                    + (int64_t)w * old_idx_strides[3]];
        continue;
      }
      i -= n_idx;
      if (i < n_norm) {
        const uint32_t tt = i % (uint32_t)T;
        const uint32_t bh = i / (uint32_t)T;
        const int hh = (int)(bh % (uint32_t)H);
        const int bb = (int)(bh / (uint32_t)H);
        norm[(int64_t)bh * (T + N) + tt] =
            old_norm[bb * old_norm_strides[0] + hh * old_norm_strides[1]
                     + (int64_t)tt * old_norm_strides[2]];
        continue;
      }
      i -= n_norm;
      if (i < n_prev) {
        const uint32_t d = i % (uint32_t)D;
        const uint32_t r = i / (uint32_t)D;
        const uint32_t ww = r % (uint32_t)W;
        const uint32_t bh = r / (uint32_t)W;
        const int hh = (int)(bh % (uint32_t)H);
        const int bb = (int)(bh / (uint32_t)H);
        rot[((int64_t)bh * (W + N) + ww) * D + d] =
            prev[bb * prev_strides[0] + hh * prev_strides[1] + (int64_t)ww * prev_strides[2]
                 + (int64_t)d * prev_strides[3]];
      }
    }
  }
""",
)


def prefill_encode_reference(
    x, mu, signs, boundaries, prev=None, old_idx=None, old_norm=None
) -> tuple[mx.array, mx.array, mx.array]:
    """Pure-MLX oracle (and CPU path): arguments and results as `prefill_encode`."""
    B, H, N, D = x.shape
    c = x.astype(mx.float32) - mu.astype(mx.float32)
    idx, norm = hadamard_quantize_reference(c.reshape(-1, D), signs, boundaries)
    idx, norm = idx.reshape(B, H, N, -1), norm.reshape(B, H, N)
    rot = rotate_reference(c, signs) if c.size else c.astype(mx.float16)
    if prev is not None:
        rot = mx.concatenate([prev.astype(mx.float16), rot], axis=2)
    if old_idx is not None:
        idx = mx.concatenate([old_idx, idx], axis=2)
        norm = mx.concatenate([old_norm.astype(mx.float16), norm], axis=2)
    return rot, idx, norm


def prefill_encode(
    x: mx.array,
    mu: mx.array,
    signs: mx.array,
    boundaries: mx.array,
    prev: mx.array | None = None,
    old_idx: mx.array | None = None,
    old_norm: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Center, rotate, quantize and append a chunk (see the module docstring).

    Args:
        x: (B, H, N, D) the chunk's raw keys or values, any float dtype, N >= 1.
        mu: (B, H, 1, D) the centering mean.
        signs: (D,) the rotation's +-1 diagonal; boundaries: (2^b - 1,) the codebook's.
        prev: optional (B, H, W, D) fp16 rows to put before the chunk's rotated rows.
        old_idx, old_norm: optional (B, H, T, b*D/32) / (B, H, T): encoded rows to put first.

    Returns:
        (rot (B, H, W + N, D) float16, idx (B, H, T + N, b*D/32) uint32, norm (B, H, T + N)
        float16).
    """
    B, H, N, D = x.shape
    bits = (boundaries.shape[0] + 1).bit_length() - 1
    wd = bits * D // 32
    if signs.shape != (D,) or (1 << bits) - 1 != boundaries.shape[0] or not 1 <= bits <= 8 or mu.shape != (B, H, 1, D):
        raise ValueError(f"x {x.shape}, mu {mu.shape}, signs {signs.shape}, boundaries {boundaries.shape} do not fit together")
    if (old_idx is None) != (old_norm is None):
        raise ValueError("old_idx and old_norm come together")
    w = prev.shape[2] if prev is not None else 0
    t = old_idx.shape[2] if old_idx is not None else 0
    if prev is not None and prev.shape != (B, H, w, D):
        raise ValueError(f"prev {prev.shape} does not match ({B}, {H}, ., {D})")
    if old_idx is not None and (old_idx.shape != (B, H, t, wd) or old_norm.shape != (B, H, t)):
        raise ValueError(
            f"old_idx {old_idx.shape} / old_norm {old_norm.shape} do not hold {bits}-bit codes of {D} dims for ({B}, {H})"
        )
    kw = dict(prev=prev, old_idx=old_idx, old_norm=old_norm)
    n_copy = B * H * (t * wd + t + w * D)
    if not applies(D) or N == 0 or B * H * (N + t + w) * max(wd, D) >= 2**31:
        return prefill_encode_reference(x, mu, signs, boundaries, **kw)
    spec = scaled(_SPEC, D)
    n_groups = B * H * N + groups(n_copy, D * CPT)
    # stand-ins and parameters are cached arrays: a new one per call is a launch (a fill) or a
    # host-to-device copy, per layer and chunk
    inputs = [
        x,
        mu.astype(mx.float32),
        signs.astype(mx.float32),
        boundaries.astype(mx.float32),
        prev.astype(mx.float16) if w else constant((0.0,), mx.float16),
        old_idx.astype(mx.uint32) if t else constant((0,), mx.uint32),
        old_norm.astype(mx.float16) if t else constant((0.0,), mx.float16),
        constant((w, t), mx.int32),
    ]
    return tuple(
        run(
            spec,
            Launch(
                inputs,
                [("D", D), ("B", bits), ("CPT", CPT)],
                (n_groups * D, 1, 1),
                (D, 1, 1),
                [(B, H, w + N, D), (B, H, t + N, wd), (B, H, t + N)],
                [mx.float16, mx.uint32, mx.float16],
            ),
            reference=lambda: prefill_encode_reference(x, mu, signs, boundaries, **kw),
        )
    )
