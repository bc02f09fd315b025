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

Thread plan: one thread per (row, 8 dims) of the output, threadgroups of 256, so a warp writes
512 consecutive bytes with 16-byte stores (a thread per 32 dims wrote 2-byte pieces 64 bytes
apart: every store instruction touched 32 sectors). The table is staged in threadgroup memory.
A segment row's thread reads the <= 3 words holding its 8 codes (byte aligned in the group's bit
stream: 8 * b bits from bit 8 * b * (chunk % 4)), shifts them into one 64-bit value, looks the 8
codes up and scales them by the norm; a head / after row's thread copies its 8 values.
"""

from __future__ import annotations

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, constant, groups, run
from .pack import unpack_reference

NT = 256

_SPEC = KernelSpec(
    name="lc_dequant",
    inputs=("idx", "idx2", "norm", "table", "head", "after", "params"),
    outputs=("out",),
    row_contiguous=False,
    source=r"""
  constexpr int B2X = B2 > 0 ? B2 : 1;
  constexpr int C = P / 8;  // chunks of 8 dims per row: 16 bytes of output each
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
  // 32-bit index math (64-bit division costs ~10x more): the dispatcher keeps the thread count
  // below 2^31.
  const uint32_t total = (uint32_t)idx_shape[0] * (uint32_t)(H * N) * (uint32_t)C;
  const uint32_t t = lc_gid;
  if (t < total) {
    const int c = (int)(t % (uint32_t)C);
    const uint32_t row = t / (uint32_t)C;  // (b * H + h) * N + n
    const int n = (int)(row % (uint32_t)N);
    const uint32_t bh = row / (uint32_t)N;
    const int h = (int)(bh % (uint32_t)H);
    const int b = (int)(bh / (uint32_t)H);
    float v[8];
    if (n < S) {
      const int64_t src = b * head_strides[0] + h * head_strides[1] + n * head_strides[2];
      LC_UNROLL for (int i = 0; i < 8; ++i) v[i] = LC_H2F(head[src + (c * 8 + i) * head_strides[3]]);
    } else if (n >= S + L) {
      const int64_t src = b * after_strides[0] + h * after_strides[1]
                          + (n - S - L) * after_strides[2];
      LC_UNROLL for (int i = 0; i < 8; ++i) v[i] = LC_H2F(after[src + (c * 8 + i) * after_strides[3]]);
    } else {
      // Chunk c holds codes 8j..8j+7 of group g = c / 4 (j = c % 4): stream bits
      // [8 * B * j, 8 * B * (j + 1)) of the group's B words, byte aligned, spanning <= 3 words.
      const int l = n - S;
      const int g = c >> 2;
      const int j = c & 3;
      const int64_t ib = b * idx_strides[0] + h * idx_strides[1] + l * idx_strides[2];
      const int bit0 = 8 * B1 * j;
      const int w0 = bit0 >> 5;
      const int sh = bit0 & 31;
      const int64_t iw = idx_strides[3];
      const uint32_t x0 = idx[ib + (g * B1 + w0) * iw];
      const uint32_t x1 = w0 + 1 < B1 ? idx[ib + (g * B1 + w0 + 1) * iw] : 0u;
      const uint32_t x2 = w0 + 2 < B1 ? idx[ib + (g * B1 + w0 + 2) * iw] : 0u;
      uint64_t bits = ((((uint64_t)x1) << 32) | (uint64_t)x0) >> sh;
      if (sh > 0) bits |= ((uint64_t)x2) << (64 - sh);
      uint64_t bits2 = 0;
      if (B2 > 0) {
        const int64_t i2b = b * idx2_strides[0] + h * idx2_strides[1] + l * idx2_strides[2];
        const int q0 = 8 * B2X * j;
        const int u0 = q0 >> 5;
        const int sh2 = q0 & 31;
        const int64_t iw2 = idx2_strides[3];
        const uint32_t y0 = idx2[i2b + (g * B2X + u0) * iw2];
        const uint32_t y1 = u0 + 1 < B2X ? idx2[i2b + (g * B2X + u0 + 1) * iw2] : 0u;
        const uint32_t y2 = u0 + 2 < B2X ? idx2[i2b + (g * B2X + u0 + 2) * iw2] : 0u;
        bits2 = ((((uint64_t)y1) << 32) | (uint64_t)y0) >> sh2;
        if (sh2 > 0) bits2 |= ((uint64_t)y2) << (64 - sh2);
      }
      const float nv = LC_H2F(norm[b * norm_strides[0] + h * norm_strides[1] + l * norm_strides[2]]);
      LC_UNROLL for (int i = 0; i < 8; ++i) {
        uint32_t code = (uint32_t)(bits >> (i * B1)) & MASK1;
        if (B2 > 0) code = (code << B2X) | ((uint32_t)(bits2 >> (i * B2X)) & MASK2);
        v[i] = tab_s[code] * nv;
      }
    }
    LC_U4 o;
    o.x = LC_F2H_BITS(v[0]) | (LC_F2H_BITS(v[1]) << 16);
    o.y = LC_F2H_BITS(v[2]) | (LC_F2H_BITS(v[3]) << 16);
    o.z = LC_F2H_BITS(v[4]) | (LC_F2H_BITS(v[5]) << 16);
    o.w = LC_F2H_BITS(v[6]) | (LC_F2H_BITS(v[7]) << 16);
    LC_ST_U4(out, (int64_t)row * P + c * 8, o);
  }
