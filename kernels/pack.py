"""Bit pack / unpack of b-bit indices (b in 1..8) into uint32 words, in packing.py's layout.

Layout (identical to `longctx.quant.packing`): along the last axis the n values form a
little-endian bit stream, value i in stream bits [b*i, b*i + b), stream bit j in word j // 32 at
bit j % 32; the axis is zero-padded to a multiple of 32 values, so a row has b * ceil(n / 32)
words and a value may straddle two words (b = 3, 5, 6, 7) but never two groups of 32.

Shapes and dtypes:
    pack:   (..., n) integer  -> (..., b * ceil(n / 32)) uint32
    unpack: (..., W) uint32   -> (..., n) uint8

Thread plan:
    pack:   one thread per output word (threadgroups of 256); the thread ORs in the <= 33
            values that overlap its word (shifted left, or right for a straddler's high part).
    unpack: one thread per output value; it reads its word (and the next when it straddles).
"""

from __future__ import annotations

import mlx.core as mx

from ._prelude import KernelSpec, Launch, backend, groups, run

GROUP = 32
_THREADS = 256

_PACK = KernelSpec(
    name="lc_pack",
    inputs=("values",),
    outputs=("words",),
    source=r"""
  const uint32_t rows = (uint32_t)values_shape[0];
  const uint32_t n = (uint32_t)values_shape[1];
  const uint32_t W = (uint32_t)B * ((n + 31u) / 32u);
  if (lc_gid < rows * W) {
    const uint32_t row = lc_gid / W;
    const uint32_t w = lc_gid % W;
    const uint32_t g = w / (uint32_t)B;  // group of 32 values
    const uint32_t k = w % (uint32_t)B;  // word within the group
    const uint32_t b0 = 32u * k;
    const uint32_t first = b0 / (uint32_t)B;
    uint32_t last = (b0 + 31u) / (uint32_t)B;
    last = last > 31u ? 31u : last;
    uint32_t word = 0u;
    for (uint32_t i = first; i <= last; ++i) {
      const uint32_t idx = g * 32u + i;
      const uint32_t v = idx < n ? ((uint32_t)values[row * n + idx] & ((1u << B) - 1u)) : 0u;
      const int sh = (int)(i * (uint32_t)B) - (int)b0;
      word |= sh >= 0 ? (v << (uint32_t)sh) : (v >> (uint32_t)(-sh));
    }
    words[lc_gid] = word;
  }
""",
)

_UNPACK = KernelSpec(
    name="lc_unpack",
    inputs=("words",),
    outputs=("values",),
    source=r"""
  const uint32_t rows = (uint32_t)words_shape[0];
  const uint32_t W = (uint32_t)words_shape[1];
  if (lc_gid < rows * (uint32_t)N) {
    const uint32_t row = lc_gid / (uint32_t)N;
    const uint32_t i = lc_gid % (uint32_t)N;
    const uint32_t bit = i * (uint32_t)B;
    const uint32_t wd = row * W + (bit >> 5);
    const uint32_t sh = bit & 31u;
    uint32_t v = words[wd] >> sh;
    if (sh + (uint32_t)B > 32u) v |= words[wd + 1u] << (32u - sh);
    values[lc_gid] = (uint8_t)(v & ((1u << B) - 1u));
  }
""",
)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def packed_words(n: int, bits: int) -> int:
    """Words per row for n values of `bits` bits: bits * ceil(n / 32)."""
    return bits * groups(n, GROUP)


