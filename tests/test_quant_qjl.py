"""QJL sign sketch: the inner-product estimator is unbiased where the MSE decode is not."""

from __future__ import annotations

import math

import numpy as np
import pytest

import longctx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from longctx.quant.codec import QuantSpec, VectorCodec
from longctx.quant.qjl import QJLSketch, default_sketch_dim, projection_matrix, row_length

N = 10_000
D = 128


def _pairs(rho: float, seed: int):
    """N correlated (q, k) pairs, k = rho q + sqrt(1 - rho^2) noise: (N, 1, D) each."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((N, 1, D)).astype(np.float32)
    k = (rho * q + math.sqrt(1 - rho * rho) * rng.standard_normal((N, 1, D))).astype(np.float32)
    return mx.array(q), mx.array(k)


def _scores(codec, q, k):
    """Per-pair true score, MSE-only estimate and QJL-corrected estimate: (N,) each."""
    enc = codec.encode(k)  # arrays (N, 1, ...): one key per pair
    q_rot = codec.rotate(q)  # (N, 1, P)
    mse_only = (q_rot @ codec.decode_rotated(enc).swapaxes(-1, -2))[:, 0, 0]
    corr = codec.qjl_correction(codec.qjl_project(q_rot), enc)  # (N, 1, 1)
    true = mx.sum(q * k, axis=-1)[:, 0]
    r = codec.rotate(k) - codec.decode_rotated(enc)  # (N, 1, P) the sketched residual
    return (
        np.array(true),
        np.array(mse_only),
        np.array(mse_only + corr[:, 0, 0]),
        np.array(mx.sum(q * q, -1)[:, 0]),
        np.array(mx.sum(r * r, -1)[:, 0]),
    )


@pytest.mark.parametrize("bits,bits2", [(2, 0), (3, 0), (2, 1)])
def test_qjl_unbiased_mse_biased(bits, bits2):
    codec = VectorCodec(D, QuantSpec(bits, bits2, qjl=True), seed=17)
    true, mse_only, qjl, qq, rr = _scores(codec, *_pairs(0.8, seed=bits * 10 + bits2))
    err_qjl, err_mse = qjl - true, mse_only - true
    se_qjl = err_qjl.std() / math.sqrt(N)
    se_mse = err_mse.std() / math.sqrt(N)
    assert abs(err_qjl.mean()) < 3 * se_qjl
    # The MSE decode under-counts aligned scores by about the relative MSE of the key.
    assert err_mse.mean() < -10 * se_mse
    rel_bias = err_mse.mean() / true.mean()
    assert -1.25 * codec.unit_mse < rel_bias < -0.75 * codec.unit_mse
    # Variance: i.i.d. Gaussian rows would give about (pi/2) ||q||^2 ||r||^2 / m; orthogonal
    # rows about (pi/2 - 1) / (pi/2) = 36% of that. Not smaller: the sketch really is 1-bit.
    gaussian = np.mean(math.pi / 2 * qq * rr / codec.qjl.m)
    var_qjl = np.mean(err_qjl**2)
    assert 0.25 * gaussian < var_qjl < 0.5 * gaussian


def test_estimator_formula():
    sk = QJLSketch(dim=40, seed=3, m=48)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 40)).astype(np.float32)
    r = rng.standard_normal((2, 7, 40)).astype(np.float32)
    packed, rnorm = sk.sketch(mx.array(r))
    assert packed.dtype == mx.uint32 and packed.shape == (2, 7, 2)
    assert rnorm.dtype == mx.float16 and rnorm.shape == (2, 7)
    S = projection_matrix(40, 48, 3)  # (m, d)
    signs = np.where(r @ S.T >= 0, 1.0, -1.0)  # (2, 7, m)
    np.testing.assert_array_equal(np.array(sk.signs(packed)), signs)
    want = math.sqrt(math.pi / 2) / 48 * (q @ S.T) @ signs.swapaxes(-1, -2)
    want = want * np.array(rnorm, dtype=np.float32)[:, None, :]
    got = sk.estimate(sk.project(mx.array(q)), packed, rnorm)
    assert got.shape == (2, 5, 7)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)


def test_projection_seeded_orthogonal_and_pinned():
    a, b = projection_matrix(16, 16, 1), projection_matrix(16, 16, 2)
    assert np.array_equal(a, projection_matrix(16, 16, 1)) and not np.array_equal(a, b)
    c = row_length(16)
    np.testing.assert_allclose(a.astype(np.float64) @ a.T, c * c * np.eye(16), atol=1e-4 * c * c)
    # More rows than dims: orthogonal blocks, every row of length E||g||.
    s = projection_matrix(80, 96, 3).astype(np.float64)
    np.testing.assert_allclose(np.linalg.norm(s, axis=1), row_length(80), rtol=1e-6)
    np.testing.assert_allclose(s[80:] @ s[80:].T, row_length(80) ** 2 * np.eye(16), atol=1e-3)
    assert abs(row_length(128) - 11.29163) < 1e-5  # sqrt(2) Gamma(64.5) / Gamma(64)
    # Part of the on-disk format: the projection for a seed must never change.
    np.testing.assert_allclose(
        projection_matrix(4, 2, 0),
        [[1.5555446, 0.06967139, -0.00903936, 1.053393], [-0.03088075, 1.5833833, -1.0107615, -0.0677969]],
        rtol=1e-5,
    )
    assert default_sketch_dim(128) == 128 and default_sketch_dim(80) == 96


def test_projection_independent_of_rotation():
    # Same seed for rotation and sketch: the projection rows must not track the sign diagonal.
    codec = VectorCodec(128, QuantSpec(2, qjl=True), seed=0)
    s = np.array(codec.rotation.signs)
    S = projection_matrix(128, 128, 0)
    assert abs(np.mean(np.sign(S) * s)) < 0.05
