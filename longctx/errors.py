"""The one error hierarchy of longctx.

The library raises subclasses of `LongctxError` with a message a user can act on; only the CLI
catches them (one red line on stderr, exit code 1). Anything else escaping is a bug.
"""

from __future__ import annotations


class LongctxError(Exception):
    """Base class: `str(err)` is a complete sentence for the user."""


class DocumentError(LongctxError):
    """The document cannot be read or has no usable text."""


class ModelError(LongctxError):
    """The model cannot be found, imported or loaded."""


class UnsupportedModel(ModelError):
    """The model has a feature (layer kind, attention variant) the chosen KV preset cannot serve."""


class ContextLengthError(LongctxError):
    """The prompt does not fit the model's context window."""


class ResourceError(LongctxError):
    """The machine lacks the memory the work needs (told before the work starts)."""


class StoreError(LongctxError):
    """The cache store is unusable (permissions, disk full, locking)."""


class EntryNotFound(StoreError):
    """No ingested document matches the name or id given."""


class CacheCorrupt(StoreError):
    """A cache file failed validation; re-ingesting rebuilds it."""


class CacheFormatUnsupported(CacheCorrupt):
    """A cache file was written in another format version (upgrade longctx or re-ingest)."""


class CacheMismatch(StoreError):
    """A cache was built with another model, tokenizer or KV preset than the one requested."""


class ConfigError(LongctxError):
    """An option has an invalid value (unknown preset, bad number)."""
