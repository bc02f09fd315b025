"""Groups: store entries made of several segment caches (a long document, or a collection).

A group is one index record (`group:<id>`, JSON) naming its files and its segments. Each segment
is an ordinary entry (its own cache file, checksums and lock) whose `group` field is the group's
id; its text (for ranking and citing) is kept under `segtext:<entry id>`. The order of writes
keeps the store consistent when a process dies: every segment is complete and indexed before the
group record that names it is written, so a group never names a missing segment; segments left
by an interrupted ingest are reused by the next one (same content address) or collected by `gc`.
Removing a group unindexes the record first, then its segments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import asdict, dataclass

from longctx.store.entry import Entry

_KEY = "group:"
_TEXT = "segtext:"


@dataclass(frozen=True)
class Group:
    """A document set stored as segment caches."""

    id: str
    name: str
    kind: str  # "segments" (one document split) or "collection" (several files)
    files: tuple = ()  # ({name, path, sha256, kind, pages}, ...)
    segments: tuple = ()  # ({id, label, tokens, spans}, ...), in document order
    tokens: int = 0
    model_id: str = ""
    model_spec: str = ""
    weights_sha256: str = ""
    tokenizer_sha256: str = ""
    kv_preset: str = ""
    bytes: int = 0
    created: float = 0.0
    prefill_seconds: float = 0.0
    bits_per_channel: float = 0.0
    question_suffix: str = ""

    @property
    def pages(self) -> int:
        return sum(int(f.get("pages", 1)) for f in self.files)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else 0.0

    @property
    def path(self) -> str:
        return self.files[0]["path"] if len(self.files) == 1 else ""

    @property
    def segment_ids(self) -> list[str]:
        return [s["id"] for s in self.segments]

    def to_json(self) -> dict:
        return {**asdict(self), "files": list(self.files), "segments": list(self.segments)}

    @classmethod
    def from_json(cls, value: object) -> "Group | None":
        if not isinstance(value, dict):
            return None
        try:
            names = {f.name for f in dataclasses.fields(cls)}
            group = cls(**{k: v for k, v in value.items() if k in names})
            group = dataclasses.replace(group, files=tuple(group.files), segments=tuple(group.segments))
            if not all(isinstance(s, dict) and isinstance(s.get("id"), str) for s in group.segments):
                return None
            if not all(isinstance(f, dict) for f in group.files):
                return None
            return group
        except TypeError:
            return None


def group_id(
    file_shas: list[str], weights_sha256: str, tokenizer_sha256: str, preset: str, layout_sha256: str, budget: int, name: str
) -> str:
    """Content address of a group (16 hex chars, like an entry id)."""
    key = "|".join(["group", *file_shas, weights_sha256, tokenizer_sha256, preset, layout_sha256, str(budget), name])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def get(store, gid: str) -> Group | None:
    return Group.from_json(store.get_value(_KEY + gid))


def groups(store) -> list[Group]:
    """Every group, newest first."""
    with store.guard():
        keys = [k for k in store.index.iterkeys() if k.startswith(_KEY)]
    found = [Group.from_json(store.get_value(k)) for k in keys]
    return sorted((g for g in found if g is not None), key=lambda g: g.created, reverse=True)


def save_text(store, eid: str, text: str) -> None:
    store.set_value(_TEXT + eid, text)


def text(store, eid: str) -> str:
    value = store.get_value(_TEXT + eid)
    return value if isinstance(value, str) else ""


def save(store, group: Group, segments: list[Entry]) -> Group:
    """Record `group` (its segments already saved); it becomes the latest document."""
    group = dataclasses.replace(
        group, bytes=sum(e.bytes for e in segments), tokens=sum(e.tokens for e in segments), created=time.time()
    )
    store.set_value(_KEY + group.id, group.to_json())
    store.set_value("latest", group.id)
    return group


def remove(store, group: Group) -> None:
    """Unindex the group, then remove its segments (each under its own lock)."""
    with store.lock(group.id):
        store.delete_value(_KEY + group.id)
        if store.get_value("latest") == group.id:
            store.delete_value("latest")
    for sid in group.segment_ids:
        entry = store.get(sid)
        if entry is not None:
            store.remove(entry)
