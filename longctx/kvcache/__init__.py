"""KV cache presets, construction, forking and (de)serialization of cache state.

Presets name how the KV cache is stored. `fp16` keeps mlx-lm's `KVCache` and stores keys and
values in half precision on disk; compressed presets arrive with the TurboQuant cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from longctx.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # "fp16" for now
    description: str

    def to_json(self) -> dict:
        return asdict(self)


PRESETS = {
    "fp16": Preset("fp16", "fp16", "uncompressed keys and values, half precision on disk"),
}
DEFAULT_PRESET = "fp16"


def get_preset(name: str) -> Preset:
    """The preset called `name`, or a ConfigError listing the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"Unknown KV preset '{name}'; choose one of: {', '.join(PRESETS)}.")
    return PRESETS[name]


def make(model, preset: Preset) -> list:
    """One cache object per layer for `model`, as the preset says."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def _check_supported(cache: list) -> None:
    from mlx_lm.models.cache import KVCache

    for c in cache:
        if type(c) is not KVCache:
            raise ConfigError(
                f"This model uses a {type(c).__name__} cache, which the fp16 preset cannot persist yet."
            )


def to_arrays(cache: list) -> dict:
    """Flatten a filled cache into named fp16 arrays for the store: `{i}.k`, `{i}.v` per layer."""
    import mlx.core as mx

    _check_supported(cache)
    arrays = {}
    for i, c in enumerate(cache):
        keys, values = c.state[0], c.state[1]
        arrays[f"{i}.k"] = keys[..., : c.offset, :].astype(mx.float16)  # (B, H, L, D)
        arrays[f"{i}.v"] = values[..., : c.offset, :].astype(mx.float16)
    return arrays


def from_arrays(arrays: dict, n_layers: int, dtype) -> list:
    """Rebuild the per-layer caches from `to_arrays` output, in the model's compute dtype."""
    from mlx_lm.models.cache import KVCache

    cache = []
    for i in range(n_layers):
        c = KVCache()
        keys, values = arrays[f"{i}.k"], arrays[f"{i}.v"]
        c.state = (keys.astype(dtype), values.astype(dtype), keys.shape[2])
        cache.append(c)
    return cache


def fork(cache: list) -> list:
    """A cache that shares the prefix read-only: appends go to new arrays, never the parent's.

    Each forked layer holds slices exactly `offset` long, so mlx-lm's KVCache must allocate (and
    concatenate) on the first append instead of writing into the parent's buffer in place.
    """
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        f = KVCache()
        keys, values = c.state[0], c.state[1]
        f.state = (keys[..., : c.offset, :], values[..., : c.offset, :], c.offset)
        out.append(f)
    return out
