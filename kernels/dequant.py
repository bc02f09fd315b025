"""Dequantize a compressed KV segment into dense fp16 rows in the codec's rotated frame.

For every token l of the segment (and KV head h, batch b), in the rotated frame:

    out[b, h, S + l, d] = norm[b, h, l] * T[code(b, h, l, d)]      code = (i1 << b2) | i2

with T the fused kernel's table (c1, or c1[i1] + c2[i1, i2] for two-stage RVQ keys;
`kvcache.attention.kernel_table`), so the values equal `VectorCodec.decode_rotated`'s (rounded
to fp16). Optional dense rows (already rotated, fp16) go before and after the segment's, so the
caller gets the whole key or value sequence of a layer in one array, without a concatenation:

    out[:, :, :S] = head,  out[:, :, S + L:] = after.

This is the GPU prefill path's first half (`kvcache.attention`): a prefill chunk of hundreds of
queries then runs `mx.fast.scaled_dot_product_attention` over the dense rows, whose tensor-core
kernels the per-key fused kernel cannot match at that many rows. The dense rows of one layer
live only until its attention has run.

Inputs: idx (B, H, L, b1 * P / 32) uint32, [idx2 (B, H, L, b2 * P / 32) uint32], norm (B, H, L)
float16 (any strides: slices of the cache's preallocated tail cost no copy), table
(2^(b1 + b2),) float32, head (B, H, S, P) / after (B, H, W, P) float16 (any strides), params
(2,) int32 = (S, W).
Output: (B, H, S + L + W, P) float16, contiguous.

Thread plan: one thread per (row, group of 32 dims) of the output, threadgroups of 256; the
table is staged in threadgroup memory; a segment row's thread loads its group's b1 (+ b2) words,
decodes the 32 codes with compile-time shifts (a code may straddle two words), and writes 32
halves; a head / after row's thread copies 32 halves.
"""

from __future__ import annotations

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, groups, run
from .pack import unpack_reference

NT = 256

_SPEC = KernelSpec(
    name="lc_dequant",
    inputs=("idx", "idx2", "norm", "table", "head", "after", "params"),
    outputs=("out",),
    row_contiguous=False,
    source=r"""
  constexpr int B2X = B2 > 0 ? B2 : 1;
  constexpr int G = P / 32;
  constexpr uint32_t MASK1 = (1u << B1) - 1u;
  constexpr uint32_t MASK2 = (1u << B2X) - 1u;
  LC_SHARED float tab_s[1 << (B1 + B2)];
  for (int i = (int)lc_tid; i < (1 << (B1 + B2)); i += NT) tab_s[i] = table[i];
  LC_BARRIER();

  const int S = params[0];  // head rows
  const int W = params[1];  // after rows
  const int H = idx_shape[1];
  const int L = idx_shape[2];
  const int N = S + L + W;  // output rows per (b, h)
  const int64_t total = (int64_t)idx_shape[0] * H * N * G;
  const int64_t t = (int64_t)lc_gid;
  if (t < total) {
    const int g = (int)(t % G);
    const int64_t row = t / G;  // (b * H + h) * N + n
    const int n = (int)(row % N);
    const int64_t bh = row / N;
    const int h = (int)(bh % H);
    const int b = (int)(bh / H);
    const int64_t ob = row * P + g * 32;
    if (n < S) {
      const int64_t src = b * head_strides[0] + h * head_strides[1] + n * head_strides[2];
      const int64_t sd = head_strides[3];
      LC_UNROLL for (int i = 0; i < 32; ++i) out[ob + i] = head[src + (g * 32 + i) * sd];
    } else if (n >= S + L) {
      const int64_t src = b * after_strides[0] + h * after_strides[1]
                          + (n - S - L) * after_strides[2];
      const int64_t sd = after_strides[3];
      LC_UNROLL for (int i = 0; i < 32; ++i) out[ob + i] = after[src + (g * 32 + i) * sd];
    } else {
      const int l = n - S;
      const int64_t ib = b * idx_strides[0] + h * idx_strides[1] + l * idx_strides[2];
      uint32_t w1[B1];
      LC_UNROLL for (int k = 0; k < B1; ++k) w1[k] = idx[ib + (g * B1 + k) * idx_strides[3]];
      uint32_t w2[B2X];
      if (B2 > 0) {
        const int64_t i2b = b * idx2_strides[0] + h * idx2_strides[1] + l * idx2_strides[2];
        LC_UNROLL for (int k = 0; k < B2X; ++k) w2[k] = idx2[i2b + (g * B2X + k) * idx2_strides[3]];
      }
      const float nv = LC_H2F(norm[b * norm_strides[0] + h * norm_strides[1] + l * norm_strides[2]]);
      LC_UNROLL for (int i = 0; i < 32; ++i) {
        const int sh = (i * B1) & 31;
        const int wi = (i * B1) >> 5;
        uint32_t c = w1[wi] >> sh;
        if (sh + B1 > 32) c |= w1[wi + 1] << (32 - sh);
        c &= MASK1;
        if (B2 > 0) {
          const int sh2 = (i * B2X) & 31;
          const int wi2 = (i * B2X) >> 5;
          uint32_t c2 = w2[wi2] >> sh2;
          if (sh2 + B2X > 32) c2 |= w2[wi2 + 1] << (32 - sh2);
          c = (c << B2X) | (c2 & MASK2);
        }
        out[ob + i] = LC_F2H(tab_s[c] * nv);
      }
    }
  }
""",
)


