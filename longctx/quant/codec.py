"""VectorCodec: the quantizer the KV cache stores keys and values with.

A vector x (..., L, dim) is stored as named arrays (their names are part of the on-disk format):

    name    dtype    shape                           when
    idx     uint32   (..., L, bits * ceil(P / 32))    always: stage-1 indices, packing.py layout
    norm    float16  (..., L)                        always: ||x||
    idx2    uint32   (..., L, bits2 * ceil(P / 32))   bits2 > 0: stage-2 indices (rvq.py)
    qjl     uint32   (..., L, ceil(m / 32))           qjl: signs of S r (qjl.py)
    rnorm   float16  (..., L)                        qjl: ||r||

where P = padded_dim (rotation.py), m = the QJL width (P rounded up to a multiple of 32), and
r = rotate(x) - decode_rotated(x) is the final residual in the rotated frame, in the key's own
units (norm included).

Attention works in the rotated frame: with q_rot = rotate(q),

    scores = q_rot @ decode_rotated(k).T + qjl_correction(qjl_project(q_rot), k)

is an unbiased estimate of q @ k.T (the second term only with qjl), values are accumulated as
p @ decode_rotated(v), and the output is rotated back once with `unrotate`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from longctx.quant import bits as bitcount
from longctx.quant.codebooks import MAX_BITS, lloyd_max
from longctx.quant.packing import pack, unpack
from longctx.quant.qjl import QJLSketch
from longctx.quant.rotation import RandomHadamard
from longctx.quant.rvq import ResidualQuantizer
from longctx.quant.scalar import dequantize, quantize, split_norm
from longctx.kernels.hadamard_quant import hadamard_quantize
from longctx.kernels import backend
from longctx.kernels.hadamard_quant import DIMS
from longctx.quant import lut


@dataclass(frozen=True)
class QuantSpec:
    """How vectors are quantized.

    Attributes:
        bits: stage-1 Lloyd-Max bits per coordinate (1..8).
        bits2: stage-2 residual bits (0 = single stage).
        qjl: keep a 1-bit QJL sketch of the final residual (for unbiased key scores).
    """

    bits: int
    bits2: int = 0
    qjl: bool = False

    def __post_init__(self):
        if not 1 <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be in 1..{MAX_BITS}, got {self.bits}")
        if not 0 <= self.bits2 <= MAX_BITS:
            raise ValueError(f"bits2 must be in 0..{MAX_BITS}, got {self.bits2}")


_KEYS: dict = {}  # (dim, spec) -> VectorCodec.key


class VectorCodec:
    """Encode/decode vectors of size `dim` under `spec`, with seeded rotation and projection.

    Args:
        dim: vector (head) dimension.
        spec: the QuantSpec.
        seed: seeds the rotation signs and (as an independent stream) the QJL projection.
    """

    def __init__(self, dim: int, spec: QuantSpec, seed: int):
        self.dim = dim
        self.spec = spec
        self.seed = seed
        self.rotation = RandomHadamard(dim, seed)
        self.padded_dim = self.rotation.padded_dim
        self.codebook = lloyd_max(self.padded_dim, spec.bits)
        self.rvq = ResidualQuantizer(self.padded_dim, spec.bits, spec.bits2) if spec.bits2 else None
        self.qjl = QJLSketch(self.padded_dim, seed) if spec.qjl else None

    @property
    def unit_mse(self) -> float:
        """Expected ||u - u_hat||^2 of a unit vector before QJL (design value)."""
        per = self.rvq.mse if self.rvq is not None else self.codebook.mse
        return per * self.padded_dim

    def rotate(self, q: mx.array) -> mx.array:
        """(..., dim) -> (..., padded_dim) float32, the frame decode_rotated works in."""
        return self.rotation.forward(q)

    def unrotate(self, o: mx.array) -> mx.array:
        """(..., padded_dim) -> (..., dim) float32."""
        return self.rotation.inverse(o)

    def encode(self, x: mx.array) -> dict[str, mx.array]:
        """Quantize vectors.

        Args:
            x: (..., L, dim), any float dtype; any leading shape, any L >= 1.

        Returns:
            Named arrays as in the module docstring.
        """
        if self.fused_encode():
            # One kernel instead of ~40 small MLX ops (a prefill chunk's encode on a GPU)

            lead = x.shape[:-1]
            idx, norm = hadamard_quantize(x.reshape(-1, self.dim), self.rotation.signs, self.boundaries)
            return {"idx": idx.reshape(*lead, idx.shape[-1]), "norm": norm.reshape(lead)}
        unit, norm = split_norm(x)  # (..., L, dim), (..., L)
        y = self.rotation.forward(unit)  # (..., L, P)
        if self.rvq is None:
            i1, i2 = quantize(y, self.codebook), None
        else:
            i1, i2 = self.rvq.quantize(y)
        enc = {"idx": pack(i1, self.spec.bits), "norm": norm}
        if i2 is not None:
            enc["idx2"] = pack(i2, self.spec.bits2)
        if self.qjl is not None:
            # Residual in key units: the true rotated x minus what decode_rotated returns.
            full = mx.sqrt(mx.sum(x.astype(mx.float32) ** 2, axis=-1))  # (..., L)
            r = y * full[..., None] - self._decode_unit(i1, i2) * norm.astype(mx.float32)[..., None]
            enc["qjl"], enc["rnorm"] = self.qjl.sketch(r)
        return enc

    def fused_encode(self) -> bool:
        """Whether `encode` runs the fused GPU kernel (`kernels/hadamard_quant.py`): a GPU backend
        and a scalar spec (no RVQ, no QJL) of an unpadded dim the kernel takes (64/128/256).
        Its codes equal the MLX path's except for a coordinate within ~1e-6 of a boundary."""
        return self._fused_shape and backend() != "cpu"

    @functools.cached_property
    def _fused_shape(self) -> bool:
        # (the spec and dims of `fused_encode`, once: a prefill chunk asks it at every layer)

        return self.rvq is None and self.qjl is None and self.padded_dim == self.dim and self.dim in DIMS

    @functools.cached_property
    def key(self) -> int:
        """A small int for (dim, spec), the same for every codec of them in this process: what a
        compiled function's key holds instead of the spec (hashing the spec dataclass at every
        layer cost more than the rest of the key)."""
        return _KEYS.setdefault((self.dim, self.spec), len(_KEYS))

    @functools.cached_property
    def boundaries(self) -> mx.array:
        return mx.array(self.codebook.boundaries.astype(np.float32))

    def _decode_unit(self, i1: mx.array, i2: mx.array | None) -> mx.array:
        if self.rvq is None:
            return dequantize(i1, self.codebook)
        return self.rvq.dequantize(i1, i2)

    def decode_rotated(self, enc: dict[str, mx.array]) -> mx.array:
        """Reconstruction in the rotated frame, scaled by the norm.

        Args:
            enc: `encode`'s output (extra entries are ignored).

        Returns:
            (..., L, padded_dim) float32.
        """
        p = self.padded_dim
        i1 = unpack(enc["idx"], self.spec.bits, p)  # (..., L, P)
        i2 = unpack(enc["idx2"], self.spec.bits2, p) if self.rvq is not None else None
        return self._decode_unit(i1, i2) * enc["norm"].astype(mx.float32)[..., None]

    def decode(self, enc: dict[str, mx.array]) -> mx.array:
        """Reconstruction in the original frame: (..., L, dim) float32."""
        return self.rotation.inverse(self.decode_rotated(enc))

    def decode_scoring(self, enc: dict[str, mx.array], head: mx.array | None = None) -> mx.array:
        """Dense vectors k_eff in the rotated frame with q_rot @ k_eff.T equal to the score estimate
        (`decode_rotated`, plus the QJL correction folded in: it is linear in the query), decoded
        by table lookup (`longctx.quant.lut`). The CPU answering path decodes a restored cache
        once with this.

        Args:
            enc: encoded vectors.
            head: optional (..., S, padded_dim) float32 rows (already in the rotated frame) to
                put first, exact.

        Returns:
            (..., S + L, padded_dim) float32.
        """
        job = self.scoring_job(enc, head)
        return self.scoring_result(job, lut.finish(job))

    def scoring_job(self, enc: dict[str, mx.array], head: mx.array | None = None) -> dict:
        """`decode_scoring` in two halves: this one reads what it needs out of MLX (call it on
        the thread that owns the arrays); `longctx.quant.lut.finish(job)` is numpy alone (any
        thread); `scoring_result(job, rows)` makes the MLX result."""
        lead = None if head is None else np.asarray(head.astype(mx.float32))
        job = lut.prepare(self, enc, lead)
        job["enc"] = enc
        return job

    def scoring_result(self, job: dict, rows: np.ndarray) -> mx.array:
        """The second half of `decode_scoring`: `rows` (from `lut.finish(job)`) into MLX, plus
        the QJL correction."""
        enc, head = job["enc"], job["head"]
        out = mx.array(rows)
        if self.qjl is not None:
            corr = self.qjl_key_offset(enc)
            if head is not None:
                corr = mx.pad(corr, [(0, 0)] * (corr.ndim - 2) + [(head.shape[-2], 0), (0, 0)])
            out = out + corr
        return out

    def qjl_key_offset(self, enc: dict[str, mx.array]) -> mx.array:
        """The QJL correction folded into the keys (it is linear in the query):
        <q, r> ~ c * rnorm * <S q, signs> = q . (c * rnorm * S^T signs), c = sqrt(pi/2) / m.

        Returns:
            (..., L, padded_dim) float32, to add to `decode_rotated(enc)`.
        """
        scale = math.sqrt(math.pi / 2) / self.qjl.m
        signs = self.qjl.signs(enc["qjl"]) * (scale * enc["rnorm"].astype(mx.float32))[..., None]
        return signs @ self.qjl.projection

    def qjl_project(self, q_rot: mx.array) -> mx.array:
        """Project rotated queries once for `qjl_correction`: (..., Lq, P) -> (..., Lq, m)."""
        if self.qjl is None:
            raise ValueError("this codec has no QJL sketch (QuantSpec.qjl is False)")
        return self.qjl.project(q_rot)

    def qjl_correction(self, q_proj: mx.array, enc: dict[str, mx.array]) -> mx.array:
        """Unbiased estimates of <q_rot, r> for every query and encoded key.

        Args:
            q_proj: (..., Lq, m) from `qjl_project`.
            enc: encoded keys with `qjl` (..., Lk, words) and `rnorm` (..., Lk); leading dims
                broadcast against q_proj's.

        Returns:
            (..., Lq, Lk) float32, to add to q_rot @ decode_rotated(enc).T.
        """
        if self.qjl is None:
            raise ValueError("this codec has no QJL sketch (QuantSpec.qjl is False)")
        return self.qjl.estimate(q_proj, enc["qjl"], enc["rnorm"])

    def bit_breakdown(self, tokens: int | None = None) -> dict[str, Any]:
        """Storage breakdown (bits.py) with per-codec constants amortized over `tokens` vectors."""
        m = self.qjl.m if self.qjl is not None else None
        s = self.spec
        return bitcount.vector_bits(self.dim, s.bits, s.bits2, s.qjl, qjl_dim=m, tokens=tokens)

    def bits_per_channel(self, tokens: int | None = None) -> float:
        """Stored bits per channel; `tokens=None` ignores the amortized constants."""
        return self.bit_breakdown(tokens)["bits_per_channel"]
