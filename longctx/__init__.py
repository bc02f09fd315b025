"""longctx: long-document question answering over a compressed, cached KV prefix."""

import os

from longctx.runtime.blas import preload_openblas

# Must run before anything imports mlx: loads OpenBLAS so MLX's CPU matmuls use it.
BLAS_STATUS = preload_openblas()
# fp32 matmuls (rotated scores, QJL projections) stay fp32 on CUDA instead of MLX's default TF32.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

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
            return importlib.util.spec_from_file_location(name, source, submodule_search_locations=[os.path.dirname(source)])

    if not any(type(f).__name__ == "_KernelsFinder" for f in sys.meta_path):
        sys.meta_path.append(_KernelsFinder())


_map_kernels()
