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
from longctx import multidoc
from longctx.store import groups
from longctx.errors import LongctxError
from longctx.errors import EntryNotFound
from longctx.runtime import distributed
from longctx import prompt
from longctx.store import entry_id


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

    store = Store()
    try:
        entry = multidoc.find(store, doc)
        if isinstance(entry, multidoc.Group):
            raise ConfigError(
                f"'{entry.name}' is stored as {len(entry.segments)} segment caches, which no "
                "single mlx-lm prompt cache can hold; export one segment by its id (`longctx "
                "info` lists them)."
            )
        ref = models.resolve(entry.model_spec)
        check_same_model(entry, ref)
        lm = models.load(ref)
        cache = restore(entry, lm, store, answering=False)
        store.record_use(entry.id)
    finally:
        store.close()
    stock = kvcache.to_mlx_lm(cache, EXPORT_KV[kv])
    metadata = {"model": str(ref.path), "tokenizer_config": "{}", "longctx_document": entry.name, "longctx_entry": entry.id}
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
    with _opened() as store:
        return multidoc.find(store, doc)


def remove_entry(doc: str):
    """Remove a document's cache(s) and index records; returns what was removed."""
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

    try:
        cfg = load_config(models.resolve(target.model_spec).path)
    except (LongctxError, OSError, ValueError):
        return None
    context = int(cfg.get("text_config", cfg).get("max_position_embeddings") or 2048)
    segments = getattr(target, "segments", ()) or ()
    longest = max((sg["tokens"] for sg in segments), default=target.tokens)
    return max(0, context - longest)


def _gather(store: Store, doc: str):
    """(an entry of `doc`, its whole arrays, its file's metadata): a single-process entry as it
    is, or every rank's share of a tensor-parallel one joined along the head axis, or every stage
    of a pipeline-parallel one joined layer after layer."""
    import json

    import mlx.core as mx

    mine = [e for e in store.entries() if not e.group and (e.name == doc or e.id == doc)]
    if not mine:
        raise EntryNotFound(f"No ingested document '{doc}' (of any topology); `longctx list` shows them.")
    whole = [e for e in mine if not e.topology]
    if whole:
        e = max(whole, key=lambda x: x.created)
        arrays, meta = store.load(e)
        return e, arrays, meta
    newest = max(mine, key=lambda x: x.created)
    t = distributed.parse_tag(newest.topology)
    shards = {}
    for e in sorted(mine, key=lambda x: x.created, reverse=True):
        s = distributed.parse_tag(e.topology)
        if (
            s is not None
            and (s.ranks, s.parallel) == (t.ranks, t.parallel)
            and e.document_sha256 == newest.document_sha256
            and e.kv_preset == newest.kv_preset
        ):
            shards.setdefault(s.rank, e)
    missing = [r for r in range(t.ranks) if r not in shards]
    if missing:
        raise EntryNotFound(
            f"'{doc}' was ingested across {t.ranks} ranks but the shards of rank(s) "
            f"{', '.join(map(str, missing))} are not in this store; copy them here first."
        )
    loaded = [store.load(shards[r]) for r in range(t.ranks)]
    if t.parallel == "pipeline":
        stages = [(distributed.parse_tag(shards[r].topology).layers[0], *loaded[r]) for r in range(t.ranks)]
        arrays, meta = _join_stages(stages)
        return shards[0], arrays, meta
    arrays = {k: (mx.concatenate([a[k] for a, _ in loaded], axis=1) if v.ndim >= 2 else v) for k, v in loaded[0][0].items()}
    meta = dict(loaded[0][1])
    kv = json.loads(meta["kv_config"])
    kv["kv_heads"] = [h * t.ranks if h else h for h in kv.get("kv_heads", [])]
    meta["kv_config"] = json.dumps(kv)
    return shards[0], arrays, meta


_PER_LAYER = ("head_dims", "kv_heads", "windows")  # KV config lists with one item per layer


def _layers_of(arrays: dict) -> tuple[dict[int, dict], dict]:
    """A cache file's arrays per layer ({layer: {name within the layer: array}}, the stacked
    parts split back per layer) and the rest (`tokens`)."""
    stacked = any(k.startswith(kvcache.STACK_PREFIX) for k in arrays)
    turbo = sorted({int(k.split(".")[0]) for k in arrays if k.split(".")[0].isdigit() and k.count(".") >= 2})
    per = kvcache.split_layers(arrays, turbo if stacked else [])
    layers = {int(k): v for k, v in per.items() if k.isdigit()}
    rest = {k: v for k, v in arrays.items() if not k.split(".")[0].isdigit() and not k.startswith(kvcache.STACK_PREFIX)}
    return layers, rest


