"""GPU attention for many query rows (prefill chunks): dequantize, then fp16 SDPA.

A prefill chunk has hundreds of queries per KV head. For them the per-key fused kernel
(`kernels/decode_attend.py`, built for a few rows) and the blocked pure-MLX path (decode a block,
matmul, online softmax: ~50 launches per block with fp32 intermediates) both lose to
`mx.fast.scaled_dot_product_attention`, which runs flash attention on tensor cores. So this path
decodes each compressed segment once per call into dense fp16 rows in the codecs' rotated frames
(`kernels/dequant.py`; the exact sink and window rows, rotated, written into the same array) and
hands them to the fused SDPA with queries rotated into the key frame; the output, in the value
frame, is rotated back once and the value mean added. The dense rows of a layer live while its
attention runs; on a GPU, MLX holds them until the command buffer that read them completes, so
a prefill chunk bounds the layers it keeps queued by their rows' bytes (`turbo.sync`,
`engine.prefill`'s `inflight`) and the working set stays a few layers' fp16 keys and values, not the
fp16 cache.

Keys are stored centered: a key mean shifts every score of a query equally, which softmax
ignores; values are centered too, and their mean is added back. QJL-sketched keys fold their
correction into the dense keys (it is linear in the query; `VectorCodec.scoring_result`).
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from longctx.kernels import backend
from longctx.kernels import rotate as rt
from longctx.kernels.dequant import dequant
from longctx.kvcache import compiling
from longctx.kvcache.turbo import CompressedKV
from longctx.kvcache.attend_fused import kernel_table


def applies(kv: CompressedKV, mask) -> bool:
    """Whether this path serves the view: a GPU backend, segments present, and a head dim the
    fused SDPA takes."""
    return (
        backend() != "cpu"
        and bool(kv.segments)
        and kv.dense is None
        and kv.key_codec.padded_dim in (64, 80, 128, 256)
        and (mask is None or isinstance(mask, (str, mx.array)))
    )


def rotated_part(codec, x: mx.array | None) -> mx.array | None:
    return None if x is None else codec.rotate(x.astype(mx.float32)).astype(mx.float16)


def decode_dense(codec, table, segments: list, head, after) -> mx.array:
    """All rows of one side (keys or values) as (B, H, N, P) fp16 in the rotated frame."""
    spec = codec.spec
    bits2 = spec.bits2 if codec.rvq is not None else 0
    parts = []
    for i, enc in enumerate(segments):
        first, last = i == 0, i == len(segments) - 1
        rows = dequant(
            enc,
            table,
            bits=spec.bits,
            bits2=bits2,
            p=codec.padded_dim,
            head=head if first else None,
            after=after if last else None,
        )
        if codec.qjl is not None:
            fold = codec.qjl_key_offset(enc)  # (B, H, L, P)
            pad = [
                (0, 0),
                (0, 0),
                (head.shape[2] if first and head is not None else 0, after.shape[2] if last and after is not None else 0),
                (0, 0),
            ]
            rows = (rows.astype(mx.float32) + mx.pad(fold, pad)).astype(mx.float16)
        parts.append(rows)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def attention(queries: mx.array, kv: CompressedKV, scale: float, mask) -> mx.array:
    """Softmax attention of `queries` (B, H_q, L_q, D) over the view, as `compressed_attention`.

    Scalar codecs whose rows the rotation kernel takes run as one compiled function (unless
    the cache's `Paths.compile` is "0"), keyed by shapes and specs, so all layers of a chunk share one trace."""
    kc, vc = kv.key_codec, kv.value_codec
    D = queries.shape[3]
    sink = kv.sink if kv.sink is not None else (None, None)
    window = kv.window if kv.window is not None else (None, None)
    # the sink's rotated rows are made once per cache, a fused prefill chunk's window rows by
    # its update (`kernels/prefill_encode.py`)
    head = kv.sink_rot or (rotated_part(kc, sink[0]), rotated_part(vc, sink[1]))
    after = kv.after_rot or (rotated_part(kc, window[0]), rotated_part(vc, window[1]))
    args = (
        queries,
        [s[0] for s in kv.segments],
        [s[1] for s in kv.segments],
        [kernel_table(kc), kernel_table(vc)],
        [kc.rotation.signs, vc.rotation.signs],
        [x for x in head if x is not None],
        [x for x in after if x is not None],
        kv.value_mean,
        mask if isinstance(mask, mx.array) else [],
        scale,
    )
    plain = (
        kc.qjl is None and rt.applies(kc.padded_dim) and kc.padded_dim == D and rt.applies(vc.padded_dim) and vc.padded_dim == D
    )
    statics = (kc, vc, head[0] is not None, after[0] is not None, mask if not isinstance(mask, mx.array) else None)
    if not (plain and compiling.prefill_compiled(kv.paths)):
        return _attend(*args, *statics)
    key = (
        "dense",
        queries.shape,
        queries.dtype,
        kc.key,
        vc.key,
        float(scale),
        tuple((name, a.shape, a.dtype) for seg in (*args[1], *args[2]) for name, a in seg.items()),
        tuple(x.shape for x in args[5]),
        tuple(x.shape for x in args[6]),
        statics[2:],
        (mask.shape, mask.dtype) if isinstance(mask, mx.array) else None,
        backend(),
    )

    def eager(*a):
        return _attend(*a, *statics)

    return compiling.call_compiled(_COMPILED, key, compiling.fresh(eager), eager, args)


_COMPILED: OrderedDict = OrderedDict()  # compiled `_attend` by shapes and specs


def _attend(
    queries,
    k_segments,
    v_segments,
    tables,
    signs,
    head,
    after,
    value_mean,
    mask,
    scale,
    kc,
    vc,
    has_head: bool,
    has_after: bool,
    mask_const,
):
    """`attention` on arrays: the segments' dicts, the codecs' tables and rotation signs, the
    rotated sink (`head`) and window (`after`) rows ([] when absent) and `mask` (an array, or []
    with `mask_const` None or "causal"). The codecs give sizes and specs only when compiled
    (scalar codecs: no per-layer array of theirs is read but `tables` and `signs`)."""
    B, Hq, Lq, D = queries.shape
    Hkv = value_mean.shape[1]
    hk, hv = head if has_head else (None, None)
    ak, av = after if has_after else (None, None)
    keys = decode_dense(kc, tables[0], k_segments, hk, ak)
    values = decode_dense(vc, tables[1], v_segments, hv, av)
    if rt.applies(kc.padded_dim) and kc.padded_dim == D:  # one launch each way
        q = rt.rotate(queries, signs[0])
    else:
        q = kc.rotate(queries.astype(mx.float32)).astype(mx.float16)  # (B, Hq, Lq, P)
    mask = mask if isinstance(mask, mx.array) else mask_const
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        mask = mask.astype(mx.float16)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    if rt.applies(vc.padded_dim) and vc.padded_dim == D:
        return rt.rotate(out, signs[1], inverse=True, mean=value_mean, out_dtype=queries.dtype)
    out = vc.unrotate(out.astype(mx.float32))  # (B, Hq, Lq, D)
    out = out.reshape(B, Hkv, Hq // Hkv, Lq, D) + value_mean[:, :, None]
    return out.reshape(B, Hq, Lq, D).astype(queries.dtype)
