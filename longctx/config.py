"""Every `LONGCTX_*` setting in one place: name, type, default and one line of doc.

Nothing else in longctx reads the environment for its own settings. `get(key)` reads the variable
when it is asked for (so a user or a test may change it after import), parses it to its type and
refuses a bad value with a `ConfigError` naming the variable. `override(**values)` sets values for
a block (tests and benchmarks compare paths with it). docs/configuration.md holds the same table.
This module imports only the standard library: `longctx/__init__` consults it before mlx loads.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Setting:
    env: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _flag(raw: str) -> bool:
    if raw.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if raw.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 0 or 1")


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return raw
    return parse


def _megabytes(raw: str) -> int:
    value = float(raw)
    if value < 0:
        raise ValueError("expected a size in MiB >= 0")
    return int(value * 2**20)


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
    return int(float(number) * base ** power)


def _budget(raw: str) -> int:
    """`LONGCTX_MAX_STORE`: bytes, 0 for no limit (`0`, `none`)."""
    return parse_size(raw) or 0


def _count(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("expected an integer >= 0")
    return value


SETTINGS: dict[str, Setting] = {
    "home": Setting("LONGCTX_HOME", str, None,
                    "data directory (default ~/.cache/longctx, ~/Library/Caches/longctx on macOS)"),
    "model": Setting("LONGCTX_MODEL", str, None,
                     "default model: mlx-lm directory, .gguf file or Hugging Face id (default "
                     "the embedded SmolLM2-135M-Instruct)"),
    "fused_max_lq": Setting("LONGCTX_FUSED_MAX_LQ", _count, 64,
                            "GPU: query tokens up to which compressed attention takes the fused "
                            "decode-attend kernel (more: dequantize + SDPA)"),
    "compile": Setting("LONGCTX_COMPILE", _choice("0", "1", "question"), "1",
                       "GPU: run the fused attention path under mx.compile: always (1), for "
                       "questions only, or never (0)"),
    "question_stepwise": Setting("LONGCTX_QUESTION_STEPWISE", _choice("0", "auto", "1"), "auto",
                                 "a question of up to 64 tokens over a compressed cache is fed one "
                                 "token at a time: on CUDA (auto: the decode step's kernel serves "
                                 "every question length, where a batched question compiles one "
                                 "kernel per length), everywhere (1), or never (0)"),
    "cuda_kernel_cache": Setting("LONGCTX_CUDA_KERNEL_CACHE", _flag, True,
                                 "CUDA (mlx 0.32.4): longctx compiles each of its kernels once "
                                 "and writes it into MLX's kernel cache folder "
                                 "(MLX_PTX_CACHE_DIR, default <temp>/mlx/<version>/ptx), where "
                                 "MLX loads it; 0: MLX compiles them in every process"),
    "fused_step": Setting("LONGCTX_FUSED_STEP", _flag, True,
                          "GPU: a decode step over one scalar-coded segment runs as two kernel "
                          "launches, one on CUDA's tensor-core path (0: the compiled fused "
                          "path)"),
    "prefill_pairs": Setting("LONGCTX_PREFILL_PAIRS", _count, 0,
                             "query-key pairs one prefill chunk may score per head; past it "
                             "chunks shrink (20971520: 128 tokens at 128k; bounds one "
                             "evaluation for the Metal watchdog; 0: fixed 512-token chunks)"),
    "prefill_inflight": Setting("LONGCTX_PREFILL_INFLIGHT_MB", _megabytes, 2**30,
                                "GPU: most MiB of dequantized cache rows a token-major "
                                "compressed prefill keeps queued (past it, older layers are "
                                "waited for; 0: no bound)"),
    "prefill_layer_inflight": Setting("LONGCTX_PREFILL_LAYER_INFLIGHT_MB", _megabytes,
                                      256 * 2**20,
                                      "GPU: most MiB of staging buffers and activations a "
                                      "layer-major prefill keeps queued (past it, older groups "
                                      "are waited for; 0: no bound)"),
    "prefill_queue_every": Setting("LONGCTX_PREFILL_QUEUE_EVERY", _count, 4,
                                   "GPU: a compressed prefill chunk queues its graph for the GPU "
                                   "every this many layers (each queueing costs host time; the "
                                   "in-flight bound still waits as prefill_inflight says)"),
    "prefill_group_tokens": Setting("LONGCTX_PREFILL_GROUP_TOKENS", _count, 4096,
                                    "GPU: a layer-major prefill queues a layer's graph every "
                                    "this many tokens (whole chunks; fewer where "
                                    "prefill_layer_inflight bounds what is queued)"),
    "prefill_layer_call_tokens": Setting("LONGCTX_PREFILL_LAYER_CALL_TOKENS", _count, 2048,
                                         "GPU: a layer-major prefill calls each layer on runs "
                                         "of whole chunks of up to this many tokens (fewer "
                                         "calls and staging copies; each scores at most a "
                                         "512-token chunk's pairs at 128k); 0: one call per "
                                         "chunk, as the fp16 prefill calls them"),
    "prefill_order": Setting("LONGCTX_PREFILL_ORDER", _choice("auto", "layer", "token"), "layer",
                             "compressed prefill of an empty cache: layer by layer, each layer "
                             "attending its keys exactly before they are compressed (layer), or "
                             "chunk by chunk through every layer, attending the compressed "
                             "prefix (token); auto: layer on a GPU, token on the CPU"),
    "dense_gpu": Setting("LONGCTX_DENSE_GPU", _flag, True,
                         "GPU: prefill chunks dequantize the cache and run fp16 SDPA (0: the "
                         "blocked MLX path)"),
    "decode_once_max": Setting("LONGCTX_DECODE_ONCE_MAX_MB", _megabytes, 2 * 2**30,
                               "CPU: most memory (MiB) for decoding a restored prefix once into "
                               "fp32 (larger: the slower blocked path)"),
    "checks": Setting("LONGCTX_CHECKS", _choice("overlap", "after"), "overlap",
                      "restore: run the sha256 checks while MLX reads the file (overlap) or "
                      "after it"),
    "openblas": Setting("LONGCTX_OPENBLAS", str, None,
                        "Linux CPU: path of the OpenBLAS library to preload (default: the "
                        "distribution's)"),
    "no_openblas": Setting("LONGCTX_NO_OPENBLAS", _flag, False,
                           "Linux CPU: do not preload OpenBLAS (MLX's reference BLAS: slow)"),
    "segment_tokens": Setting("LONGCTX_SEGMENT_TOKENS", _count, 0,
                              "most prompt tokens of one segment of a long document or "
                              "collection (0: the model's context less the answer reserve)"),
    "ranker": Setting("LONGCTX_RANKER", _choice("bm25", "model", "attention"), "bm25",
                      "how `ask` picks the segments of a long document: lexical (bm25), or BM25's "
                      "best 4 reranked by the model's question likelihood (model) or by the "
                      "question's attention mass on each (attention)"),
    "max_store": Setting("LONGCTX_MAX_STORE", _budget, None,
                         "most bytes the store keeps (20GB, 500MiB, bytes; 0 or none: no limit); "
                         "ingest then evicts the least recently asked entries (default: 25% of "
                         "its disk, at most the store plus half the free space)"),
    "peer_timeout": Setting("LONGCTX_PEER_TIMEOUT", _count, 60,
                            "seconds a rank started by mlx.launch waits for the other ranks to connect"),
    "failpoint": Setting("LONGCTX_FAILPOINT", str, None,
                         "tests only: a named crash point, <point>[:kill, :stop or :enospc]"),
}

_OVERRIDES: dict[str, Any] = {}


def get(key: str) -> Any:
    """The current value of setting `key` (a key of `SETTINGS`).

    Raises:
        ConfigError: the variable is set to a value its type refuses.
    """
    if key in _OVERRIDES:
        return _OVERRIDES[key]
    s = SETTINGS[key]
    if _ENV_BYTES is not None:  # the decode step asks a few settings per layer and token
        raw_b = _ENV_BYTES.get(_ENV_KEYS.get(s.env) or _env_key(s.env))
        if raw_b is None:
            return s.default
        hit = _PARSED.get((key, raw_b))
        if hit is not None:
            return hit[0]
        raw = os.fsdecode(raw_b)
    else:
        raw = os.environ.get(s.env)
    if raw is None or (raw == "" and s.parse is str):
        return s.default
    try:
        value = s.parse(raw)
    except ValueError as err:
        from longctx.errors import ConfigError

        raise ConfigError(f"{s.env}={raw!r} is not valid ({err}); unset it or fix it.") from None
    if _ENV_BYTES is not None and len(_PARSED) < 1024:
        _PARSED[(key, raw_b)] = (value,)
    return value


# CPython on POSIX keeps the environment as os.environ._data, bytes to bytes, which every read
# and write through os.environ goes to: a lookup there skips the str encoding and decoding (~1 us
# a setting). Parsed values are kept per (setting, raw bytes), so a changed variable is parsed
# again. Elsewhere os.environ.get.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_ENV_BYTES, dict) or not isinstance(next(iter(_ENV_BYTES), b""), bytes):
    _ENV_BYTES = None
_ENV_KEYS: dict[str, bytes] = {}
_PARSED: dict[tuple, tuple] = {}


def _env_key(name: str) -> bytes:
    _ENV_KEYS[name] = os.fsencode(name)
    return _ENV_KEYS[name]


@contextlib.contextmanager
def override(**values):
    """Set settings for the block (keys of `SETTINGS`), whatever the environment says."""
    unknown = set(values) - set(SETTINGS)
    if unknown:
        raise KeyError(f"unknown settings: {sorted(unknown)}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(values)
    GENERATION[0] += 1
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)
        GENERATION[0] += 1


GENERATION = [0]  # bumped by `override` (what a decode step's kept launch compares)


def raw(key: str):
    """The environment variable of setting `key` as the environment holds it (bytes on POSIX,
    else str; None when unset): what changes when the setting can, read in ~0.1 us."""
    name = SETTINGS[key].env
    if _ENV_BYTES is not None:
        return _ENV_BYTES.get(_ENV_KEYS.get(name) or _env_key(name))
    return os.environ.get(name)


def table() -> str:
    """The settings as a markdown table (docs/configuration.md is this, checked by a test)."""
    rows = ["| variable | default | what it sets |", "|---|---|---|"]
    for s in SETTINGS.values():
        default = {None: "-", True: "1", False: "0"}.get(s.default, s.default) \
            if not isinstance(s.default, int) or isinstance(s.default, bool) else s.default
        if s.env.endswith("_MB"):
            default = s.default // 2**20
        rows.append(f"| `{s.env}` | {default} | {s.doc} |")
    return "\n".join(rows)
