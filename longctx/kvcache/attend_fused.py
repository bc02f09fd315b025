"""GPU decode steps and questions: the fused decode-attend kernel, under `mx.compile`.

Compressed segments go to `longctx.kernels.decode_attend`, which reads the packed cache directly
(`attend_blocked.attend` with `fused`). One layer's attention is then ~50 small MLX operations
around the kernel (rotations, the split merge, the exact block, the softmax merge), each its own
launch; compiled they cost about what the kernel does, well under their eager cost
(benchmarks/diagnostics/restore_profile.py, docs/performance.md). The compiled
function takes every per-layer array as an input (rotation signs, QJL projection, centroid
tables, segments, sink, window, value mean) and is keyed by sizes, specs and positions only, so
all layers of a forward pass share one trace. An answer's window lives in preallocated buffers
with a valid-slot mask, so decode steps do not change the trace's input shapes.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import mlx.core as mx
import numpy as np

from longctx.kvcache.attend_blocked import BLOCK, attend
from longctx.kvcache.compiling import lookup, remember
from longctx.kvcache.turbo import CompressedKV
from longctx.kernels import backend
from longctx.kernels import decode_attend as da

_COMPILED: OrderedDict = OrderedDict()  # key -> compiled function, least recently used first


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


def compile_wanted(lq: int, mode: str) -> bool:
    """Whether a cache's compile mode (`turbo.Paths.compile`) asks for the compiled path at this
    many query tokens."""
    return mode == "1" or (mode == "question" and lq > 1)


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


def compiled_attention(queries: mx.array, kv: CompressedKV, scale: float, mask) -> mx.array:
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

    key = (
        kc.dim,
        kc.spec,
        vc.dim,
        vc.spec,
        float(scale),
        mask,
        lq,
        lengths,
        has_sink,
        has_window,
        buffered,
        offset if mask is not None else None,
        queries.dtype,
        backend(),
        da.MIN_BLOCKS,
        da.STAGE_WORDS,
        da.TARGET_GROUPS,
        da.SM_COUNT,
        da.MIN_SPLIT_TILES,
    )
    fn = lookup(_COMPILED, key)
    if fn is None:
        # Before the first trace of a key, one eager call (its result unused, so every result
        # comes from the compiled function): a kernel variant is checked on its first launch
        # (`kernels._prelude.run`), which a compile trace cannot evaluate.
        tables = (kernel_table(kc), kernel_table(vc))
        mx.eval(attend(queries, kv, kc, vc, tables, scale, mask, BLOCK, True, False))

        def traced(q, k_arrays, v_arrays, segments, sink, window, value_mean, window_mask):
            view = CompressedKV(
                kc,
                vc,
                tuple((k, v, n) for (k, v), n in zip(segments, lengths)),
                offset,
                value_mean,
                tuple(window) if has_window else None,
                tuple(sink) if has_sink else None,
                None,
                None,
                window_mask[0] if buffered else None,
            )
            tk, tv = _Traced(kc, k_arrays), _Traced(vc, v_arrays)
            return attend(q, view, tk, tv, (k_arrays["table"], v_arrays["table"]), scale, mask, BLOCK, True, False)

        fn = remember(_COMPILED, key, mx.compile(traced))
    return fn(
        queries,
        _codec_arrays(kc),
        _codec_arrays(vc),
        [(k, v) for k, v, _ in kv.segments],
        list(kv.sink) if has_sink else [],
        list(window) if has_window else [],
        kv.value_mean,
        [kv.window_buffer[2]] if buffered else [],
    )
