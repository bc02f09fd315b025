"""Load OpenBLAS into the process before mlx, on Linux, so MLX's CPU matmuls use it.

MLX's Linux CPU wheel is linked against a reference BLAS. Symbols resolve to the first library
loaded with RTLD_GLOBAL, so loading OpenBLAS before `import mlx` makes every sgemm an OpenBLAS one.
This module must not import mlx.
"""

from __future__ import annotations

import ctypes
import os
import sys
from longctx import config

# Debian/Ubuntu multiarch paths first (package libopenblas0-pthread), then generic ones.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def preload_openblas() -> str:
    """Load OpenBLAS globally if this is Linux and mlx is not imported yet.

    Returns:
        "loaded:<path>", "not-linux", "already-imported" (too late to help), "disabled"
        (LONGCTX_OPENBLAS=0) or "missing" (no OpenBLAS found: CPU matmuls will be slow).
    """
    if not sys.platform.startswith("linux"):
        return "not-linux"

    wanted = config.get("openblas")  # a path, None (search) or False (off)
    if wanted is False:
        return "disabled"
    if "mlx.core" in sys.modules:
        return "already-imported"
    paths = [wanted] if wanted else []
    for path in paths + list(_CANDIDATES):
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return f"loaded:{path}"
    return "missing"


def tune_malloc() -> bool:
    """Keep freed blocks of up to 64 MiB in the heap for reuse (glibc), for the CLI process.

    By default glibc serves blocks of a few MiB with fresh mmaps and unmaps them on free, so each
    new numpy array of that size pays its page faults again: decoding a cache layer or a softmax
    block with numpy took 2-3x longer that way. Returns False where it does not apply.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 64 << 20) and libc.mallopt(m_trim_threshold, 256 << 20))
    except (OSError, AttributeError):
        return False
