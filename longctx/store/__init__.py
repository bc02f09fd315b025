"""The cache store: entries (one per document × model × KV preset) in one data directory.

Files: `caches/<id>.safetensors` (see `format.py`); `index/` is a diskcache index whose values are
JSON (diskcache's JSONDisk: nothing is ever unpickled). An entry id is content-addressed from the
document bytes, the model weights and tokenizer, the KV preset and the prompt layout, so ingesting
the same document again with the same settings finds the existing entry.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from longctx.errors import EntryNotFound, StoreError
from longctx.paths import subdir
from longctx.store import format as fmt


@dataclass(frozen=True)
class Entry:
    """What the index knows about one ingested document."""

    id: str
    name: str
    path: str  # the document's path at ingest time
    document_sha256: str
    kind: str
    pages: int
    tokens: int
    model_id: str
    model_spec: str  # resolves to the model again (see runtime.models.resolve)
    weights_sha256: str
    tokenizer_sha256: str
    kv_preset: str
    file: str  # cache file name under caches/
    bytes: int
    created: float
    prefill_seconds: float = 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict:
        return asdict(self)


def entry_id(document_sha256: str, weights_sha256: str, tokenizer_sha256: str, preset: str,
             layout_sha256: str) -> str:
    """Content address of a cache: 16 hex chars of sha256 over everything that shapes it."""
    key = "|".join((document_sha256, weights_sha256, tokenizer_sha256, preset, layout_sha256))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Store:
    """The index plus the cache files; safe to open from several processes."""

    def __init__(self, root: Path | None = None):
        import diskcache

        self.root = root or subdir("store")
        self.caches = self.root / "caches"
        self.caches.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self.index = diskcache.Cache(str(self.root / "index"), disk=diskcache.JSONDisk)
        except Exception as err:  # sqlite errors surface as several types
            raise StoreError(f"Cannot open the index in {self.root}: {err}") from err

    def close(self) -> None:
        self.index.close()

    # -- entries -----------------------------------------------------------------------------
    def get(self, eid: str) -> Entry | None:
        value = self.index.get(f"entry:{eid}")
        return Entry(**value) if value else None

    def entries(self) -> list[Entry]:
        """All entries, newest first."""
        found = [Entry(**self.index[k]) for k in self.index.iterkeys() if str(k).startswith("entry:")]
        return sorted(found, key=lambda e: e.created, reverse=True)

    def find(self, ref: str | None) -> Entry:
        """The entry named `ref` (document name, id or id prefix), or the latest if `ref` is None."""
        entries = self.entries()
        if not entries:
            raise EntryNotFound("No documents ingested yet; run `longctx ingest FILE` first.")
        if ref is None:
            latest = self.get(self.index.get("latest", "")) if self.index.get("latest") else None
            return latest or entries[0]
        matches = [e for e in entries if e.id == ref] or [e for e in entries if e.name == ref]
        matches = matches or [e for e in entries if e.id.startswith(ref)]
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
        """Write the cache file atomically, then record the entry (file first: never a dangling entry)."""
        size = fmt.write(self.caches / entry.file, arrays, metadata)
        entry = Entry(**{**entry.to_json(), "bytes": size, "created": time.time()})
        self.index.set(f"entry:{entry.id}", entry.to_json())
        self.index.set("latest", entry.id)
        return entry

    def touch_latest(self, entry: Entry) -> None:
        self.index.set("latest", entry.id)

    def load(self, entry: Entry) -> tuple[dict, dict[str, str]]:
        return fmt.read(self.caches / entry.file, entry.name)

    def remove(self, entry: Entry) -> None:
        """Delete the index entry, then the file (a crash in between leaves only an orphan file)."""
        self.index.delete(f"entry:{entry.id}")
        if self.index.get("latest") == entry.id:
            self.index.delete("latest")
        (self.caches / entry.file).unlink(missing_ok=True)