def _flat(layers: dict[int, dict], rest: dict) -> dict:
    """`_layers_of` undone: named arrays as `kvcache.to_arrays` writes them (parts restacked)."""
    import mlx.core as mx

    out = {f"{i}.{name}": a for i in sorted(layers) for name, a in layers[i].items()}
    turbo = [i for i in sorted(layers) if "k.mu" in layers[i]]
    if kvcache.stackable([(layers[i]["k.mu"].shape[1], layers[i]["k.mu"].shape[3]) for i in turbo]):
        kvcache.stack_parts(out, turbo, lambda parts: mx.concatenate(parts, axis=0))
    return {**out, **rest}


def _join_stages(stages: list[tuple[int, dict, dict]]) -> tuple[dict, dict]:
    """One cache's arrays and metadata from pipeline stages' (first layer, arrays, metadata)."""
    import json

    layers, rest, kv_lists = {}, {}, {k: [] for k in _PER_LAYER}
    for lo, arrays, meta in sorted(stages, key=lambda s: s[0]):
        mine, rest = _layers_of(arrays)
        layers.update({lo + i: parts for i, parts in mine.items()})
        kv = json.loads(meta["kv_config"])
        for k in _PER_LAYER:
            kv_lists[k] += kv.get(k, [0] * len(kv["head_dims"]))
    meta = dict(stages[0][2])
    kv = {**json.loads(meta["kv_config"]), **{k: v for k, v in kv_lists.items() if k != "windows" or any(v)}}
    meta["kv_config"] = json.dumps(kv)
    return _flat(layers, rest), meta


def _split_stage(arrays: dict, meta: dict, lo: int, hi: int) -> tuple[dict, dict]:
    """Layers [lo, hi) of one cache's arrays and metadata, numbered from 0 (a pipeline stage's)."""
    import json

    layers, rest = _layers_of(arrays)
    kv = json.loads(meta["kv_config"])
    kv.update({k: kv[k][lo:hi] for k in _PER_LAYER if k in kv})
    if "windows" in kv and not any(kv["windows"]):
        del kv["windows"]
    return (_flat({i - lo: layers[i] for i in layers if lo <= i < hi}, rest), {**meta, "kv_config": json.dumps(kv)})


def _save_as(store: Store, base, arrays: dict, meta: dict, topology: str):
    """Save `arrays` as an entry like `base` for `topology`, under the content address an ingest
    with that topology would give it."""
    import dataclasses

    ref = models.resolve(base.model_spec)
    at = f"@{distributed.place(topology)}" if topology else ""  # as `session.plan` addresses it
    eid = entry_id(
        base.document_sha256,
        base.weights_sha256,
        base.tokenizer_sha256,
        base.kv_preset + at,
        prompt.layout_sha256(models.tokenizer(ref)),
    )
    entry = dataclasses.replace(base, id=eid, topology=topology)
    with store.lock(eid):
        return store.save(entry, arrays, meta)


def merge(doc: str):
    """Join a tensor- or pipeline-parallel document's shards into an ordinary entry (one process
    can then answer it alone); returns the new entry."""
    with _opened() as store:
        base, arrays, meta = _gather(store, doc)
        if not base.topology:
            raise ConfigError(f"'{doc}' is an ordinary entry already; nothing to merge.")
        return _save_as(store, base, arrays, meta, "")


def reshard(doc: str, ranks: int, parallel: str = "tensor") -> list:
    """Split a document's cache into `ranks` shards (from an ordinary entry, or from another
    topology's shards): tensor-parallel (each rank its KV heads) or pipeline-parallel (each
    stage its layers, as mlx-lm's `pipeline` splits them); returns the new entries."""
    import json

    import mlx.core as mx

    if ranks < 2:
        raise ConfigError("--ranks must be at least 2 (`longctx merge` makes one ordinary entry).")
    with _opened() as store:
        base, arrays, meta = _gather(store, doc)
        kv = json.loads(meta["kv_config"])
        if parallel == "pipeline":
            n = len(kv["head_dims"])
            if ranks > n:
                raise ConfigError(f"{ranks} pipeline stages exceed the cache's {n} layers; reshard it for at most {n} ranks.")
            out = []
            for r in range(ranks):
                lo, hi = distributed.stage_layers(n, ranks, r)
                part, m = _split_stage(arrays, meta, lo, hi)
                out.append(_save_as(store, base, part, m, distributed.Topology(ranks, r, "pipeline", (lo, hi)).tag))
            return out
        heads = [h for h in kv.get("kv_heads", []) if h]
        if any(h % ranks for h in heads):
            valid = [n for n in range(2, max(heads) + 1) if all(h % n == 0 for h in heads)]
            raise ConfigError(
                f"{ranks} ranks do not divide the cache's {max(heads)} KV heads; "
                f"reshard it for {' or '.join(map(str, valid)) or 'no other number of'} ranks."
            )
        out = []
        for r in range(ranks):
            part = {k: (mx.split(v, ranks, axis=1)[r] if v.ndim >= 2 else v) for k, v in arrays.items()}
            m = dict(meta)
            m["kv_config"] = json.dumps({**kv, "kv_heads": [h // ranks if h else h for h in kv.get("kv_heads", [])]})
            out.append(_save_as(store, base, part, m, distributed.Topology(ranks, r).tag))
        return out
