"""Lloyd-Max scalar codebooks for the coordinates of a randomly rotated unit vector.

After a random rotation, one coordinate x of a unit vector in R^d has the density
(TurboQuant, Zandieh, Daliri, Hadian, Mirrokni 2025, arXiv 2504.19874)

    f_d(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) * (1 - x^2)^((d-3)/2),   x in [-1, 1],

which tends to N(0, 1/d) as d grows. The MSE-optimal b-bit scalar quantizer for it is found with
Lloyd's conditions (centroid = conditional mean of its cell, boundary = midpoint of neighbouring
centroids), solved with a few Lloyd steps then Newton's method. The density is tabulated as
piecewise constant on 2^16 grid cells, whose moments over any interval are exact, so the answer
is the continuous optimum up to the grid's O(h^2) and does not degrade for narrow (8-bit) cells.
Everything is numpy and deterministic; results are cached per (dim, bits), ~10 ms each.

Per-coordinate MSE times d tends to the Gaussian Lloyd-Max values 0.3634, 0.1175, 0.03454,
0.009497 for b = 1..4. For b = 1 the optimum is exactly c = +-E|x| = +-Gamma(d/2) /
(sqrt(pi) Gamma((d+1)/2)) ~ sqrt(2/(pi d)).

`residual_codebook` designs the stage-2 codebooks of the residual quantizer (rvq.py) the same way,
on the exact distribution of the stage-1 error x - c(x): either one codebook per stage-1 cell
(the error's distribution given the cell; the default) or one shared by all cells.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

MAX_BITS = 8
_GRID = 1 << 16  # grid cells of the tabulated densities
_TOL = 1e-11  # convergence of the boundaries, in units of the coordinate's std
_MAX_ITERS = 200


@dataclass(frozen=True, eq=False)
class Codebook:
    """A scalar quantizer: sorted centroids and the decision boundaries between them.

    Instances are cached and compared by identity.

    Attributes:
        centroids: (2^bits,) float64, increasing.
        boundaries: (2^bits - 1,) float64; value x maps to index #{k : x > boundaries[k]}.
        mse: expected squared error per coordinate under the design distribution.
        bits: index width.
        dim: the dimension whose coordinate distribution it was designed for.
    """

    centroids: np.ndarray
    boundaries: np.ndarray
    mse: float
    bits: int
    dim: int


@dataclass(frozen=True, eq=False)
class ResidualCodebook:
    """Stage-2 codebooks of the residual quantizer, one row per stage-1 index.

    The stage-1 error r = x - c1[i1] of a coordinate in stage-1 cell i1 is quantized with row i1:
    index i2 = #{j : r > boundaries[i1, j]}, reconstruction c1[i1] + centroids[i1, i2].

    Attributes:
        centroids: (2^bits1, 2^bits2) float64 offsets from the stage-1 centroid, rows increasing.
        boundaries: (2^bits1, 2^bits2 - 1) float64.
        mse: expected squared error per coordinate after both stages.
        bits1, bits2: stage widths; dim: the rotated dimension.
        conditional: rows designed per cell (True) or all rows equal (one shared codebook).
    """

    centroids: np.ndarray
    boundaries: np.ndarray
    mse: float
    bits1: int
    bits2: int
    dim: int
    conditional: bool


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float64)
    a.setflags(write=False)
    return a


def _check(dim: int, bits: int) -> None:
    if dim < 2:
        raise ValueError(f"dim must be >= 2, got {dim}")
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in 1..{MAX_BITS}, got {bits}")


class _Density:
    """A piecewise-constant density on a uniform grid, with exact moments over any interval.

    Cell j of `edges` carries probability mass[j]; F, G, S below are the exact mass, first and
    second moment left of any point t for that model, so Lloyd's cell integrals have no
    interpolation error however narrow the quantizer cells are.
    """

    def __init__(self, edges: np.ndarray, mass: np.ndarray):
        self.edges = edges
        self.h = edges[1] - edges[0]
        self.dens = mass / self.h
        e0, e1 = edges[:-1], edges[1:]
        zero = np.zeros(1)
        self.F = np.concatenate([zero, np.cumsum(mass)])
        self.G = np.concatenate([zero, np.cumsum(self.dens * (e1 - e0) * (e1 + e0) / 2)])
        self.S = np.concatenate([zero, np.cumsum(self.dens * (e1 - e0) * (e1 * e1 + e1 * e0 + e0 * e0) / 3)])

    def density(self, t: np.ndarray) -> np.ndarray:
        """The density at points t."""
        return self.dens[self._cell(t)]

    def _cell(self, t: np.ndarray) -> np.ndarray:
        k = np.floor((t - self.edges[0]) / self.h).astype(np.int64)
        return np.clip(k, 0, len(self.dens) - 1)

    def moments(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(F, G, S) at points t inside [edges[0], edges[-1]]."""
        k = self._cell(t)
        e, d, dt = self.edges[k], self.dens[k], t - self.edges[k]
        return (self.F[k] + d * dt, self.G[k] + d * dt * (t + e) / 2, self.S[k] + d * dt * (t * t + t * e + e * e) / 3)

    def quantile(self, p: np.ndarray, lo: float, hi: float, cube_root: bool = False) -> np.ndarray:
        """Points splitting [lo, hi] at fractions p of the mass of the density (or its cbrt)."""
        w = np.cbrt(self.dens) if cube_root else self.dens
        w = np.where((self.edges[1:] > lo) & (self.edges[:-1] < hi), w, 0.0)
        c = np.concatenate([[0.0], np.cumsum(w)])
        return np.clip(np.interp(p * c[-1], c, self.edges), lo, hi)


