"""Bit packing: exact round trips and the documented layout shared with the kernels."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import longctx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from longctx.quant.packing import pack, packed_words, unpack


def _reference_pack(values: np.ndarray, bits: int) -> np.ndarray:
    """The layout written out bit by bit: value i -> stream bits [b*i, b*i+b), LSB first."""
    lead, n = values.shape[:-1], values.shape[-1]
    flat = values.reshape(-1, n)
    out = np.zeros((flat.shape[0], packed_words(n, bits)), dtype=np.uint32)
    for row in range(flat.shape[0]):
        for i in range(n):
            for k in range(bits):
                if (int(flat[row, i]) >> k) & 1:
                    j = bits * i + k
                    out[row, j // 32] |= np.uint32(1 << (j % 32))
    return out.reshape(*lead, -1)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]),
    n=st.integers(1, 150),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_and_reference(bits, n, lead, seed):
    vals = np.random.default_rng(seed).integers(0, 2**bits, size=(*lead, n), dtype=np.uint8)
    words = pack(mx.array(vals), bits)
    assert words.dtype == mx.uint32
    assert words.shape == (*lead, bits * ((n + 31) // 32))
    assert np.array_equal(np.array(words), _reference_pack(vals, bits))
    back = unpack(words, bits, n)
    assert back.dtype == mx.uint8 and back.shape == vals.shape
    assert np.array_equal(np.array(back), vals)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 80, 127])
def test_round_trip_grid(bits, n):
    vals = np.random.default_rng(bits * 1000 + n).integers(0, 2**bits, size=(2, 3, n))
    words = pack(mx.array(vals.astype(np.uint8)), bits)
    assert np.array_equal(np.array(unpack(words, bits, n)), vals)


def test_layout_pinned_3bit():
    # 0..7 repeated: the stream is octal 0o76543210 76543210 ..., value 10 straddles words 0/1.
    vals = mx.array([i % 8 for i in range(32)], dtype=mx.uint8)
    assert np.array(pack(vals, 3)).tolist() == [0x88FAC688, 0xC688FAC6, 0xFAC688FA]
    # A single value 5 (0b101) at index 10 (bits 30..32): 0b01 at the top of word 0, 1 in word 1.
    one = np.zeros(11, dtype=np.uint8)
    one[10] = 5
    assert np.array(pack(mx.array(one), 3)).tolist() == [1 << 30, 1, 0]


def test_layout_pinned_other_widths():
    v4 = mx.array(list(range(16)) * 2, dtype=mx.uint8)
    assert np.array(pack(v4, 4)).tolist() == [0x76543210, 0xFEDCBA98] * 2
    v1 = mx.array([1, 0, 1, 1] + [0] * 30 + [1], dtype=mx.uint8)  # 35 values -> 2 words
    assert np.array(pack(v1, 1)).tolist() == [0b1101, 0b100]
    v8 = mx.array([0x11, 0x22, 0x33, 0x44, 0xFF], dtype=mx.uint8)
    words = np.array(pack(v8, 8)).tolist()
    assert len(words) == 8 and words[:2] == [0x44332211, 0xFF] and words[2:] == [0] * 6
    v2 = mx.array([3, 0, 1, 2], dtype=mx.uint8)
    assert np.array(pack(v2, 2)).tolist() == [0b10010011, 0]


def test_high_bits_dropped_and_bad_args():
    assert np.array(pack(mx.array([9], dtype=mx.uint8), 3)).tolist() == [1, 0, 0]
    with pytest.raises(ValueError):
        pack(mx.zeros((4,), dtype=mx.uint8), 0)
    with pytest.raises(ValueError):
        unpack(mx.zeros((2,), dtype=mx.uint32), 3, 40)  # 40 values need 6 words
    assert packed_words(80, 3) == 9 and packed_words(128, 4) == 16 and packed_words(1, 1) == 1
