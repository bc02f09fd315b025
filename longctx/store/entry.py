"""A store entry: what the index knows about one ingested document, and its content address
(a leaf of the store package: the index, recovery, groups and budget all read it)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shlex
from dataclasses import asdict, dataclass

ID_PATTERN = re.compile(r"^[0-9a-f]{16}$")  # an entry id: 16 hex chars of a sha256


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
    file: str  # cache file name under caches/ (always `<id>.safetensors`)
    bytes: int
    created: float
    prefill_seconds: float = 0.0
    bits_per_channel: float = 0.0  # stored bits per key/value channel, all-in
    # The chat template after the question, stored when the `tokenizers`-only tokenizer was
    # checked to encode like the model's (see runtime.light); "" for transformers' path.
    question_suffix: str = ""
    group: str = ""  # the id of the group (segmented document, collection) it belongs to
    segment: int = -1  # its index in that group
    # "" for a single process; "tensor:N:r" for rank r's share of N, "pipeline:N:r:lo-hi" for a
    # pipeline stage's layers lo..hi-1 (runtime.distributed)
    topology: str = ""

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: object) -> "Entry | None":
        """An Entry from an index value, or None if the value is not one (unknown keys ignored)."""
        if not isinstance(value, dict):
            return None
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in value:
                if f.default is dataclasses.MISSING:
                    return None
                continue
            v = value[f.name]
            ok = {"str": isinstance(v, str), "int": type(v) is int, "float": type(v) in (int, float)}.get(f.type, True)
            if not ok:
                return None
            kwargs[f.name] = v
        entry = cls(**kwargs)
        return entry if ID_PATTERN.match(entry.id) and entry.file == f"{entry.id}.safetensors" else None


def entry_id(document_sha256: str, weights_sha256: str, tokenizer_sha256: str, preset: str, layout_sha256: str) -> str:
    """Content address of a cache: 16 hex chars of sha256 over everything that shapes it."""
    key = "|".join((document_sha256, weights_sha256, tokenizer_sha256, preset, layout_sha256))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def rebuild_hint(entry: Entry) -> str:
    """The command that rebuilds an entry's cache, for error messages."""
    return f"rebuild it with `longctx ingest --force {shlex.quote(entry.path)}`"
