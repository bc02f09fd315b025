"""One decode step on the GPU in two kernel launches: the decode-attend kernel, then the finish.

A decode step (one query token, no mask) over a cache whose compressed tokens are one segment
(what `ask` holds after a restore: the document's prefix; the question and answer stay exact in
the window) needs neither the q rotation, nor the split merge, nor the ~10 small operations of
the exact block as separate launches:

    decode_attend_partials   rotates q in the kernel, writes each split's softmax state (on
                             CUDA, 4-bit keys and values: `decode_attend_mma`, tensor cores)
    decode_finish            merges the splits, rotates the values back, attends the sink and
                             the window, normalizes, adds the value mean, casts

Per layer that replaces ~14 launches (the compiled fused path) by 2, and the Python around them
is a few attribute reads: below 32k cached tokens a step was bound by issuing launches, not by
the GPU (docs/performance.md). Other cases (QJL keys, RVQ keys, several segments, a padded head
dim, the CPU decoded prefix) take the fused path (`attend_fused`).
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from longctx.kernels import _prelude
from longctx.kernels import decode_attend as da
from longctx.kernels import decode_attend_mma as dm
from longctx.kernels import decode_finish as df
from longctx.kvcache import attend_fused
from longctx.kvcache.attend_fused import kernel_table
from longctx.kvcache.turbo import CompressedKV


def applies(kv: CompressedKV, mask, lq: int, rows: int) -> bool:
    """Whether this step can take the two-launch path (the caller has chosen the fused kernel);
    `rows`: query heads per KV head."""
    if lq != 1 or mask is not None or kv.dense is not None or len(kv.segments) != 1:
        return False
    kc, vc = kv.key_codec, kv.value_codec
    if kc.rvq is not None or kc.spec.qjl or vc.rvq is not None or vc.spec.qjl:
        return False
    p = kc.padded_dim
    if kc.dim != p or vc.dim != p or vc.padded_dim != p:
        return False
    return (_prelude.backend() != "cpu" and df.supported(p, rows)
            and (dm.applies(p, rows, kc, vc) or da.rotates_queries(p, rows, vc.spec.bits))
            and kv.segments[0][2] > 0 and not _prelude.failed("lc_decode_finish"))


_COMPILED: OrderedDict = OrderedDict()  # key -> compiled step (attend_fused.lookup / remember)


def _step(kc, vc, scale, dtype, mma, q, seg_k, seg_v, k_arrays, v_arrays, sink, window, count,
          mean):
    if mma:  # the tensor-core kernel (`decode_attend_mma`)
        partials = dm.decode_attend_mma_partials(q, seg_k, seg_v, k_arrays[0], k_arrays[1],
                                                 scale=scale)
    else:
        partials = da.decode_attend_partials(q, seg_k, seg_v, k_arrays[0], v_arrays[0],
                                             k_arrays[1], key_bits=kc.spec.bits,
                                             value_bits=vc.spec.bits, scale=scale)
    return df.decode_finish(*partials, q, tuple(sink) if sink else None,
                            tuple(window) if window else None, v_arrays[1], mean, scale, dtype,
                            valid_array=count)


def attention(queries, kv: CompressedKV, scale: float):
    """(B, H_q, 1, D) attention of one query token over `kv`, in the queries' dtype.

    Both launches run under `mx.compile`: an eager custom-kernel call costs ~0.1 ms of host time
    on the H200's VM (MLX assembles the kernel's source at every call), a compiled replay a
    fraction. The compiled step takes every per-layer array as an input and the window as its
    whole buffers plus a count, so all layers and all steps until the buffers grow share one
    trace; before the first trace of a key, one eager call checks the kernels' variants
    (`kernels._prelude.run`), as `attend_fused` does.
    """
    B, Hq, _, D = queries.shape
    H = kv.value_mean.shape[1]
    kc, vc = kv.key_codec, kv.value_codec
    q = queries.reshape(B, H, Hq // H, D)
    seg_k, seg_v, length = kv.segments[0]
    if kv.window_buffer is not None:
        window, valid = kv.window_buffer[:2], kv.window[0].shape[2]
    else:
        window, valid = kv.window, (kv.window[0].shape[2] if kv.window is not None else 0)
    sink = list(kv.sink) if kv.sink is not None and kv.sink[0].shape[2] else []
    window = list(window) if window is not None and valid else []
    args = (q, seg_k, seg_v, (kernel_table(kc), kc.rotation.signs),
            (kernel_table(vc), vc.rotation.signs), sink, window, df.count(valid), kv.value_mean)
    # the tensor-core kernel where it applies and has not failed in this process (decided
    # here, once: the trace and its key follow it)
    mma = dm.applies(D, Hq // H, kc, vc) and not _prelude.failed(dm.NAME)
    key = (kc.dim, kc.spec, vc.spec, float(scale), queries.dtype, q.shape, length,
           tuple(a.shape for a in sink), tuple(a.shape for a in window), kv.sink is not None and
           kv.sink[0].dtype, da.PREFETCH, da.MIN_BLOCKS, da.STAGE_WORDS, da.TARGET_GROUPS,
           da.SM_COUNT, da.MIN_SPLIT_TILES, mma, dm.WARPS, dm.STAGES)
    dtype = queries.dtype  # the closure below must not keep this call's arrays alive
    # An executor sees every launch, and `LONGCTX_COMPILE=0` / `question` ask for eager steps
    eager = attend_fused.executor_installed() or not attend_fused.compile_wanted(1)
    fn = None if eager else attend_fused.lookup(_COMPILED, key)
    if fn is None:
        out = _step(kc, vc, scale, dtype, mma, *args)
        if eager:
            return out.reshape(B, Hq, 1, D)
        mx.eval(out)
        # the kernels and the references read the window's count from its array input
        attend_fused.remember(_COMPILED, key, mx.compile(
            lambda q, sk, sv, ka, va, sink, window, count, mean:
            _step(kc, vc, scale, dtype, mma, q, sk, sv, ka, va, sink, window, count, mean)))
        return out.reshape(B, Hq, 1, D)
    return fn(*args).reshape(B, Hq, 1, D)
