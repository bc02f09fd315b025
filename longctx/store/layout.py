"""What a cache file must hold, derived from its own metadata: checked before any array is read.

From `tokens` (T) and `kv_config` (the preset's fields, per-layer `head_dims` D and `kv_heads` H)
the names, dtypes and shapes of every array follow (naming as in `longctx.kvcache`):

- `tokens`: int32 (T,);
- fp16: `{i}.k`, `{i}.v` float16 (1, H, T, D);
- affine: `{i}.{k,v}.w` uint32 (1, H, T, D*bits/32), `.s`/`.b` float (1, H, T, D/group);
- turbo: `{i}.{k,v}.mu` float32 (1, H, 1, D), the exact first tokens `{i}.{k,v}.sink` float16
  (1, H, S, D) when the preset keeps S = min(T, sink) > 0, plus the codec's arrays
  (1, H, T - S, ...) as `longctx.quant.codec` documents them, sized with the quant modules' own
  shape functions; from format 3 on, when every compressed layer has the same H and D, the
  parts named in `kvcache.STACKED_PARTS` are instead one array each, `turbo.{k,v}.<part>`,
  the compressed layers' arrays in order, concatenated along the first (batch) axis;
- sliding-window layers (optional `windows`: per layer W > 0, else 0), whatever the kind:
  `{i}.k`, `{i}.v` float16 (1, H, min(T, W), D).

So every layer is present, nothing else is, and every token axis equals T. A file that disagrees
is `CacheCorrupt`; whether it suits the model at hand is the caller's check (`session.restore`).
"""

from __future__ import annotations

import json
from longctx.errors import CacheCorrupt
from longctx.store.format import Header
from longctx.kvcache import stack_parts, stackable

MAX_TOKENS = 1 << 24
MAX_LAYERS = 1024
MAX_HEAD_DIM = 1024
MAX_KV_HEADS = 1024
_FLOATS = ("F16", "BF16", "F32")
_KINDS = ("fp16", "affine", "turbo")


def _int(value, lo: int, hi: int) -> int | None:
    return value if type(value) is int and lo <= value <= hi else None


def kv_config(meta: dict[str, str]) -> dict:
    """The parsed, type-checked `kv_config` of a header (raises ValueError if malformed)."""
    cfg = json.loads(meta["kv_config"])
    if not isinstance(cfg, dict) or cfg.get("kind") not in _KINDS or not isinstance(cfg.get("name"), str):
        raise ValueError("kv_config names no known kind")
    dims, heads = cfg.get("head_dims"), cfg.get("kv_heads")
    if (
        not isinstance(dims, list)
        or not isinstance(heads, list)
        or not 1 <= len(dims) <= MAX_LAYERS
        or len(heads) != len(dims)
        or any(_int(d, 2, MAX_HEAD_DIM) is None for d in dims)
        or any(_int(h, 1, MAX_KV_HEADS) is None for h in heads)
    ):
        raise ValueError("kv_config has invalid head_dims / kv_heads")
    for key in ("key_bits", "key_bits2", "value_bits", "affine_bits", "seed", "window", "sink"):
        if _int(cfg.get(key, 0), 0, 1 << 32) is None:
            raise ValueError(f"kv_config has an invalid {key}")
    windows = cfg.get("windows", [0] * len(dims))
    if not isinstance(windows, list) or len(windows) != len(dims) or any(_int(w, 0, MAX_TOKENS) is None for w in windows):
        raise ValueError("kv_config has invalid windows")
    if not isinstance(cfg.get("key_qjl", False), bool):
        raise ValueError("kv_config has an invalid key_qjl")
    if cfg["kind"] == "affine" and cfg.get("affine_bits") not in (2, 3, 4, 5, 6, 8):
        raise ValueError("kv_config has invalid affine bits")
    if cfg["kind"] == "turbo" and not (
        1 <= cfg.get("key_bits", 0) <= 8 and 1 <= cfg.get("value_bits", 0) <= 8 and 0 <= cfg.get("key_bits2", 0) <= 8
    ):
        raise ValueError("kv_config has invalid bit widths")
    return cfg


