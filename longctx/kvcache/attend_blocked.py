"""The pure-MLX attention over a compressed cache: the reference path, and the oracle of the others.

Queries are rotated once into the key codec's frame (keys are stored centered; the mean's score
shift is the same for every key of a query, so softmax needs no correction); each block of keys is
decoded in that frame (plus the QJL correction when the keys carry one), scores go through a
running-max softmax, and values are accumulated in the value codec's rotated frame and rotated
back once. Tokens kept exact (the sink and the uncompressed window) need no rotation: they are
attended last, as one block, in the original frame. Only one block of keys and values is ever
decoded at a time, so a 128k cache is never expanded in full.

With `fused`, each compressed segment's (m, l, acc) state comes from the fused kernel
(`longctx.kernels.decode_attend`) instead and is merged like any other block: that is the body
of the GPU fused path (`attend_fused`), compiled there.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from longctx.kvcache.turbo import CompressedKV
from longctx.kernels.decode_attend import decode_attend

BLOCK = 2048


def _block_mask(mask, q_pos: mx.array, k_lo: int, k_hi: int, lq: int):
    """Mask of one key block as a bool array (broadcastable to (B, H_kv, r, Lq, n)) or None."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal": key position <= query position
        k_pos = mx.arange(k_lo, k_hi)
        return k_pos[None, :] <= q_pos[:, None]  # (Lq, n)
    block = mask[..., -lq:, k_lo:k_hi]
    if block.dtype == mx.bool_:
        return block
    return block > -1e30  # additive masks: -inf (or very negative) means masked


NUMPY_SOFTMAX_MIN = 16384  # scores per block from which the CPU path exponentiates in numpy


def _softmax_step(s: mx.array, m: mx.array, cpu: bool, inplace: bool = False):
    """One online-softmax step: (running max, exp(s - max), rescale of the old state, row sums).

    On the CPU, MLX's exp is the bottleneck of long-context attention (~16 ns per element on the
    development machine; numpy's ~3 ns), so large score blocks are exponentiated in numpy there
    (forcing evaluation of the scores, which the CPU computes synchronously anyway). With
    `inplace` the caller vouches that `s` is a fresh array nobody reads again: it is overwritten
    with the probabilities (no new buffer, no copy back into MLX; 4k-token attention on the CPU
    spends 40% less time here).
    """
    if cpu and s.size >= NUMPY_SOFTMAX_MIN:
        mx.eval(s, m)
        sn, mn = np.asarray(s), np.asarray(m)
        m_new = np.maximum(mn, sn.max(axis=-1, keepdims=True))
        m_safe = np.where(m_new == -np.inf, np.float32(0.0), m_new)  # rows with nothing visible
        if inplace and sn.flags.c_contiguous and sn.flags.writeable and sn.dtype == np.float32 and numpy_writes_through():
            np.subtract(sn, m_safe, out=sn)
            np.exp(sn, out=sn)
            p, p_mx = sn, s
        else:
            p = np.exp(sn - m_safe)
            p_mx = mx.array(p)
        return (mx.array(m_new), p_mx, mx.array(np.exp(mn - m_safe)), mx.array(p.sum(axis=-1, keepdims=True)))
    m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
    m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # rows with nothing visible yet
    p = mx.exp(s - m_safe)
    return m_new, p, mx.exp(m - m_safe), p.sum(axis=-1, keepdims=True)


def _merge(state, m2: mx.array, l2: mx.array, acc2: mx.array):
    """Online-softmax merge of two (m, l, acc) states (m = -inf, l = 0: nothing seen yet)."""
    m, l, acc = state
    if acc is None:  # nothing seen yet
        return m2, l2, acc2
    m_new = mx.maximum(m, m2)
    m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # rows with nothing visible yet
    c1, c2 = mx.exp(m - m_safe), mx.exp(m2 - m_safe)
    return m_new, l * c1 + l2 * c2, acc * c1 + acc2 * c2


@functools.lru_cache(maxsize=1)
def numpy_writes_through() -> bool:
    """Whether numpy's view of an evaluated MLX array shares its memory (writes seen by MLX), as
    the in-place softmax steps assume; checked once, else they copy back into MLX."""
    a = mx.zeros((4,), dtype=mx.float32)
    mx.eval(a)
    view = np.asarray(a)
    if not view.flags.writeable:
        return False
    view[2] = 7.0
    return float(a[2].item()) == 7.0


