"""The on-disk cache file: a safetensors container with string metadata, written atomically.

Metadata keys (all strings): `format_version`, `model_id`, `weights_sha256`, `tokenizer_sha256`,
`document_sha256`, `tokens`, `kv_config` (JSON), `layout_sha256`. Arrays: `tokens` (int32 prefix
token ids) plus the cache's own arrays. Writers use a temp file in the same directory, fsync and
rename, so a reader never sees half a file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from longctx.errors import CacheCorrupt, StoreError

FORMAT_VERSION = "1"
REQUIRED_META = ("format_version", "model_id", "weights_sha256", "tokenizer_sha256",
                 "document_sha256", "tokens", "kv_config")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: Path, arrays: dict, metadata: dict[str, str]) -> int:
    """Write `arrays` + `metadata` to `path` atomically.

    Returns:
        bytes written.
    """
    import mlx.core as mx

    metadata = {"format_version": FORMAT_VERSION, **{k: str(v) for k, v in metadata.items()}}
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        size = os.path.getsize(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as err:
        raise StoreError(f"Cannot write cache file {path}: {err.strerror or err}") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return size


def read(path: Path, doc_label: str) -> tuple[dict, dict[str, str]]:
    """Load a cache file's arrays (lazily, as MLX does) and metadata, checking the basics.

    Args:
        path: the `.safetensors` file.
        doc_label: the document's name, for error messages.
    """
    import mlx.core as mx

    hint = f"re-ingest it with `longctx ingest --force` to rebuild the cache"
    if not path.is_file():
        raise CacheCorrupt(f"The cache file of '{doc_label}' is missing ({path}); {hint}.")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise CacheCorrupt(f"The cache of '{doc_label}' is unreadable ({err}); {hint}.") from err
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise CacheCorrupt(f"The cache of '{doc_label}' lacks {', '.join(missing)}; {hint}.")
    if meta["format_version"] != FORMAT_VERSION:
        raise CacheCorrupt(
            f"The cache of '{doc_label}' has format version {meta['format_version']}, this longctx "
            f"reads version {FORMAT_VERSION}; upgrade longctx or {hint}."
        )
    return arrays, meta
