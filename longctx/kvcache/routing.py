"""Route mlx-lm models' attention to the compressed path when the cache is ours.

mlx-lm model modules do `from .base import scaled_dot_product_attention` and call it with the
values returned by `cache.update_and_fetch`. Every such module's name is rebound to a wrapper
that sends `CompressedKV` views to `compressed_attention`, long uncompressed calls on the CPU
(an fp16 cache, the layer-major prefill's exact staging cache) to `attend_cpu.exact_attention`
(numpy exponentials), and everything else to mlx-lm's own function, unchanged. Gemma-2's
attention, which computes its scores itself, is wrapped by `kvcache.softcap`. Idempotent; call it
after a model's module is imported.
"""

from __future__ import annotations

import sys
from longctx.kvcache import softcap

_ORIGINAL = "_longctx_original"


def _wrap(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        # deferred: loads mlx.core, numpy (the light commands start without it)
        from longctx.kvcache import attend_cpu
        from longctx.kvcache.attention import compressed_attention

        # deferred: loads mlx.core, numpy (the light commands start without it)
        from longctx.kvcache.turbo import CompressedKV

        if isinstance(keys, CompressedKV):
            if sinks is not None:
                raise NotImplementedError("attention sinks are not supported by compressed caches")
            return compressed_attention(queries, keys, scale=scale, mask=mask)
        if attend_cpu.exact_applies(queries, keys, mask, sinks) and not kw:
            return attend_cpu.exact_attention(queries, keys, values, scale, mask)
        if sinks is not None:
            kw["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    setattr(scaled_dot_product_attention, _ORIGINAL, original)
    return scaled_dot_product_attention


def install() -> int:
    """Rebind `scaled_dot_product_attention` in every loaded mlx-lm model module.

    Returns:
        how many modules were newly routed.
    """
    from mlx_lm.models import base

    softcap.install()  # Gemma-2 computes its soft-capped scores itself: a shim of its own
    original = base.scaled_dot_product_attention
    original = getattr(original, _ORIGINAL, original)
    routed = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("mlx_lm.models.") or module is None:
            continue
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is original:
            setattr(module, "scaled_dot_product_attention", _wrap(original))
            routed += 1
    return routed
