"""KV caches per preset: construction, forking, and flattening to/from named arrays for the store.

Array names in a cache file, per layer i:
- fp16: `{i}.k`, `{i}.v` (B, H_kv, L, D) float16;
- affine: `{i}.k.w|s|b`, `{i}.v.w|s|b` (mlx-lm's packed weights, scales, biases);
- turbo: `{i}.k.<name>`, `{i}.v.<name>` as produced by the codec (see `longctx.quant.codec`).
  The small parts (`STACKED_PARTS`: centering means, exact sink tokens, norms) of every compressed
  layer are stacked into one array each, `turbo.k.<name>` / `turbo.v.<name>` (n_layers * B, H_kv,
  ...: concatenated along the batch axis, B = 1), the compressed layers in order, when all of
  them share H_kv and D (else they stay per layer): a reader allocates and fills ~6 arrays
  instead of ~180 for 30 layers (fewer arrays to allocate and fill: faster to load and to
  first use, benchmarks/diagnostics/mxload_layouts.py).

Sliding-window layers (mlx-lm's `RotatingKVCache`, e.g. Gemma-3's local layers) stay uncompressed
whatever the preset: `{i}.k`, `{i}.v` (B, H_kv, min(T, window), D) float16, the newest tokens in
temporal order (plus the cache's `keep` first tokens once the window is full). Restored with
offset T, the cache continues exactly as the original would: every later step reads only the
newest window - 1 tokens of it.
"""

from __future__ import annotations

from longctx.errors import ConfigError
from longctx.kvcache import support
from longctx.kvcache.presets import DEFAULT_PRESET, PRESETS, Preset, get_preset
from longctx.kvcache.support import attention_module
from longctx.kvcache import routing
from longctx.kvcache.kinds import Compressed, kind_of

__all__ = [
    "ANSWER_EXACT",
    "DEFAULT_PRESET",
    "PRESETS",
    "Preset",
    "get_preset",
    "make",
    "to_arrays",
    "from_arrays",
    "split_layers",
    "fork",
    "first_layer",
    "head_dims",
    "kv_heads",
    "seal",
    "to_mlx_lm",
    "windows",
    "window_config",
]

STACKED_PARTS = ("mu", "sink", "norm", "rnorm")  # per compressed layer, stacked across layers
STACK_PREFIX = "turbo."


def stackable(shapes: list[tuple[int, int]]) -> bool:
    """Whether compressed layers of these (H_kv, D) have their small parts stacked (all alike)."""
    return len(shapes) > 1 and len(set(shapes)) == 1


def stack_parts(named: dict, layers: list[int], combine) -> None:
    """Replace, in `named`, every `STACKED_PARTS` entry of the compressed `layers` by one
    `turbo.<tag>.<part>` entry, `combine([entry of each layer, in order])`. Shared by the writer
    (arrays, concatenated) and the file layout (expected dtypes and shapes)."""
    for tag in ("k", "v"):
        for part in STACKED_PARTS:
            if f"{layers[0]}.{tag}.{part}" in named:
                named[f"{STACK_PREFIX}{tag}.{part}"] = combine([named.pop(f"{i}.{tag}.{part}") for i in layers])


def head_dims(model) -> list[int]:
    """Per-layer attention head dim, read from the layers' attention modules (the query/key head
    dim of MLA's `q_head_dim`; 0 for a layer without a recognizable attention module)."""
    dims = []
    for layer in model.layers:
        attn = attention_module(layer)
        dim = getattr(attn, "head_dim", None) or getattr(attn, "q_head_dim", None)
        if dim is None and hasattr(attn, "k_proj") and hasattr(attn, "n_kv_heads"):
            dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads
        dims.append(int(dim or 0))
    return dims


def kv_heads(model) -> list[int | None]:
    """Per-layer KV head count from the attention modules (None where a module does not say)."""
    heads = [getattr(attention_module(layer), "n_kv_heads", None) for layer in model.layers]
    return [int(n) if n is not None else None for n in heads]


def make(model, preset: Preset, paths=None) -> list:
    """One cache object per layer for `model`, as the preset says.

    Full-attention layers get the preset's cache; layers for which the model asks for another kind
    (e.g. sliding-window `RotatingKVCache`) keep it. `paths`: the compressed layers' GPU paths
    (`turbo.Paths`; None: the product's), for experiments that compare them.

    Raises:
        UnsupportedModel: a layer kind or attention feature the preset cannot serve
            (`kvcache.support`).
    """
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    base = make_prompt_cache(model)
    support.check(model, base, preset.name, compressed=preset.kind != "fp16", turbo=preset.kind == "turbo")
    routing.install()  # compressed views to our attention; long exact calls on the CPU too (fp16)
    if preset.kind == "fp16":
        return base
    if preset.kind == "affine":
        # mlx-lm's default group of 64, or 32 for smaller head dims
        groups = [64 if d % 64 == 0 else 32 for d in head_dims(model)]
        return [
            QuantizedKVCache(group_size=g, bits=preset.affine_bits) if type(c) is KVCache else c for c, g in zip(base, groups)
        ]
    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache.turbo import TurboQuantCache

    first = first_layer(model)  # codec seeds follow the layer's number in the whole model
    extra = () if paths is None else (paths,)
    return [TurboQuantCache(preset, first + i, *extra) if type(c) is KVCache else c for i, c in enumerate(base)]


