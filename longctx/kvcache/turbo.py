"""TurboQuant-compressed KV cache for one attention layer (mlx-lm cache protocol).

Keys and values arrive as (B, H_kv, L, D) after rope. Each vector is normalized (fp16 norm kept),
rotated by a seeded randomized Hadamard transform and quantized coordinate-wise (see
`longctx.quant.codec`); keys may add a second RVQ stage and a 1-bit QJL sketch of the residual.

Before quantization, keys and values are centered per head by a mean fixed at the first update
(`k.mu`, `v.mu`, (B, H_kv, 1, D)): a key mean shifts every score of a query by the same amount,
which softmax ignores, and a value mean is added back exactly (the weights sum to one). SmolLM2's
keys keep only 30-70% of their energy after centering, so the same bits give a smaller error.

Storage is two segments of packed arrays, each a dict name -> (B, H_kv, L, ...):
- `prefix`: read-only (restored from disk, or shared with the parent of a fork);
- `tail`: private, preallocated in steps of 256 tokens, where new tokens are written;
plus, when the preset has `window > 0`, the most recent `window` tokens kept uncompressed
(centered, fp32) and compressed as they age out; and, when the preset has `sink > 0`, the first
`sink` tokens of the sequence kept uncompressed for good (stored as fp16): attention sinks take a
large share of every query's attention, so an error in their keys shifts every distribution. `seal()` compresses the window (done before a
cache is persisted, so files hold compressed tokens only).
`update_and_fetch` returns a `CompressedKV` view (the segments, not decoded tensors); attention
is routed to `longctx.kvcache.attention`, which decodes block by block. The class deliberately has
no `bits` attribute: mlx-lm treats any cache with one as its own affine-quantized cache.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from dataclasses import dataclass

import mlx.core as mx

from longctx.chunking import INFLIGHT, QUEUE_EVERY
from longctx.kernels import backend as _backend
from longctx.kernels.prefill_encode import prefill_encode
from longctx.kvcache import compiling
from longctx.kvcache.presets import Preset
from longctx.quant.codec import QuantSpec, VectorCodec
from longctx.runtime import cuda_kernels
from longctx.quant import lut

cuda_kernels.install()  # CUDA: compiled kernels kept on disk, loaded by MLX (runtime/cuda_kernels)


def _on_gpu() -> bool:
    return _backend() != "cpu"


# (arrays, bytes) queued by earlier layers' `sync` and not yet waited for, oldest first
_PENDING: deque = deque()
_INFLIGHT = [0]  # the bytes of _PENDING's entries
_UNQUEUED = [0]  # sync calls since the last one that queued (`every`)


def sync(arrays: tuple, nbytes: int, budget: int, every: int = 1) -> None:
    """Queue `arrays` (the graph before this layer, `mx.async_eval`); then wait for the oldest
    queued layers until at most `budget` bytes of dequantized rows stay in flight.

    On a GPU, MLX holds every buffer an operation reads until its command buffer completes, and
    graph building runs ahead of the GPU. A prefill chunk's graph is all layers deep, so without
    a bound every layer's transients are alive at once: for the compressed cache, each layer's
    dequantized prefix (`dense_gpu`, fp16 keys and values: 0.5 GiB per layer at 128k tokens of
    an 8B model), so a chunk's working set grows to the size of an fp16 cache. A layer's incoming
    keys are made by the previous layers' attention: waiting for an older layer's keys frees the
    rows of the layers before it. Waiting costs the overlap of graph building and GPU work (one
    wait per layer cost much of the prefill rate: docs/performance.md), so the bound is in bytes:
    short prefixes, whose rows are small, keep every layer in flight.

    Args:
        arrays: this layer's incoming keys and values.
        nbytes: the fp16 rows this layer's attention will dequantize (an estimate: one
            segment's keys and values; several segments or QJL corrections hold more).
        budget: most bytes in flight (`engine.prefill`'s `inflight`).
        every: queue only every this many calls (`engine.prefill`'s `queue_every`). Each `mx.async_eval`
            costs host time: in a small model's GPU prefill those calls were a large share of
            the host's work (cProfile, docs/performance.md; the profile in git history). A
            wait still evaluates the layers before it, queued or not. The default, 4, measured
            faster than 1 in most rows (docs/performance.md; the queue4 rows in git history);
            30 lost at 32k.
    """
    if not _PENDING:
        _INFLIGHT[0] = 0
        _UNQUEUED[0] = 0
    _UNQUEUED[0] += 1
    if _UNQUEUED[0] >= every:
        _queue(*arrays)
        _UNQUEUED[0] = 0
    _PENDING.append((arrays, nbytes))
    _INFLIGHT[0] += nbytes
    while len(_PENDING) > 1 and _INFLIGHT[0] > budget:
        old, n = _PENDING.popleft()
        _INFLIGHT[0] -= n
        _wait(*old)


def drain() -> None:
    """Forget the queued layers (call once their work is evaluated: after a prefill chunk), so
    that their arrays are not kept alive and their byte counts do not carry over."""
    _PENDING.clear()
    _INFLIGHT[0] = _UNQUEUED[0] = 0


_queue, _wait = mx.async_eval, mx.eval  # (tests count them)


@dataclass(frozen=True)
class Paths:
    """Which GPU paths a cache's updates and attention take (`kvcache.attention`). The defaults
    are the product's; tests and benchmarks compare others, passed to `kvcache.make` or
    `TurboQuantCache` (a model's forward pass reaches the cache with no arguments of ours, so
    the cache carries them, and each view of it).

    Attributes:
        fused_max_lq: query tokens up to which attention takes the fused decode-attend kernel
            (more: dequantize + SDPA; 0: the blocked path).
        dense_gpu: prefill chunks dequantize the cache and run fp16 SDPA, their cache updates in
            `prefill_encode` (False: the blocked MLX path).
        compile: run the attention paths under mx.compile always ("1"), for questions only
            ("question": a decode step and the prefill run eagerly) or never ("0").
        compile_under_executor: compile the prefill paths with a test's kernel executor
            installed too (its kernels' references then run inside the traces, on the CPU).
        tensor_cores: a decode step takes the tensor-core kernel (CUDA) or the simdgroup-matrix
            one (Metal) where it applies (False: the portable kernel, as `attend_step.attention`
            takes it; the Mac-proxy rows of the GPU benchmarks).
    """

    fused_max_lq: int = 64
    dense_gpu: bool = True
    compile: str = "1"
    compile_under_executor: bool = False
    tensor_cores: bool = True


DEFAULT_PATHS = Paths()


@dataclass(frozen=True)
class CompressedKV:
    """What attention reads: the codecs and the key/value segments (each a dict of arrays)."""

    key_codec: VectorCodec
    value_codec: VectorCodec
    segments: tuple  # ((keys_dict, values_dict, length), ...)
    offset: int  # total tokens
    value_mean: mx.array  # (B, H_kv, 1, D), added back to the attention output
    window: tuple | None = None  # (keys, values) (B, H_kv, W, D) centered fp32: the newest tokens
    sink: tuple | None = None  # (keys, values) (B, H_kv, S, D) centered: the first tokens, exact
    # (keys, values) (B, H_kv, S + L0, P) fp32 in the codecs' rotated frames: the sink and the
    # first segment decoded once (`TurboQuantCache.decode_prefix`); replaces both when set
    dense: tuple | None = None
    # (keys, values, valid) when the window lives in larger preallocated buffers: the buffers
    # (B, H_kv, capacity, D) and a (capacity,) bool mask of their valid slots (the compiled decode
    # path attends over the buffers, so its input shapes change only when they grow)
    window_buffer: tuple | None = None
    # (W,) bool: which of `window`'s slots hold tokens (None: all); set where `window` is a buffer
    window_mask: mx.array | None = None
    # (B, H_kv, 1, D): the keys' centering mean; only soft-capped scores need it (tanh is not
    # shift-invariant, so the score shift q . mu it causes must be added back before capping)
    key_mean: mx.array | None = None
    dtype: mx.Dtype = mx.float32  # of the keys and values the model handed to the cache
    # (keys, values) (B, H_kv, S, P) fp16: the sink in the codecs' rotated frames (made once)
    sink_rot: tuple | None = None
    paths: Paths = DEFAULT_PATHS  # the cache's GPU paths
    # (keys, values) (B, H_kv, W, P) fp16: `window` in the rotated frames, made by a fused
    # prefill chunk's update (`kernels/prefill_encode.py`); set, it stands for `window` on the
    # dense GPU path
    after_rot: tuple | None = None
    # [plan or None]: a slot the cache owns, where the decode step keeps its launch between steps
    # (`attend_step._Plan`; it checks that it still fits the view)
    plan: list | None = None

    def astype(self, dtype) -> "CompressedKV":
        """The view itself: attention reads compressed keys in fp32 whatever the model casts them
        to (phi and StableLM call `keys.astype(mx.float32)` before the routed SDPA)."""
        return self


_CODECS: dict = {}


def codecs_for(preset: Preset, head_dim: int, layer: int) -> tuple[VectorCodec, VectorCodec]:
    """Key and value codecs of one layer; seeds differ per layer and between keys and values."""
    key = (preset.name, preset.key_bits_layers, head_dim, layer)
    if key not in _CODECS:
        kspec = QuantSpec(bits=preset.key_bits_of(layer), bits2=preset.key_bits2, qjl=preset.key_qjl)
        vspec = QuantSpec(bits=preset.value_bits)
        seed = preset.seed + 7919 * layer
        _CODECS[key] = (VectorCodec(head_dim, kspec, seed), VectorCodec(head_dim, vspec, seed + 1))
    return _CODECS[key]


_ENCODE: OrderedDict = OrderedDict()  # compiled `_encode_chunk` by shapes and specs


def _encode_chunk(keys, values, means, signs, boundaries, prev, old, window, held: int, w: int):
    """A fused prefill chunk's update as arrays in, arrays out (`TurboQuantCache._fused_chunk`;
    compiled there): for keys and values, `prefill_encode` of the chunk after the first `held`
    rows of the tail's buffer (`old`: idx_k, norm_k, idx_v, norm_v) and the window's rotated rows
    (`prev`); then the centered rows the view shows (`window` and the chunk) and, for w > 0, the
    chunk's newest w of them (the next window).

    Returns:
        [rot_k, idx_k, norm_k, rot_v, idx_v, norm_v, seen_k, seen_v] (+ [win_k, win_v] if w).
    """
    out, centered = [], []
    for i, x in enumerate((keys, values)):
        tail = (old[2 * i][:, :, :held], old[2 * i + 1][:, :, :held]) if held else (None, None)
        out.extend(prefill_encode(x, means[i], signs[i], boundaries[i], prev[i] if prev else None, *tail))
        centered.append(x.astype(mx.float32) - means[i])
    seen = [mx.concatenate([window[i], c], axis=2) if window else c for i, c in enumerate(centered)]
    return out + seen + ([c[:, :, -w:] for c in centered] if w else [])


def _center(keys, values, k_mu, v_mu):
    return keys.astype(mx.float32) - k_mu, values.astype(mx.float32) - v_mu


# A decode step's new keys and values centered in one compiled call: two fused launches where
# the eager casts and subtractions are four (a step's launches cost host time on a GPU: 32
# layers x 2 saved per token); bit for bit the eager arithmetic
_center_pair = mx.compile(_center)


_MASKS: dict = {}


def _valid_mask(cap: int, valid: int) -> mx.array:
    """(cap,) bool: slot < valid; one array per (cap, valid), shared by every layer of a step."""
    key = (cap, valid)
    if key not in _MASKS:
        if len(_MASKS) > 4096:
            _MASKS.clear()
        _MASKS[key] = mx.arange(cap) < valid
    return _MASKS[key]


def _slice(d: dict, n: int) -> dict:
    return {k: v[:, :, :n] for k, v in d.items()}


class TurboQuantCache:
    """One layer's compressed cache. Create with `TurboQuantCache(preset, layer)`."""

    step = 256
    # a chunk-by-chunk prefill's bound on a GPU (`sync`; `engine.prefill` sets its own)
    inflight = INFLIGHT
    queue_every = QUEUE_EVERY

    def __init__(self, preset: Preset, layer: int, paths: Paths = DEFAULT_PATHS):
        self.preset = preset
        self.layer = layer
        self.paths = paths  # which GPU paths its updates and attention take (`Paths`)
        self.prefix: tuple[dict, dict] | None = None
        self.prefix_len = 0
        self.tail: tuple[dict, dict] | None = None
        self.tail_len = 0
        self.head_dim = 0
        self.means: tuple[mx.array, mx.array] | None = None  # (k_mu, v_mu), each (B, H_kv, 1, D)
        self.window: tuple[mx.array, mx.array] | None = None  # newest tokens, uncompressed
        self.sink: tuple[mx.array, mx.array] | None = None  # first tokens, never compressed
        self.dense_prefix: tuple[mx.array, mx.array] | None = None  # see decode_prefix()
        # The window lives in preallocated buffers (B, H_kv, capacity, D) owned by this cache;
        # `window` is always the valid prefix of them (a slice, no copy).
        self._wbuf: tuple[mx.array, mx.array] | None = None
        # Newest tokens kept uncompressed: the preset's window, or more in an answering fork
        # (`fork(exact_new=...)`), where the question and answer stay exact.
        self.window_cap = preset.window
        self.dtype = mx.float32  # the model's key/value dtype, from the latest update
        # Set by a fused prefill chunk (`_fused_chunk`): the window's rows in the rotated frames
        # (fp16), and a promise that the tail's buffer also holds the window's encodings, in
        # rows tail_len .. tail_len + window_len (so aging or sealing them is a count). Anything
        # else that changes the window or the tail drops it (`_drop_encoded`).
        self._rot_window: tuple[mx.array, mx.array] | None = None
        self._rot_sink: tuple[mx.array, mx.array] | None = None  # rotated_sink() in fp16, once
        self._plan = [None]  # the decode step's kept launch (`CompressedKV.plan`)
        self._step_base = None  # (state, fields) of the last decode view (`_step_view`)
        self._anchor: mx.array | None = None  # see `keys`

    @property
    def keys(self) -> mx.array:
        """An anchor, not the keys (this cache holds no dense keys): mlx-lm's pipeline stages
        make the last layer's `keys` depend on the activations they send to the next stage
        (`cache[-1].keys = mx.depends(cache[-1].keys, h)`), so that evaluating the cache runs
        the send; `state` carries what is assigned here, so that dependency is kept."""
        return self._anchor if self._anchor is not None else mx.zeros((1,), mx.float16)

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._anchor = value

    @property
    def sink_len(self) -> int:
        return self.sink[0].shape[2] if self.sink is not None else 0

    @property
    def window_len(self) -> int:
        return self.window[0].shape[2] if self.window is not None else 0

    # -- protocol ----------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self.sink_len + self.prefix_len + self.tail_len + self.window_len

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def codecs(self) -> tuple[VectorCodec, VectorCodec]:
        return codecs_for(self.preset, self.head_dim, self.layer)

    def _grow(self, enc_k: dict, enc_v: dict, needed: int) -> None:
        cap = self.tail[0][next(iter(self.tail[0]))].shape[2] if self.tail else 0
        if needed <= cap:
            return
        # A fresh buffer per growth: MLX writes into it in place (nothing else references it).
        # Preallocating the whole prefill's tail once was slower (docs/performance.md): every
        # later write then copied the whole buffer, which the view slices keep referenced.
        new_cap = (needed + self.step - 1) // self.step * self.step

        def grown(old: dict | None, like: dict) -> dict:
            out = {}
            for name, arr in like.items():
                shape = (*arr.shape[:2], new_cap, *arr.shape[3:])
                buf = mx.zeros(shape, dtype=arr.dtype)
                if old is not None and self.tail_len:
                    buf[:, :, : self.tail_len] = old[name][:, :, : self.tail_len]
                out[name] = buf
            return out

        old_k, old_v = self.tail if self.tail else (None, None)
        self.tail = (grown(old_k, enc_k), grown(old_v, enc_v))

    def _append_compressed(self, keys: mx.array, values: mx.array) -> None:
        """Quantize centered (B, H_kv, n, D) keys/values into the tail (the first `sink` tokens
        of the sequence go to the exact sink instead)."""
        room = self.preset.sink - self.sink_len if self.prefix_len + self.tail_len == 0 else 0
        if room > 0:
            take = min(room, keys.shape[2])
            head_k, head_v = keys[:, :, :take], values[:, :, :take]
            if self.sink is not None:
                head_k = mx.concatenate([self.sink[0], head_k], axis=2)
                head_v = mx.concatenate([self.sink[1], head_v], axis=2)
            self.sink = (head_k.astype(mx.float16), head_v.astype(mx.float16))
            self._rot_sink = None
            keys, values = keys[:, :, take:], values[:, :, take:]
            if keys.shape[2] == 0:
                return
        kc, vc = self.codecs()
        enc_k, enc_v = kc.encode(keys), vc.encode(values)
        n = keys.shape[2]
        self._grow(enc_k, enc_v, self.tail_len + n)
        lo, hi = self.tail_len, self.tail_len + n
        for store, enc in zip(self.tail, (enc_k, enc_v)):
            for name, arr in enc.items():
                store[name][:, :, lo:hi] = arr
        self.tail_len = hi

    def update_and_fetch(self, keys: mx.array, values: mx.array, *, bound: bool = True):
        """Append (B, H_kv, L, D) keys/values; return the view attention reads.

        The view holds the compressed tokens as they were before this call plus the window and
        the new tokens uncompressed: a chunk attends to itself exactly. Afterwards whatever falls
        out of the window is compressed into the tail. `bound`: a prefill chunk over a compressed
        prefix bounds the layers queued (`_bound_inflight`; `absorb` builds none).
        """
        self.head_dim = keys.shape[-1]
        self.dtype = values.dtype
        if self.means is None:
            self.means = (
                keys.astype(mx.float32).mean(axis=2, keepdims=True),
                values.astype(mx.float32).mean(axis=2, keepdims=True),
            )
        n = self.window_len + keys.shape[2]
        if n <= self.window_cap:  # decode steps and questions: into the window's buffers
            self._window_write(*_center_pair(keys, values, *self.means))
            view = self._step_view()
            return view, view
        if bound and self.prefix_len + self.tail_len:
            self._bound_inflight(keys, values)
        fused = self._fused_chunk(keys, values)
        if fused is not None:
            return fused, fused
        k, v = self._centered(keys, values)
        self._drop_encoded()
        if self.window is not None:
            k = mx.concatenate([self.window[0], k], axis=2)
            v = mx.concatenate([self.window[1], v], axis=2)
        self.window, self._wbuf = (k, v), None
        view = self.view()  # slices of the tail taken now stay valid after the writes below
        old = k.shape[2] - self.window_cap
        self.window = None
        self._append_compressed(k[:, :, :old], v[:, :, :old])
        # The newest tokens stay as slices (a prefill's next chunk concatenates them anyway)
        self.window = (k[:, :, old:], v[:, :, old:]) if self.window_cap else None
        return view, view

    def absorb(self, keys: mx.array, values: mx.array) -> list:
        """Append (B, H_kv, L, D) keys and values that attention has already read exactly (a
        layer-major prefill, `longctx.prefill_layers`): `update_and_fetch` without the view's use
        and without the in-flight bound, whose queued layers this path does not build. Called
        with the chunks a token-major prefill would append, or longer runs of them, it stores
        what that would store for the same keys and values.

        Returns:
            the window's arrays, copied out of the span's buffers (the window was a slice of
            the span's centered rows and of its rotated rows: kept for every layer, by count
            ~8 GiB at 32k tokens of an 8B model). Evaluate them with `state`.
        """
        self.update_and_fetch(keys, values, bound=False)
        copies = []
        if self.window is not None:
            self.window = tuple(mx.contiguous(x) for x in self.window)
            copies += self.window
        if self._rot_window is not None:
            self._rot_window = tuple(mx.contiguous(x) for x in self._rot_window)
            copies += self._rot_window
        return copies

    def _centered(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return _center(keys, values, *self.means)

    def _drop_encoded(self) -> None:
        """Forget the fused prefill's window state: the window or the tail changes otherwise."""
        self._rot_window = None

    def _fused_room(self, n: int) -> int | None:
        """How many of a chunk's `n` tokens go to the sink when `_fused_chunk` takes it, or None
        when it cannot: a GPU with the dense prefill path, scalar codecs of a size the kernel
        takes, a window that is empty or the fused path's own, and a chunk that fills the window
        by itself."""
        kc, vc = self.codecs()
        # a codec that encodes through `hadamard_quantize` fits `prefill_encode` too
        if not (self.paths.dense_gpu and kc.fused_encode() and vc.fused_encode()):
            return None
        room = self.preset.sink - self.sink_len if self.prefix_len + self.tail_len == 0 else 0
        room = max(0, min(room, n))
        if self.window is not None and (room or self._rot_window is None):
            return None
        if n - room < max(self.window_cap, 1):
            return None
        if self.tail is not None and set(self.tail[0]) != {"idx", "norm"}:
            return None
        return room

    def _fused_chunk(self, keys: mx.array, values: mx.array):
        """A prefill chunk's update in two launches (`kernels/prefill_encode.py`), or None.

        The chunk's raw keys and values are centered, rotated, encoded and appended to the
        tail's buffer at once, window tokens included (their codes do not depend on when they
        are made), and their rotated fp16 rows are what the dense GPU attention reads for the
        window. Aging tokens out of the window is then a count (`tail_len`). The view carries
        the same tokens as the unfused path's; its `window` (centered fp32, for the other
        attention paths) is left unevaluated unless one reads it. Past the first chunk the
        update is one compiled function (`_encode_chunk`; `Paths.compile`), shared by
        every layer of the same shapes.

        Args:
            keys, values: (B, H_kv, n, D) as the model handed them.
        """
        room = self._fused_room(keys.shape[2])
        if room is None:
            return None
        exact_sink = None
        if room:
            k, v = self._centered(keys, values)
            head_k, head_v = k[:, :, :room], v[:, :, :room]
            if self.sink is not None:
                head_k = mx.concatenate([self.sink[0].astype(mx.float32), head_k], axis=2)
                head_v = mx.concatenate([self.sink[1].astype(mx.float32), head_v], axis=2)
            exact_sink = (head_k, head_v)  # this chunk attends to its own tokens unrounded
            self.sink = (head_k.astype(mx.float16), head_v.astype(mx.float16))
            self._rot_sink = None
            keys, values = keys[:, :, room:], values[:, :, room:]
        kc, vc = self.codecs()
        held = self.tail_len + (self.window_len if self._rot_window is not None else 0)
        w = self.window_cap
        args = (
            keys,
            values,
            list(self.means),
            [kc.rotation.signs, vc.rotation.signs],
            [kc.boundaries, vc.boundaries],
            list(self._rot_window) if self._rot_window is not None else [],
            [self.tail[i][name] for i in (0, 1) for name in ("idx", "norm")] if held else [],
            list(self.window) if self.window is not None else [],
            held,
            w,
        )
        if room or not compiling.prefill_compiled(self.paths):
            out = _encode_chunk(*args)
        else:
            key = (
                "encode",
                keys.shape,
                keys.dtype,
                values.shape,
                values.dtype,
                self.means[0].shape,
                kc.key,
                vc.key,
                held,
                None if self.tail is None else self.tail[0]["idx"].shape,
                None if self._rot_window is None else self._rot_window[0].shape,
                None if self.window is None else self.window[0].shape,
                w,
                _backend(),
            )
            out = compiling.call_compiled(_ENCODE, key, compiling.fresh(_encode_chunk), _encode_chunk, args)
        rot_k, idx_k, norm_k, rot_v, idx_v, norm_v, seen_k, seen_v, *win = out
        self.window, self._wbuf = (seen_k, seen_v), None
        view = self.view(after_rot=(rot_k, rot_v))
        if exact_sink is not None:
            view = dataclasses.replace(view, sink=exact_sink, sink_rot=None)
        self.tail = ({"idx": idx_k, "norm": norm_k}, {"idx": idx_v, "norm": norm_v})
        self.tail_len = idx_k.shape[2] - w
        # from this chunk's rows only: no chain of unevaluated windows across chunks
        self.window = tuple(win) if w else None
        self._rot_window = (rot_k[:, :, -w:], rot_v[:, :, -w:]) if w else None
        return view

    def _bound_inflight(self, keys: mx.array, values: mx.array) -> None:
        """A prefill chunk's layer over a compressed prefix, on a GPU: bound the layers queued
        (`sync`, this cache's `inflight` and `queue_every`)."""
        budget = self.inflight
        # only chunks whose attention dequantizes the prefix (`dense_gpu`): a decode step past
        # the window's cap takes the fused kernel and must not wait
        paths = self.paths
        if not budget or keys.shape[2] <= paths.fused_max_lq or not paths.dense_gpu or not _on_gpu():
            return
        kc, vc = self.codecs()
        b, h, n, _ = keys.shape
        rows = 2 * b * h * (self.offset + n) * (kc.padded_dim + vc.padded_dim)  # fp16 K and V
        sync((keys, values), rows, budget, self.queue_every)

    def _window_write(self, k: mx.array, v: mx.array) -> None:
        """Append centered fp32 (B, H_kv, n, D) tokens to the window, in its own buffers (grown
        in steps of `step` tokens, up to `window_cap`); `window` becomes their valid prefix."""
        self._drop_encoded()
        lo = self.window_len
        hi = lo + k.shape[2]
        cap = self._wbuf[0].shape[2] if self._wbuf is not None else 0
        if self._wbuf is None or hi > cap:
            new_cap = min(max(self.window_cap, hi), (hi + self.step - 1) // self.step * self.step)
            bufs = []
            for old in (self.window[0], self.window[1]) if self.window is not None else (None, None):
                buf = mx.zeros((*k.shape[:2], new_cap, k.shape[3]), dtype=mx.float32)
                if old is not None and lo:
                    buf[:, :, :lo] = old
                bufs.append(buf)
            self._wbuf = (bufs[0], bufs[1])
        self._wbuf[0][:, :, lo:hi] = k
        self._wbuf[1][:, :, lo:hi] = v
        self.window = (self._wbuf[0][:, :, :hi], self._wbuf[1][:, :, :hi])

    def seal(self) -> None:
        """Compress the uncompressed window, so that every token is stored compressed."""
        self._forget_step()
        if self.window is not None:
            if self._rot_window is not None:  # the fused prefill encoded the window already
                self.tail_len += self.window_len
            else:
                self._append_compressed(*self.window)
            self.window, self._wbuf, self._rot_window = None, None, None

    def view(self, after_rot: tuple | None = None) -> CompressedKV:
        """What attention reads now. `after_rot`: the rotated rows of `window` when the caller
        made them (a fused prefill chunk); default, the fused prefill's own window rows if set."""
        kc, vc = self.codecs()
        segments = []
        if self.prefix_len:
            segments.append((self.prefix[0], self.prefix[1], self.prefix_len))
        if self.tail_len:
            segments.append((_slice(self.tail[0], self.tail_len), _slice(self.tail[1], self.tail_len), self.tail_len))
        buffer = None
        if self._wbuf is not None and self.window is not None:
            cap = self._wbuf[0].shape[2]
            if cap > self.window_len:
                buffer = (*self._wbuf, _valid_mask(cap, self.window_len))
        return CompressedKV(
            kc,
            vc,
            tuple(segments),
            self.offset,
            self.means[1],
            self.window,
            self.sink,
            self.dense_prefix,
            buffer,
            key_mean=self.means[0],
            dtype=self.dtype,
            sink_rot=self.rotated_sink16(),
            after_rot=after_rot if after_rot is not None else self._rot_window,
            plan=self._plan if buffer is not None else None,
            paths=self.paths,
        )

    def _forget_step(self) -> None:
        """Drop the decode step's kept view fields and launch (they hold the window's buffers and
        the prefix; each checks that it still fits, so this only frees them sooner)."""
        self._plan[0], self._step_base = None, None

    def _step_view(self) -> CompressedKV:
        """`view()` after a write into the window's buffers, from the fields of the last such view
        where nothing but the window changed since (the same prefix, tail, sink, decoded prefix,
        dtype and buffers): a decode step makes one view per layer and token, and building all
        its fields was ~5 us of a step's ~15 us budget of Python per layer."""
        buf = self._wbuf
        if buf is None or buf[0].shape[2] <= self.window_len:
            return self.view()
        # objects compared by identity (every change replaces them), numbers and the dtype by value
        same = (self.prefix, self.sink, self.dense_prefix, buf, self.means, self._rot_window)
        equal = (self.tail_len, self.dtype, self.head_dim)
        base = self._step_base
        if base is None or base[1] != equal or not all(a is b for a, b in zip(base[0], same)):
            view = self.view()
            self._step_base = (same, equal, dict(view.__dict__))
            return view
        view = object.__new__(CompressedKV)  # the dataclass's fields, without its frozen __init__
        fields = view.__dict__
        fields.update(base[2])
        window = self.window
        fields["offset"], fields["window"] = self.offset, window
        fields["window_buffer"] = (buf[0], buf[1], _valid_mask(buf[0].shape[2], window[0].shape[2]))
        return view

    def rotated_sink16(self) -> tuple[mx.array, mx.array] | None:
        """`rotated_sink()` in fp16, made once per sink (every prefill chunk's dense attention
        reads it; unevaluated until one does)."""
        if self.sink is None:
            return None
        if self._rot_sink is None:
            k, v = self.rotated_sink()
            self._rot_sink = (k.astype(mx.float16), v.astype(mx.float16))
        return self._rot_sink

    def rotated_sink(self) -> tuple[mx.array, mx.array] | None:
        """The sink's keys and values (fp32) in the codecs' rotated frames, or None."""
        if self.sink is None:
            return None
        kc, vc = self.codecs()
        return kc.rotate(self.sink[0].astype(mx.float32)), vc.rotate(self.sink[1].astype(mx.float32))

    def decode_prefix(self, pool=None, sink=None) -> int:
        """Decode the sink and the read-only prefix once, into fp32 in the rotated frames.

        For answering on the CPU: there, decoding (a table lookup per coordinate) costs far more
        than the attention itself, and the blocked path would repeat it for every answer token.
        Attention then reads these dense arrays instead of the prefix (the same values the
        blocked path decodes, QJL correction folded into the keys); the packed prefix stays the
        stored form, and forks share the decoded arrays. Costs (sink + prefix) x H_kv x
        (P_k + P_v) x 4 bytes per layer. No-op without a prefix.

        Args:
            pool: an executor: the keys' table lookups then run on it while the values' run
                here (numpy releases the GIL; MLX is only touched on this thread).
            sink: `rotated_sink()`, evaluated (decode_once evaluates every layer's at once).

        Returns:
            the bytes the decoded arrays hold.
        """
        if not self.prefix_len:
            return 0
        kc, vc = self.codecs()
        sink_k, sink_v = (sink or self.rotated_sink()) or (None, None)
        job_k, job_v = kc.scoring_job(self.prefix[0], sink_k), vc.scoring_job(self.prefix[1], sink_v)
        if pool is None:
            rows_k, rows_v = lut.finish(job_k), lut.finish(job_v)
        else:
            pending = pool.submit(lut.finish, job_k)
            rows_v = lut.finish(job_v)
            rows_k = pending.result()
        self.dense_prefix = (kc.scoring_result(job_k, rows_k), vc.scoring_result(job_v, rows_v))
        keys, values = self.dense_prefix
        return keys.nbytes + values.nbytes

    def dense_prefix_bytes(self) -> int:
        """What `decode_prefix` would hold, without decoding."""
        if not self.prefix_len:
            return 0
        kc, vc = self.codecs()
        b, h = self.means[0].shape[:2]
        return 4 * b * h * (self.sink_len + self.prefix_len) * (kc.padded_dim + vc.padded_dim)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self._forget_step()
        self._drop_encoded()
        if n > self.window_len + self.tail_len:
            self.dense_prefix = None  # the prefix or the sink shrinks
        from_window = min(n, self.window_len)
        if from_window:
            keep = self.window_len - from_window
            self.window = tuple(a[:, :, :keep] for a in self.window) if keep else None
            if not keep:
                self._wbuf = None
        n_rest = n - from_window
        from_tail = min(n_rest, self.tail_len)
        self.tail_len -= from_tail
        rest = n_rest - from_tail
        if rest > self.prefix_len:  # trimming into the sink
            keep = self.sink_len - (rest - self.prefix_len)
            self.sink = tuple(a[:, :, :keep] for a in self.sink) if keep else None
            self._rot_sink = None
            rest = self.prefix_len
        if rest:
            self.prefix_len -= rest
            self.prefix = (_slice(self.prefix[0], self.prefix_len), _slice(self.prefix[1], self.prefix_len))
        return n

    def dense(self) -> tuple[mx.array, mx.array]:
        """All keys and values decoded to fp32 (B, H_kv, offset, D), means added back (for export)."""
        kc, vc = self.codecs()
        view = self.view()
        keys = [kc.decode(seg_k)[..., : self.head_dim] for seg_k, _, _ in view.segments]
        values = [vc.decode(seg_v)[..., : self.head_dim] for _, seg_v, _ in view.segments]
        if self.sink is not None:
            keys.insert(0, self.sink[0].astype(mx.float32))
            values.insert(0, self.sink[1].astype(mx.float32))
        if self.window is not None:
            keys.append(self.window[0])
            values.append(self.window[1])
        return (mx.concatenate(keys, axis=2) + self.means[0], mx.concatenate(values, axis=2) + self.means[1])

    @property
    def nbytes(self) -> int:
        total = 0
        for seg_k, seg_v, _ in self.view().segments:
            total += sum(a.nbytes for a in seg_k.values()) + sum(a.nbytes for a in seg_v.values())
        return total

    @property
    def state(self) -> list:
        """The arrays holding the cache (for `mx.eval`); persistence goes through `arrays()`."""
        if self.means is None:
            return []
        segs = self.view().segments
        # the fused prefill's window is a view of the chunk's keys, left unevaluated (its rotated
        # rows, evaluated with the tail, stand for it)
        window = list(self._rot_window) if self._rot_window is not None else list(self.window) if self.window is not None else []
        window += list(self.sink) if self.sink is not None else []
        window += [self._anchor] if self._anchor is not None else []  # a pipeline stage's send
        return [*self.means, *window, *(a for seg_k, seg_v, _ in segs for a in (*seg_k.values(), *seg_v.values()))]

    @property
    def meta_state(self) -> tuple:
        return (self.preset.name, str(self.layer), str(self.head_dim), str(self.offset))

    # -- persistence -------------------------------------------------------------------------
    def arrays(self) -> dict:
        """All compressed tokens as one dict: `k.<name>` / `v.<name>` -> (B, H_kv, L, ...), plus
        the centering means `k.mu` / `v.mu` (B, H_kv, 1, D). Call `seal()` first to include the
        uncompressed window."""
        if self.means is None:
            return {}
        out = {"k.mu": self.means[0], "v.mu": self.means[1]}
        if self.sink is not None:
            out["k.sink"], out["v.sink"] = self.sink
        for tag, i in (("k", 0), ("v", 1)):
            parts = [seg[i] for seg in self.view().segments]
            for name in parts[0] if parts else ():
                pieces = [p[name] for p in parts]
                out[f"{tag}.{name}"] = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)
        return out

    @classmethod
    def from_arrays(
        cls, preset: Preset, layer: int, arrays: dict, head_dim: int, paths: Paths = DEFAULT_PATHS
    ) -> "TurboQuantCache":
        """A cache whose read-only prefix is `arrays` (as produced by `arrays()`)."""
        cache = cls(preset, layer, paths)
        cache.head_dim = head_dim
        if not arrays:
            return cache
        cache.means = (arrays["k.mu"], arrays["v.mu"])
        if "k.sink" in arrays:
            cache.sink = (arrays["k.sink"], arrays["v.sink"])
        special = ("mu", "sink")
        keys = {k[2:]: v for k, v in arrays.items() if k.startswith("k.") and k[2:] not in special}
        values = {k[2:]: v for k, v in arrays.items() if k.startswith("v.") and k[2:] not in special}
        cache.prefix = (keys, values)
        cache.prefix_len = next(iter(keys.values())).shape[2] if keys else 0
        return cache

    def fork(self, exact_new: int | None = None) -> "TurboQuantCache":
        """Share everything so far as a read-only prefix; new tokens go to a private tail.

        Args:
            exact_new: keep up to this many of the newest tokens uncompressed (at least the
                preset's window; None: as this cache does): an answering fork keeps its question
                and answer exact; they are never persisted, and `seal()` compresses them if they
                ever are.
        """
        child = TurboQuantCache.from_arrays(self.preset, self.layer, self.arrays(), self.head_dim, self.paths)
        child.window_cap = max(self.preset.window, self.window_cap if exact_new is None else exact_new)
        child.means = self.means
        child.sink = self.sink
        child.window = self.window  # immutable arrays: the child's first append copies them into
        # buffers of its own (`_window_write`), so the parent's never change
        if not self.tail_len:  # the child's prefix is this prefix: the decoded form carries over
            child.dense_prefix = self.dense_prefix
        return child
