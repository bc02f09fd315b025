"""Where longctx keeps its data: one directory, `LONGCTX_HOME` or the platform's user cache dir."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from longctx.errors import StoreError
from longctx import config


def home() -> Path:
    """The data directory (created 0700 on first use).

    Returns:
        `$LONGCTX_HOME` if set, else `~/Library/Caches/longctx` on macOS, else
        `$XDG_CACHE_HOME/longctx` (default `~/.cache/longctx`).
    """
    env = config.get("home")
    if env:
        path = Path(env).expanduser()
    elif sys.platform == "darwin":
        path = Path.home() / "Library" / "Caches" / "longctx"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "longctx"
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as err:
        raise StoreError(
            f"Cannot create the data directory {path}: {err.strerror}. Set LONGCTX_HOME to a writable directory."
        ) from err
    return path


def subdir(name: str) -> Path:
    """A subdirectory of `home()`, created 0700."""
    path = home() / name
    path.mkdir(exist_ok=True, mode=0o700)
    return path
