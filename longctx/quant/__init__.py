"""TurboQuant in plain MLX: rotation, Lloyd-Max codebooks, scalar/residual quantizers, QJL,
bit packing and bits accounting. No model or I/O knowledge.

References: Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with
Near-optimal Distortion Rate" (arXiv 2504.19874); Zandieh, Daliri, Han, "QJL: 1-Bit Quantized JL
Transform for KV Cache Quantization with Zero Overhead" (arXiv 2406.03482).
"""

from longctx.quant.bits import kv_bits, spec_bits, vector_bits
from longctx.quant.codebooks import Codebook, ResidualCodebook, lloyd_max, residual_codebook
from longctx.quant.codec import QuantSpec, VectorCodec
from longctx.quant.packing import pack, packed_words, unpack
from longctx.quant.qjl import QJLSketch
from longctx.quant.rotation import RandomHadamard, supported_size
from longctx.quant.rvq import ResidualQuantizer

__all__ = [
    "Codebook",
    "QJLSketch",
    "QuantSpec",
    "RandomHadamard",
    "ResidualCodebook",
    "ResidualQuantizer",
    "VectorCodec",
    "kv_bits",
    "lloyd_max",
    "pack",
    "packed_words",
    "residual_codebook",
    "spec_bits",
    "supported_size",
    "unpack",
    "vector_bits",
]