@functools.lru_cache(maxsize=None)
def _sphere(dim: int) -> _Density:
    """The density of one coordinate of a random unit vector in R^dim, tabulated."""
    # Beyond 16 std the mass is < 1e-50; shrinking the range keeps large-d grids fine.
    half = min(1.0, 16.0 / np.sqrt(dim))
    edges = np.linspace(-half, half, _GRID + 1)
    mids = 0.5 * (edges[1:] + edges[:-1])
    logf = 0.5 * (dim - 3) * np.log1p(-mids * mids)
    w = np.exp(logf - logf.max())
    return _Density(edges, w / w.sum())


def _cells(dens: _Density, lo: float, hi: float, bounds: np.ndarray):
    """Masses, conditional means and (F, G, S) at the edges of the cells split by `bounds`."""
    pts = np.concatenate([[lo], bounds, [hi]])
    F, G, S = dens.moments(pts)
    mass = np.diff(F)
    # Empty cells (never for these densities) keep their midpoint.
    cents = np.where(mass > 0, np.diff(G) / np.maximum(mass, 1e-300), 0.5 * (pts[1:] + pts[:-1]))
    return mass, cents, (F, G, S)


def _lloyd(
    dens: _Density, lo: float, hi: float, levels: int, scale: float, start: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float]:
    """Solve the Lloyd-Max conditions for `dens` restricted to [lo, hi].

    Lloyd's iteration converges slowly in the tails when there are many levels, so after a few
    plain Lloyd steps we solve `boundary = midpoint of neighbouring centroids` with Newton's
    method (tridiagonal Jacobian), falling back to a Lloyd step whenever Newton would not shrink
    the residual, and stopping when it reaches _TOL * scale or stops shrinking.

    Args:
        dens: the tabulated density; lo, hi: the interval quantized.
        levels: number of centroids.
        scale: the distribution's typical width (sets the convergence tolerance).
        start: (levels,) increasing initial centroids.

    Returns:
        (centroids (levels,), boundaries (levels-1,), mse of the restricted distribution, not
        renormalized: the sum over cells of the integral of (x - c)^2).
    """
    bounds = 0.5 * (start[1:] + start[:-1])
    for _ in range(20):
        cents = _cells(dens, lo, hi, bounds)[1]
        bounds = 0.5 * (cents[1:] + cents[:-1])
    prev_err = None
    for _ in range(_MAX_ITERS):
        mass, cents, _ = _cells(dens, lo, hi, bounds)
        resid = bounds - 0.5 * (cents[1:] + cents[:-1])
        err = np.max(np.abs(resid), initial=0.0)
        if err < _TOL * scale or (prev_err is not None and err >= prev_err):
            break
        prev_err = err
        accepted = False
        if levels > 2:
            f = dens.density(bounds)
            m = np.maximum(mass, 1e-300)
            up = f * (bounds - cents[:-1]) / m[:-1]  # d c_i / d t_i (upper edge of cell i)
            dn = f * (cents[1:] - bounds) / m[1:]  # d c_{i+1} / d t_i (lower edge of cell i+1)
            n = levels - 1
            jac = np.eye(n) - 0.5 * np.diag(up + dn)
            jac[np.arange(1, n), np.arange(n - 1)] -= 0.5 * dn[:-1]
            jac[np.arange(n - 1), np.arange(1, n)] -= 0.5 * up[1:]
            try:
                step = np.linalg.solve(jac, resid)
            except np.linalg.LinAlgError:
                step = np.full(n, np.nan)
            for damp in (1.0, 0.5, 0.25):
                trial = bounds - damp * step
                if np.all(np.isfinite(trial)) and np.all(np.diff(trial) > 0) and trial[0] > lo and trial[-1] < hi:
                    c2 = _cells(dens, lo, hi, trial)[1]
                    if np.max(np.abs(trial - 0.5 * (c2[1:] + c2[:-1]))) < err:
                        bounds, accepted = trial, True
                        break
        if not accepted:
            bounds = 0.5 * (cents[1:] + cents[:-1])
    _, cents, (F, G, S) = _cells(dens, lo, hi, bounds)
    # sum over cells of E[(x - c)^2] = S - 2 c G + c^2 F (cell differences).
    mse = float(np.sum(np.diff(S) - 2 * cents * np.diff(G) + cents * cents * np.diff(F)))
    return cents, bounds, max(mse, 0.0)


