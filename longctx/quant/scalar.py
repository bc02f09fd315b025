"""Coordinate-wise scalar quantization with a Lloyd-Max codebook (TurboQuant_mse).

A vector x is stored as its fp16 norm plus the b-bit codebook indices of the rotated unit vector
u = R x / ||x||; it is rebuilt as ||x|| * c[idx] (in the rotated frame), then rotated back.
Because each centroid is the conditional mean of its cell, the error of u is uncorrelated with
the reconstruction, so E||u - u_hat||^2 = dim * codebook.mse, and <q, u_hat> under-estimates
<q, u> by the factor (1 - that error) on average when q is aligned with u (see qjl.py).

Reference: Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant" (arXiv 2504.19874), Algorithm 1.
"""

from __future__ import annotations

import mlx.core as mx

from longctx.quant.codebooks import Codebook, as_mx
from longctx.quant.rotation import RandomHadamard

FP16_MAX = 65504.0


def quantize(x: mx.array, codebook: Codebook) -> mx.array:
    """Index of the nearest centroid of every element.

    A branch-free binary search over the sorted boundaries: `bits` gathers and compares, so
    memory stays a small multiple of x's (no (..., 2^bits) distance tensor). Equals
    `(x[..., None] > boundaries).sum(-1)`.

    Args:
        x: (...) float array in the codebook's units (rotated unit-vector coordinates).
        codebook: the scalar quantizer.

    Returns:
        (...) uint8 indices in [0, 2^bits).
    """
    _, bounds = as_mx(codebook)  # (2^b - 1,)
    x = x.astype(mx.float32)
    idx = mx.zeros(x.shape, dtype=mx.uint32)
    step = 1 << (codebook.bits - 1)
    while step:
        cand = idx + step
        idx = mx.where(x > mx.take(bounds, cand - 1), cand, idx)
        step >>= 1
    return idx.astype(mx.uint8)


def dequantize(indices: mx.array, codebook: Codebook) -> mx.array:
    """Centroid values of indices.

    Args:
        indices: (...) integer indices.
        codebook: the scalar quantizer.

    Returns:
        (...) float32.
    """
    cents, _ = as_mx(codebook)
    return mx.take(cents, indices.astype(mx.uint32))


def split_norm(x: mx.array) -> tuple[mx.array, mx.array]:
    """Split vectors into fp16 norms and fp32 unit directions (zero vectors stay zero).

    Args:
        x: (..., D).

    Returns:
        (unit (..., D) float32, norms (...) float16, clipped to the fp16 range).
    """
    x = x.astype(mx.float32)
    norm = mx.sqrt(mx.sum(x * x, axis=-1))  # (...)
    unit = x / mx.maximum(norm, 1e-30)[..., None]
    return unit, mx.minimum(norm, FP16_MAX).astype(mx.float16)


def encode_unit(x: mx.array, rotation: RandomHadamard, codebook: Codebook) -> tuple[mx.array, mx.array]:
    """Normalize, rotate and quantize vectors.

    Args:
        x: (..., dim) vectors.
        rotation: the seeded rotation (its padded_dim must equal codebook.dim).
        codebook: lloyd_max(rotation.padded_dim, bits).

    Returns:
        (indices (..., padded_dim) uint8, norms (...) float16).
    """
    unit, norms = split_norm(x)
    return quantize(rotation.forward(unit), codebook), norms


def decode_unit(indices: mx.array, norms: mx.array, codebook: Codebook, rotation: RandomHadamard | None = None) -> mx.array:
    """Rebuild vectors from `encode_unit`'s output.

    Args:
        indices: (..., padded_dim) indices.
        norms: (...) norms.
        codebook: the codebook used to encode.
        rotation: if given, rotate back to the original frame.

    Returns:
        (..., padded_dim) float32 in the rotated frame, or (..., dim) if `rotation` is given.
    """
    y = dequantize(indices, codebook) * norms.astype(mx.float32)[..., None]
    return rotation.inverse(y) if rotation is not None else y
