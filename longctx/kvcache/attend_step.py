"""One decode step on the GPU in two kernel launches: the decode-attend kernel, then the finish.

A decode step (one query token, no mask) over a cache whose compressed tokens are one segment
(what `ask` holds after a restore: the document's prefix; the question and answer stay exact in
the window) needs neither the q rotation, nor the split merge, nor the ~10 small operations of
the exact block as separate launches:

    decode_attend_partials   rotates q in the kernel, writes each split's softmax state
    decode_finish            merges the splits, rotates the values back, attends the sink and
                             the window, normalizes, adds the value mean, casts

Per layer that replaces ~14 launches (the compiled fused path) by 2, and the Python around them
is a few attribute reads: below 32k cached tokens a step was bound by issuing launches, not by
the GPU (docs/performance.md). Other cases (QJL keys, RVQ keys, several segments, a padded head
dim, the CPU decoded prefix) take the fused path (`attend_fused`).
"""

from __future__ import annotations

from longctx.kernels import decode_attend as da
from longctx.kernels import decode_finish as df
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
    return (df.supported(p, rows) and da.rotates_queries(p, rows, vc.spec.bits)
            and kv.segments[0][2] > 0)


def attention(queries, kv: CompressedKV, scale: float):
    """(B, H_q, 1, D) attention of one query token over `kv`, in the queries' dtype."""
    B, Hq, _, D = queries.shape
    H = kv.value_mean.shape[1]
    r = Hq // H
    kc, vc = kv.key_codec, kv.value_codec
    q = queries.reshape(B, H, r, D)
    seg_k, seg_v, _ = kv.segments[0]
    partials = da.decode_attend_partials(q, seg_k, seg_v, kernel_table(kc), kernel_table(vc),
                                         kc.rotation.signs, key_bits=kc.spec.bits,
                                         value_bits=vc.spec.bits, scale=scale)
    out = df.decode_finish(*partials, q, kv.sink, kv.window, vc.rotation.signs, kv.value_mean,
                           scale, queries.dtype)
    return out.reshape(B, Hq, 1, D)
