"""longctx: long-document question answering over a compressed, cached KV prefix."""

import os
import sys

from longctx.runtime.blas import preload_openblas

# Must run before anything imports mlx: loads OpenBLAS so MLX's CPU matmuls use it.
BLAS_STATUS = preload_openblas()
# fp32 matmuls (rotated scores, QJL projections) stay fp32 on CUDA instead of MLX's default TF32.
os.environ.setdefault("MLX_ENABLE_TF32", "0")


def _kernel_cache_dir() -> None:
    """MLX's CUDA kernel cache (`MLX_PTX_CACHE_DIR`, read when MLX first compiles a kernel) in
    longctx's data directory when the user has not set it: kept across reboots, where MLX's
    default (the temp dir) is not, and holding longctx's own compiled kernels as well
    (`runtime/cuda_kernels`): a fresh `ask` on CUDA then compiles nothing."""
    if sys.platform == "darwin" or os.environ.get("MLX_PTX_CACHE_DIR"):
        return
    from importlib import metadata

    from longctx import config, paths

    try:
        if not config.get("cuda_kernel_cache"):
            return
        version = metadata.version("mlx")
    except Exception:  # noqa: BLE001 - a bad setting is reported where it is used; no mlx: none
        return
    os.environ["MLX_PTX_CACHE_DIR"] = str(paths.home_path() / "cuda-kernels" / f"mlx-{version}")


_kernel_cache_dir()

__version__ = "0.1.0"


def _map_kernels() -> None:
    """Make `longctx.kernels` importable from a source checkout (PYTHONPATH=<repo root>).

    Installed, setuptools maps the repo's `kernels/` to `longctx/kernels` (pyproject.toml); in a
    plain checkout that directory does not exist, so a finder, consulted after all others, maps
    the one name `longctx.kernels` to `<repo>/kernels`. Nothing is imported until it is used.
    """
    import importlib.abc
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(os.path.dirname(here), "kernels", "__init__.py")
    if os.path.isdir(os.path.join(here, "kernels")) or not os.path.isfile(source):
        return

    class _KernelsFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "longctx.kernels":
                return None
            return importlib.util.spec_from_file_location(
                name, source, submodule_search_locations=[os.path.dirname(source)])

    if not any(type(f).__name__ == "_KernelsFinder" for f in sys.meta_path):
        sys.meta_path.append(_KernelsFinder())


_map_kernels()
