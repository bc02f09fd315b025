"""Which models the cache presets can serve, decided before any work (ingest refuses the rest).

Every preset persists mlx-lm's standard caches: `KVCache` layers (full attention) and
`RotatingKVCache` layers (sliding windows). A layer whose model asks for another kind of cache
(recurrent / linear-attention state such as `ArraysCache` in Mamba or Qwen3-Next) cannot be
stored by any preset. The compressed presets additionally need each full-attention layer to hand
its keys to mlx-lm's `scaled_dot_product_attention` (which `kvcache.routing` sends to the
compressed path) as plain per-head keys and values; they refuse:
- attention that computes its scores itself (Gemma-2's soft-capped scores: `queries @ keys`);
- multi-head latent attention (DeepSeek-V2/V3's MLA: the cache holds a shared latent);
- attention sinks (gpt-oss: a learned per-head logit in the softmax).
"""

from __future__ import annotations

import dis
import functools

from longctx.errors import UnsupportedModel
from longctx.kvcache import _attention

_SDPA = "scaled_dot_product_attention"


@functools.lru_cache(maxsize=64)
def _calls_routed_sdpa(cls) -> bool:
    """Whether `cls.__call__` calls the module-level `scaled_dot_product_attention` (the name
    `kvcache.routing` rebinds), not `mx.fast.…` or its own score matmul."""
    call = getattr(cls, "__call__", None)
    code = getattr(call, "__code__", None)
    if code is None:
        return False
    return any(ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == _SDPA
               for ins in dis.get_instructions(code))


def _compressed_blocker(attn) -> str | None:
    """The feature of one attention module that the compressed cache cannot serve, or None."""
    if attn is None:
        return "a layer without a recognizable attention module"
    if getattr(attn, "kv_lora_rank", None):
        return "multi-head latent attention (MLA)"
    if getattr(attn, "sinks", None) is not None:
        return "attention sinks"
    if not _calls_routed_sdpa(type(attn)):
        if getattr(attn, "attn_logit_softcapping", None):
            return "soft-capped attention scores (attn_logit_softcapping)"
        return f"attention computed by the model itself ({type(attn).__name__})"
    return None


def check(model, base_cache: list, preset_name: str, compressed: bool) -> None:
    """Raise `UnsupportedModel` naming the first feature of `model` that `preset_name` cannot
    serve; return quietly when every layer is supported.

    Args:
        model: an mlx-lm model (its `layers`).
        base_cache: `make_prompt_cache(model)`, one cache per layer, as the model asks.
        preset_name: the KV preset's name (for the message).
        compressed: whether the preset compresses full-attention layers.
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
                "standard attention layers.")
        if compressed and type(c) is KVCache:
            blocker = _compressed_blocker(_attention(layers[i]) if i < len(layers) else None)
            if blocker:
                raise UnsupportedModel(
                    f"This model ({kind}) uses {blocker} in layer {i}, which the compressed KV "
                    f"preset '{preset_name}' does not support; ingest with --kv fp16.")
