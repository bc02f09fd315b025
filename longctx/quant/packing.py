"""Bit packing of b-bit indices into uint32 words, over the last axis (shared with the kernels).

Layout (the GPU kernels read exactly this):

- The n values of the last axis form a little-endian bit stream: value i occupies stream bits
  [b*i, b*i + b), its least significant bit first.
- Stream bit j lives in word j // 32, at bit position j % 32 (LSB = position 0).
- The last axis is zero-padded to a multiple of 32 values, so each group of 32 values is exactly
  b words and the packed last axis has b * ceil(n / 32) words. No bits are wasted inside a
  group: for b = 3, 5, 6, 7 a value may straddle two consecutive words (its low bits at the top
  of word w, its high bits at the bottom of word w + 1); it never straddles two groups.

So for value i of group g (i in 0..31): word = g*b + (b*i) // 32, shift = (b*i) % 32, and if
shift + b > 32 the top (shift + b - 32) bits are in the next word, at position 0.

Example, b = 3, the 32 values 0, 1, ..., 7, 0, 1, ..., 7, ...: the stream read as one integer is
octal 0o76543210...76543210, giving words 0x88FAC688, 0xC688FAC6, 0xFAC688FA. Value 10 (= 2)
straddles: its low two bits are bits 30..31 of word 0 (0b10), its top bit is bit 0 of word 1.

Both directions are vectorized MLX ops over (..., groups, 32) with static per-slot shift tables.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

GROUP = 32  # values per group; a group of b-bit values is exactly b words


def packed_words(n: int, bits: int) -> int:
    """Number of uint32 words that hold n values of `bits` bits: bits * ceil(n / 32)."""
    return bits * ((n + GROUP - 1) // GROUP)


@functools.lru_cache(maxsize=None)
def _tables(bits: int) -> dict:
    """Per-slot word index, shifts and straddle flags for one group of 32 values."""
    start = np.arange(GROUP) * bits
    word = start // 32
    shift = start % 32
    straddle = shift + bits > 32
    word_hi = np.where(straddle, word + 1, word)
    # Contribution masks (32 slots, bits words): where each slot's low / high part goes.
    lo_mask = np.zeros((GROUP, bits), dtype=np.uint32)
    lo_mask[np.arange(GROUP), word] = 1
    hi_mask = np.zeros((GROUP, bits), dtype=np.uint32)
    hi_mask[np.arange(GROUP)[straddle], word_hi[straddle]] = 1
    return {
        "word": mx.array(word.astype(np.uint32)),
        "word_hi": mx.array(np.minimum(word_hi, bits - 1).astype(np.uint32)),
        "shift": mx.array(shift.astype(np.uint32)),
        # High part: value >> (32 - shift) when packing, word << (32 - shift) when unpacking;
        # 0 for non-straddling slots (never used, kept < 32 so the shift is defined).
        "rshift": mx.array(np.where(straddle, 32 - shift, 0).astype(np.uint32)),
        "straddle": mx.array(straddle),
        "lo_mask": mx.array(lo_mask),
        "hi_mask": mx.array(hi_mask),
        "any_straddle": bool(straddle.any()),
    }


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def pack(indices: mx.array, bits: int) -> mx.array:
    """Pack b-bit values along the last axis into uint32 words (layout in the module docstring).

    Args:
        indices: (..., n) integer array with values in [0, 2^bits); higher bits are dropped.
        bits: 1..8.

    Returns:
        (..., bits * ceil(n / 32)) uint32.
    """
    _check_bits(bits)
    n = indices.shape[-1]
    lead = indices.shape[:-1]
    groups = (n + GROUP - 1) // GROUP
    v = indices.astype(mx.uint32) & ((1 << bits) - 1)
    if groups * GROUP != n:
        v = mx.pad(v, [(0, 0)] * len(lead) + [(0, groups * GROUP - n)])
    v = v.reshape(*lead, groups, GROUP)  # (..., G, 32)
    t = _tables(bits)
    if 32 % bits == 0:
        # No straddling: word w of a group holds slots [w*32/b, (w+1)*32/b) in order.
        per = 32 // bits
        v = v.reshape(*lead, groups, bits, per)  # (..., G, b, 32/b)
        shifts = mx.arange(per, dtype=mx.uint32) * bits  # (32/b,)
        words = mx.sum(v << shifts, axis=-1)  # (..., G, b); disjoint bits: sum == or
    else:
        lo = v << t["shift"]  # (..., G, 32); bits shifted past 31 fall off
        hi = mx.where(t["straddle"], v >> t["rshift"], 0)  # (..., G, 32)
        words = mx.sum(lo[..., None] * t["lo_mask"], axis=-2)  # (..., G, b)
        words = words + mx.sum(hi[..., None] * t["hi_mask"], axis=-2)
    return words.astype(mx.uint32).reshape(*lead, groups * bits)


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of `pack`.

    Args:
        words: (..., bits * ceil(n / 32)) uint32.
        bits: 1..8.
        n: number of values to return.

    Returns:
        (..., n) uint8.
    """
    _check_bits(bits)
    lead = words.shape[:-1]
    groups = (n + GROUP - 1) // GROUP
    if words.shape[-1] != groups * bits:
        raise ValueError(f"expected {groups * bits} words for n={n}, bits={bits}, got {words.shape[-1]}")
    w = words.astype(mx.uint32).reshape(*lead, groups, bits)  # (..., G, b)
    mask = (1 << bits) - 1
    t = _tables(bits)
    if 32 % bits == 0:
        per = 32 // bits
        shifts = mx.arange(per, dtype=mx.uint32) * bits  # (32/b,)
        v = (w[..., None] >> shifts) & mask  # (..., G, b, 32/b)
    else:
        lo = mx.take(w, t["word"], axis=-1) >> t["shift"]  # (..., G, 32)
        hi = mx.take(w, t["word_hi"], axis=-1) << t["rshift"]  # (..., G, 32)
        v = (lo | mx.where(t["straddle"], hi, 0)) & mask
    v = v.reshape(*lead, groups * GROUP)
    if groups * GROUP != n:
        v = v[..., :n]
    return v.astype(mx.uint8)
