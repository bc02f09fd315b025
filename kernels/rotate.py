"""Rotate rows into a codec's frame, or back out of it (plus a per-group mean), in one launch.

    forward:  out = H (signs * x) / sqrt(P)                        (`RandomHadamard.forward`, P = D)
    inverse:  out = signs * H x / sqrt(P) + mean[b, h // G]        (`RandomHadamard.inverse`, then
                                                                    the value mean added back)

written in the output dtype. The GPU prefill path (`kvcache/dense_gpu.py`) rotates a chunk's
queries into the key frame before fp16 SDPA (forward, fp16 out), and the SDPA output back out of
the value frame with the value mean added, in the model's dtype (inverse). Unfused, each was
3-5 launches (casts, the sign multiply, the transform, the mean's addition), and the prefill is
bound by the host's launches.

Inputs: x (B, H, L, P) any float, any strides; signs (P,) float32; mean (B, H / G, 1, P) float32
(inverse with a mean; else a one-element stand-in). P in 64/128/256.
Output: (B, H, L, P) in `out_dtype`, contiguous.

Thread plan: one threadgroup of P threads per row, one coordinate per thread, the butterfly in
threadgroup memory (read both, barrier, write, barrier), as `hadamard_quantize`.
"""

from __future__ import annotations

import mlx.core as mx

from ._prelude import KernelSpec, Launch, constant, run
from .hadamard_quant import applies, scaled

_SPEC = KernelSpec(
    name="lc_rotate",
    inputs=("x", "signs", "mean"),
    outputs=("out",),
    row_contiguous=False,
    source=r"""
  LC_SHARED float buf[P];
  const uint32_t g = lc_tg;
  const uint32_t t = lc_tid;
  const int H = x_shape[1];
  const int L = x_shape[2];
  const int l = (int)(g % (uint32_t)L);
  const uint32_t bh = g / (uint32_t)L;
  const int hh = (int)(bh % (uint32_t)H);
  const int bb = (int)(bh / (uint32_t)H);
  float v = LC_TOF(x[bb * x_strides[0] + hh * x_strides[1] + l * x_strides[2]
                     + (int)t * x_strides[3]]);
  if (INV == 0) v *= signs[t];
  buf[t] = v;
  LC_BARRIER();
  LC_UNROLL for (uint32_t s = 1u; s < (uint32_t)P; s <<= 1) {
    const bool upper = (t & s) != 0u;
    const float a = buf[t];
    const float b = buf[upper ? t - s : t + s];
    LC_BARRIER();
    buf[t] = upper ? (b - a) : (a + b);
    LC_BARRIER();
  }
  float y = buf[t] * HSCALE;
  if (INV != 0) y *= signs[t];
  if (HAS_MEAN != 0) y += mean[bb * mean_strides[0] + (hh / G) * mean_strides[1] + (int)t * mean_strides[3]];
  out[(int64_t)g * P + t] = static_cast<OT>(y);
""",
)


def rotate_reference(
    x: mx.array, signs: mx.array, inverse: bool = False, mean: mx.array | None = None, out_dtype=mx.float16
) -> mx.array:
    """Pure-MLX oracle (and CPU path): arguments and result as `rotate`."""
    B, H, L, P = x.shape
    x = x.astype(mx.float32)
    if inverse:
        y = mx.hadamard_transform(x, scale=P**-0.5) * signs
    else:
        y = mx.hadamard_transform(x * signs, scale=P**-0.5)
    if mean is not None:
        hm = mean.shape[1]
        y = (y.reshape(B, hm, H // hm, L, P) + mean.astype(mx.float32)[:, :, None]).reshape(B, H, L, P)
    return y.astype(out_dtype)


def rotate(x: mx.array, signs: mx.array, inverse: bool = False, mean: mx.array | None = None, out_dtype=mx.float16) -> mx.array:
    """Rows into (forward) or out of (inverse) a rotated frame, see the module docstring.

    Args:
        x: (B, H, L, P), any float dtype.
        signs: (P,) the rotation's +-1 diagonal (`RandomHadamard.signs`).
        inverse: undo the rotation instead.
        mean: optional (B, H / G, 1, P) added after the rotation, row group h // G (G = H / its
            heads: query heads per KV head).
        out_dtype: of the result.

    Returns:
        (B, H, L, P) in `out_dtype`.
    """
    B, H, L, P = x.shape
    if signs.shape != (P,):
        raise ValueError(f"signs {signs.shape} do not match rows of {P}")
    if mean is not None and (mean.shape[0] != B or mean.shape[2:] != (1, P) or H % mean.shape[1]):
        raise ValueError(f"mean {mean.shape} does not fit rows {x.shape}")
    kw = dict(inverse=inverse, mean=mean, out_dtype=out_dtype)
    if not applies(P) or x.size == 0 or B * H * L * P >= 2**31:
        return rotate_reference(x, signs, **kw)
    spec = scaled(_SPEC, P)
    g = H // mean.shape[1] if mean is not None else 1
    m = mean.astype(mx.float32) if mean is not None else constant((0.0,), mx.float32)  # cached
    (out,) = run(
        spec,
        Launch(
            [x, signs.astype(mx.float32), m],
            [("P", P), ("INV", int(inverse)), ("HAS_MEAN", int(mean is not None)), ("G", g), ("OT", out_dtype)],
            (B * H * L * P, 1, 1),
            (P, 1, 1),
            [(B, H, L, P)],
            [out_dtype],
        ),
        reference=lambda: [rotate_reference(x, signs, **kw)],
    )
    return out
