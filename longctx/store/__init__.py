"""The cache store: entries (one per document × model × KV preset) in one private data directory.

Layout under `<data dir>/store/` (every directory 0700):

- `caches/<id>.safetensors`: one cache file per entry (see `format.py`); the name is the entry's
  content address, never anything a user typed;
- `index/`: a diskcache index of JSON values (`index.py`: nothing is ever unpickled);
- `locks/<id>.lock`: `fcntl.flock` locks, one per entry id (`locks.py`: exclusive for writers
  and evictors, shared for readers).

The index holds `entry:<id>` (the Entry as JSON), `used:<id>` (when the entry was last asked,
reused or exported: a key of its own, so recording a use is one small upsert that never
rewrites the entry) and `latest`. `budget.py` evicts the least recently used entries.

Writers of an entry hold its lock from the moment they decide to build it until the index says so,
so concurrent ingests of one document build it once and the others reuse it. The order of steps
keeps the store consistent if a process dies anywhere: a cache file is complete before it is
renamed into place, it is indexed only after that, and `remove` unindexes before it deletes.
What a crash can leave (a temp file, a file no entry names) is cleaned when a store is next
opened by any command but `ask` (which only reads, and skips the scan), but only under the
entry's lock, so a live writer's files are never touched.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from longctx.errors import CacheCorrupt, EntryNotFound, StoreError
from longctx.paths import subdir
from longctx.store import format as fmt
from longctx.store import layout, locks, recovery
from longctx.store.failpoints import failpoint
from longctx.store.entry import ID_PATTERN, Entry, entry_id, rebuild_hint
from longctx.store.index import IndexCorrupt, open_index

__all__ = ["Entry", "Store", "entry_id", "rebuild_hint"]


def _private_dir(path: Path) -> Path:
    """Create `path` 0700, or tighten it to 0700 if it is ours and looser."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