def dequant_reference(enc: dict, table: mx.array, *, bits: int, bits2: int = 0, p: int,
                      head: mx.array | None = None, after: mx.array | None = None) -> mx.array:
    """Pure-MLX oracle (and CPU path): arguments and result as `dequant`."""
    codes = unpack_reference(enc["idx"], bits, p).astype(mx.uint32)
    if bits2:
        codes = (codes << bits2) | unpack_reference(enc["idx2"], bits2, p).astype(mx.uint32)
    rows = (mx.take(table.astype(mx.float32), codes)
            * enc["norm"].astype(mx.float32)[..., None]).astype(mx.float16)  # (B, H, L, P)
    parts = [x.astype(mx.float16) for x in (head, rows, after) if x is not None]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def dequant(enc: dict, table: mx.array, *, bits: int, bits2: int = 0, p: int,
            head: mx.array | None = None, after: mx.array | None = None) -> mx.array:
    """Dense fp16 rows of a compressed segment in the rotated frame (GPU kernel, else reference).

    Args:
        enc: the segment's arrays as `VectorCodec.encode` stores them: idx (B, H, L, W1), norm
            (B, H, L) and, for two-stage keys, idx2.
        table: (2^(bits + bits2),) float32 (`kvcache.attention.kernel_table`).
        bits, bits2: index widths (bits2 = 0: single stage).
        p: the codec's padded dim (a multiple of 32).
        head: optional (B, H, S, p) rows to put first (the exact sink, rotated).
        after: optional (B, H, W, p) rows to put last (the exact window, rotated).

    Returns:
        (B, H, S + L + W, p) float16.
    """
    B, H, L = enc["norm"].shape
    if enc["idx"].shape != (B, H, L, bits * groups(p, 32)) or p % 32:
        raise ValueError(f"idx {enc['idx'].shape} does not hold {bits}-bit codes of {p} dims")
    for name, x in (("head", head), ("after", after)):
        if x is not None and (x.shape[:2] != (B, H) or x.shape[3] != p):
            raise ValueError(f"{name} {x.shape} does not match ({B}, {H}, ., {p})")
    kw = dict(bits=bits, bits2=bits2, p=p, head=head, after=after)
    if backend() == "cpu" or L == 0 or bits + bits2 > 8:
        return dequant_reference(enc, table, **kw)
    s = head.shape[2] if head is not None else 0
    w = after.shape[2] if after is not None else 0
    empty = mx.zeros((1, 1, 1, 1), dtype=mx.float16)
    u32 = mx.uint32
    idx2 = enc["idx2"].astype(u32) if bits2 else mx.zeros((1, 1, 1, 1), dtype=u32)
    inputs = [enc["idx"].astype(u32), idx2, enc["norm"].astype(mx.float16),
              table.astype(mx.float32),
              head.astype(mx.float16) if s else empty, after.astype(mx.float16) if w else empty]
    n = B * H * (s + L + w) * (p // 32)
    inputs.append(mx.array([s, w], dtype=mx.int32))
    (out,) = run(_SPEC, Launch(inputs, [("P", p), ("B1", bits), ("B2", bits2), ("NT", NT)],
                               (groups(n, NT) * NT, 1, 1), (NT, 1, 1),
                               [(B, H, s + L + w, p)], [mx.float16]),
                 reference=lambda: [dequant_reference(enc, table, **kw)])
    return out
