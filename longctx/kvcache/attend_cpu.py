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