class Store:
    """The index plus the cache files; safe to use from several processes at once.

    Args:
        root: the store directory (default: `<data dir>/store`).
        cleanup: remove what crashed processes left behind (see `cleanup`).
    """

    def __init__(self, root: Path | None = None, cleanup: bool = True):
        try:
            self.root = _private_dir(root or subdir("store"))
            self.caches = _private_dir(self.root / "caches")
            self.locks = _private_dir(self.root / "locks")
            self._index_dir = _private_dir(self.root / "index")
        except OSError as err:
            raise StoreError(
                f"Cannot create the store in {root or 'the data directory'}: "
                f"{err.strerror or err}; set LONGCTX_HOME to a writable directory."
            ) from err
        self._index = None
        if cleanup:
            self.cleanup()

    @property
    def index(self):
        """The diskcache index, opened on first use: reading a cache file of a known entry needs
        none (diskcache's open writes its settings back, ~3-5 ms with the close)."""
        if self._index is None:
            try:
                self._index = open_index(self._index_dir)
            except Exception as err:  # sqlite and settings errors surface as several types
                raise StoreError(f"Cannot open the index in {self._index_dir}: {err}") from err
            try:
                os.chmod(self._index_dir / "cache.db", 0o600)
            except OSError:
                pass
        return self._index

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None

    # -- index access: every failure becomes a StoreError ----------------------------------------
    @contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as err:
            if "full" in str(err):
                raise StoreError(
                    f"The disk holding {self.root} is full; free some space or set LONGCTX_HOME to a directory on a larger disk."
                ) from err
            raise StoreError(f"The index in {self.root / 'index'} cannot be used ({err}).") from err
        except (sqlite3.Error, IndexCorrupt, ValueError, TypeError, zlib.error, OSError) as err:
            raise StoreError(
                f"The index in {self.root / 'index'} is damaged ({err}); move that directory "
                "aside and ingest your documents again."
            ) from err

    def get_value(self, key: str, default=None):
        with self.guard():
            return self.index.get(key, default)

    def set_value(self, key: str, value) -> None:
        with self.guard():
            self.index.set(key, value)

    def delete_value(self, key: str) -> None:
        with self.guard():
            self.index.delete(key)

    def entry_keys(self, prefix: str = "entry:") -> list[str]:
        with self.guard():
            return [k for k in self.index.iterkeys() if k.startswith(prefix)]

    # -- locking (see locks.py) ----------------------------------------------------------------
    def _lock_dir(self, eid: str) -> Path:
        if not ID_PATTERN.match(eid):
            raise StoreError(f"Invalid entry id {eid!r}.")
        return self.locks

    def lock(self, eid: str):
        """Hold entry `eid`'s exclusive lock (waits for another process holding it)."""
        return locks.exclusive(self._lock_dir(eid), eid)

    def try_lock(self, eid: str):
        """Take entry `eid`'s exclusive lock if nobody holds it; yields whether it was taken."""
        return locks.try_exclusive(self._lock_dir(eid), eid)

    def read_lock(self, eid: str):
        """Hold entry `eid`'s shared lock while opening its file (yields whether it is held)."""
        return locks.shared(self._lock_dir(eid), eid)

    # -- entries ------------------------------------------------------------------------------
    def cache_path(self, eid: str) -> Path:
        """The cache file of entry `eid` (ids are hex content addresses; nothing else is a path)."""
        if not ID_PATTERN.match(eid):
            raise StoreError(f"Invalid entry id {eid!r}.")
        return self.caches / f"{eid}.safetensors"

    def get(self, eid: str) -> Entry | None:
        return Entry.from_json(self.get_value(f"entry:{eid}")) if ID_PATTERN.match(eid) else None

    def entries(self) -> list[Entry]:
        """All entries, newest first (unreadable ones are skipped; `cleanup` drops them)."""
        found = [Entry.from_json(self.get_value(k)) for k in self.entry_keys()]
        return sorted((e for e in found if e is not None), key=lambda e: e.created, reverse=True)

    def find(self, ref: str | None) -> Entry:
        """The entry named `ref` (document name, id or id prefix), or the latest if `ref` is None."""
        entries = self.entries()
        if not entries:
            raise EntryNotFound("No documents ingested yet; run `longctx ingest FILE` first.")
        if ref is None:
            latest = self.get_value("latest")
            return (self.get(latest) if isinstance(latest, str) else None) or entries[0]
        ref = ref.strip()
        matches = [e for e in entries if e.id == ref] or [e for e in entries if e.name == ref]
        matches = matches or [e for e in entries if ref and e.id.startswith(ref)]
        if not matches:
            names = ", ".join(sorted({e.name for e in entries})[:8])
            raise EntryNotFound(f"No ingested document matches '{ref}'. Known: {names}.")
        if len({m.id for m in matches}) > 1 and any(m.name == ref for m in matches):
            return matches[0]  # same name, several models/presets: the newest wins
        if len(matches) > 1:
            ids = ", ".join(m.id for m in matches)
            raise EntryNotFound(f"'{ref}' matches several entries ({ids}); give an id.")
        return matches[0]

    def save(self, entry: Entry, arrays: dict, metadata: dict[str, str]) -> Entry:
        """Write the cache file atomically, then record the entry. Hold `lock(entry.id)`."""
        path = self.cache_path(entry.id)
        size = fmt.write(path, arrays, metadata, tag=entry.id)
        failpoint("save:written")
        entry = dataclasses.replace(entry, file=path.name, bytes=size, created=time.time())
        try:
            self.set_value(f"entry:{entry.id}", entry.to_json())
        except StoreError:
            try:
                known = self.get(entry.id) is not None
            except StoreError:
                known = False
            if not known:  # no entry names the file: do not leave it behind
                path.unlink(missing_ok=True)
            raise
        failpoint("save:indexed")
        self.record_use(entry.id, entry.created)
        self.set_value("latest", entry.id)
        failpoint("save:done")
        return entry

    def touch_latest(self, entry: Entry) -> None:
        self.set_value("latest", entry.id)

    def record_use(self, eid: str, when: float | None = None) -> bool:
        """Note that entry `eid` was just used (asked, reused, exported): the eviction order.
        Best effort: a store that cannot record it (disk full) still answers; returns whether
        it was recorded."""
        try:
            self.set_value(f"used:{eid}", time.time() if when is None else when)
            return True
        except StoreError:
            return False

    def last_used(self, ids: list[str] | None = None) -> dict[str, float]:
        """Entry id -> when it was last used, for `ids` (default: all); absent if never recorded."""
        keys = self.entry_keys("used:") if ids is None else [f"used:{eid}" for eid in ids]
        values = {key[5:]: self.get_value(key) for key in keys if ID_PATTERN.match(key[5:])}
        return {eid: float(v) for eid, v in values.items() if type(v) in (int, float)}

    def unindex(self, ids: list[str], group: str = "") -> None:
        """Drop entries (and the record of the group they make up, if any) from the index in one
        transaction (their files stay: delete them next; a crash in between leaves orphan files,
        which `cleanup` deletes)."""
        with self.guard():
            with self.index.transact():
                if group:
                    self.index.delete(f"group:{group}")
                for eid in ids:
                    self.index.delete(f"entry:{eid}")
                    self.index.delete(f"used:{eid}")
                    self.index.delete(f"segtext:{eid}")
                if self.index.get("latest") in (*ids, group):
                    self.index.delete("latest")

    def check_free_space(self, nbytes: int, what: str) -> None:
        """Raise StoreError unless the store's disk has room for `nbytes` more (plus a margin)."""
        fmt.check_free_space(self.caches, nbytes, what)

    def load(self, entry: Entry, check: Callable[[dict], None] | None = None, checks: str = fmt.CHECKS) -> tuple[dict, dict]:
        """An entry's arrays and metadata, every byte verified.

        Args:
            entry: the entry.
            check: called with the (checksum-verified) metadata before any array is read; raises
                to refuse the file (e.g. `CacheMismatch` for another model).
            checks: when the checksum threads start: "overlap" (as MLX reads the arrays) or
                "after" (`store.format.CHECKS`).

        Raises:
            CacheCorrupt: the file is missing, damaged, of another format, or not this entry's.
        """
        arrays, meta, pending = self.load_verifying(entry, check, checks)
        pending.wait()
        return arrays, meta

    def load_verifying(
        self, entry: Entry, check: Callable[[dict], None] | None = None, checks: str = fmt.CHECKS
    ) -> tuple[dict, dict, fmt.PendingChecksums]:
        """`load`, handing the arrays out while their checksums are still being computed: the
        header, the metadata and every size are checked before this returns; call `wait()` on
        the third value (it raises CacheCorrupt) before anything computed from the arrays is
        shown. Used by `ask`, whose question pass then overlaps the checksums."""
        hint = rebuild_hint(entry)
        path = self.cache_path(entry.id)
        # Shared while the file is opened and read: an evictor skips the entry meanwhile (the
        # checks go on after, on a descriptor of their own).
        with self.read_lock(entry.id):
            if not path.exists() and self.get(entry.id) is None:
                raise EntryNotFound(
                    f"'{entry.name}' was removed from the store while it was "
                    "being opened (`longctx rm`, or evicted to keep the store "
                    "within LONGCTX_MAX_STORE); ingest it again."
                )
            with fmt.open_cache(path, entry.name, hint) as reader:
                meta = reader.header.meta
                if check is not None:
                    check(dict(meta))
                _check_is_entrys(reader, entry)
                layout.check(reader.header, entry.name, hint)
                arrays, pending = reader.arrays_verifying(checks)
                return arrays, dict(meta), pending

    def verify(self, entry: Entry) -> bool:
        """Whether the entry's file is complete and intact (reads it all; keeps nothing)."""
        hint = rebuild_hint(entry)
        try:
            with fmt.open_cache(self.cache_path(entry.id), entry.name, hint) as reader:
                _check_is_entrys(reader, entry)
                layout.check(reader.header, entry.name, hint)
                reader.verify()
        except CacheCorrupt:
            return False
        return True

    def remove(self, entry: Entry) -> None:
        """Unindex the entry, then delete its file (a crash in between leaves only an orphan file,
        which `cleanup` deletes)."""
        with self.lock(entry.id):
            self.unindex([entry.id])
            failpoint("remove:unindexed")
            self.cache_path(entry.id).unlink(missing_ok=True)
            if entry.group:
                self.delete_value(f"segtext:{entry.id}")

    # -- recovery -----------------------------------------------------------------------------
    def cleanup(self) -> dict[str, int]:
        """Remove what crashed processes left (see `recovery.cleanup`, which this runs).

        Returns:
            counts by kind ("temps", "orphans", "dangling", "invalid").
        """
        return recovery.cleanup(self)


_IDENTITY = ("document_sha256", "tokens", "model_id", "weights_sha256", "tokenizer_sha256")


def _check_is_entrys(reader: fmt.Reader, entry: Entry) -> None:
    """Raise CacheCorrupt unless the file's metadata agrees with the index entry that names it."""
    meta = reader.header.meta
    differ = [k for k in _IDENTITY if meta[k] != str(getattr(entry, k))]
    if differ:
        raise reader.corrupt(
            f"the file is not this entry's: its {', '.join(differ)} differ "
            f"(it holds '{meta.get('document_name', '?')}', {meta['tokens']} tokens)"
        )
