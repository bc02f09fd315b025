"""Randomized Hadamard rotation: orthonormal, invertible, seeded, any leading shape."""

from __future__ import annotations

import numpy as np
import pytest

import longctx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from longctx.quant.rotation import RandomHadamard, rademacher_signs, supported_size

DIMS = [64, 80, 96, 128, 256]


def _rand(shape, seed):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("dim", DIMS + [100, 48, 7])
def test_preserves_norms_and_inner_products(dim):
    rot = RandomHadamard(dim, seed=11)
    x, y = _rand((3, 5, dim), 0), _rand((3, 5, dim), 1)
    rx, ry = rot.forward(x), rot.forward(y)
    assert rx.shape == (3, 5, rot.padded_dim) and rx.dtype == mx.float32
    nx = np.linalg.norm(np.array(x), axis=-1)
    ny = np.linalg.norm(np.array(y), axis=-1)
    np.testing.assert_allclose(np.linalg.norm(np.array(rx), axis=-1), nx, rtol=1e-5)
    ip = np.sum(np.array(x) * np.array(y), -1)
    rip = np.sum(np.array(rx) * np.array(ry), -1)
    assert np.max(np.abs(rip - ip) / (nx * ny)) < 1e-5


@pytest.mark.parametrize("dim", DIMS + [100, 7])
def test_inverse_is_identity(dim):
    rot = RandomHadamard(dim, seed=3)
    x = _rand((2, 3, 9, dim), 2)
    back = rot.inverse(rot.forward(x))
    assert back.shape == x.shape
    scale = np.max(np.abs(np.array(x)))
    assert np.max(np.abs(np.array(back) - np.array(x))) < 1e-5 * scale
    # And the other way round for non-padded sizes (the rotation is square there).
    if rot.padded_dim == dim:
        y = _rand((4, dim), 5)
        np.testing.assert_allclose(np.array(rot.forward(rot.inverse(y))), np.array(y), atol=1e-5)


def test_native_sizes_and_padding():
    assert [supported_size(d) for d in DIMS] == DIMS  # 80 = 20*4, 96 = 12*8 are native
    assert supported_size(100) == 112  # 28*4
    assert supported_size(7) == 8
    assert supported_size(130) == 160  # 20*8 beats 256
    assert RandomHadamard(100, 0).padded_dim == 112


def test_rotation_actually_mixes():
    # A basis vector must be spread over all coordinates (|entries| = 1/sqrt(n)).
    rot = RandomHadamard(128, seed=1)
    e = mx.zeros((128,)).at[5].add(1.0)
    np.testing.assert_allclose(np.abs(np.array(rot.forward(e))), 1 / np.sqrt(128), rtol=1e-5)


def test_deterministic_from_seed():
    a, b, c = RandomHadamard(128, 42), RandomHadamard(128, 42), RandomHadamard(128, 43)
    x = _rand((4, 128), 9)
    assert np.array_equal(np.array(a.signs), np.array(b.signs))
    assert np.array_equal(np.array(a.forward(x)), np.array(b.forward(x)))
    assert not np.array_equal(np.array(a.signs), np.array(c.signs))
    assert set(np.unique(np.array(a.signs))) == {-1.0, 1.0}


def test_signs_pinned():
    # The signs are part of the on-disk format: they must never change for a given seed.
    expected = [1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, -1, 1, -1, 1, -1]
    assert rademacher_signs(16, 0).tolist() == expected
    assert np.array(RandomHadamard(16, 0).signs).tolist() == expected


def test_wrong_size_rejected():
    rot = RandomHadamard(64, 0)
    with pytest.raises(ValueError):
        rot.forward(mx.zeros((2, 63)))
    with pytest.raises(ValueError):
        rot.inverse(mx.zeros((2, 63)))
