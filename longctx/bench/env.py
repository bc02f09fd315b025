"""What a benchmark result records about where it ran, and how results are named on disk."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import longctx


def environment() -> dict:
    """Machine, backend and versions, recorded with every result."""
    import importlib.metadata as md

    import mlx.core as mx

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "-"

    device = mx.default_device()
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "backend": str(device),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "longctx": longctx.__version__,
        "blas": longctx.BLAS_STATUS,
    }
    if device.type == mx.DeviceType.gpu:
        try:
            info["gpu"] = mx.device_info().get("device_name", "gpu")
        except Exception:  # device_info is best-effort across backends
            info["gpu"] = "gpu"
    return info


def safe_name(name: str) -> str:
    """`name` (a model id) usable in a file name: anything but letters, digits, -_. becomes _."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
