"""Recovery: what crashed processes leave in the store, found and removed on the next start.

A crash can leave a temp file (a write that never renamed), a cache file no entry names (a
save that never indexed it, or an eviction/`rm` that unindexed but never deleted), an entry
whose file is gone, an unreadable index row, or a use record of an entry since evicted. Files
are only removed under their entry's lock (try-lock), so a live writer's are never touched.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from pathlib import Path

from longctx.store.entry import Entry
from longctx.store import format as fmt

_CACHE_NAME = re.compile(r"^([0-9a-f]{16})\.safetensors$")
_TEMP_NAME = re.compile(r"^\.tmp-(?:([0-9a-f]{16})-)?(\d+)-")
STALE_TEMP_SECONDS = 60  # a temp file no lock vouches for, untouched this long, is abandoned


def cleanup(store) -> dict[str, int]:
    """Remove what crashed processes left: temp files, files no entry names, entries whose file
    is gone, unreadable entries. Only under the entry's lock, so live writers are untouched.

    Returns:
        counts by kind ("temps", "orphans", "dangling", "invalid").
    """
    done = {"temps": 0, "orphans": 0, "dangling": 0, "invalid": 0}
    known: dict[str, Entry] = {}
    for key in store.entry_keys():
        with store.guard():
            try:
                value = store.index.get(key)
            except (ValueError, zlib.error):  # IndexCorrupt too: e.g. a row asking to be
                value = {}  # unpickled is never read, only dropped
        entry = Entry.from_json(value)
        if entry is not None and key == f"entry:{entry.id}":
            known[entry.id] = entry
        elif value is not None:
            store.delete_value(key)
            done["invalid"] += 1
    try:
        names = os.listdir(store.caches)
    except OSError:
        names = []
    for name in names:
        path = store.caches / name
        temp, cache = _TEMP_NAME.match(name), _CACHE_NAME.match(name)
        if temp and temp.group(1):
            with store.try_lock(temp.group(1)) as free:
                if free:  # its writer would hold the lock until the rename
                    done["temps"] += _unlink(path)
        elif temp or name.startswith(fmt.TEMP_PREFIX):
            pid = int(temp.group(2)) if temp else None
            if (pid is not None and not _pid_alive(pid)) or _age(path) > STALE_TEMP_SECONDS:
                done["temps"] += _unlink(path)
        elif cache and cache.group(1) not in known:
            with store.try_lock(cache.group(1)) as free:
                if free and store.get(cache.group(1)) is None:
                    done["orphans"] += _unlink(path)
    for key in store.entry_keys("used:"):  # a use recorded as its entry was evicted
        if key[5:] not in known and store.get(key[5:]) is None:
            store.delete_value(key)
    for eid in known:
        if not store.cache_path(eid).exists():
            with store.try_lock(eid) as free:
                if free and not store.cache_path(eid).exists():
                    store.unindex([eid])
                    done["dangling"] += 1
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except FileNotFoundError:
        return 0
    except OSError:
        return 0
