"""One decode step on the GPU in one or two kernel launches: the decode-attend kernel, then the
finish (on CUDA at 4-bit keys and values and P = 128, both in one launch: `decode_step_mma`, the
tensor-core kernel whose last threadgroup per KV head runs the finish's body).

A decode step (one query token, no mask) over a cache whose compressed tokens are one segment
(what `ask` holds after a restore: the document's prefix; the question and answer stay exact in
the window) needs neither the q rotation, nor the split merge, nor the ~10 small operations of
the exact block as separate launches:

    decode_attend_partials   rotates q in the kernel, writes each split's softmax state (on
                             CUDA, 4-bit keys and values: `decode_attend_mma`, tensor cores;
                             on Metal: `decode_attend_simdgroup`, simdgroup matrices)
    decode_finish            merges the splits, rotates the values back, normalizes, adds the
                             value mean, casts (and attends the sink and the window where the
                             splits did not take them)

The decode-attend kernel's splits also take the exact tokens (the sink and the window, a share
each), so the finish only merges (`decode_step_mma` for the tensor-core kernel on CUDA at 4-bit
keys and values, `decode_attend.EXACT_IN_SPLITS` for the portable kernel, the one Metal runs;
`attention(..., tensor_cores=False)` runs it on CUDA too, for benchmarks): attended by the finish alone, one threadgroup per KV head, they were a large
part of an answer's step (docs/performance.md).

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
from longctx.kernels import decode_attend_simdgroup as dsg
from longctx.kernels import decode_finish as df
from longctx.kernels import decode_step_mma as ds
from longctx.kvcache import attend_fused, compiling
from longctx.kvcache.attend_fused import kernel_table
from longctx.kvcache.turbo import CompressedKV


_CODECS: dict = {}  # (id(kc), id(vc), rows) -> _Codecs (see `_codecs`)


class _Codecs:
    """What a step needs to know of its codecs, worked out once per pair and row count (a decode
    step asks at every layer and token: ~30 attribute reads and calls, a sizable share of the
    host time a step has per layer): whether the two-launch path, the tensor-core kernel and the
    portable kernel take them (on this backend), and their tables."""

    __slots__ = ("kc", "vc", "backend", "fits", "mma", "sg", "portable", "k_arrays", "v_arrays", "spec")

    def __init__(self, kc, vc, rows: int, which: str):
        self.kc, self.vc, self.backend = kc, vc, which
        p = kc.padded_dim
        self.mma = dm.applies(p, rows, kc, vc)
        self.sg = dsg.applies(p, rows, kc, vc)  # Metal's simdgroup matrices (never run on a Mac)
        self.portable = da.rotates_queries(p, rows, vc.spec.bits)
        self.fits = (
            kc.rvq is None
            and not kc.spec.qjl
            and vc.rvq is None
            and not vc.spec.qjl
            and kc.dim == p
            and vc.dim == p
            and vc.padded_dim == p
            and which != "cpu"
            and df.supported(p, rows)
            and (self.mma or self.sg or self.portable)
        )
        self.k_arrays = (kernel_table(kc), kc.rotation.signs)
        self.v_arrays = (kernel_table(vc), vc.rotation.signs)
        # the specs as small ints for the trace's key (`VectorCodec.key`)
        self.spec = (kc.key, vc.key)


def _codecs(kc, vc, rows: int) -> _Codecs:
    # an entry keeps its codecs alive, so while it is here no other codec can take their ids
    which = _prelude.backend()
    key = (id(kc), id(vc), rows)
    c = _CODECS.get(key)
    if c is None or c.backend != which:
        if len(_CODECS) > 1024:
            _CODECS.clear()
        c = _CODECS[key] = _Codecs(kc, vc, rows, which)
    return c


def applies(kv: CompressedKV, mask, lq: int, rows: int) -> bool:
    """Whether this step can take the two-launch path (the caller has chosen the fused kernel);
    `rows`: query heads per KV head."""
    if lq != 1 or mask is not None or kv.dense is not None or len(kv.segments) != 1:
        return False
    return _codecs(kv.key_codec, kv.value_codec, rows).fits and kv.segments[0][2] > 0 and not _prelude.failed("lc_decode_finish")


_COMPILED: OrderedDict = OrderedDict()  # key -> compiled step (compiling.lookup / remember)


def _step(kc, vc, scale, dtype, mma, whole, sg, queries, seg_k, seg_v, k_arrays, v_arrays, sink, window, count, mean, counts):
    """(the step's output, the count array for the next whole-step launch: `counts` itself
    when the step takes two launches)."""
    B, Hq, _, D = queries.shape
    H = mean.shape[1]
    q = queries.reshape(B, H, Hq // H, D)  # rows grouped per KV head
    sink = tuple(sink) if sink else None
    window = tuple(window) if window else None
    if whole:  # one launch: the tensor-core kernel and the finish (`decode_step_mma`)
        out, counts = ds.decode_step_mma(
            q, seg_k, seg_v, k_arrays[0], k_arrays[1], sink, window, v_arrays[1], mean, scale, dtype, count, counts
        )
        return out.reshape(B, Hq, 1, D), counts
    if mma:  # the tensor-core kernel, the exact tokens in its splits (`decode_step_mma`)
        folded = True
        partials = ds.decode_step_mma_partials(
            q,
            seg_k,
            seg_v,
            k_arrays[0],
            k_arrays[1],
            scale=scale,
            sink=sink,
            window=window,
            v_signs=v_arrays[1],
            valid_array=count,
        )
    elif sg:  # Metal's simdgroup-matrix kernel; the finish attends the exact tokens
        folded = False
        partials = dsg.decode_attend_simdgroup_partials(q, seg_k, seg_v, k_arrays[0], k_arrays[1], scale=scale)
    else:  # the portable kernel, the exact tokens in its splits where they fit
        folded = (
            da.EXACT_IN_SPLITS
            and (sink is not None or window is not None)
            and da.exact_fits(q.shape[3], q.shape[2], vc.spec.bits)
            and not _prelude.failed(da.EXACT_NAME)
        )
        partials = da.decode_attend_partials(
            q,
            seg_k,
            seg_v,
            k_arrays[0],
            v_arrays[0],
            k_arrays[1],
            key_bits=kc.spec.bits,
            value_bits=vc.spec.bits,
            scale=scale,
            sink=sink if folded else None,
            window=window if folded else None,
            v_signs=v_arrays[1],
            valid_array=count,
        )
    if folded:  # the finish only merges
        sink = window = None
    return df.decode_finish(*partials, q, sink, window, v_arrays[1], mean, scale, dtype, valid_array=count).reshape(
        B, Hq, 1, D
    ), counts


def _env() -> tuple:
    """What a kept step (`_Plan`) was built under and must still hold: the backend, the kernels
    failed so far, and the generation of the executor and the forced backend (the cache's
    `Paths`, which also choose the path, are compared by identity in `_Plan.matches`)."""
    return (_prelude.backend(), _prelude.GENERATION[0], _prelude.failure_count())


class _Plan:
    """One layer's decode step as its compiled call takes it, kept by the layer's cache between
    steps (the view's `plan` slot): the compiled function and every input but the queries and
    the window's count. It serves while the view holds the same segment, sink, value mean and
    window buffers (MLX writes a decode step's token into the window's buffer objects in place),
    or no window, and `_env()` is unchanged. It skips the path choice, the checks and the trace
    key: ~10-15 us of Python a layer and token on a 2-core x86 host
    (`benchmarks/diagnostics/decode_host.py`).
    """

    __slots__ = ("fn", "shape", "dtype", "scale", "seg", "sink", "wbuf", "args", "mean", "env", "heads", "tensor_cores", "paths")

    def matches(self, queries, kv: CompressedKV, scale, tensor_cores: bool) -> bool:
        wb = kv.window_buffer
        return (
            (wb[0] if wb is not None else kv.window) is self.wbuf
            and tensor_cores == self.tensor_cores
            and kv.paths is self.paths
            and kv.segments[0][0] is self.seg
            and kv.sink is self.sink
            and kv.value_mean is self.mean
            and kv.dense is None
            and len(kv.segments) == 1
            and queries.shape == self.shape
            and queries.dtype == self.dtype
            and scale == self.scale
            and self.env == _env()
        )


def replay(queries, kv: CompressedKV, scale: float, tensor_cores: bool = True):
    """The step through the plan the view's cache keeps, or None when there is none that fits
    (then `compressed_attention` chooses the path as usual); `tensor_cores` as `attention`
    took it."""
    p = kv.plan[0]
    if p is None or not p.matches(queries, kv, scale, tensor_cores):
        return None
    out, counts = p.fn(queries, *p.args, df.count(kv.window[0].shape[2] if kv.window else 0), p.mean, ds.counter(p.heads))
    ds.keep_counter(p.heads, counts)
    return out


def _keep_plan(kv: CompressedKV, fn, queries, scale, args, heads: int, tensor_cores: bool) -> None:
    # a window that is not a buffer changes its arrays at every step: no plan
    if kv.plan is None or (kv.window is not None and kv.window_buffer is None):
        return
    p = _Plan()
    p.fn, p.shape, p.dtype, p.scale = fn, queries.shape, queries.dtype, scale
    p.seg, p.sink = kv.segments[0][0], kv.sink
    p.wbuf = kv.window_buffer[0] if kv.window_buffer is not None else None
    # the compiled call's arguments between the queries and the count
    p.args, p.mean, p.env, p.heads = args[1:7], args[8], _env(), heads
    p.tensor_cores, p.paths = tensor_cores, kv.paths
    kv.plan[0] = p


def attention(queries, kv: CompressedKV, scale: float, *, tensor_cores: bool = True):
    """(B, H_q, 1, D) attention of one query token over `kv`, in the queries' dtype;
    `tensor_cores=False`: the portable kernel where the tensor-core one applies (what Metal
    runs, timed on CUDA by benchmarks/attend.py).

    Both launches run under `mx.compile`: an eager custom-kernel call costs many times a compiled
    replay's host time (MLX assembles the kernel's source at every call). The compiled step takes
    every per-layer array as an input and the window as its whole buffers plus a count, so all
    layers and all steps until the buffers grow share one trace; before the first trace of a
    key, one eager call checks the kernels' variants (`kernels._prelude.run`), as `attend_fused`
    does. The step's inputs are then kept with the layer's cache (`_Plan`), so that its next steps
    replay it directly.
    """
    if not tensor_cores and kv.plan is not None:  # (`compressed_attention` replays the rest)
        out = replay(queries, kv, scale, tensor_cores=False)
        if out is not None:
            return out
    shape = queries.shape
    H = kv.value_mean.shape[1]
    kc, vc = kv.key_codec, kv.value_codec
    codecs = _codecs(kc, vc, shape[1] // H)
    if not (tensor_cores or codecs.portable):
        raise ValueError("the portable decode-attend kernel does not take these codecs")
    seg_k, seg_v, length = kv.segments[0]
    if kv.window_buffer is not None:
        window, valid = kv.window_buffer[:2], kv.window[0].shape[2]
    else:
        window, valid = kv.window, (kv.window[0].shape[2] if kv.window is not None else 0)
    sink = list(kv.sink) if kv.sink is not None and kv.sink[0].shape[2] else []
    window = list(window) if window is not None and valid else []
    heads = shape[0] * H
    args = (
        queries,
        seg_k,
        seg_v,
        codecs.k_arrays,
        codecs.v_arrays,
        sink,
        window,
        df.count(valid),
        kv.value_mean,
        ds.counter(heads),
    )
    # the tensor-core kernel where it applies and has not failed in this process, with the
    # finish in the same launch where that applies (decided here, once: the trace and its key
    # follow them)
    mma = tensor_cores and codecs.mma and not _prelude.failed(dm.NAME)
    whole = mma and ds.fuses_finish(kc.padded_dim, shape[1] // H)
    # on Metal, the simdgroup-matrix kernel where it applies and has not failed (else the
    # portable kernel: its fallback)
    sg = tensor_cores and codecs.sg and not _prelude.failed(dsg.NAME)
    key = (
        codecs.spec,
        float(scale),
        queries.dtype,
        shape,
        H,
        length,
        tuple([a.shape for a in sink]),
        tuple([a.shape for a in window]),
        kv.sink is not None and kv.sink[0].dtype,
        mma,
        whole,
        sg,
        _prelude.failed(da.EXACT_NAME),
    )
    dtype = queries.dtype  # the closure below must not keep this call's arrays alive
    # An executor sees every launch (unless a test compiles under it), and the cache's compile
    # mode "0" / "question" asks for eager steps
    eager = (compiling.executor_installed() and not kv.paths.compile_under_executor) or not attend_fused.compile_wanted(
        1, kv.paths.compile
    )
    fn = None if eager else compiling.lookup(_COMPILED, key)
    if fn is None:
        out, counts = _step(kc, vc, scale, dtype, mma, whole, sg, *args)
        ds.keep_counter(heads, counts)
        if eager:
            return out
        mx.eval(out, counts)
        # the kernels and the references read the window's count from its array input
        compiling.remember(
            _COMPILED,
            key,
            mx.compile(
                lambda q, sk, sv, ka, va, sink, window, count, mean, counts: _step(
                    kc, vc, scale, dtype, mma, whole, sg, q, sk, sv, ka, va, sink, window, count, mean, counts
                )
            ),
        )
        return out
    _keep_plan(kv, fn, queries, scale, args, heads, tensor_cores)
    out, counts = fn(*args)
    ds.keep_counter(heads, counts)
    return out