def _turbo_parts(cfg: dict, head_dim: int) -> tuple[dict, dict]:
    """(key parts, value parts): name -> (dtype, trailing shape), per `quant.codec`'s table."""
    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.quant.packing import packed_words

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.quant.qjl import default_sketch_dim

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.quant.rotation import supported_size

    p = supported_size(head_dim)  # the rotation's padded dim

    def parts(bits: int, bits2: int = 0, qjl: bool = False) -> dict:
        out = {"idx": ("U32", (packed_words(p, bits),)), "norm": ("F16", ())}
        if bits2:
            out["idx2"] = ("U32", (packed_words(p, bits2),))
        if qjl:
            out["qjl"] = ("U32", (packed_words(default_sketch_dim(p), 1),))
            out["rnorm"] = ("F16", ())
        return out

    return (parts(cfg["key_bits"], cfg.get("key_bits2", 0), bool(cfg.get("key_qjl"))), parts(cfg["value_bits"]))


def expected(meta: dict[str, str]) -> dict[str, tuple[tuple[str, ...], tuple]]:
    """name -> (allowed dtypes, shape) for the file `meta` describes (ValueError if malformed)."""
    tokens = int(meta["tokens"]) if meta["tokens"].isdigit() else -1
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError("tokens is not a positive count")

    cfg = kv_config(meta)
    out: dict = {"tokens": (("I32",), (tokens,))}
    windows = cfg.get("windows", [0] * len(cfg["head_dims"]))
    turbo = [i for i, w in enumerate(windows) if not w] if cfg["kind"] == "turbo" else []
    shapes = [(cfg["kv_heads"][i], cfg["head_dims"][i]) for i in turbo]
    stacked = meta.get("format_version") != "2" and stackable(shapes)
    for i, (d, h) in enumerate(zip(cfg["head_dims"], cfg["kv_heads"])):
        for tag in ("k", "v"):
            if windows[i]:
                out[f"{i}.{tag}"] = (("F16",), (1, h, min(tokens, windows[i]), d))
            elif cfg["kind"] == "fp16":
                out[f"{i}.{tag}"] = (("F16",), (1, h, tokens, d))
            elif cfg["kind"] == "affine":
                bits, group = cfg["affine_bits"], 64 if d % 64 == 0 else 32
                if (d * bits) % 32 or d % group:
                    raise ValueError(f"head dim {d} cannot hold {bits}-bit groups of {group}")
                out[f"{i}.{tag}.w"] = (("U32",), (1, h, tokens, d * bits // 32))
                for part in ("s", "b"):
                    out[f"{i}.{tag}.{part}"] = (_FLOATS, (1, h, tokens, d // group))
            else:
                parts = _turbo_parts(cfg, d)[0 if tag == "k" else 1]
                out[f"{i}.{tag}.mu"] = (("F32",), (1, h, 1, d))
                sink = min(tokens, cfg.get("sink", 0))
                if sink:
                    out[f"{i}.{tag}.sink"] = (("F16",), (1, h, sink, d))
                for name, (dtype, trailing) in parts.items():
                    out[f"{i}.{tag}.{name}"] = ((dtype,), (1, h, tokens - sink, *trailing))
    if stacked:  # the layers' (dtypes, shape), all alike, concatenated along the batch axis
        stack_parts(out, turbo, lambda parts: (parts[0][0], (len(parts) * parts[0][1][0], *parts[0][1][1:])))
    return out


def check(header: Header, label: str, hint: str) -> None:
    """Raise CacheCorrupt unless the header's arrays are exactly those its metadata implies."""

    def corrupt(problem: str) -> CacheCorrupt:
        return CacheCorrupt(f"The cache of '{label}' is corrupt ({problem}); {hint}.")

    try:
        want = expected(header.meta)
    except (ValueError, TypeError, RecursionError) as err:
        raise corrupt(f"its metadata is inconsistent: {err}") from None
    have = header.tensors
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing or extra:
        what = f"missing {', '.join(missing[:4])}" if missing else f"unexpected {', '.join(extra[:4])}"
        raise corrupt(f"arrays do not match its KV layout: {what}")
    for name, (dtypes, shape) in want.items():
        t = have[name]
        if t.dtype not in dtypes or t.shape != shape:
            raise corrupt(f"array {name} is {t.dtype}{list(t.shape)}, expected {'/'.join(dtypes)}{list(shape)}")
