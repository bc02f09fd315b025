"""Which models the cache presets can serve, decided before any work (ingest refuses the rest).

Every preset persists mlx-lm's standard caches: `KVCache` layers (full attention) and
`RotatingKVCache` layers (sliding windows), keys and values of one head dim per layer. A layer
whose model asks for another kind of cache (recurrent / linear-attention state such as
`ArraysCache` in Mamba or Qwen3-Next) cannot be stored by any preset, nor can multi-head latent
attention whose cache holds other widths (`_storage_blocker`: DeepSeek-V3's latent, DeepSeek-V2's
keys wider than its values). The compressed presets additionally need each full-attention layer
to hand its keys to mlx-lm's `scaled_dot_product_attention` (which `kvcache.routing` sends to the
compressed path) as plain per-head keys and values, or to be Gemma-2's soft-capped attention
(which `kvcache.softcap` routes, for the TurboQuant presets only); they refuse:
- other attention that computes its scores itself (`queries @ keys` in the model);
- multi-head latent attention (DeepSeek-V2's MLA: keys and values built from a shared latent);
- attention sinks (gpt-oss: a learned per-head logit in the softmax).
"""

from __future__ import annotations

import dis
import functools

from longctx.errors import UnsupportedModel
from longctx.kvcache import softcap

_SDPA = "scaled_dot_product_attention"


def attention_module(layer):
    """A layer's attention module: `self_attn`, `attention`, or EXAONE's `attn.attention`."""
    attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
    if attn is None and getattr(layer, "attn", None) is not None:
        attn = getattr(layer.attn, "attention", None) or layer.attn
    return attn


@functools.lru_cache(maxsize=64)
def _calls_routed_sdpa(cls) -> bool:
    """Whether `cls.__call__` calls the module-level `scaled_dot_product_attention` (the name
    `kvcache.routing` rebinds), not `mx.fast.…` or its own score matmul."""
    call = getattr(cls, "__call__", None)
    code = getattr(call, "__code__", None)
    if code is None:
        return False
    return any(ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == _SDPA for ins in dis.get_instructions(code))


def _storage_blocker(attn) -> str | None:
    """A feature of one attention module that no preset can store, or None: a cache file holds
    keys and values of one head dim per layer, and multi-head latent attention may cache other
    widths (DeepSeek-V3's absorbed form caches the latent and the RoPE key; DeepSeek-V2's keys
    are nope + rope wide, its values v_head_dim)."""
    if getattr(attn, "kv_lora_rank", None):
        if hasattr(attn, "embed_q"):
            return "multi-head latent attention caching its latent (MLA, absorbed form)"
        if getattr(attn, "v_head_dim", None) != getattr(attn, "q_head_dim", None):
            return "multi-head latent attention with keys and values of different widths"
    return None


def _compressed_blocker(attn, turbo: bool) -> str | None:
    """The feature of one attention module that the compressed cache cannot serve, or None
    (`turbo`: the TurboQuant cache, which `kvcache.softcap` serves for Gemma-2; mlx-lm's affine
    cache goes to the model's own score matmul, which cannot read it)."""
    if attn is None:
        return "a layer without a recognizable attention module"
    if getattr(attn, "kv_lora_rank", None):
        return "multi-head latent attention (MLA)"
    if getattr(attn, "sinks", None) is not None:
        return "attention sinks"
    if not _calls_routed_sdpa(type(attn)):
        if turbo and softcap.serves(type(attn)):  # Gemma-2: `kvcache.softcap` routes it
            return None
        if getattr(attn, "attn_logit_softcapping", None):
            return "soft-capped attention scores (attn_logit_softcapping)"
        return f"attention computed by the model itself ({type(attn).__name__})"
    return None


def check(model, base_cache: list, preset_name: str, compressed: bool, turbo: bool = False) -> None:
    """Raise `UnsupportedModel` naming the first feature of `model` that `preset_name` cannot
    serve; return quietly when every layer is supported.

    Args:
        model: an mlx-lm model (its `layers`).
        base_cache: `make_prompt_cache(model)`, one cache per layer, as the model asks.
        preset_name: the KV preset's name (for the message).
        compressed: whether the preset compresses full-attention layers.
        turbo: whether it compresses them with the TurboQuant cache (not mlx-lm's affine one).
    """
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    kind = getattr(getattr(model, "args", None), "model_type", None) or type(model).__module__
    kind = str(kind).rsplit(".", 1)[-1]
    layers = getattr(model, "layers", [])
    for i, c in enumerate(base_cache):
        if type(c) not in (KVCache, RotatingKVCache):
            raise UnsupportedModel(
                f"This model ({kind}) keeps {type(c).__name__} state in layer {i} (recurrent or "
                "linear-attention layers), which longctx cannot store yet; use a model with "
                "standard attention layers."
            )
        attn = attention_module(layers[i]) if i < len(layers) else None
        blocker = _storage_blocker(attn)
        if blocker:
            raise UnsupportedModel(
                f"This model ({kind}) uses {blocker} in layer {i}, which longctx cannot store yet "
                "(a cache holds keys and values of one head dim per layer); use a model with "
                "standard attention layers."
            )
        if compressed and type(c) is KVCache:
            blocker = _compressed_blocker(attn, turbo)
            if blocker:
                raise UnsupportedModel(
                    f"This model ({kind}) uses {blocker} in layer {i}, which the compressed KV "
                    f"preset '{preset_name}' does not support; ingest with --kv fp16."
                )