def first_layer(model) -> int:
    """The number, in the whole model, of `model.layers[0]`: a pipeline stage's first layer
    (mlx-lm's `pipeline` keeps `model.model.start_idx`), else 0."""
    return int(getattr(getattr(model, "model", None), "start_idx", 0) or 0)


def windows(cache: list) -> list[int]:
    """Per layer, the sliding window of a `RotatingKVCache` layer (its max_size), else 0."""
    from mlx_lm.models.cache import RotatingKVCache

    return [c.max_size if type(c) is RotatingKVCache else 0 for c in cache]


def window_config(cache: list) -> dict:
    """`{"windows": windows(cache)}` for a file's KV config if any layer slides, else {} (so files
    of models without sliding-window layers are unchanged)."""
    w = windows(cache)
    return {"windows": w} if any(w) else {}


def seal(cache: list) -> None:
    """Compress every compressed layer's uncompressed window (what a persisted cache holds)."""
    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache.turbo import TurboQuantCache

    for c in cache:
        if isinstance(c, TurboQuantCache):
            c.seal()


def to_arrays(cache: list, preset: Preset) -> dict:
    """Flatten a filled cache into named arrays for the store (see the module docstring); each
    layer's kind writes its own (`kvcache.kinds`)."""
    import mlx.core as mx

    arrays = {}
    for i, c in enumerate(cache):
        kind = kind_of(c)
        if kind is None:
            raise ConfigError(f"Layer {i} uses a {type(c).__name__} cache, which cannot be persisted yet.")
        arrays.update(kind.to_arrays(c, i))
    turbo = [i for i, c in enumerate(cache) if isinstance(kind_of(c), Compressed) and c.means is not None]
    mu = [cache[i].means[0].shape for i in turbo]  # (B, H_kv, 1, D)
    if stackable([(shape[1], shape[3]) for shape in mu]):  # along the batch axis (B = 1)
        stack_parts(arrays, turbo, lambda parts: mx.concatenate(parts, axis=0))
    return arrays


def split_layers(arrays: dict, turbo_layers: list[int]) -> dict[str, dict]:
    """Group `to_arrays` output per layer: "i" -> {name within the layer: array}. Stacked arrays
    (`turbo.*`) give one part (a view, no copy) to each of `turbo_layers`, in order: one split per
    stacked array (one MLX operation, not one slice per layer: 30 slices cost ~3x the time)."""
    import mlx.core as mx

    per_layer: dict[str, dict] = {}
    for name, arr in arrays.items():
        layer, _, rest = name.partition(".")
        if layer == STACK_PREFIX[:-1]:
            if not turbo_layers or arr.shape[0] % len(turbo_layers):
                raise ValueError(f"{name} does not stack {len(turbo_layers)} layers")
            parts = mx.split(arr, len(turbo_layers), axis=0) if len(turbo_layers) > 1 else [arr]
            for i, part in zip(turbo_layers, parts):
                per_layer.setdefault(str(i), {})[rest] = part
        else:
            per_layer.setdefault(layer, {})[rest] = arr
    return per_layer


def from_arrays(arrays: dict, model, preset: Preset, dtype, paths=None) -> list:
    """Rebuild per-layer caches from `to_arrays` output; fp16 arrays become `dtype`. Each layer
    is rebuilt by the kind of cache the model and preset ask for (`kvcache.kinds`); `paths` as
    `make` takes it.

    Sliding-window layers need the prefix length: `arrays["tokens"]` (as the store keeps it)."""
    template = make(model, preset, paths)
    kinds = [kind_of(c) for c in template]
    per_layer = split_layers(arrays, [i for i, k in enumerate(kinds) if isinstance(k, Compressed)])
    ctx = {
        "preset": preset,
        "head_dims": head_dims(model),
        "dtype": dtype,
        "tokens": int(arrays["tokens"].shape[0]) if "tokens" in arrays else 0,
    }
    return [kind.from_arrays(c, i, arrays, per_layer.get(str(i), {}), ctx) for i, (c, kind) in enumerate(zip(template, kinds))]