def pack_reference(indices: mx.array, bits: int) -> mx.array:
    """Pure-MLX pack (the CPU path and the oracle): (..., n) -> (..., bits * ceil(n/32)) uint32.

    Each value's low part is shifted into its word, a straddler's high part into the next; the
    per-word contributions have disjoint bits, so summing them equals OR-ing them.
    """
    _check_bits(bits)
    n = indices.shape[-1]
    lead = indices.shape[:-1]
    g = groups(n, GROUP)
    v = indices.astype(mx.uint32) & ((1 << bits) - 1)
    if g * GROUP != n:
        v = mx.pad(v, [(0, 0)] * len(lead) + [(0, g * GROUP - n)])
    v = v.reshape(*lead, g, GROUP)  # (..., G, 32)
    start = mx.arange(GROUP, dtype=mx.uint32) * bits  # stream bit of each slot
    word, shift = start // 32, start % 32
    slot_words = mx.arange(bits, dtype=mx.uint32)  # (b,)
    lo = mx.where(word[:, None] == slot_words, (v << shift)[..., None], 0)  # (..., G, 32, b)
    straddle = shift + bits > 32
    rshift = mx.where(straddle, 32 - shift, 0)
    hi_val = mx.where(straddle, v >> rshift, 0)
    hi = mx.where((word + 1)[:, None] == slot_words, hi_val[..., None], 0)
    words = mx.sum(lo + hi, axis=-2)  # (..., G, b)
    return words.astype(mx.uint32).reshape(*lead, g * bits)


def unpack_reference(words: mx.array, bits: int, n: int) -> mx.array:
    """Pure-MLX unpack: (..., bits * ceil(n/32)) uint32 -> (..., n) uint8."""
    _check_bits(bits)
    g = groups(n, GROUP)
    if words.shape[-1] != g * bits:
        raise ValueError(f"expected {g * bits} words for n={n}, bits={bits}, got {words.shape[-1]}")
    lead = words.shape[:-1]
    w = words.astype(mx.uint32).reshape(*lead, g, bits)  # (..., G, b)
    start = mx.arange(GROUP, dtype=mx.uint32) * bits
    word, shift = start // 32, start % 32
    straddle = shift + bits > 32
    lo = mx.take(w, word, axis=-1) >> shift  # (..., G, 32)
    hi = mx.take(w, mx.minimum(word + 1, bits - 1), axis=-1) << mx.where(straddle, 32 - shift, 0)
    v = (lo | mx.where(straddle, hi, 0)) & ((1 << bits) - 1)
    v = v.reshape(*lead, g * GROUP)[..., :n]
    return v.astype(mx.uint8)


def pack(indices: mx.array, bits: int) -> mx.array:
    """Pack b-bit values along the last axis (GPU kernel on Metal/CUDA, else the reference).

    Args:
        indices: (..., n) integer array, values in [0, 2^bits) (higher bits are dropped).
        bits: 1..8.

    Returns:
        (..., bits * ceil(n / 32)) uint32, equal bit for bit to `longctx.quant.packing.pack`.
    """
    _check_bits(bits)
    if backend() == "cpu" or indices.size == 0:
        return pack_reference(indices, bits)
    n = indices.shape[-1]
    lead = indices.shape[:-1]
    rows = indices.size // n
    w = packed_words(n, bits)
    x = indices.astype(mx.uint8).reshape(rows, n)  # one dtype: MLX caches modules by name
    (out,) = run(
        _PACK,
        Launch([x], [("B", bits)], (groups(rows * w, _THREADS) * _THREADS, 1, 1), (_THREADS, 1, 1), [(rows, w)], [mx.uint32]),
        reference=lambda: [pack_reference(x, bits)],
    )
    return out.reshape(*lead, w)


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of `pack` (GPU kernel on Metal/CUDA, else the reference).

    Args:
        words: (..., bits * ceil(n / 32)) uint32.
        bits: 1..8.
        n: values per row.

    Returns:
        (..., n) uint8.
    """
    _check_bits(bits)
    w = packed_words(n, bits)
    if words.shape[-1] != w:
        raise ValueError(f"expected {w} words for n={n}, bits={bits}, got {words.shape[-1]}")
    if backend() == "cpu" or words.size == 0:
        return unpack_reference(words, bits, n)
    lead = words.shape[:-1]
    rows = words.size // w
    x = words.astype(mx.uint32).reshape(rows, w)
    (out,) = run(
        _UNPACK,
        Launch(
            [x], [("B", bits), ("N", n)], (groups(rows * n, _THREADS) * _THREADS, 1, 1), (_THREADS, 1, 1), [(rows, n)], [mx.uint8]
        ),
        reference=lambda: [unpack_reference(x, bits, n)],
    )
    return out.reshape(*lead, n)
