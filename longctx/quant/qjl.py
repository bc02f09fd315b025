"""QJL: a 1-bit sign sketch of a residual that makes inner products unbiased.

The MSE quantizers are biased for inner products: with conditional-mean centroids the error
e = k - k_hat is uncorrelated with k_hat, so for a query aligned with the key,
E<q, k_hat> = (1 - relative MSE) <q, k> (an under-count). QJL (Zandieh, Daliri, Han 2024,
arXiv 2406.03482; used as the second stage of TurboQuant_prod, arXiv 2504.19874) stores
sign(S r) and ||r|| for the residual r under an independent random projection S (m x d), and
estimates

    <q, r> ~ sqrt(pi/2) / m * ||r|| * <S q, sign(S r)>.

For a Gaussian row s ~ N(0, I): E[<s, q> sign(<s, r>)] = sqrt(2/pi) <q, r> / ||r||, so the
estimate is unbiased, with variance at most (pi/2) ||q||^2 ||r||^2 / m for i.i.d. rows.

Our rows are orthogonal (blocks of d rows of a Haar-random orthogonal matrix) and all have length
c_d = E||g|| = sqrt(2) Gamma((d+1)/2) / Gamma(d/2), the mean length of a Gaussian row. Each row
is still c_d times a uniformly random direction, and a Gaussian row is an independent length
times such a direction, so each row has the same expectation as a Gaussian one: the estimator
stays unbiased over the draw of S, with the same formula. But the error variance at m = d drops
to about (pi/2 - 1) / (pi/2) = 36% of the i.i.d. Gaussian one (measured at d = 128, 2-bit keys:
RMS 0.0218 vs 0.0368), and with one S fixed per cache the S-dependent bias (the estimator is
unbiased only on average over S) shrinks from ~2 to ~0.5 standard errors at 20k pairs.

S is built from the raw stream of numpy's PCG64 seeded with [seed, QJL_STREAM] (Box-Muller, then
Gram-Schmidt): independent of the rotation's signs (PCG64(seed)), the same on every backend up
to floating-point rounding, and stable across numpy versions (raw bit-generator streams are;
`Generator.standard_normal` is not promised to be). m defaults to the sketch width rounded up to
a multiple of 32: the packed words hold that many bits anyway. The query is projected once
(`project`) and scored against all keys' signs with one matmul (`estimate`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from longctx.quant.packing import pack, packed_words, unpack
from longctx.quant.scalar import FP16_MAX

QJL_STREAM = 0x514A4C  # "QJL": second entropy word, separating S from the rotation's stream


def default_sketch_dim(dim: int) -> int:
    """Number of projections for residuals of size dim: dim rounded up to a multiple of 32."""
    return 32 * ((dim + 31) // 32)


def _gaussians(n: int, bitgen: np.random.PCG64) -> np.ndarray:
    """n i.i.d. N(0, 1) float64 by Box-Muller from raw 64-bit outputs (stable across numpy)."""
    raw = bitgen.random_raw(2 * ((n + 1) // 2))
    u = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # uniform in (0, 1)
    rad = np.sqrt(-2.0 * np.log(u[0::2]))
    z = np.stack([rad * np.cos(2 * np.pi * u[1::2]), rad * np.sin(2 * np.pi * u[1::2])], axis=1)
    return z.ravel()[:n]


def row_length(dim: int) -> float:
    """E||g|| for g ~ N(0, I_dim): the length given to every projection row."""
    return math.sqrt(2.0) * math.exp(math.lgamma((dim + 1) / 2) - math.lgamma(dim / 2))


def projection_matrix(dim: int, m: int, seed: int) -> np.ndarray:
    """The (m, dim) float32 projection for `seed`: blocks of orthogonal rows of length E||g||.

    Args:
        dim: size of the projected vectors.
        m: number of rows; rows within each block of `dim` are orthogonal.
        seed: projection seed.

    Returns:
        (m, dim) float32.
    """
    bitgen = np.random.PCG64([seed, QJL_STREAM])
    blocks = []
    for lo in range(0, m, dim):
        rows = min(dim, m - lo)
        blocks.append(_orthonormal_rows(_gaussians(rows * dim, bitgen).reshape(rows, dim)))
    return (np.concatenate(blocks, axis=0) * row_length(dim)).astype(np.float32)


def _orthonormal_rows(g: np.ndarray) -> np.ndarray:
    """Gram-Schmidt (twice, for stability) of the rows of a Gaussian matrix: Haar rows.

    Matrix-vector products only: with OpenBLAS preloaded for MLX, numpy's own LAPACK QR and
    matrix-matrix products oversubscribe the cores and take ~100x longer on small matrices.
    """
    q = np.empty_like(g)
    for i in range(g.shape[0]):
        v = g[i].copy()
        for _ in range(2 if i else 0):
            v -= q[:i].T @ (q[:i] @ v)
        q[i] = v / np.sqrt(v @ v)
    return q


class QJLSketch:
    """Sign sketch of vectors in R^dim under a seeded Gaussian projection.

    Args:
        dim: size of the sketched vectors (the rotated dimension).
        seed: projection seed.
        m: number of projections (default: `default_sketch_dim(dim)`).
    """

    def __init__(self, dim: int, seed: int, m: int | None = None):
        self.dim = dim
        self.seed = seed
        self.m = default_sketch_dim(dim) if m is None else m
        self.words = packed_words(self.m, 1)
        self._st = mx.array(projection_matrix(dim, self.m, seed).T)  # (dim, m)

    @property
    def projection(self) -> mx.array:
        """S, (m, dim) float32."""
        return self._st.T

    @property
    def projection_t(self) -> mx.array:
        """S^T, (dim, m) float32: what `project` multiplies by."""
        return self._st

    def project(self, q: mx.array, projection_t: mx.array | None = None) -> mx.array:
        """S q, computed once per query.

        Args:
            q: (..., dim).
            projection_t: stand-in for `projection_t` (a traced input of a compiled function
                that serves every layer's sketch of this size).

        Returns:
            (..., m) float32.
        """
        return q.astype(mx.float32) @ (self._st if projection_t is None else projection_t)

    def sketch(self, r: mx.array) -> tuple[mx.array, mx.array]:
        """Signs of S r, packed, and ||r||.

        Args:
            r: (..., dim) residuals.

        Returns:
            (signs (..., ceil(m/32)) uint32 with bit j = [<S_j, r> >= 0] (packing.py layout),
             rnorm (...) float16).
        """
        r = r.astype(mx.float32)
        bits = (self.project(r) >= 0).astype(mx.uint8)  # (..., m)
        rnorm = mx.minimum(mx.sqrt(mx.sum(r * r, axis=-1)), FP16_MAX).astype(mx.float16)
        return pack(bits, 1), rnorm

    def signs(self, packed: mx.array) -> mx.array:
        """Unpack signs to +-1.

        Args:
            packed: (..., ceil(m/32)) uint32.

        Returns:
            (..., m) float32 in {-1, +1}.
        """
        return unpack(packed, 1, self.m).astype(mx.float32) * 2.0 - 1.0

    def estimate(self, q_proj: mx.array, packed: mx.array, rnorm: mx.array) -> mx.array:
        """Unbiased estimates of <q, r> for every (query, sketched vector) pair.

        Args:
            q_proj: (..., Lq, m) projected queries (`project`).
            packed: (..., Lk, ceil(m/32)) packed signs; leading dims broadcast with q_proj's.
            rnorm: (..., Lk) residual norms.

        Returns:
            (..., Lq, Lk) float32.
        """
        s = self.signs(packed)  # (..., Lk, m)
        dots = q_proj.astype(mx.float32) @ mx.swapaxes(s, -1, -2)  # (..., Lq, Lk)
        scale = math.sqrt(math.pi / 2) / self.m
        return dots * (scale * rnorm.astype(mx.float32))[..., None, :]
