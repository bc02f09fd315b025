"""Scalar (TurboQuant_mse) and two-stage residual quantization of rotated unit vectors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import longctx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from longctx.quant.codebooks import lloyd_max, residual_codebook
from longctx.quant.rotation import RandomHadamard
from longctx.quant.rvq import ResidualQuantizer
from longctx.quant.scalar import decode_unit, dequantize, encode_unit, quantize, split_norm

D = 128
LLOYD_MAX = {1: 0.363, 2: 0.117, 3: 0.0345, 4: 0.0095}  # d * MSE, Gaussian limit


@pytest.fixture(scope="module")
def rotated_units():
    """10k random unit vectors in R^128, rotated: (10000, 128) float32."""
    x = np.random.default_rng(0).standard_normal((10_000, D)).astype(np.float32)
    unit, _ = split_norm(mx.array(x))
    return RandomHadamard(D, seed=5).forward(unit)


def _sq_err(a, b):
    return np.sum((np.array(a) - np.array(b)) ** 2, axis=-1)  # per vector


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_quantize_matches_comparison_sum(bits):
    cb = lloyd_max(64, bits)
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((7, 300)) * 0.2
    x[0, : len(cb.boundaries)] = cb.boundaries.astype(np.float32)  # exact ties go down
    x = x.astype(np.float32)
    got = np.array(quantize(mx.array(x), cb))
    bounds32 = cb.boundaries.astype(np.float32)
    want = (x[..., None] > bounds32).sum(-1)
    assert got.dtype == np.uint8 and np.array_equal(got, want)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_distortion(rotated_units, bits):
    cb = lloyd_max(D, bits)
    err = _sq_err(rotated_units, dequantize(quantize(rotated_units, cb), cb))
    mse = err.mean()
    se = err.std() / math.sqrt(len(err))
    assert mse <= math.sqrt(3) * math.pi / 2 * 4.0**-bits  # TurboQuant's upper bound
    assert abs(mse / LLOYD_MAX[bits] - 1) < 0.10
    assert abs(mse - D * cb.mse) < 4 * se + 1e-3 * D * cb.mse  # the codebook's own prediction


def test_encode_unit_round_trip():
    rot = RandomHadamard(D, seed=1)
    cb = lloyd_max(D, 4)
    x = mx.array(np.random.default_rng(3).standard_normal((2, 5, 33, D)).astype(np.float32)) * 3.0
    idx, norms = encode_unit(x, rot, cb)
    assert idx.dtype == mx.uint8 and idx.shape == (2, 5, 33, D)
    assert norms.dtype == mx.float16 and norms.shape == (2, 5, 33)
    np.testing.assert_allclose(np.array(norms, dtype=np.float32), np.linalg.norm(np.array(x), axis=-1), rtol=1e-3)
    back = decode_unit(idx, norms, cb, rot)
    rel = _sq_err(x, back) / np.sum(np.array(x) ** 2, -1)
    assert abs(rel.mean() / (D * cb.mse) - 1) < 0.1
    zero_idx, zero_norm = encode_unit(mx.zeros((1, D)), rot, cb)
    assert float(zero_norm[0]) == 0.0
    assert np.all(np.array(decode_unit(zero_idx, zero_norm, cb, rot)) == 0)


@pytest.mark.parametrize("b1,b2", [(2, 2), (3, 1), (2, 1), (3, 2)])
def test_rvq_lowers_mse_by_stage2_factor(rotated_units, b1, b2):
    rq = ResidualQuantizer(D, b1, b2)
    i1, i2 = rq.quantize(rotated_units)
    assert i1.dtype == mx.uint8 and int(mx.max(i2)) < 2**b2
    stage1 = _sq_err(rotated_units, rq.dequantize(i1)).mean()
    both = _sq_err(rotated_units, rq.dequantize(i1, i2)).mean()
    # The measured gain matches the design gain of the stage-2 codebooks within 5% ...
    design = lloyd_max(D, b1).mse / rq.mse
    assert abs((stage1 / both) / design - 1) < 0.05
    # ... which is close to what one more b2 bits buy a single-stage quantizer (4^b2-ish).
    single_gain = lloyd_max(D, b1).mse / lloyd_max(D, b1 + b2).mse
    assert 0.95 * single_gain < stage1 / both <= 1.01 * single_gain


def test_rvq_stage2_indices_match_reference(rotated_units):
    rq = ResidualQuantizer(D, 2, 2)
    y = np.array(rotated_units[:200])
    i1, i2 = (np.array(a) for a in rq.quantize(mx.array(y)))
    cb = rq.stage2
    r = y - lloyd_max(D, 2).centroids[i1].astype(np.float32)
    want = (r[..., None] > cb.boundaries[i1].astype(np.float32)).sum(-1)
    # float32 rounding of r may flip an index exactly at a boundary; allow a handful.
    assert np.mean(i2 == want) > 0.9999


def test_shared_stage2_is_worse_but_works(rotated_units):
    cond, shared = ResidualQuantizer(D, 2, 2), ResidualQuantizer(D, 2, 2, conditional=False)
    e_c = _sq_err(rotated_units, cond.dequantize(*cond.quantize(rotated_units))).mean()
    e_s = _sq_err(rotated_units, shared.dequantize(*shared.quantize(rotated_units))).mean()
    assert abs(e_s / (D * residual_codebook(D, 2, 2, False).mse) - 1) < 0.05
    assert e_c < 0.6 * e_s
