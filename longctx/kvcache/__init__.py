"""KV caches per preset: construction, forking, and flattening to/from named arrays for the store.

Array names in a cache file, per layer i:
- fp16: `{i}.k`, `{i}.v` (B, H_kv, L, D) float16;
- affine: `{i}.k.w|s|b`, `{i}.v.w|s|b` (mlx-lm's packed weights, scales, biases);
- turbo: `{i}.k.<name>`, `{i}.v.<name>` as produced by the codec (see `longctx.quant.codec`).
"""

from __future__ import annotations

from longctx.errors import ConfigError
from longctx.kvcache.presets import DEFAULT_PRESET, PRESETS, Preset, get_preset

__all__ = ["DEFAULT_PRESET", "PRESETS", "Preset", "get_preset", "make", "to_arrays", "from_arrays",
           "fork", "head_dims"]

_AFFINE_PARTS = ("w", "s", "b")


def head_dims(model) -> list[int]:
    """Per-layer attention head dim, read from the layers' attention modules."""
    dims = []
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        dim = getattr(attn, "head_dim", None)
        if dim is None:
            dim = attn.k_proj.weight.shape[0] // getattr(attn, "n_kv_heads")
        dims.append(int(dim))
    return dims


def make(model, preset: Preset) -> list:
    """One cache object per layer for `model`, as the preset says.

    Full-attention layers get the preset's cache; layers for which the model asks for another kind
    (e.g. sliding-window `RotatingKVCache`) keep it.
    """
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    base = make_prompt_cache(model)
    if preset.kind == "fp16":
        return base
    if preset.kind == "affine":
        # mlx-lm's default group of 64, or 32 for smaller head dims
        groups = [64 if d % 64 == 0 else 32 for d in head_dims(model)]
        return [QuantizedKVCache(group_size=g, bits=preset.affine_bits) if type(c) is KVCache else c
                for c, g in zip(base, groups)]
    from longctx.kvcache import routing
    from longctx.kvcache.turbo import TurboQuantCache

    routing.install()
    return [TurboQuantCache(preset, i) if type(c) is KVCache else c for i, c in enumerate(base)]


def to_arrays(cache: list, preset: Preset) -> dict:
    """Flatten a filled cache into named arrays for the store (see the module docstring)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from longctx.kvcache.turbo import TurboQuantCache

    arrays = {}
    for i, c in enumerate(cache):
        n = c.offset
        if type(c) is KVCache:
            keys, values = c.state[0], c.state[1]
            arrays[f"{i}.k"] = keys[..., :n, :].astype(mx.float16)  # (B, H, L, D)
            arrays[f"{i}.v"] = values[..., :n, :].astype(mx.float16)
        elif type(c) is QuantizedKVCache:
            for tag, parts in (("k", c.keys), ("v", c.values)):
                for part, arr in zip(_AFFINE_PARTS, parts):
                    arrays[f"{i}.{tag}.{part}"] = arr[..., :n, :]
        elif isinstance(c, TurboQuantCache):
            c.seal()
            arrays.update({f"{i}.{k}": v for k, v in c.arrays().items()})
        else:
            raise ConfigError(f"Layer {i} uses a {type(c).__name__} cache, which cannot be persisted yet.")
    return arrays


def from_arrays(arrays: dict, model, preset: Preset, dtype) -> list:
    """Rebuild per-layer caches from `to_arrays` output; fp16 arrays become `dtype`."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from longctx.kvcache.turbo import TurboQuantCache

    template = make(model, preset)
    dims = head_dims(model)
    out = []
    for i, c in enumerate(template):
        if type(c) is KVCache:
            keys, values = arrays[f"{i}.k"], arrays[f"{i}.v"]
            c.state = (keys.astype(dtype), values.astype(dtype), keys.shape[2])
        elif type(c) is QuantizedKVCache:
            k = tuple(arrays[f"{i}.k.{p}"] for p in _AFFINE_PARTS)
            v = tuple(arrays[f"{i}.v.{p}"] for p in _AFFINE_PARTS)
            c.keys, c.values, c.offset = k, v, k[0].shape[2]
        elif isinstance(c, TurboQuantCache):
            layer = {k[len(f"{i}."):]: v for k, v in arrays.items() if k.startswith(f"{i}.")}
            c = TurboQuantCache.from_arrays(preset, i, layer, dims[i])
        out.append(c)
    return out


def fork(cache: list) -> list:
    """Caches that share the prefix read-only: appends never touch the parent's arrays.

    fp16/affine layers hold slices exactly `offset` long, so mlx-lm must allocate (and
    concatenate) on the first append instead of writing into the parent's buffers in place.
    """
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from longctx.kvcache.turbo import TurboQuantCache

    out = []
    for c in cache:
        n = c.offset
        if type(c) is KVCache:
            f = KVCache()
            f.state = (c.state[0][..., :n, :], c.state[1][..., :n, :], n)
        elif type(c) is QuantizedKVCache:
            f = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
            f.keys = tuple(a[..., :n, :] for a in c.keys)
            f.values = tuple(a[..., :n, :] for a in c.values)
            f.offset = n
        elif isinstance(c, TurboQuantCache):
            f = c.fork()
        else:
            raise ConfigError(f"A {type(c).__name__} cache cannot be forked yet.")
        out.append(f)
    return out
