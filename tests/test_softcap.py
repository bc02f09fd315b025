"""Soft-capped attention (Gemma-2) over compressed caches: the blocked path against dense softmax
of capped scores over the same decoded keys, and the path decision that keeps kernels out."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from longctx import kvcache
from longctx.kvcache import attention
from longctx.kvcache.attention import compressed_attention
from longctx.kvcache.turbo import TurboQuantCache

CAP = 5.0


def _capped_attention(q, k, v, scale, cap, causal):
    """Reference: Gemma-2's attention, dense, fp32 (keys and values already per KV head)."""
    B, Hq, Lq, D = q.shape
    r = Hq // k.shape[1]
    k, v = mx.repeat(k, r, axis=1), mx.repeat(v, r, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * scale
    if cap:
        s = mx.tanh(s / cap) * cap
    if causal:
        L = k.shape[2]
        s = mx.where(mx.arange(L)[None, :] <= mx.arange(L - Lq, L)[:, None], s, -mx.inf)
    return mx.softmax(s, axis=-1) @ v


def _filled_fork(preset: str, prefix: int, new: int, hkv: int = 2, d: int = 32, decoded=False):
    """A fork of a sealed `prefix`-token cache holding `new` more (exact) tokens, with keys far
    from centered (mean 3): the score shift the centering removes is large."""
    mx.random.seed(1)
    k = mx.random.normal((1, hkv, prefix + new, d)) + 3.0
    v = mx.random.normal((1, hkv, prefix + new, d))
    cache = TurboQuantCache(kvcache.get_preset(preset), layer=1)
    cache.update_and_fetch(k[:, :, :prefix], v[:, :, :prefix])
    cache.seal()
    child = kvcache.fork([cache])[0]
    if decoded:  # as `kvcache.decode_once` does for CPU answering
        child.decode_prefix()
    view, _ = child.update_and_fetch(k[:, :, prefix:], v[:, :, prefix:])
    return child, view


@pytest.mark.parametrize("preset", ["tq4", "tq4k3v", "rvq2+2"])
@pytest.mark.parametrize(
    "hq,lq,mask,decoded",
    [(2, 1, None, False), (4, 7, "causal", False), (4, 7, "array", False), (4, 5, "causal", True), (2, 1, None, True)],
)
def test_capped_attention_matches_dense_capped_attention(preset, hq, lq, mask, decoded):
    child, view = _filled_fork(preset, prefix=150, new=lq, decoded=decoded)
    assert view.segments and (view.dense is not None) == decoded
    q = mx.random.normal((1, hq, lq, 32)) * 2.0
    scale = 32**-0.5
    if mask == "array":
        from mlx_lm.models.base import create_causal_mask

        mask = create_causal_mask(lq, offset=view.offset - lq)  # what Gemma-2 passes: (Lq, T) bool
    k_hat, v_hat = child.dense()  # every token as attention reads it, means added back
    ref = _capped_attention(q, k_hat, v_hat, scale, CAP, lq > 1)
    out = compressed_attention(q, view, scale=scale, mask=mask, block=64, softcap=CAP)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=3e-4, rtol=1e-3)
    # the cap bites at these scores: uncapped attention is far from capped attention
    uncapped = _capped_attention(q, k_hat, v_hat, scale, None, lq > 1)
    assert np.abs(np.array(uncapped - ref)).max() > 0.05


def test_soft_capped_scores_never_take_a_kernel_path(monkeypatch):
    """On a GPU the fused kernel and the dense SDPA path would serve this view; with a cap the
    decision is the blocked path, and forcing the kernel is an error."""
    from longctx.kvcache import dense_gpu

    _, view = _filled_fork("tq4", prefix=150, new=1)
    monkeypatch.setattr(attention, "use_fused", lambda mask, lq, *max_lq: True)
    monkeypatch.setattr(dense_gpu, "applies", lambda kv, mask: True)
    assert attention.choose_path(view, None, 1)[0] != "blocked"  # what an uncapped view gets
    path, why = attention.choose_path(view, None, 1, softcap=CAP)
    assert path == "blocked" and "soft-capped" in why
    with pytest.raises(ValueError, match="soft-cap"):
        attention.choose_path(view, None, 1, fused=True, softcap=CAP)
