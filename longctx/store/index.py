"""The index: a diskcache `Cache` whose keys are strings and whose values are JSON, never pickle.

diskcache's own `JSONDisk` writes JSON, but its read path still trusts two columns of the SQLite
row: `raw = 0` makes `Disk.get` unpickle the key and `mode = MODE_PICKLE` makes `Disk.fetch`
unpickle the value (and `filename` is joined to the directory unchecked). A damaged or planted
`cache.db` could therefore execute code on `longctx list`. `SafeJSONDisk` refuses those rows:
keys must be raw, values raw or a diskcache-named file inside the index directory, and
decompression is bounded. Anything else is `IndexCorrupt`, which the store reports as a
`StoreError`.
"""

from __future__ import annotations

import json
import re
import sqlite3
import zlib
from pathlib import Path

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW, UNKNOWN

MAX_VALUE_BYTES = 1 << 20  # an entry's JSON is ~1 KiB
_VALUE_FILE = re.compile(r"^[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val$")


class IndexCorrupt(ValueError):
    """A row of the index is not something this store wrote."""


def _inflate(data: bytes) -> object:
    d = zlib.decompressobj()
    raw = d.decompress(data, MAX_VALUE_BYTES)
    if d.unconsumed_tail:
        raise IndexCorrupt("an index value is too large")
    return json.loads(raw.decode("utf-8"))


class SafeJSONDisk(diskcache.JSONDisk):
    """`JSONDisk` with a read path that never unpickles and never leaves the index directory."""

    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"index keys are strings, not {type(key).__name__}")
        return super().put(key)

    def get(self, key, raw):
        if not raw or type(key) not in (bytes, sqlite3.Binary):
            raise IndexCorrupt("an index key is not raw JSON")
        key = _inflate(bytes(key))
        if type(key) is not str:
            raise IndexCorrupt("an index key is not a string")
        return key

    def store(self, value, read, key=UNKNOWN):
        if read:
            raise TypeError("the index stores JSON values, not files")
        return super().store(value, False, key=key)

    def fetch(self, mode, filename, value, read):
        if read:
            raise IndexCorrupt("the index does not hand out files")
        if mode == MODE_RAW and type(value) in (bytes, sqlite3.Binary):
            return _inflate(bytes(value))
        if mode == MODE_BINARY and isinstance(filename, str) and _VALUE_FILE.match(filename):
            data = diskcache.Disk.fetch(self, mode, filename, None, False)
            return _inflate(data)
        raise IndexCorrupt(f"an index row has storage mode {mode!r}, which this store never writes")


def open_index(directory: Path) -> diskcache.Cache:
    """The diskcache index in `directory` (created 0700 by the caller)."""
    return diskcache.Cache(str(directory), disk=SafeJSONDisk)
