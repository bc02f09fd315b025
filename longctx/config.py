"""Every `LONGCTX_*` setting in one place: name, type, default and one line of doc.

The settings are a user's (where data lives, which model, how much disk, how `ask` ranks, ...);
experiments are keyword arguments of the functions they change, with defaults (as mlx-lm's
`generate_step` takes them). Nothing else in longctx reads the environment for its own settings.
`get(key)` reads the variable when it is asked for (so a user or a test may change it after
import), parses it to its type and refuses a bad value with a `ConfigError` naming the variable.
docs/configuration.md holds the same table. This module imports only the standard library and `errors`:
`longctx/__init__` consults it before mlx loads.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from longctx.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    env: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return raw

    return parse


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(raw: str) -> int | None:
    """A size in bytes: `20GB` (powers of 1000), `500MiB` or `500M` (powers of 1024), `123`
    (bytes); None for `none`, `unlimited` or `off`.

    Raises:
        ValueError: not a size.
    """
    if raw.strip().lower() in ("none", "unlimited", "off"):
        return None
    m = _SIZE.match(raw)
    if not m or (m.group(3) and not m.group(2)) or (m.group(3) and not m.group(4)):
        raise ValueError("expected a size such as 20GB, 500MiB, 1073741824, or 0/none for no limit")
    number, prefix, binary, unit = m.groups()
    power = "kmgtp".index(prefix.lower()) + 1 if prefix else 0
    base = 1000 if unit and not binary else 1024  # `20GB`: decimal; `20G`, `20GiB`: binary
    return int(float(number) * base**power)


def _budget(raw: str) -> int:
    """`LONGCTX_MAX_STORE`: bytes, 0 for no limit (`0`, `none`)."""
    return parse_size(raw) or 0


def _openblas(raw: str) -> str | bool | None:
    """`LONGCTX_OPENBLAS`: a library path; False for 0/off (no preload); None (the default
    search) for 1/on or nothing."""
    flag = raw.strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("", "1", "true", "yes", "on"):
        return None
    return raw


def _count(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("expected an integer >= 0")
    return value


SETTINGS: dict[str, Setting] = {
    "home": Setting("LONGCTX_HOME", str, None, "data directory (default ~/.cache/longctx, ~/Library/Caches/longctx on macOS)"),
    "model": Setting(
        "LONGCTX_MODEL",
        str,
        None,
        "default model: mlx-lm directory, .gguf file or Hugging Face id (default the embedded SmolLM2-135M-Instruct)",
    ),
    "openblas": Setting(
        "LONGCTX_OPENBLAS",
        _openblas,
        None,
        "Linux CPU: path of the OpenBLAS library to preload (default: the "
        "distribution's); 0 or off: no preload (MLX's reference BLAS: slow)",
    ),
    "segment_tokens": Setting(
        "LONGCTX_SEGMENT_TOKENS",
        _count,
        0,
        "most prompt tokens of one segment of a long document or collection (0: the model's context less the answer reserve)",
    ),
    "ranker": Setting(
        "LONGCTX_RANKER",
        _choice("bm25", "model", "attention"),
        "bm25",
        "how `ask` picks the segments of a long document: lexical (bm25), or BM25's "
        "best 4 reranked by the model's question likelihood (model) or by the "
        "question's attention mass on each (attention)",
    ),
    "max_store": Setting(
        "LONGCTX_MAX_STORE",
        _budget,
        None,
        "most bytes the store keeps (20GB, 500MiB, bytes; 0 or none: no limit); "
        "ingest then evicts the least recently asked entries (default: 25% of "
        "its disk, at most the store plus half the free space)",
    ),
    "peer_timeout": Setting(
        "LONGCTX_PEER_TIMEOUT", _count, 60, "seconds a rank started by mlx.launch waits for the other ranks to connect"
    ),
    "failpoint": Setting(
        "LONGCTX_FAILPOINT",
        str,
        None,
        "fault injection for the reliability tests (set in a child process's "
        "environment): a named crash point, <point>[:kill, :stop or :enospc]",
    ),
}


def get(key: str) -> Any:
    """The current value of setting `key` (a key of `SETTINGS`), read from the environment now.

    Raises:
        ConfigError: the variable is set to a value its type refuses.
    """
    s = SETTINGS[key]
    raw = os.environ.get(s.env)
    if raw is None or (raw == "" and s.parse is str):
        return s.default
    try:
        return s.parse(raw)
    except ValueError as err:
        raise ConfigError(f"{s.env}={raw!r} is not valid ({err}); unset it or fix it.") from None


def table() -> str:
    """The settings as a markdown table (docs/configuration.md is this, checked by a test)."""
    rows = ["| variable | default | what it sets |", "|---|---|---|"]
    for s in SETTINGS.values():
        default = (
            {None: "-", True: "1", False: "0"}.get(s.default, s.default)
            if not isinstance(s.default, int) or isinstance(s.default, bool)
            else s.default
        )
        rows.append(f"| `{s.env}` | {default} | {s.doc} |")
    return "\n".join(rows)
