"""CPU answering: attention over a prefix decoded once plus the exact window, as one softmax.

The path `kvcache.decode_once` sets up: on the CPU, decoding (a table lookup per coordinate)
costs far more than the attention arithmetic, so a restored prefix is decoded into fp32 once and
answer tokens attend to it directly; exponentials go through numpy (MLX's CPU `exp` is ~5x
slower), in place.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from longctx.kvcache import attend_blocked
from longctx.kvcache.turbo import CompressedKV


@functools.lru_cache(maxsize=256)
def rotation_matrices(codec) -> tuple[mx.array, mx.array]:
    """A codec's rotation as matrices: `rotate(x) == x @ R` (D, Dp) and `unrotate(y) == y @ U`
    (Dp, D), float32 (the transform is linear: its images of the identity), evaluated."""
    r = codec.rotate(mx.eye(codec.dim, dtype=mx.float32))
    u = codec.unrotate(mx.eye(codec.padded_dim, dtype=mx.float32))
    mx.eval(r, u)
    return r, u


def applies(kv: CompressedKV, mask, lq: int) -> bool:
    """Whether `attention` covers this view: a decoded prefix and nothing compressed
    after it (a long answer's tail takes the blocked path), a mask that is none or causal, and
    queries that all follow the decoded prefix."""
    if kv.dense is None or len(kv.segments) != 1 or not (mask is None or mask == "causal"):
        return False
    return kv.dense[0].shape[2] <= kv.offset - lq


def attention(queries: mx.array, kv: CompressedKV, scale: float, mask) -> mx.array:
    """Attention over a decoded prefix plus the exact window as one softmax, exponentials in numpy.

    The CPU answering path (`kvcache.decode_once`): the window's keys and values are rotated into
    the prefix's frames (window and prefix are both centered), so prefix and window scores share
    one running max and one sum, and the output is rotated back once; the blocked path would run
    two blocks and merge them, ~30 MLX operations of ~20-50 us each on a CPU for a few MFLOP.
    Matmuls stay in MLX: numpy's own BLAS threads would fight MLX's for the cores between layers
    (a 1k-token question then took 2x longer, not less). The two score arrays are exponentiated in
    place (see `attend_blocked._softmax_step`) and never concatenated, so no score block is copied.
    """
    B, Hq, Lq, D = queries.shape
    Hkv = kv.value_mean.shape[1]
    r = Hq // Hkv
    rk, _ = rotation_matrices(kv.key_codec)
    rv, uv = rotation_matrices(kv.value_codec)
    dense_k, dense_v = kv.dense
    n_dense = dense_k.shape[2]
    q = queries.astype(mx.float32).reshape(B, Hkv, r * Lq, D) @ rk
    blocks = [((q @ dense_k.swapaxes(-1, -2)) * scale, dense_v)]  # fresh arrays, read only here
    if kv.window is not None:
        win_k, win_v = kv.window[0] @ rk, kv.window[1] @ rv
        blocks.append(((q @ win_k.swapaxes(-1, -2)) * scale, win_v))
    mx.eval([b[0] for b in blocks])
    scores = [np.asarray(b[0]) for b in blocks]
    if mask is not None and len(scores) > 1:  # key p is seen by the query at position t if p <= t
        w = scores[1].shape[-1]
        seen = np.arange(n_dense, n_dense + w)[None, :] <= np.arange(kv.offset - Lq, kv.offset)[:, None]
        np.copyto(scores[1], np.float32(-np.inf), where=~np.tile(seen, (r, 1)))
    top = scores[0].max(axis=-1, keepdims=True)  # the prefix is always seen: finite
    if len(scores) > 1:
        top = np.maximum(top, scores[1].max(axis=-1, keepdims=True))
    total = 0
    acc = None
    for (s, values), sn in zip(blocks, scores):
        np.subtract(sn, top, out=sn)
        np.exp(sn, out=sn)
        total = total + sn.sum(axis=-1, keepdims=True)
        p = s if attend_blocked.numpy_writes_through() else mx.array(sn)
        acc = p @ values if acc is None else acc + p @ values
    out = (acc / mx.array(total)) @ uv
    out = out.reshape(B, Hkv, r, Lq, D) + kv.value_mean[:, :, None]
    return out.reshape(B, Hq, Lq, D).astype(queries.dtype)


EXACT_MIN_SCORES = 1 << 20  # scores per call from which exact attention on the CPU goes through numpy


def exact_applies(queries, keys, mask, sinks) -> bool:
    """Whether `exact_attention` takes an uncompressed attention call (`kvcache.routing`): the
    CPU, plain arrays (not an affine cache's tuples), no attention sinks, a mask that is none or
    causal, grouped heads, and enough scores that MLX's exponentials would dominate (short calls
    keep MLX's SDPA)."""
    if sinks is not None or not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return False
    if not (isinstance(queries, mx.array) and isinstance(keys, mx.array)):  # e.g. mlx-lm's quantized cache
        return False
    if mx.default_device().type != mx.DeviceType.cpu or queries.ndim != 4 or keys.ndim != 4:
        return False
    if queries.shape[1] % keys.shape[1] or keys.shape[2] < queries.shape[2]:
        return False
    return queries.shape[1] * queries.shape[2] * keys.shape[2] >= EXACT_MIN_SCORES


def _exp_rows(scores: np.ndarray, pool) -> np.ndarray:
    """scores <- exp(scores - row max) in place; returns the row sums. Rows are split between
    the pool's threads (numpy's loops release the GIL; MLX's BLAS is idle meanwhile)."""
    rows = scores.reshape(-1, scores.shape[-1])
    sums = np.empty((rows.shape[0], 1), dtype=np.float32)

    def part(lo: int, hi: int) -> None:
        x = rows[lo:hi]
        np.subtract(x, x.max(axis=-1, keepdims=True), out=x)
        np.exp(x, out=x)
        np.sum(x, axis=-1, keepdims=True, out=sums[lo:hi])

    n = rows.shape[0]
    if pool is None or n < 2:
        part(0, n)
    else:
        half = n // 2
        job = pool.submit(part, 0, half)
        part(half, n)
        job.result()
    return sums.reshape(scores.shape[:-1] + (1,))


@functools.lru_cache(maxsize=1)
def helper_pool():
    """One helper thread for numpy work beside the caller's (None on one core), kept for the
    process: the exact attention's exponentials and `kvcache.decode_once`'s value decoding."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1) if (os.cpu_count() or 1) > 1 else None


def exact_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """Softmax attention over uncompressed keys and values on the CPU, exponentials in numpy.

    What the model's SDPA computes (an fp16 cache's attention, and the exact staging cache of a
    layer-major prefill), for long calls: MLX's CPU SDPA spends most of its time in `exp`
    (~5x numpy's per element; at 16k cached tokens the softmax was ~80% of a 512-token chunk's
    attention: benchmarks/diagnostics/cpu_profile.py). The score matmuls stay in MLX (its BLAS);
    the scores are exponentiated in place, split over two threads, and never copied.
    """
    B, Hq, Lq, D = queries.shape
    Hkv, Lk = keys.shape[1], keys.shape[2]
    r = Hq // Hkv
    q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, r * Lq, D)
    s = q @ keys.astype(mx.float32).swapaxes(-1, -2)  # (B, Hkv, r*Lq, Lk), fresh
    mx.eval(s)
    sn = np.asarray(s)
    through = attend_blocked.numpy_writes_through() and sn.flags.writeable and sn.flags.c_contiguous
    if not through:
        sn = np.array(sn)
    if mask is not None and Lq > 1:  # causal: query i (position Lk - Lq + i) sees keys <= it
        tail = sn.reshape(B, Hkv, r, Lq, Lk)[..., Lk - Lq :]  # a view: written through
        np.copyto(tail, np.float32(-np.inf), where=np.triu(np.ones((Lq, Lq), dtype=bool), 1))
    sums = _exp_rows(sn, helper_pool())
    p = s if through else mx.array(sn)
    out = (p @ values.astype(mx.float32)) / mx.array(sums)
    return out.reshape(B, Hq, Lq, D).astype(queries.dtype)
