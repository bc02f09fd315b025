"""Gemma-2's soft-capped attention over a compressed cache (a shim around mlx-lm's module).

mlx-lm's `gemma2.Attention` computes its scores itself (`queries @ keys`, then
`tanh(scores / cap) * cap`, the mask, a softmax), so the routed `scaled_dot_product_attention`
never sees them. `install` wraps the class's `__call__`: with a `TurboQuantCache` the wrapper
projects, applies RoPE and appends to the cache as mlx-lm 0.32's module does, then calls
`compressed_attention(..., softcap=cap)` (blocked, pure MLX: capping is a monotone map of each
score, applied inside the online softmax); with any other cache it calls mlx-lm's own method,
unchanged. Idempotent; call it after the model's module is imported (`routing.install` does).
"""

from __future__ import annotations

import sys

_ORIGINAL = "_longctx_original"
_MODULE = "mlx_lm.models.gemma2"


def _wrap(original):
    def __call__(self, x, mask=None, cache=None):
        # deferred: loads mlx.core, numpy (the light commands start without it)
        from longctx.kvcache.attention import compressed_attention

        # deferred: loads mlx.core, numpy (the light commands start without it)
        from longctx.kvcache.turbo import TurboQuantCache

        if not isinstance(cache, TurboQuantCache):
            return original(self, x, mask, cache)
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=cache.offset)  # (B, H_q, L, D)
        keys = self.rope(keys, offset=cache.offset)  # (B, H_kv, L, D)
        view, _ = cache.update_and_fetch(keys, values)
        out = compressed_attention(
            queries, view, scale=self.scale, mask=mask, softcap=float(self.attn_logit_softcapping)
        )  # (B, H_q, L, D)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    setattr(__call__, _ORIGINAL, original)
    return __call__


def serves(cls) -> bool:
    """Whether `cls` is an attention class this shim routes (Gemma-2's, once installed or not)."""
    module = sys.modules.get(_MODULE)
    return module is not None and cls is getattr(module, "Attention", None)


def install() -> bool:
    """Wrap `mlx_lm.models.gemma2.Attention.__call__` if that module is loaded.

    Returns:
        whether it was newly wrapped.
    """
    module = sys.modules.get(_MODULE)
    cls = getattr(module, "Attention", None) if module is not None else None
    if cls is None or hasattr(cls.__call__, _ORIGINAL):
        return False
    cls.__call__ = _wrap(cls.__call__)
    return True
