"""Seeded randomized Hadamard rotation (the "random rotation" of TurboQuant and QJL).

`forward(x) = H (s * pad(x))`: zero-pad the last axis to `padded_dim`, flip signs with a seeded
+-1 diagonal s, then apply the orthonormal Walsh-Hadamard transform H (`mx.hadamard_transform`
with scale 1/sqrt(n)). It preserves norms and inner products, and spreads any vector's energy
evenly over the coordinates, so each rotated coordinate of a unit vector is close in distribution
to one coordinate of a uniformly random unit vector (the distribution the codebooks are built for).

Sizes: MLX transforms n = m * 2^k with m in {1, 12, 20, 28} (64, 80 = 20*4, 96 = 12*8, 128, 256
are native). Other dims are zero-padded to the smallest such n >= dim; `inverse` returns the first
`dim` coordinates. For m in {20, 28} MLX's Hadamard matrix is orthogonal but not symmetric, so it
is not its own inverse: `inverse` then multiplies by the explicit transposed matrix (n x n fp32).

The signs are the top bits of the raw 64-bit outputs of numpy's PCG64 seeded with `seed` (the
bit generator behind `numpy.random.default_rng(seed)`), so they are the same on every backend;
raw bit-generator streams are stable across numpy versions (NEP 19), while the distribution
methods of `Generator` (e.g. `integers`) are not promised to be, and a cache on disk must decode
with the signs it was encoded with.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

_BASES = (1, 12, 20, 28)


def supported_size(dim: int) -> int:
    """The smallest n >= dim that `mx.hadamard_transform` supports (m * 2^k, m in 1/12/20/28)."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    best = None
    for m in _BASES:
        n = m
        while n < dim:
            n *= 2
        best = n if best is None else min(best, n)
    return best


@functools.lru_cache(maxsize=16)
def _hadamard_matrix(n: int) -> tuple[mx.array, bool]:
    """MLX's orthonormal Hadamard matrix M (rows: transformed unit vectors) and whether M = M^T."""
    m = mx.hadamard_transform(mx.eye(n, dtype=mx.float32), scale=1.0 / math.sqrt(n))  # (n, n)
    # Checked in float64 numpy: a GPU fp32 matmul may run in TF32 (CUDA's default in MLX) and
    # miss 1e-5 on an exactly orthonormal matrix.
    h = np.array(m, dtype=np.float64)
    if float(np.max(np.abs(h @ h.T - np.eye(n)))) > 1e-5:
        raise ValueError(f"mx.hadamard_transform is not orthonormal at size {n}")
    return m, float(np.max(np.abs(h - h.T))) < 1e-6


def rademacher_signs(n: int, seed: int) -> np.ndarray:
    """The +-1 diagonal: n float32 signs from the raw stream of numpy's PCG64(seed)."""
    raw = np.random.PCG64(seed).random_raw(n)  # (n,) uint64
    return np.where(raw >> np.uint64(63), 1.0, -1.0).astype(np.float32)


class RandomHadamard:
    """Orthonormal seeded rotation of the last axis: x (..., dim) -> (..., padded_dim).

    Args:
        dim: input size of the last axis.
        seed: seed of the sign diagonal.
    """

    def __init__(self, dim: int, seed: int):
        self.dim = dim
        self.seed = seed
        self.padded_dim = supported_size(dim)
        self.signs = mx.array(rademacher_signs(self.padded_dim, seed))  # (padded_dim,)
        self._scale = 1.0 / math.sqrt(self.padded_dim)
        matrix, symmetric = _hadamard_matrix(self.padded_dim)
        # Only non-symmetric sizes need the explicit matrix; M^T is the inverse transform.
        self._inverse_matrix = None if symmetric else matrix.T

    def forward(self, x: mx.array, signs: mx.array | None = None) -> mx.array:
        """Rotate the last axis.

        Args:
            x: (..., dim), any float dtype.
            signs: stand-in for `self.signs` (a traced input of a compiled function that serves
                every layer's rotation of this size).

        Returns:
            (..., padded_dim) float32.
        """
        x = x.astype(mx.float32)
        if x.shape[-1] != self.dim:
            raise ValueError(f"expected last axis {self.dim}, got {x.shape[-1]}")
        if x.size == 0:  # hadamard_transform rejects empty arrays (e.g. L = 0)
            return mx.zeros((*x.shape[:-1], self.padded_dim), dtype=mx.float32)
        if self.padded_dim != self.dim:
            pad = [(0, 0)] * (x.ndim - 1) + [(0, self.padded_dim - self.dim)]
            x = mx.pad(x, pad)  # (..., padded_dim)
        return mx.hadamard_transform(x * (self.signs if signs is None else signs), scale=self._scale)

    def inverse(self, y: mx.array, signs: mx.array | None = None) -> mx.array:
        """Undo `forward`.

        Args:
            y: (..., padded_dim), any float dtype.
            signs: stand-in for `self.signs`, as in `forward` (the inverse matrix depends on the
                size only).

        Returns:
            (..., dim) float32: the first `dim` coordinates of the un-rotated vector.
        """
        y = y.astype(mx.float32)
        if y.shape[-1] != self.padded_dim:
            raise ValueError(f"expected last axis {self.padded_dim}, got {y.shape[-1]}")
        if y.size == 0:
            return mx.zeros((*y.shape[:-1], self.dim), dtype=mx.float32)
        if self._inverse_matrix is None:
            z = mx.hadamard_transform(y, scale=self._scale)  # H is symmetric: H^-1 = H
        else:
            z = y @ self._inverse_matrix  # (..., padded_dim)
        z = z * (self.signs if signs is None else signs)
        return z[..., : self.dim] if self.padded_dim != self.dim else z