@functools.lru_cache(maxsize=None)
def lloyd_max(dim: int, bits: int) -> Codebook:
    """The MSE-optimal `bits`-bit codebook for one coordinate of a random unit vector in R^dim.

    Args:
        dim: the (rotated) vector dimension, >= 2.
        bits: 1..8.

    Returns:
        A symmetric Codebook with 2^bits centroids; `mse` is per coordinate (dim * mse is the
        expected squared error of a whole unit vector).
    """
    _check(dim, bits)
    dens = _sphere(dim)
    lo, hi = dens.edges[0], dens.edges[-1]
    levels = 1 << bits
    # Start from the high-resolution optimum (Panter-Dite): centroid density ~ f^(1/3).
    start = dens.quantile((np.arange(levels) + 0.5) / levels, lo, hi, cube_root=True)
    cents, bounds, mse = _lloyd(dens, lo, hi, levels, 1 / np.sqrt(dim), start)
    # Symmetrize away rounding noise so +-c are exact negatives.
    cents = 0.5 * (cents - cents[::-1])
    bounds = 0.5 * (bounds - bounds[::-1])
    return Codebook(_frozen(cents), _frozen(bounds), mse, bits, dim)


def _shared_residual(dim: int, stage1: Codebook, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """One codebook for the stage-1 error pooled over all cells."""
    dens = _sphere(dim)
    mids = 0.5 * (dens.edges[1:] + dens.edges[:-1])
    res = mids - stage1.centroids[np.searchsorted(stage1.boundaries, mids, side="left")]
    # Re-tabulate the error's distribution on its own uniform grid.
    half = np.max(np.abs(res)) * (1 + 1e-9)
    edges = np.linspace(-half, half, _GRID + 1)
    b = np.clip(np.searchsorted(edges, res, side="right") - 1, 0, _GRID - 1)
    rdens = _Density(edges, np.bincount(b, weights=dens.dens * dens.h, minlength=_GRID))
    # The error's density jumps at cell edges; start from equal-mass cells.
    start = rdens.quantile((np.arange(levels) + 0.5) / levels, -half, half)
    cents, bounds, _ = _lloyd(rdens, -half, half, levels, 1 / np.sqrt(dim), start)
    return cents, bounds


@functools.lru_cache(maxsize=None)
def residual_codebook(dim: int, bits1: int, bits2: int, conditional: bool = True) -> ResidualCodebook:
    """Stage-2 codebooks for the error of `lloyd_max(dim, bits1)`.

    Conditional codebooks are Lloyd-Max for the coordinate's distribution inside each stage-1
    cell, so the two stages together are a (bits1 + bits2)-bit quantizer whose cells refine the
    stage-1 cells; a shared codebook is Lloyd-Max for the error pooled over cells. Both have an
    absolute scale: nothing per vector is stored.

    Args:
        dim: the rotated dimension.
        bits1, bits2: stage widths, 1..8 each.
        conditional: per-cell rows (default) or one shared row.

    Returns:
        The ResidualCodebook; its `mse` is exact for the design distribution.
    """
    _check(dim, bits1)
    _check(dim, bits2)
    stage1 = lloyd_max(dim, bits1)
    dens = _sphere(dim)
    k1, k2 = 1 << bits1, 1 << bits2
    cuts = np.concatenate([[dens.edges[0]], stage1.boundaries, [dens.edges[-1]]])
    if conditional:
        cents = np.empty((k1, k2))
        bounds = np.empty((k1, k2 - 1))
        for k in range(k1):
            lo, hi = cuts[k], cuts[k + 1]
            start = dens.quantile((np.arange(k2) + 0.5) / k2, lo, hi)
            c, b, _ = _lloyd(dens, lo, hi, k2, 1 / np.sqrt(dim), start)
            cents[k], bounds[k] = c - stage1.centroids[k], b - stage1.centroids[k]
        # Cell k mirrors cell k1-1-k; symmetrize away rounding noise.
        cents = 0.5 * (cents - cents[::-1, ::-1])
        bounds = 0.5 * (bounds - bounds[::-1, ::-1])
    else:
        c, b = _shared_residual(dim, stage1, k2)
        cents = np.tile(0.5 * (c - c[::-1]), (k1, 1))
        bounds = np.tile(0.5 * (b - b[::-1]), (k1, 1))
    # Exact MSE of the final quantizer: sum over stage-1 cells and their stage-2 sub-cells.
    mse = 0.0
    for k in range(k1):
        absb = np.clip(bounds[k] + stage1.centroids[k], cuts[k], cuts[k + 1])
        F, G, S = dens.moments(np.concatenate([[cuts[k]], absb, [cuts[k + 1]]]))
        c = cents[k] + stage1.centroids[k]
        mse += float(np.sum(np.diff(S) - 2 * c * np.diff(G) + c * c * np.diff(F)))
    return ResidualCodebook(_frozen(cents), _frozen(bounds), max(mse, 0.0), bits1, bits2, dim, conditional)


def exact_one_bit_centroid(dim: int) -> float:
    """E|x| for one coordinate of a random unit vector in R^dim: the exact 1-bit centroid."""
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)


@functools.lru_cache(maxsize=None)
def as_mx(codebook: Codebook | ResidualCodebook) -> tuple[mx.array, mx.array]:
    """The codebook as fp32 MLX arrays (cached per codebook object).

    Returns:
        (centroids, boundaries) float32, flattened: (2^bits,), (2^bits - 1,) for a Codebook;
        (2^bits1 * 2^bits2,), (2^bits1 * (2^bits2 - 1),) row-major for a ResidualCodebook.
    """
    return (mx.array(codebook.centroids.astype(np.float32).ravel()), mx.array(codebook.boundaries.astype(np.float32).ravel()))
