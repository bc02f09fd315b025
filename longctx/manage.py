"""Managing the store's documents: list, find, remove, evict (gc) and export them.

The use cases besides ingest and ask (`session`), each opening the store for its own duration.
Errors are `longctx.errors` subclasses with messages a user can act on.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from longctx import config, kvcache
from longctx.errors import ConfigError
from longctx.runtime import models
from longctx.session import check_same_model, restore
from longctx.store import Store, budget


EXPORT_KV = {"fp16": 0, "affine8": 8, "affine4": 4}


def export(doc: str | None, out: str | Path, kv: str = "fp16") -> Path:
    """Write a stock mlx-lm prompt cache of a stored document (`mlx_lm.generate --prompt-cache-file`).

    Args:
        doc: document name or id (None: the latest).
        out: destination `.safetensors` file (written atomically).
        kv: "fp16", "affine8" or "affine4": the stock cache type to write.

    Returns:
        the path written.
    """
    import os
    import tempfile

    from mlx_lm.models.cache import save_prompt_cache

    if kv not in EXPORT_KV:
        raise ConfigError(f"Unknown export cache type '{kv}'; choose one of: {', '.join(EXPORT_KV)}.")
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ConfigError(f"The export file must end in .safetensors (mlx-lm's format), not '{out.name}'.")
    from longctx import multidoc

    store = Store()
    try:
        entry = multidoc.find(store, doc)
        if isinstance(entry, multidoc.Group):
            raise ConfigError(
                f"'{entry.name}' is stored as {len(entry.segments)} segment caches, which no "
                "single mlx-lm prompt cache can hold; export one segment by its id (`longctx "
                "info` lists them).")
        ref = models.resolve(entry.model_spec)
        check_same_model(entry, ref)
        lm = models.load(ref)
        cache = restore(entry, lm, store, answering=False)
        store.record_use(entry.id)
    finally:
        store.close()
    stock = kvcache.to_mlx_lm(cache, EXPORT_KV[kv])
    metadata = {"model": str(ref.path), "tokenizer_config": "{}", "longctx_document": entry.name,
                "longctx_entry": entry.id}
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=out.parent)
    os.close(fd)
    try:
        save_prompt_cache(tmp, stock, metadata)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@contextmanager
def _opened(cleanup: bool = True) -> Iterator[Store]:
    store = Store(cleanup=cleanup)
    try:
        yield store
    finally:
        store.close()


def list_entries() -> list:
    """Ingested documents, newest first: entries and groups (segmented documents, collections);
    a group's segments are listed through it (`info`), not here."""
    from longctx.store import groups

    with _opened() as store:
        items = [*groups.groups(store), *(e for e in store.entries() if not e.group)]
        return sorted(items, key=lambda t: t.created, reverse=True)


def store_usage() -> budget.Usage:
    """Every entry with its last use, the store's size and its budget (`list`)."""
    with _opened() as store:
        return budget.usage(store)


def gc(max_size: str | None = None, dry_run: bool = False) -> tuple[dict[str, int], budget.Eviction]:
    """Clean crash leftovers, then evict least recently used entries down to the budget.

    Args:
        max_size: evict down to this size (`20GB`, `500MiB`, bytes; `0`: every entry not in
            use); None: the configured budget (`LONGCTX_MAX_STORE`).
        dry_run: change nothing; report what would be removed.

    Returns:
        (the cleanup's counts, empty when dry; the eviction).
    """
    limit: int | None | str = budget.SETTING
    if max_size is not None:
        try:
            limit = config.parse_size(max_size)
        except ValueError as err:
            raise ConfigError(f"--max-size {max_size!r} is not valid ({err}).") from None
    with _opened(cleanup=False) as store:
        return ({} if dry_run else store.cleanup()), budget.evict(store, limit, dry_run=dry_run)


def find_entry(doc: str | None):
    """The entry or group named `doc` (None: the latest)."""
    from longctx import multidoc

    with _opened() as store:
        return multidoc.find(store, doc)


def remove_entry(doc: str):
    """Remove a document's cache(s) and index records; returns what was removed."""
    from longctx import multidoc
    from longctx.store import groups

    with _opened() as store:
        target = multidoc.find(store, doc)
        if isinstance(target, groups.Group):
            groups.remove(store, target)
        else:
            store.remove(target)
        return target


def room(target) -> int | None:
    """Tokens of its model's context a document leaves for questions and conversations (a
    segmented document: what its longest segment leaves); None if the model is not at hand."""
    from mlx_lm.utils import load_config

    from longctx.errors import LongctxError
    from longctx.runtime import models

    try:
        cfg = load_config(models.resolve(target.model_spec).path)
    except (LongctxError, OSError, ValueError):
        return None
    context = int(cfg.get("text_config", cfg).get("max_position_embeddings") or 2048)
    segments = getattr(target, "segments", ()) or ()
    longest = max((sg["tokens"] for sg in segments), default=target.tokens)
    return max(0, context - longest)