def attend(
    queries: mx.array,
    kv: CompressedKV,
    kc,
    vc,
    tables,
    scale: float,
    mask,
    block: int,
    fused: bool,
    cpu: bool,
    softcap: float | None = None,
) -> mx.array:
    """The blocked path (and, with `fused`, the fused path's body). `kc`/`vc`: the codecs (or their `_Traced` stand-ins);
    `tables`: the kernel's centroid tables when fused; `cpu`: large score blocks may go through
    numpy (never under compile); `softcap`: scores become `tanh(s / softcap) * softcap` before
    the softmax (Gemma-2), pure MLX only (the fused kernel does not cap)."""
    if softcap and fused:
        raise ValueError("the fused kernel does not soft-cap scores")
    B, Hq, Lq, D = queries.shape
    Hkv = kv.value_mean.shape[1]
    r = Hq // Hkv
    q_rot = kc.rotate(queries.astype(mx.float32))  # (B, Hq, Lq, Dp)
    q_rot = q_rot.reshape(B, Hkv, r * Lq, q_rot.shape[-1])  # query heads grouped by KV head
    q_proj = kc.qjl_project(q_rot) if kc.spec.qjl else None
    q_pos = mx.arange(kv.offset - Lq, kv.offset)
    first_q = kv.offset - Lq
    shift = None  # (B, Hkv, r*Lq, 1): q . key_mean, the score shift of the centered keys
    if softcap:
        if kv.key_mean is None:
            raise ValueError("soft-capped attention needs the view's key mean")
        shift = queries.astype(mx.float32).reshape(B, Hkv, r * Lq, D) @ kv.key_mean.swapaxes(-1, -2)

    state = None  # (m, l, acc) once a block or segment has been seen

    def visible(parts: list) -> mx.array | None:
        """Mask of keys at the positions [lo, hi) of `parts`, side by side (None: all visible).
        Keys no later than the first query are visible to every query."""
        if mask is None or max(hi for _, hi in parts) <= first_q + 1:
            return None
        blocks = [_block_mask(mask, q_pos, lo, hi, Lq) for lo, hi in parts]
        return blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=-1)

    def add_block(state, q, keys, values, allowed, correction):
        if state is None:
            state = (
                mx.full((B, Hkv, r * Lq, 1), -mx.inf, dtype=mx.float32),
                mx.zeros((B, Hkv, r * Lq, 1), dtype=mx.float32),
                None,
            )
        n = keys.shape[2]
        s = q @ keys.swapaxes(-1, -2)  # (B, Hkv, r*Lq, n)
        if correction is not None:
            s = s + correction
        if shift is not None:  # capping the true scores: the key mean's shift back first
            s = mx.tanh((s + shift) * (scale / softcap)) * softcap
        else:
            s = s * scale
        if allowed is not None:
            s = s.reshape(B, Hkv, r, Lq, n)
            s = mx.where(allowed, s, -mx.inf).reshape(B, Hkv, r * Lq, n)
        m, l, acc = state
        # s is this block's own fresh array (a matmul, scaled, maybe masked), read only here
        m_new, p, corr, p_sum = _softmax_step(s, m, cpu, inplace=True)
        pv = p @ values  # (B, Hkv, r*Lq, Dv)
        return m_new, l * corr + p_sum, pv if acc is None else acc * corr + pv

    pos = 0
    segments = kv.segments
    exact = []  # (keys, values, lo, hi): tokens kept exact, attended in the original frame
    if kv.dense is not None and not fused:  # sink + first segment, decoded once (CPU answering)
        n = kv.dense[0].shape[2]
        state = add_block(state, q_rot, kv.dense[0], kv.dense[1], visible([(0, n)]), None)
        pos = n
        segments = segments[1:]
    elif kv.sink is not None:  # the first tokens of the sequence, kept exact
        pos = kv.sink[0].shape[2]
        exact.append((kv.sink[0], kv.sink[1], 0, pos))
    for seg_k, seg_v, length in segments:  # oldest first
        if fused:
            # Causal masking only matters if a key of the segment follows the first query.
            last_q = kv.offset - Lq
            causal = mask is not None and pos + length - 1 > last_q
            seg = _fused_segment(kc, vc, tables, q_rot, q_proj, seg_k, seg_v, scale, Lq, last_q - pos if causal else None)
            state = seg if state is None else _merge(state, *seg)
        else:
            for lo in range(0, length, block):
                hi = min(lo + block, length)
                bk = {k: v[:, :, lo:hi] for k, v in seg_k.items()}
                bv = {k: v[:, :, lo:hi] for k, v in seg_v.items()}
                corr = kc.qjl_correction(q_proj, bk) if q_proj is not None else None
                state = add_block(
                    state, q_rot, kc.decode_rotated(bk), vc.decode_rotated(bv), visible([(pos + lo, pos + hi)]), corr
                )
        pos += length
    if kv.window is not None:  # the newest tokens, uncompressed
        exact.append((kv.window[0], kv.window[1], pos, pos + kv.window[0].shape[2]))
    if state is not None:  # values were accumulated in the rotated frame: back, once
        m, l, acc = state
        state = (m, l, vc.unrotate(acc))
    if exact:
        # Exact tokens need no rotation: scores and values in the original frame (the
        # rotation is orthonormal), sink and window as one block.
        keys = mx.concatenate([e[0] for e in exact], axis=2) if len(exact) > 1 else exact[0][0]
        values = mx.concatenate([e[1] for e in exact], axis=2) if len(exact) > 1 else exact[0][1]
        q_plain = queries.astype(mx.float32).reshape(B, Hkv, r * Lq, D)
        allowed = visible([(lo, hi) for _, _, lo, hi in exact])
        if kv.window_mask is not None and kv.window is not None:  # a buffer: its valid slots only
            valid = kv.window_mask
            if len(exact) > 1:
                valid = mx.concatenate([mx.ones((exact[0][3],), dtype=mx.bool_), valid])
            allowed = valid if allowed is None else allowed & valid
        state = add_block(state, q_plain, keys.astype(mx.float32), values.astype(mx.float32), allowed, None)
    if state is None:
        raise ValueError("attention over an empty cache view (no segment, no window)")
    _, l, acc = state
    out = (acc / mx.maximum(l, 1e-30)).reshape(B, Hkv, r, Lq, D)
    out = out + kv.value_mean[:, :, None]  # values were stored centered
    return out.reshape(B, Hq, Lq, D).astype(queries.dtype)


def _fused_segment(kc, vc, tables, q_rot, q_proj, seg_k: dict, seg_v: dict, scale: float, lq: int, causal_base):
    """(m, l, acc) of one compressed segment from the fused kernel."""
    return decode_attend(
        q_rot,
        seg_k,
        seg_v,
        tables[0],
        tables[1],
        key_bits=kc.spec.bits,
        key_bits2=kc.spec.bits2 if kc.rvq else 0,
        value_bits=vc.spec.bits,
        scale=scale,
        q_proj=q_proj,
        lq=lq,
        causal_base=causal_base,
    )
