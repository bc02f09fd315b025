"""Inputs for the kernel tests and benchmarks: random packed caches with real codebooks."""

from __future__ import annotations

import numpy as np

import mlx.core as mx

from longctx.kvcache.presets import PRESETS
from longctx.quant.codebooks import lloyd_max, residual_codebook

TURBO = {name: p for name, p in PRESETS.items() if p.kind == "turbo"}


def preset_bits(name: str) -> tuple[int, int, bool, int]:
    """(key_bits, key_bits2, key_qjl, value_bits) of a turbo preset."""
    p = TURBO[name]
    return p.key_bits, p.key_bits2, p.key_qjl, p.value_bits


def tables(p: int, b1: int, b2: int, bv: int) -> tuple[mx.array, mx.array]:
    """The fused kernel's key table (c1, or c1 + c2 per cell) and the value centroids."""
    c1 = lloyd_max(p, b1).centroids.astype(np.float32)
    if b2:
        c1 = (c1[:, None] + residual_codebook(p, b1, b2).centroids.astype(np.float32)).ravel()
    return mx.array(c1), mx.array(lloyd_max(p, bv).centroids.astype(np.float32))


def random_segment(B, H, R, P, L, b1, b2, bv, qjl, seed=0, capacity=None):
    """(q, q_proj, keys, values, key_table, value_table): random codes (every bit pattern is a
    valid code), norms in [0.5, 2), queries with realistic spread; with `capacity`, the arrays
    are slices [:, :, :L] of larger buffers, like the cache's preallocated tail."""
    rng = np.random.default_rng(seed)
    cap = capacity or L

    def words(bits, n=P):
        w = rng.integers(0, 2**32, size=(B, H, cap, bits * n // 32), dtype=np.uint64)
        return mx.array(w.astype(np.uint32))[:, :, :L]

    def norms(lo, hi):
        return mx.array(rng.uniform(lo, hi, size=(B, H, cap)).astype(np.float16))[:, :, :L]

    keys = {"idx": words(b1), "norm": norms(0.5, 2.0)}
    if b2:
        keys["idx2"] = words(b2)
    q_proj = None
    if qjl:
        keys["qjl"] = words(1)
        keys["rnorm"] = norms(0.0, 0.5)
        q_proj = mx.array(rng.normal(size=(B, H, R, P)).astype(np.float32))
    values = {"idx": words(bv), "norm": norms(0.5, 2.0)}
    q = mx.array(rng.normal(size=(B, H, R, P)).astype(np.float32)) * 3.0
    kt, vt = tables(P, b1, b2, bv)
    return q, q_proj, keys, values, kt, vt


def state_errors(out, ref) -> dict:
    """Distances between two (m, l, acc) states: output rows acc/l (relative Frobenius), m, l."""
    m1, l1, a1 = (np.array(x, dtype=np.float64) for x in out)
    m2, l2, a2 = (np.array(x, dtype=np.float64) for x in ref)
    seen = l2[..., 0] > 0
    o1, o2 = a1[seen] / l1[seen], a2[seen] / l2[seen]
    return {
        "out_rel": float(np.linalg.norm(o1 - o2) / max(np.linalg.norm(o2), 1e-30)),
        "m_abs": float(np.abs(m1[seen] - m2[seen]).max()) if seen.any() else 0.0,
        "l_rel": float(np.abs(l1[seen] / l2[seen] - 1).max()) if seen.any() else 0.0,
        "unseen_ok": bool(np.all(l1[~seen] == 0) and np.all(a1[~seen] == 0) and np.all(np.isneginf(m1[~seen]))),
        "finite": bool(np.all(np.isfinite(a1)) and np.all(np.isfinite(l1))),
    }
