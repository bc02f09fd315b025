"""longctx: long-document question answering over a compressed, cached KV prefix."""

from longctx.runtime.blas import preload_openblas

# Must run before anything imports mlx: loads OpenBLAS so MLX's CPU matmuls use it.
BLAS_STATUS = preload_openblas()

__version__ = "0.1.0"
