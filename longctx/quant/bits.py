"""Exact storage accounting of a quantized KV cache, in bits per channel.

Per vector (one token of one head), in stored bits:
- `idx`: stage-1 indices as packed words: 32 * bits * ceil(padded_dim / 32);
- `norm`: 16 (fp16 norm);
- `idx2`: stage-2 indices, 32 * bits2 * ceil(padded_dim / 32) (no per-vector stage-2 scale:
  the stage-2 codebooks have an absolute scale, see rvq.py);
- `qjl`: packed sign bits, 32 * ceil(m / 32); `rnorm`: 16 (fp16 residual norm).

Per codec (shared by all the vectors it encodes, so amortized over them), what a file needs to
rebuild the codec without trusting a generator: `signs` (padded_dim bits, the rotation's
diagonal), `codebooks` (fp32 centroids: 2^bits, plus 2^(bits + bits2) for stage 2; boundaries
are the midpoints of the centroids so they are not stored) and `qjl_seed` (64 bits: the m x d
Gaussian projection is regenerated from it; storing it would cost 32 * m * d bits).

Bits per channel divide by the head dimension `dim` (not the padded one): padding is overhead.
"""

from __future__ import annotations

from typing import Any

from longctx.quant.packing import packed_words
from longctx.quant.qjl import default_sketch_dim
from longctx.quant.rotation import supported_size

NORM_BITS = 16
SEED_BITS = 64
CENTROID_BITS = 32


def vector_bits(
    dim: int, bits: int, bits2: int = 0, qjl: bool = False, qjl_dim: int | None = None, tokens: int | None = None
) -> dict[str, Any]:
    """Storage breakdown of one codec configuration.

    Args:
        dim: head dimension.
        bits: stage-1 bits; bits2: stage-2 bits (0 = none); qjl: whether a sign sketch is kept.
        qjl_dim: number of QJL projections (default: padded_dim rounded up to a multiple of 32).
        tokens: vectors sharing the per-codec constants; None = asymptotic (constants ignored).

    Returns:
        {"per_vector": {name: bits}, "constants": {name: bits}, "vector_bits": int,
         "constant_bits": int, "bits_per_channel": float}.
    """
    p = supported_size(dim)
    per = {"idx": 32 * packed_words(p, bits), "norm": NORM_BITS}
    const = {"signs": p, "codebooks": CENTROID_BITS * (1 << bits)}
    if bits2:
        per["idx2"] = 32 * packed_words(p, bits2)
        const["codebooks"] += CENTROID_BITS * (1 << (bits + bits2))
    if qjl:
        m = default_sketch_dim(p) if qjl_dim is None else qjl_dim
        per["qjl"] = 32 * packed_words(m, 1)
        per["rnorm"] = NORM_BITS
        const["qjl_seed"] = SEED_BITS
    vec = sum(per.values())
    cst = sum(const.values())
    amortized = 0.0 if tokens is None else cst / tokens
    return {
        "per_vector": per,
        "constants": const,
        "vector_bits": vec,
        "constant_bits": cst,
        "bits_per_channel": (vec + amortized) / dim,
    }


def spec_bits(dim: int, spec: Any, tokens: int | None = None) -> dict[str, Any]:
    """`vector_bits` for an object with `bits`, `bits2`, `qjl` attributes (a QuantSpec)."""
    return vector_bits(dim, spec.bits, spec.bits2, spec.qjl, tokens=tokens)


def kv_bits(dim: int, key_spec: Any, value_spec: Any, tokens: int | None = None) -> dict[str, Any]:
    """Breakdown for keys and values and their average bits per channel.

    Args:
        dim: head dimension.
        key_spec, value_spec: QuantSpec-like (`bits`, `bits2`, `qjl`).
        tokens: vectors per codec (see `vector_bits`).

    Returns:
        {"keys": breakdown, "values": breakdown, "average": float}.
    """
    keys = spec_bits(dim, key_spec, tokens)
    values = spec_bits(dim, value_spec, tokens)
    return {"keys": keys, "values": values, "average": 0.5 * (keys["bits_per_channel"] + values["bits_per_channel"])}
