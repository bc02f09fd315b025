"""Lloyd-Max codebooks for the coordinate of a random unit vector."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

import longctx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from longctx.quant.codebooks import (
    as_mx,
    exact_one_bit_centroid,
    lloyd_max,
    residual_codebook,
)

GAUSSIAN_LM = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}  # d * MSE as d -> infinity


def _density(dim: int, x: np.ndarray) -> np.ndarray:
    logc = math.lgamma(dim / 2) - 0.5 * math.log(math.pi) - math.lgamma((dim - 1) / 2)
    with np.errstate(divide="ignore"):  # log(0) at x = +-1: density 0 there
        return np.exp(logc + 0.5 * (dim - 3) * np.log1p(-x * x))


def _cell_stats(dim, lo, hi):
    """Mass and mean of the density on [lo, hi] by an independent fine trapezoid rule."""
    x = np.linspace(lo, hi, 20001)
    f = _density(dim, x)
    mass = np.trapezoid(f, x)
    return mass, np.trapezoid(x * f, x) / mass


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_close_to_gaussian_lloyd_max(bits):
    cb = lloyd_max(128, bits)
    # Finite d is a little better than the Gaussian limit, and converges to it.
    assert 0.97 * GAUSSIAN_LM[bits] < 128 * cb.mse < GAUSSIAN_LM[bits]
    big = lloyd_max(4096, bits)
    assert abs(4096 * big.mse / GAUSSIAN_LM[bits] - 1) < 1e-3
    assert 128 * cb.mse < 4096 * big.mse


def test_one_bit_is_exact():
    for dim in (3, 64, 128, 1024):
        cb = lloyd_max(dim, 1)
        c = exact_one_bit_centroid(dim)
        np.testing.assert_allclose(cb.centroids, [-c, c], rtol=1e-7)
        assert cb.boundaries.tolist() == [0.0]
        np.testing.assert_allclose(cb.mse, 1 / dim - c * c, rtol=1e-6)


def test_one_bit_large_dim_is_gaussian():
    c = lloyd_max(1024, 1).centroids[1]
    assert abs(c / math.sqrt(2 / (math.pi * 1024)) - 1) < 0.01


@pytest.mark.parametrize("dim,bits", [(128, 2), (128, 4), (64, 3), (80, 8)])
def test_lloyd_conditions_hold(dim, bits):
    cb = lloyd_max(dim, bits)
    c, b = cb.centroids, cb.boundaries
    assert len(c) == 2**bits and len(b) == 2**bits - 1
    assert np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=0)  # symmetric
    np.testing.assert_allclose(b, 0.5 * (c[1:] + c[:-1]), rtol=0, atol=1e-9 / math.sqrt(dim))
    # Each centroid is the conditional mean of its cell (independent quadrature).
    edges = np.concatenate([[-1.0], b, [1.0]])
    for k in [0, len(c) // 2 - 1, len(c) // 2, len(c) - 1]:
        _, mean = _cell_stats(dim, edges[k], edges[k + 1])
        assert abs(mean - c[k]) < 1e-6 / math.sqrt(dim)
    # And the reported MSE is the density's.
    x = np.linspace(-1, 1, 400001)
    f = _density(dim, x)
    q = c[np.searchsorted(b, x, side="left")]
    np.testing.assert_allclose(np.trapezoid((x - q) ** 2 * f, x), cb.mse, rtol=1e-4)


def test_deterministic_and_fast():
    t = time.perf_counter()
    a = lloyd_max.__wrapped__(96, 8)
    elapsed = time.perf_counter() - t
    b = lloyd_max.__wrapped__(96, 8)
    assert np.array_equal(a.centroids, b.centroids) and a.mse == b.mse
    assert elapsed < 2.0, f"8-bit codebook took {elapsed:.2f} s"
    assert lloyd_max(128, 3) is lloyd_max(128, 3)  # cached


def test_rejects_bad_args():
    with pytest.raises(ValueError):
        lloyd_max(128, 0)
    with pytest.raises(ValueError):
        lloyd_max(128, 9)
    with pytest.raises(ValueError):
        lloyd_max(1, 2)


def test_residual_codebooks():
    d = 128
    # Conditional stage 2 refines the stage-1 cells: 1+1 is exactly the 2-bit quantizer.
    np.testing.assert_allclose(residual_codebook(d, 1, 1).mse, lloyd_max(d, 2).mse, rtol=1e-6)
    for b1, b2 in [(2, 1), (2, 2), (3, 1), (3, 2)]:
        cond = residual_codebook(d, b1, b2)
        shared = residual_codebook(d, b1, b2, conditional=False)
        single = lloyd_max(d, b1 + b2).mse
        assert single <= cond.mse < 1.04 * single
        assert cond.mse < shared.mse < lloyd_max(d, b1).mse
        assert cond.centroids.shape == (2**b1, 2**b2)
        assert np.all(shared.centroids == shared.centroids[0])  # one shared row
        # Stage-2 boundaries stay inside their stage-1 cell.
        s1 = lloyd_max(d, b1)
        absb = cond.boundaries + s1.centroids[:, None]
        assert np.all(absb[1:, 0] > s1.boundaries) and np.all(absb[:-1, -1] < s1.boundaries)


def test_as_mx():
    cb = lloyd_max(64, 2)
    c, b = as_mx(cb)
    assert c.dtype == mx.float32 and c.shape == (4,) and b.shape == (3,)
    np.testing.assert_allclose(np.array(c), cb.centroids, rtol=1e-6)
    rc = residual_codebook(64, 2, 2)
    c2, b2 = as_mx(rc)
    assert c2.shape == (16,) and b2.shape == (12,)