""",
)


def dequant_reference(
    enc: dict, table: mx.array, *, bits: int, bits2: int = 0, p: int, head: mx.array | None = None, after: mx.array | None = None
) -> mx.array:
    """Pure-MLX oracle (and CPU path): arguments and result as `dequant`."""
    codes = unpack_reference(enc["idx"], bits, p).astype(mx.uint32)
    if bits2:
        codes = (codes << bits2) | unpack_reference(enc["idx2"], bits2, p).astype(mx.uint32)
    rows = (mx.take(table.astype(mx.float32), codes) * enc["norm"].astype(mx.float32)[..., None]).astype(
        mx.float16
    )  # (B, H, L, P)
    parts = [x.astype(mx.float16) for x in (head, rows, after) if x is not None]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def dequant(
    enc: dict, table: mx.array, *, bits: int, bits2: int = 0, p: int, head: mx.array | None = None, after: mx.array | None = None
) -> mx.array:
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
    if (
        backend() == "cpu"
        or L == 0
        or bits + bits2 > 8
        or B * H * (L + (head.shape[2] if head is not None else 0) + (after.shape[2] if after is not None else 0)) * (p // 8)
        >= 2**31
    ):
        return dequant_reference(enc, table, **kw)
    s = head.shape[2] if head is not None else 0
    w = after.shape[2] if after is not None else 0
    # cached stand-ins and parameters: a new array per call is a launch (a fill) or a copy
    empty = constant((0.0,), mx.float16)
    u32 = mx.uint32
    idx2 = enc["idx2"].astype(u32) if bits2 else constant((0,), u32)
    inputs = [
        enc["idx"].astype(u32),
        idx2,
        enc["norm"].astype(mx.float16),
        table.astype(mx.float32),
        head.astype(mx.float16) if s else empty,
        after.astype(mx.float16) if w else empty,
    ]
    n = B * H * (s + L + w) * (p // 8)
    inputs.append(constant((s, w), mx.int32))
    (out,) = run(
        _SPEC,
        Launch(
            inputs,
            [("P", p), ("B1", bits), ("B2", bits2), ("NT", NT)],
            (groups(n, NT) * NT, 1, 1),
            (NT, 1, 1),
            [(B, H, s + L + w, p)],
            [mx.float16],
        ),
        reference=lambda: [dequant_reference(enc, table, **kw)],
    )
    return out
