"""Exact bits-per-channel accounting."""

from __future__ import annotations

import pytest

import longctx  # noqa: F401  (OpenBLAS before mlx)

from longctx.quant.bits import kv_bits, vector_bits
from longctx.quant.codec import QuantSpec, VectorCodec


def test_scalar_4bit_d128():
    b = vector_bits(128, 4)
    assert b["per_vector"] == {"idx": 512, "norm": 16}
    assert b["bits_per_channel"] == 4.125  # 4 + 16/128
    assert b["constants"] == {"signs": 128, "codebooks": 16 * 32}
    # Constants amortized over the tokens, tending to 4.125.
    assert vector_bits(128, 4, tokens=10)["bits_per_channel"] == (528 + 640 / 10) / 128
    assert vector_bits(128, 4, tokens=10**6)["bits_per_channel"] == pytest.approx(4.125, abs=1e-5)
    assert VectorCodec(128, QuantSpec(4), seed=0).bits_per_channel() == 4.125


def test_rvq_qjl_d128():
    b = vector_bits(128, 2, bits2=2, qjl=True)
    assert b["per_vector"] == {"idx": 256, "norm": 16, "idx2": 256, "qjl": 128, "rnorm": 16}
    assert b["bits_per_channel"] == 672 / 128 == 5.25
    assert b["constants"] == {"signs": 128, "codebooks": (4 + 16) * 32, "qjl_seed": 64}
    assert vector_bits(128, 3, qjl=True)["bits_per_channel"] == (384 + 16 + 128 + 16) / 128


def test_padding_overhead_is_counted():
    # 80 values pack into 3 groups of 32 slots: 96 * b bits.
    assert vector_bits(80, 4)["bits_per_channel"] == (3 * 4 * 32 + 16) / 80 == 5.0
    assert vector_bits(96, 4)["bits_per_channel"] == (3 * 4 * 32 + 16) / 96
    # 100 is rotated in 112 dims (28 * 4): 4 groups.
    assert vector_bits(100, 2)["per_vector"]["idx"] == 4 * 2 * 32
    assert vector_bits(80, 3, qjl=True)["per_vector"]["qjl"] == 96


def test_kv_average():
    out = kv_bits(128, QuantSpec(3, qjl=True), QuantSpec(2), tokens=None)
    assert out["keys"]["bits_per_channel"] == 4.25
    assert out["values"]["bits_per_channel"] == 2.125
    assert out["average"] == (4.25 + 2.125) / 2
    amort = kv_bits(128, QuantSpec(4), QuantSpec(4), tokens=1000)
    assert amort["average"] == (528 + 640 / 1000) / 128
