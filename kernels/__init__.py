"""GPU kernels for TurboQuant (installed as `longctx.kernels`): one kernel per module.

    pack             bit pack / unpack (packing.py's layout)
    scalar_quant     nearest-centroid quantize / dequantize
    hadamard_quant   normalize + randomized Hadamard + quantize + pack (VectorCodec.encode, scalar)
    qjl_encode       QJL sign sketch + residual norm
    decode_attend    fused decode + attention over a compressed segment (flash-decoding)
    decode_attend_mma  the same for one decode step on CUDA tensor cores (4-bit keys and values)
    decode_step_mma  the whole decode step on it: exact tokens in the splits, the finish fused
    decode_attend_simdgroup  its Metal twin on simdgroup matrices (never run on a Mac GPU)
    decode_finish    a decode step's split merge, rotation back, exact tokens and value mean
    dequant          compressed rows to fp16 (prefill chunks' attention)
    split_combine    merge of flash-decoding partials

Each module holds a kernel body written once for Metal and CUDA (see `_prelude`), a pure-MLX
`*_reference` (the CPU path and the test oracle) and one public function that checks shapes and
dispatches to Metal, CUDA or the reference; `decode_attend_mma` is the one CUDA-only body (MMA
and `cp.async`), a faster variant of `decode_attend`, and `decode_attend_simdgroup` the one
Metal-only body; `decode_attend` stays their fallback and reference. Import a function from its module
(`from longctx.kernels.decode_attend import decode_attend`). This package imports only mlx.
"""

from ._prelude import backend

__all__ = ["backend"]
