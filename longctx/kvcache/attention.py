"""Attention over a compressed cache, in blocks with an online softmax (the pure-MLX path).

Queries are rotated once into the key codec's frame (keys are stored centered; the mean's score
shift is the same for every key of a query, so softmax needs no correction); each block of keys is decoded in that frame
(plus the QJL correction when the keys carry one), scores go through a running-max softmax, and
values are accumulated in the value codec's rotated frame and rotated back once at the end. Only
one block of keys and values is ever decoded at a time, so a 128k cache is never expanded in full.
"""

from __future__ import annotations

import mlx.core as mx

from longctx.kvcache.turbo import CompressedKV

BLOCK = 2048


def _block_mask(mask, q_pos: mx.array, k_lo: int, k_hi: int, lq: int):
    """Mask of one key block as a bool array (broadcastable to (B, H_kv, r, Lq, n)) or None."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal": key position <= query position
        k_pos = mx.arange(k_lo, k_hi)
        return (k_pos[None, :] <= q_pos[:, None])  # (Lq, n)
    block = mask[..., -lq:, k_lo:k_hi]
    if block.dtype == mx.bool_:
        return block
    return block > -1e30  # additive masks: -inf (or very negative) means masked


def compressed_attention(queries: mx.array, kv: CompressedKV, scale: float, mask=None,
                         block: int = BLOCK) -> mx.array:
    """Softmax attention of `queries` over a compressed cache.

    Args:
        queries: (B, H_q, L_q, D), rope already applied; H_q a multiple of the cache's H_kv.
        kv: the cache view returned by `TurboQuantCache.update_and_fetch`.
        scale: score scale (usually D ** -0.5).
        mask: None, "causal" (queries are the last L_q positions), or an mlx-lm mask array.
        block: keys decoded per step.

    Returns:
        (B, H_q, L_q, D) in the queries' dtype.
    """
    kc, vc = kv.key_codec, kv.value_codec
    B, Hq, Lq, D = queries.shape
    Hkv = kv.value_mean.shape[1]
    r = Hq // Hkv
    q_rot = kc.rotate(queries.astype(mx.float32))  # (B, Hq, Lq, Dp)
    q_rot = q_rot.reshape(B, Hkv, r * Lq, q_rot.shape[-1])  # query heads grouped by KV head
    q_proj = kc.qjl_project(q_rot) if kc.spec.qjl else None
    q_pos = mx.arange(kv.offset - Lq, kv.offset)

    m = mx.full((B, Hkv, r * Lq, 1), -mx.inf, dtype=mx.float32)
    l = mx.zeros((B, Hkv, r * Lq, 1), dtype=mx.float32)
    acc = None

    def blocks():
        """(rotated keys, rotated values, first position) per block, oldest first."""
        pos = 0
        for seg_k, seg_v, length in kv.segments:
            for lo in range(0, length, block):
                hi = min(lo + block, length)
                bk = {k: v[:, :, lo:hi] for k, v in seg_k.items()}
                bv = {k: v[:, :, lo:hi] for k, v in seg_v.items()}
                k_rot = kc.decode_rotated(bk)
                if q_proj is not None:
                    yield k_rot, vc.decode_rotated(bv), pos + lo, kc.qjl_correction(q_proj, bk)
                else:
                    yield k_rot, vc.decode_rotated(bv), pos + lo, None
            pos += length
        if kv.window is not None:  # the newest tokens, uncompressed
            yield kc.rotate(kv.window[0]), vc.rotate(kv.window[1]), pos, None

    for k_rot, v_rot, start, correction in blocks():
        n = k_rot.shape[2]
        s = q_rot @ k_rot.swapaxes(-1, -2)  # (B, Hkv, r*Lq, n)
        if correction is not None:
            s = s + correction
        s = s * scale
        allowed = _block_mask(mask, q_pos, start, start + n, Lq)
        if allowed is not None:
            s = s.reshape(B, Hkv, r, Lq, n)
            s = mx.where(allowed, s, -mx.inf).reshape(B, Hkv, r * Lq, n)
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # rows with nothing visible yet
        p = mx.exp(s - m_safe)
        corr = mx.exp(m - m_safe)
        l = l * corr + p.sum(axis=-1, keepdims=True)
        pv = p @ v_rot  # (B, Hkv, r*Lq, Dpv)
        acc = pv if acc is None else acc * corr + pv
        m = m_new
    out = acc / mx.maximum(l, 1e-30)
    out = vc.unrotate(out.reshape(B, Hkv, r, Lq, out.shape[-1]))[..., :D]  # (B, Hkv, r, Lq, D)
    out = out + kv.value_mean[:, :, None]  # values were stored centered
    return out.reshape(B, Hq, Lq, D).astype(queries.dtype)
