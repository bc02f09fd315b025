"""Attention over a compressed cache, in blocks with an online softmax.

Queries are rotated once into the key codec's frame (keys are stored centered; the mean's score
shift is the same for every key of a query, so softmax needs no correction); each block of keys is
decoded in that frame (plus the QJL correction when the keys carry one), scores go through a
running-max softmax, and values are accumulated in the value codec's rotated frame and rotated
back once. Tokens kept exact (the sink and the uncompressed window) need no rotation: they are
attended last, as one block, in the original frame. Only one block of keys and values is ever
decoded at a time, so a 128k cache is never expanded in full.

Two paths produce the (m, l, acc) state of a compressed segment:
- pure MLX (the CPU path, and the oracle): decode a block, matmul, softmax, matmul;
- fused (GPU, a few query tokens): `longctx.kernels.decode_attend` reads the packed segment
  directly and returns the segment's softmax state, merged here like any other block.
The uncompressed window always takes the MLX path.

On a GPU the fused path runs under `mx.compile` (`COMPILE`): one layer's attention is ~50 small
MLX operations around the kernel (rotations, the split merge, the exact block, the softmax merge),
each its own launch, and compiled they cost about what the kernel does (H200, 8k tokens, 16 query
tokens: 1.78 -> 0.74 ms per layer; `restore_profile_gpu.json`). The compiled function takes every
per-layer array as an input (rotation signs, QJL projection, centroid tables, segments, sink,
window, value mean) and is keyed by sizes, specs and positions only, so all layers of a forward
pass share one trace.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict

import mlx.core as mx
import numpy as np

from longctx.kvcache.turbo import CompressedKV

BLOCK = 2048
# Query tokens up to which the fused kernel is used (decode steps and questions; prefill chunks
# take the blocked path). On the H200 a 16-token question over 4k-7.9k tokens answers 10-40%
# sooner through the kernel than through the blocked path (restore_gpu_lq64.json vs
# restore_gpu_lq8.json). The environment's LONGCTX_FUSED_MAX_LQ overrides it.
FUSED_MAX_LQ = int(os.environ.get("LONGCTX_FUSED_MAX_LQ", "64"))
# Compile the fused path: "1" always, "question" for more than one query token only (decode steps
# change the window's length, so each step traces anew), "0" never. LONGCTX_COMPILE overrides.
COMPILE = os.environ.get("LONGCTX_COMPILE", "1")
_COMPILED: OrderedDict = OrderedDict()  # key -> compiled function, least recently used first
_COMPILED_MAX = 8


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


@functools.lru_cache(maxsize=256)
def kernel_table(codec) -> mx.array:
    """The fused kernel's centroid table of a codec: c1, or c1[i1] + c2[i1, i2] at (i1 << b2) | i2.

    Each entry is the same float32 sum `VectorCodec.decode_rotated` computes, so both paths decode
    identical key values.
    """
    c1 = codec.codebook.centroids.astype(np.float32)
    if codec.rvq is None:
        return mx.array(c1)
    c2 = codec.rvq.stage2.centroids.astype(np.float32)  # (2^b1, 2^b2)
    return mx.array((c1[:, None] + c2).ravel())


def use_fused(mask, lq: int) -> bool:
    """Whether compressed segments go to the fused kernel: on a GPU backend, few query tokens,
    and a mask the kernel expresses (none, or causal)."""
    from longctx.kernels import backend, _prelude

    return (backend() != "cpu" and lq <= FUSED_MAX_LQ and _kernel_mask(mask)
            and not _prelude.failed("lc_decode_attend"))  # failed: the blocked path is its reference


# Many query rows on a GPU (prefill chunks): dequantize + fp16 SDPA (`kvcache.dense_gpu`) instead
# of the blocked path. LONGCTX_DENSE_GPU=0 turns it off (the blocked path then serves them).
DENSE_GPU = os.environ.get("LONGCTX_DENSE_GPU", "1") != "0"


def _dense_gpu_wanted(kv: CompressedKV, mask, head_dim: int) -> bool:
    from longctx.kvcache import dense_gpu

    return DENSE_GPU and dense_gpu.applies(kv, mask, head_dim)


def _kernel_mask(mask) -> bool:
    return mask is None or (isinstance(mask, str) and mask == "causal")


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
        if (inplace and sn.flags.c_contiguous and sn.flags.writeable and sn.dtype == np.float32
                and _numpy_writes_through()):
            np.subtract(sn, m_safe, out=sn)
            np.exp(sn, out=sn)
            p, p_mx = sn, s
        else:
            p = np.exp(sn - m_safe)
            p_mx = mx.array(p)
        return (mx.array(m_new), p_mx, mx.array(np.exp(mn - m_safe)),
                mx.array(p.sum(axis=-1, keepdims=True)))
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


def compressed_attention(queries: mx.array, kv: CompressedKV, scale: float, mask=None,
                         block: int = BLOCK, fused: bool | None = None) -> mx.array:
    """Softmax attention of `queries` over a compressed cache.

    Args:
        queries: (B, H_q, L_q, D), rope already applied; H_q a multiple of the cache's H_kv.
        kv: the cache view returned by `TurboQuantCache.update_and_fetch`.
        scale: score scale (usually D ** -0.5).
        mask: None, "causal" (queries are the last L_q positions), or an mlx-lm mask array.
        block: keys decoded per step on the MLX path.
        fused: send compressed segments to `longctx.kernels.decode_attend` (None: `use_fused`).
            On the CPU that function runs its pure-MLX reference.

    Returns:
        (B, H_q, L_q, D) in the queries' dtype.
    """
    Lq = queries.shape[2]
    if fused is None:
        fused = use_fused(mask, Lq)
        if not fused and _dense_gpu_wanted(kv, mask, queries.shape[-1]):
            from longctx.kvcache import dense_gpu

            return dense_gpu.attention(queries, kv, scale, mask)
    elif fused and not _kernel_mask(mask):
        raise ValueError("the fused kernel takes mask None or 'causal'")
    if fused and _compile_wanted(Lq) and not _executor_installed():
        return _compiled_attention(queries, kv, scale, mask)
    kc, vc = kv.key_codec, kv.value_codec
    tables = (kernel_table(kc), kernel_table(vc)) if fused else None
    cpu = mx.default_device().type == mx.DeviceType.cpu
    if cpu and not fused and _dense_numpy_applies(kv, mask, Lq):
        return _dense_numpy_attention(queries, kv, scale, mask)
    return _attend(queries, kv, kc, vc, tables, scale, mask, block, fused, cpu)


@functools.lru_cache(maxsize=256)
def rotation_matrices(codec) -> tuple[mx.array, mx.array]:
    """A codec's rotation as matrices: `rotate(x) == x @ R` (D, Dp) and `unrotate(y) == y @ U`
    (Dp, D), float32 (the transform is linear: its images of the identity), evaluated."""
    r = codec.rotate(mx.eye(codec.dim, dtype=mx.float32))
    u = codec.unrotate(mx.eye(codec.padded_dim, dtype=mx.float32))
    mx.eval(r, u)
    return r, u


def _dense_numpy_applies(kv: CompressedKV, mask, lq: int) -> bool:
    """Whether `_dense_numpy_attention` covers this view: a decoded prefix and nothing compressed
    after it (a long answer's tail takes the blocked path), a mask that is none or causal, and
    queries that all follow the decoded prefix."""
    if kv.dense is None or len(kv.segments) != 1 or not _kernel_mask(mask):
        return False
    return kv.dense[0].shape[2] <= kv.offset - lq


def _dense_numpy_attention(queries: mx.array, kv: CompressedKV, scale: float, mask) -> mx.array:
    """Attention over a decoded prefix plus the exact window as one softmax, exponentials in numpy.

    The CPU answering path (`kvcache.decode_once`): the window's keys and values are rotated into
    the prefix's frames (window and prefix are both centered), so prefix and window scores share
    one running max and one sum, and the output is rotated back once; the blocked path would run
    two blocks and merge them, ~30 MLX operations of ~20-50 us each on a CPU for a few MFLOP.
    Matmuls stay in MLX: numpy's own BLAS threads would fight MLX's for the cores between layers
    (a 1k-token question then took 2x longer, not less). The two score arrays are exponentiated in
    place (see `_softmax_step`) and never concatenated, so no score block is copied.
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
        p = s if _numpy_writes_through() else mx.array(sn)
        acc = p @ values if acc is None else acc + p @ values
    out = (acc / mx.array(total)) @ uv
    out = out.reshape(B, Hkv, r, Lq, D) + kv.value_mean[:, :, None]
    return out.reshape(B, Hq, Lq, D).astype(queries.dtype)


@functools.lru_cache(maxsize=1)
def _numpy_writes_through() -> bool:
    """Whether numpy's view of an evaluated MLX array shares its memory (writes seen by MLX), as
    the in-place softmax steps assume; checked once, else they copy back into MLX."""
    a = mx.zeros((4,), dtype=mx.float32)
    mx.eval(a)
    view = np.asarray(a)
    if not view.flags.writeable:
        return False
    view[2] = 7.0
    return float(a[2].item()) == 7.0


def _compile_wanted(lq: int) -> bool:
    return COMPILE == "1" or (COMPILE == "question" and lq > 1)


def _executor_installed() -> bool:
    """A test or emulation executor runs the kernels: it must see
    every launch, not only those of a trace (`kernels._prelude.executor`)."""
    from longctx.kernels import _prelude

    return _prelude._EXECUTOR is not None


class _Traced:
    """A codec as the compiled path sees it: sizes and specs from a codec of the same dim and spec
    (any layer's), arrays (rotation signs, QJL projection) from the compiled function's inputs."""

    def __init__(self, codec, arrays: dict):
        self.codec, self.arrays = codec, arrays
        self.spec, self.rvq, self.padded_dim = codec.spec, codec.rvq, codec.padded_dim

    def rotate(self, x: mx.array) -> mx.array:
        return self.codec.rotation.forward(x, signs=self.arrays["signs"])

    def unrotate(self, y: mx.array) -> mx.array:
        return self.codec.rotation.inverse(y, signs=self.arrays["signs"])

    def qjl_project(self, q_rot: mx.array) -> mx.array:
        return self.codec.qjl.project(q_rot, projection_t=self.arrays["qjl"])


def _codec_arrays(codec) -> dict:
    out = {"signs": codec.rotation.signs, "table": kernel_table(codec)}
    if codec.qjl is not None:
        out["qjl"] = codec.qjl.projection_t
    return out


def _compiled_attention(queries: mx.array, kv: CompressedKV, scale: float, mask) -> mx.array:
    """The fused path under `mx.compile`, one compiled function per (sizes, specs, positions)."""
    kc, vc = kv.key_codec, kv.value_codec
    lq = queries.shape[2]
    lengths = tuple(n for *_, n in kv.segments)
    has_sink, has_window = kv.sink is not None, kv.window is not None
    # A window in preallocated buffers goes in whole, with its valid-slot mask: the inputs'
    # shapes then change when the buffer grows, not at every decode step (each change retraces)
    buffered = kv.window_buffer is not None
    window = kv.window_buffer[:2] if buffered else kv.window
    # Positions only matter to a mask; without one, every decode step shares the function (and
    # the traced view's offset, never read then, is the first call's).
    offset = kv.offset  # an int: the closure must not keep this call's arrays alive
    from longctx.kernels import backend
    from longctx.kernels import decode_attend as da

    key = (kc.dim, kc.spec, vc.dim, vc.spec, float(scale), mask, lq, lengths, has_sink,
           has_window, buffered, offset if mask is not None else None, queries.dtype, backend(),
           da.KPT, da.VECTOR_ROWS, da.TARGET_GROUPS)
    fn = _COMPILED.get(key)
    if fn is None:
        # Before the first trace of a key, one eager call (its result unused, so every result
        # comes from the compiled function): a kernel variant is checked on its first launch
        # (`kernels._prelude.run`), which a compile trace cannot evaluate.
        tables = (kernel_table(kc), kernel_table(vc))
        mx.eval(_attend(queries, kv, kc, vc, tables, scale, mask, BLOCK, True, False))

        def traced(q, k_arrays, v_arrays, segments, sink, window, value_mean, window_mask):
            view = CompressedKV(kc, vc, tuple((k, v, n) for (k, v), n in zip(segments, lengths)),
                                offset, value_mean,
                                tuple(window) if has_window else None,
                                tuple(sink) if has_sink else None, None, None,
                                window_mask[0] if buffered else None)
            tk, tv = _Traced(kc, k_arrays), _Traced(vc, v_arrays)
            return _attend(q, view, tk, tv, (k_arrays["table"], v_arrays["table"]), scale, mask,
                           BLOCK, True, False)

        fn = _COMPILED[key] = mx.compile(traced)
        while len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    else:
        _COMPILED.move_to_end(key)
    return fn(queries, _codec_arrays(kc), _codec_arrays(vc), [(k, v) for k, v, _ in kv.segments],
              list(kv.sink) if has_sink else [], list(window) if has_window else [],
              kv.value_mean, [kv.window_buffer[2]] if buffered else [])


def _attend(queries: mx.array, kv: CompressedKV, kc, vc, tables, scale: float, mask, block: int,
            fused: bool, cpu: bool) -> mx.array:
    """`compressed_attention`'s body. `kc`/`vc`: the codecs (or their `_Traced` stand-ins);
    `tables`: the kernel's centroid tables when fused; `cpu`: large score blocks may go through
    numpy (never under compile)."""
    B, Hq, Lq, D = queries.shape
    Hkv = kv.value_mean.shape[1]
    r = Hq // Hkv
    q_rot = kc.rotate(queries.astype(mx.float32))  # (B, Hq, Lq, Dp)
    q_rot = q_rot.reshape(B, Hkv, r * Lq, q_rot.shape[-1])  # query heads grouped by KV head
    q_proj = kc.qjl_project(q_rot) if kc.spec.qjl else None
    q_pos = mx.arange(kv.offset - Lq, kv.offset)
    first_q = kv.offset - Lq

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
            state = (mx.full((B, Hkv, r * Lq, 1), -mx.inf, dtype=mx.float32),
                     mx.zeros((B, Hkv, r * Lq, 1), dtype=mx.float32), None)
        n = keys.shape[2]
        s = q @ keys.swapaxes(-1, -2)  # (B, Hkv, r*Lq, n)
        if correction is not None:
            s = s + correction
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
            seg = _fused_segment(kc, vc, tables, q_rot, q_proj, seg_k, seg_v, scale, Lq,
                                 last_q - pos if causal else None)
            state = seg if state is None else _merge(state, *seg)
        else:
            for lo in range(0, length, block):
                hi = min(lo + block, length)
                bk = {k: v[:, :, lo:hi] for k, v in seg_k.items()}
                bv = {k: v[:, :, lo:hi] for k, v in seg_v.items()}
                corr = kc.qjl_correction(q_proj, bk) if q_proj is not None else None
                state = add_block(state, q_rot, kc.decode_rotated(bk), vc.decode_rotated(bv),
                                  visible([(pos + lo, pos + hi)]), corr)
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
        state = add_block(state, q_plain, keys.astype(mx.float32), values.astype(mx.float32),
                          allowed, None)
    if state is None:
        raise ValueError("attention over an empty cache view (no segment, no window)")
    _, l, acc = state
    out = (acc / mx.maximum(l, 1e-30)).reshape(B, Hkv, r, Lq, D)
    out = out + kv.value_mean[:, :, None]  # values were stored centered
    return out.reshape(B, Hq, Lq, D).astype(queries.dtype)


def _fused_segment(kc, vc, tables, q_rot, q_proj, seg_k: dict, seg_v: dict, scale: float,
                   lq: int, causal_base):
    """(m, l, acc) of one compressed segment from the fused kernel."""
    from longctx.kernels.decode_attend import decode_attend

    return decode_attend(q_rot, seg_k, seg_v, tables[0], tables[1],
                         key_bits=kc.spec.bits, key_bits2=kc.spec.bits2 if kc.rvq else 0,
                         value_bits=vc.spec.bits, scale=scale, q_proj=q_proj, lq=lq,
                         causal_base=causal_base)