def to_mlx_lm(cache: list, affine_bits: int = 0) -> list:
    """Stock mlx-lm caches holding the same tokens: `KVCache` in fp16, or `QuantizedKVCache`.

    Compressed layers are decoded; affine layers are dequantized first. `affine_bits` (4 or 8)
    re-quantizes with mlx-lm's own `to_quantized` (group 64, or 32 for small head dims);
    sliding-window layers stay rotating fp16 caches.
    """
    out = []
    for i, c in enumerate(cache):
        kind = kind_of(c)
        if kind is None:
            raise ConfigError(f"Layer {i} uses a {type(c).__name__} cache, which cannot be exported yet.")
        out.append(kind.stock(c, affine_bits))
    return out


def cache_heads(c) -> int:
    """The KV head count a filled per-layer cache holds."""
    return kind_of(c).heads(c)


# CPU: most memory for decoding a restored prefix once into fp32 (`decode_once`; larger: the
# slower blocked path)
DECODE_ONCE_MAX = 2 * 2**30


def decode_once(cache: list, max_bytes: int = DECODE_ONCE_MAX) -> int:
    """Decode the restored prefix of every compressed layer once, for answering on the CPU.

    There, a table lookup per coordinate costs far more than the attention arithmetic, and the
    blocked path would decode the whole document again for every answer token (0.4 s per token
    for 1.4k tokens of SmolLM2-135M). The decoded arrays (fp32, rotated frame) live in memory
    only; the file and the packed arrays stay compressed. Skipped, leaving the blocked path,
    when the decoded cache would exceed `max_bytes`.

    Returns:
        bytes decoded (0 when skipped or nothing to decode).
    """
    import mlx.core as mx

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache.attend_cpu import helper_pool
    from longctx.kvcache.turbo import TurboQuantCache

    layers = [c for c in cache if isinstance(c, TurboQuantCache)]
    if sum(c.dense_prefix_bytes() for c in layers) > max_bytes:
        return 0
    total = 0
    # Every layer's small MLX inputs in one evaluation, not one (a sync) per layer and array.
    sinks = [c.rotated_sink() if c.prefix_len else None for c in layers]
    mx.eval([a for s in sinks if s for a in s])
    # Keys and values of a layer decode side by side (numpy's loops release the GIL).
    pool = helper_pool()
    for c, sink in zip(layers, sinks):
        total += c.decode_prefix(pool, sink)
        mx.eval(c.dense_prefix or [])  # layer by layer: the numpy buffers are freed as we go
    return total


ANSWER_EXACT = 1024  # newest tokens an answering fork keeps uncompressed (see fork)


def fork(cache: list, exact_new: int = ANSWER_EXACT) -> list:
    """Caches that share the prefix read-only: appends never touch the parent's arrays.

    fp16/affine layers hold slices exactly `offset` long, so mlx-lm must allocate (and
    concatenate) on the first append instead of writing into the parent's buffers in place.
    Compressed layers keep up to `exact_new` new tokens (the question and the answer)
    uncompressed: compressing them would save nothing (a fork is not persisted) and cost
    quality, since a question's and an answer's own tokens draw much of their attention.
    Memory: exact_new x H_kv x D x 8 bytes per layer (SmolLM2-135M: 46 MiB at 1024 tokens).
    """
    out = []
    for c in cache:
        kind = kind_of(c)
        if kind is None:
            raise ConfigError(f"A {type(c).__name__} cache cannot be forked yet.")
        out.append(kind.fork(c, exact_new))
    return out


def new_tokens(cache: list, start: int) -> dict:
    """The keys and values of the tokens after position `start` (a conversation's own turns on a
    fork of a document's prefix), as float16 arrays `{i}.k`, `{i}.v` of (B, H_kv, n, D): what
    `append` feeds back. Compressed layers hold them in their fork's exact window (`fork`'s
    `exact_new` must have covered them)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache.turbo import TurboQuantCache

    out = {}
    for i, c in enumerate(cache):
        n = c.offset - start
        if n <= 0:
            continue
        if type(c) is TurboQuantCache:
            if c.window_len < n:
                raise ConfigError("The conversation outgrew its fork's exact window; it cannot be kept.")
            k, v = (w[:, :, c.window_len - n : c.window_len] + mu for w, mu in zip(c.window, c.means))
        elif type(c) is KVCache:
            k, v = c.keys[..., start : c.offset, :], c.values[..., start : c.offset, :]
        else:
            raise ConfigError(f"A {type(c).__name__} layer cannot keep a conversation.")
        out[f"{i}.k"], out[f"{i}.v"] = k.astype(mx.float16), v.astype(mx.float16)
    return out


def append(cache: list, arrays: dict, dtype) -> None:
    """Append `new_tokens`' arrays to the caches, as the model's own calls append them."""
    import mlx.core as mx

    for i, c in enumerate(cache):
        if f"{i}.k" in arrays:
            c.update_and_fetch(arrays[f"{i}.k"].astype(dtype), arrays[f"{i}.v"].astype(dtype))
    mx.eval([c.state for c in cache])
