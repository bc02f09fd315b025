"""A bounded store: a size budget and least-recently-used eviction.

The budget is `LONGCTX_MAX_STORE` (bytes; 0: no limit), else `default_budget`. After an ingest
saves, `evict` removes the least recently used entries until the store fits, never the entry
just written (the `keep` ids) and never one another process holds (the per-entry locks, taken
with try-lock: a busy entry is skipped, not waited for). Last use is the index key
`used:<id>` (see `Store.record_use`); an entry never used since it was written counts from
its creation.

Eviction works on units: entries sharing a non-empty `group` (the segments of one document or
collection; the entry whose id is the group id belongs to it too) are evicted together, their
sizes summed and their last use the latest of theirs, so no document is left half-evicted. A
writer of a group's members holds the group id's lock while it writes, so the unit is busy.

Order of steps, for crashes: every member's lock is taken, the unit is unindexed in one index
transaction, then its files are deleted. A crash before the transaction changes nothing; after
it, the files left are orphans no entry names, which the next `cleanup` deletes.
"""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from longctx import config
from longctx.store import Entry, Store
from longctx.store import groups as groups_
from longctx.store.entry import ID_PATTERN
from longctx.store.failpoints import failpoint

DEFAULT_DISK_FRACTION = 0.25
DEFAULT_FREE_FRACTION = 0.5


@dataclass(frozen=True)
class Unit:
    """What is evicted at once: one entry, or every entry of one group."""

    key: str  # the group id, or the entry's own id
    entries: tuple[Entry, ...]
    bytes: int
    last_used: float


@dataclass
class Eviction:
    """What `evict` did (or, dry, would do)."""

    budget: int | None  # bytes; None: no limit
    bytes_before: int
    bytes_after: int
    removed: list[Unit] = field(default_factory=list)
    busy: list[Unit] = field(default_factory=list)  # over budget but in use: kept
    kept: list[Unit] = field(default_factory=list)  # over budget but asked to be kept
    dry_run: bool = False

    @property
    def freed(self) -> int:
        return self.bytes_before - self.bytes_after

    @property
    def over_budget(self) -> bool:
        return self.budget is not None and self.bytes_after > self.budget


def default_budget(root: Path, store_bytes: int) -> int:
    """The budget when `LONGCTX_MAX_STORE` is unset: a quarter of the disk holding the store
    (a cache's share: room for dozens of long documents, leaving the disk to its owner), but at
    most the store plus half the free space, so the store gives way as the disk fills instead of
    filling it: eviction starts while half of what is left is still free."""
    usage = shutil.disk_usage(root)
    return max(0, min(int(usage.total * DEFAULT_DISK_FRACTION), store_bytes + int(usage.free * DEFAULT_FREE_FRACTION)))


SETTING = "setting"  # `evict`'s default limit: the configured budget


def budget(root: Path, store_bytes: int) -> int | None:
    """The configured budget in bytes, None for no limit: `LONGCTX_MAX_STORE` (0: no limit), else
    `default_budget`."""
    value = config.get("max_store")
    if value is None:
        try:
            return default_budget(root, store_bytes)
        except OSError:  # the disk's size is unknown: no limit rather than a guess
            return None
    return value or None


def units(entries: list[Entry], used: dict[str, float]) -> list[Unit]:
    """Entries grouped into eviction units, least recently used first."""
    groups: dict[str, list[Entry]] = {}
    for e in entries:
        groups.setdefault(getattr(e, "group", "") or e.id, []).append(e)
    out = [
        Unit(key, tuple(members), sum(e.bytes for e in members), max(used.get(e.id, e.created) for e in members))
        for key, members in groups.items()
    ]
    return sorted(out, key=lambda u: (u.last_used, u.key))


@dataclass
class Usage:
    """The store at a glance (`list`): documents newest first (entries and groups; a group's
    segments through it; segments of an unfinished ingest, whose group was never recorded, as
    themselves), their last use, size and budget."""

    entries: list  # Entry | Group
    last_used: dict[str, float]  # id -> time (never used since written: its creation)
    bytes: int
    budget: int | None  # None: no limit


def usage(store: Store) -> Usage:
    entries = store.entries()
    used = store.last_used()
    when = {e.id: used.get(e.id, e.created) for e in entries}
    found = groups_.groups(store)
    recorded = {g.id for g in found}
    items = [*found, *(e for e in entries if not e.group or e.group not in recorded)]
    items.sort(key=lambda t: t.created, reverse=True)
    for g in found:
        when[g.id] = max([when.get(sid, g.created) for sid in g.segment_ids] or [g.created])
    total = sum(e.bytes for e in entries)
    return Usage(items, when, total, budget(store.root, total))


def evict(store: Store, limit: int | None | str = SETTING, keep: tuple[str, ...] = (), dry_run: bool = False) -> Eviction:
    """Evict least recently used units until the store is within its budget.

    Args:
        store: the store.
        limit: the budget in bytes (0: evict all that may be; None: no limit; default: `budget`).
        keep: entry ids whose units are never evicted (the entry an ingest just wrote).
        dry_run: only work out what would be evicted (locks are not taken).

    Returns:
        what was removed, what was kept busy or by request, the bytes before and after.
    """
    all_units = units(store.entries(), store.last_used())
    total = sum(u.bytes for u in all_units)
    limit = budget(store.root, total) if limit == SETTING else limit
    report = Eviction(limit, total, total, dry_run=dry_run)
    if report.budget is None:
        return report
    for unit in all_units:
        if report.bytes_after <= report.budget:
            break
        if any(e.id in keep for e in unit.entries):
            report.kept.append(unit)
        elif dry_run or _evict_unit(store, unit):
            report.removed.append(unit)
            report.bytes_after -= unit.bytes
        else:
            report.busy.append(unit)
    return report


def _evict_unit(store: Store, unit: Unit) -> bool:
    """Remove one unit if none of it is in use; whether it was removed (or already gone)."""
    ids = [e.id for e in unit.entries]
    names = ids + ([unit.key] if ID_PATTERN.match(unit.key) and unit.key not in ids else [])
    with ExitStack() as held:
        if not all(held.enter_context(store.try_lock(n)) for n in names):
            return False
        # Under the locks, as it is now: still indexed, and not used since the snapshot.
        current = [e for e in unit.entries if store.get(e.id) is not None]
        used = store.last_used(ids)
        if any(used.get(e.id, e.created) > unit.last_used for e in current):
            return False
        store.unindex(ids, group=unit.key if unit.key not in ids else "")
        failpoint("evict:unindexed")
        for eid in ids:
            try:
                os.unlink(store.cache_path(eid))
            except OSError:  # gone already; or left as an orphan for `cleanup`
                pass
    return True
