"""Layer-major prefill: the whole prompt through one layer at a time, each layer attending its own
keys and values exactly, which are then compressed into that layer's cache.

`engine.prefill`'s token-major loop runs each chunk through every layer, so every layer-chunk
attends the compressed prefix: on a GPU it dequantizes the whole prefix to fp16 rows first
(`kvcache.dense_gpu`), work that grows with the prefix and that an fp16 cache never does (on a
CPU it decodes the prefix for every chunk: far slower than fp16 at length). Here layer j's
chunks attend an uncompressed staging cache (mlx-lm's `KVCache`, the fp16 path's own attention,
SDPA over the model's dtype), and once every chunk of layer j has run, its keys and values go
into layer j's compressed cache chunk by chunk, as the token-major loop would have appended them
(`TurboQuantCache.absorb`). The compressed cache is then the compression of exactly the keys and
values an fp16 prefill makes (the token-major loop's later layers see keys shaped by the earlier
layers' compressed attention instead).

Memory: one layer's staging keys and values plus the hidden states of the whole prompt (two
layers' worth while one is built from the other): at 32k tokens of an 8B model 0.125 + 2 x 0.25
GiB, where the fp16 cache is 4 GiB.

How the layers run without forking the model's code: for the pass of layer j, the entries of
the list the model's call iterates (`layer_list`) are stand-ins (`_Stand`). The model is called
on a chunk as usual (its own embedding, mask and rope offsets, from the staging cache every entry
of the cache list points to); every stand-in before j returns that chunk's stored output of
layer j-1 (whatever it was: an array, or a tuple a model unpacks), and the stand-in of j runs the
real layer with the arguments the model passed, keeps its output and stops the call (`_Stop`):
nothing after layer j is built. Unused lazy arrays (the embedding, past layer 0) are never
computed. The first chunk is a probe: a model whose call does not reach the stand-ins, fails
with them, or has more than one layer write the staging cache gets the token-major loop, with
nothing written yet.

The model's call is needed only in the first layer's pass: there each chunk's call goes on
through every stand-in, which records what the model passed its layer besides the hidden states
(the mask, the cache, keywords) and hands the hidden states on unchanged (`_record`); later
passes call each layer directly with its recorded arguments, the pass's staging cache in place
of the first's (`_direct`). That saves the model's call (embedding, masks, the stand-ins before
the layer) for all but one layer: the loop's host time at 8k tokens of SmolLM2's shape went from
79 to 65 ms (median of 7; CPU, kernels stood in: `benchmarks/diagnostics/prefill_loop_host.py`).
A model whose layers do not take the hidden states first and pass them on as they came (keywords,
tuples, work between layers), or that hands them a large array (an explicit mask: kept per
chunk, it would hold GiBs at 128k tokens; `RECORD_MAX_BYTES`), stops the recording: its later
passes go through its call as before. What it assumes: a layer's other arguments do not depend
on the hidden states (a model computing one from them inside its loop would have it from the
first pass's; none of the families in tests/families.py does, each stores the oracle's arrays
bit for bit).

Where: `applies` (`engine.prefill`'s `order`, `layer` by default: an empty cache whose layers
are all compressed, on every backend. On the CPU the token-major loop is faster for a small
model (SmolLM2-135M) but several times slower for the default 1.5B model, docs/performance.md;
`auto` keeps the token-major loop on the CPU.)
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from longctx.chunking import ACTIVATIONS, FUSED_SDPA_DIMS, GROUP_TOKENS, LAYER_CALL_TOKENS, LAYER_INFLIGHT, ORDER

Progress = Callable[[int, int], None]
_log = logging.getLogger("longctx.prefill")


class _Stop(Exception):
    """Raised by the active layer's stand-in once its output is kept: ends the model call."""


_STAGE = object()  # in a recorded call, where the model passed the staging cache
RECORD = True  # False: every pass goes through the model's call (benchmarks/diagnostics/prefill_loop_host.py)
# the largest array a recorded call may hold (a chunk's explicit mask is (T, offset + T): at 128k
# tokens kept for every chunk until the last layer's pass, GiBs; such a model is called per layer)
RECORD_MAX_BYTES = 2**20


class _Unrecorded(Exception):
    """Raised by a recording stand-in whose call is not `layer(h, ...)` with h what the layer
    before returned: that model's layers past the first run through its own call."""


class _Stand:
    """Stands in for entry `i` of `model.layers` (the module `layer`) while one layer's pass runs
    (see the module docstring); `run` decides what a call does. Every other attribute is the
    layer's (models read some, e.g. llama's `use_sliding`, to pick a layer's mask)."""

    __slots__ = ("i", "layer", "run")

    def __init__(self, i: int, layer, run):
        self.i, self.layer, self.run = i, layer, run

    def __call__(self, *args, **kwargs):
        return self.run(self.i, args, kwargs)

    def __getattr__(self, name: str):
        if name in _Stand.__slots__:  # unset (a copy made without __init__): no recursion
            raise AttributeError(name)
        return getattr(self.layer, name)


def applies(model, cache: list, order: str = ORDER) -> bool:
    """Whether `prefill` takes this path: `order` (`token`: never; `layer`: wherever it can;
    `auto`: on a GPU; `engine.prefill`'s argument), an empty cache whose every layer is compressed
    (`TurboQuantCache`: sliding-window layers' masks depend on their own offsets) and a model
    with one `layers` entry per cache entry."""
    # deferred: loads mlx.core (the light commands start without it)
    from longctx.kernels import backend

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache.turbo import TurboQuantCache

    if order not in ("auto", "layer", "token"):
        raise ValueError(f"order is one of auto, layer, token, got {order!r}")
    if order == "token" or (order == "auto" and backend() == "cpu"):
        return False
    layers = layer_list(model)
    return (
        bool(cache)
        and layers is not None
        and len(layers) == len(cache)
        and all(type(c) is TurboQuantCache and c.offset == 0 for c in cache)
    )


def layer_list(model) -> list | None:
    """The list of layers the model's call runs through: `model.layers` where that is one list
    at every access, else the first such `layers` list of an inner module (`model.model`,
    `model.language_model`, its `model`) holding the same layer objects (Qwen2's `layers` is a
    new slice of `model.model.layers` at every access, which its call slices again); None when
    there is none."""
    want = getattr(model, "layers", None)
    if not isinstance(want, list) or not want:
        return None
    inner = getattr(model, "language_model", None)
    for owner in (model, getattr(model, "model", None), inner, getattr(inner, "model", None)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if (
            isinstance(layers, list)
            and layers is getattr(owner, "layers")
            and len(layers) == len(want)
            and all(a is b for a, b in zip(layers, want))
        ):
            return layers
    return None


ABSORB_TOKENS = 8192  # most tokens one `absorb` appends (past the first chunk)


CALL_PAIRS = 512 * 131072  # most query-key pairs a merged layer call scores per head: what a
# 512-token chunk scores at 128k keys (one evaluation's time: Metal's watchdog)


def call_spans(bounds: list[tuple[int, int]], most: int, pairs: int = 0) -> list[tuple[int, int]]:
    """The token runs each layer is called on: runs of whole chunks of up to `most` tokens whose
    queries x keys (the run's length x its end) stay within `pairs` (0: CALL_PAIRS) and
    CALL_PAIRS, at least one chunk each; `most` 0: one call per chunk (`bounds` as they are).

    Fewer calls cost less host time (the loop is host-bound at small shapes) and each queued call holds one copy of the staging keys and
    values (`chunk_bytes`) where its chunks held one each. The keys and values then come from
    calls of other lengths than the fp16 prefill's chunks (the same math; the last bits may
    differ where a kernel's result depends on the call's length)."""
    if not most:
        return list(bounds)
    cap = min(pairs, CALL_PAIRS) if pairs else CALL_PAIRS
    return _runs(bounds, lambda lo, hi: hi - lo <= most and (hi - lo) * hi <= cap)


def _runs(bounds: list[tuple[int, int]], fits, first_alone: bool = False) -> list[tuple[int, int]]:
    """`bounds` merged into runs of consecutive chunks while `fits(lo, hi)` holds for the run
    (a chunk that does not fit alone stays one run); `first_alone`: the first chunk is never
    merged."""
    spans: list[tuple[int, int]] = []
    for lo, hi in bounds:
        if spans and not (first_alone and len(spans) == 1) and fits(spans[-1][0], hi):
            spans[-1] = (spans[-1][0], hi)
        else:
            spans.append((lo, hi))
    return spans


def absorb_spans(bounds: list[tuple[int, int]], most: int | None = None) -> list[tuple[int, int]]:
    """The spans a layer's keys and values are absorbed in: the first chunk alone (it fixes the
    centering means and holds the sink, as in the token-major loop), then runs of whole chunks
    of up to `most` tokens (at least one chunk each). Fewer, longer appends than one per chunk:
    each fused append writes the tail into a new buffer (a copy of the rows before it), and a
    layer's appends are queued at once, so one per chunk kept ~chunks / 2 tails' worth alive
    (by count, ~1 GiB at 32k tokens of an 8B model) and cost host time per chunk. A token's codes do not
    depend on the span it is appended in: the stored arrays are the same. `most`: None,
    `ABSORB_TOKENS`."""
    most = most or ABSORB_TOKENS
    return _runs(bounds, lambda lo, hi: hi - lo <= most, first_alone=True)


def chunk_bytes(stage, out) -> int:
    """What one queued layer-chunk holds until it has run (an estimate, for the in-flight bound):
    the staging buffer it reads (mlx-lm's `KVCache` gives each chunk a new one, the keys and
    values so far: 0.5 GiB at 128k tokens of an 8B model), its activations, ~ACTIVATIONS
    times its output (Llama's MLP alone holds gate, up and their product at 3.5x the width),
    and, at head dims whose SDPA is not fused on the GPUs, its fp32 scores (query heads taken
    as the output's width over the head dim)."""
    from mlx.utils import tree_flatten

    arrays = [a for _, a in tree_flatten(out) if hasattr(a, "nbytes")]
    total = stage.keys.nbytes + stage.values.nbytes + ACTIVATIONS * sum(a.nbytes for a in arrays)
    b, _, _, dim = stage.keys.shape
    if dim not in FUSED_SDPA_DIMS and arrays and arrays[0].ndim == 3:
        n, width = arrays[0].shape[1:]
        total += 4 * b * max(1, width // dim) * n * stage.offset
    return int(total)


def prefill(
    model,
    tokens: list[int],
    cache: list,
    bounds: list[tuple[int, int]],
    progress: Progress | None = None,
    pairs: int = 0,
    *,
    layer_inflight: int = LAYER_INFLIGHT,
    group_tokens: int = GROUP_TOKENS,
    layer_call_tokens: int = LAYER_CALL_TOKENS,
) -> list[float] | None:
    """Fill the empty compressed `cache` with `tokens`, layer by layer (module docstring).

    Args:
        model: an mlx-lm model whose `layers` list its call runs through.
        tokens: the prompt token ids.
        cache: one empty `TurboQuantCache` per layer (`applies`).
        bounds: the chunks, (lo, hi) token ranges in order, as the token-major loop cuts them:
            each is one call per layer (or runs of them: `call_spans`, `layer_call_tokens`),
            and the compressed cache absorbs them in `absorb_spans`.
        progress: `progress(done, total)` after every queued group of chunks, `done` the
            tokens' share of the work queued so far (layers x chunks; the GPU may still be
            running the last groups).
        pairs: the bound on query-key pairs the chunks were cut by (0: none): merged calls
            keep within it.
        layer_inflight: most bytes queued (0: no bound).
        group_tokens: tokens per queued group.
        layer_call_tokens: a layer is called on runs of whole chunks of up to this many
            tokens (0: one call per chunk).

    A layer's chunks are queued for the GPU in groups (`mx.async_eval`) of up to
    `group_tokens` tokens, or fewer where their `chunk_bytes` reach half of
    `layer_inflight`; past that many bytes queued, the oldest groups are waited for (the
    newest always stays queued, so the GPU has work while the host builds the next).

    Returns:
        the wall seconds between the waits (one per group of chunks: the longest is the
        longest a queued evaluation ran), or None when the model's call does not fit the
        stand-ins (it bypasses its layers list, fails with them, or more than one layer writes
        the staging cache): the caller runs the token-major loop, and nothing was written.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    layers = layer_list(model)
    real = list(layers)
    n_layers, total = len(real), len(tokens)
    runs = call_spans(bounds, layer_call_tokens, pairs)
    pieces = [mx.array(tokens[lo:hi], dtype=mx.int32)[None] for lo, hi in runs]  # (1, T) each
    at = {"layer": 0, "chunk": 0, "out": None, "stage": None}
    hidden: list = []  # the previous layer's output, per chunk
    # per chunk, per layer i >= 1: the arguments the model passed it besides the hidden states
    # (`_record`), kept during the first layer's pass; None once a chunk's call did not fit (or
    # not RECORD): the model's call serves every pass
    calls: list | None = [] if RECORD else None

    def run(i: int, args, kwargs):
        if calls is not None and at["layer"] == 0:
            return _record(i, args, kwargs)
        if i < at["layer"]:  # what layer j - 1 returned (its earlier stand-ins' is discarded)
            return hidden[at["chunk"]]
        at["out"] = real[i](*args, **kwargs)
        raise _Stop

    def _record(i: int, args, kwargs):
        # the first layer's pass lets the model's call go on through every stand-in: layer 0
        # runs, and each later stand-in keeps what the model passed it and hands the hidden
        # states on unchanged, so later passes call their layer directly (`_direct`) instead of
        # the whole model (embedding, masks, every stand-in before it: ~10 us a call)
        if i == 0:
            at["out"] = real[0](*args, **kwargs)
            calls.append([None])
            return at["out"]
        if not args or args[0] is not at["out"] or len(calls[-1]) != i:
            raise _Unrecorded
        if any(isinstance(a, mx.array) and a.nbytes > RECORD_MAX_BYTES for a in (*args[1:], *kwargs.values())):
            raise _Unrecorded
        stage = at["stage"]  # kept as a mark: that pass's buffers are not held past it
        calls[-1].append(
            (tuple(_STAGE if a is stage else a for a in args[1:]), {k: _STAGE if v is stage else v for k, v in kwargs.items()})
        )
        return args[0]

    def _direct(j: int, c: int, stage):
        # layer j on chunk c with the arguments the model passed it in the first pass, this
        # pass's staging cache where that one's was
        rest, kwargs = calls[c][j]
        return real[j](
            hidden[c], *[stage if a is _STAGE else a for a in rest], **{k: stage if v is _STAGE else v for k, v in kwargs.items()}
        )

    spans = absorb_spans(bounds)
    budget = layer_inflight or float("inf")
    times: list[float] = []
    queued: list = []  # (arrays, bytes) of the groups queued and not yet waited for, oldest first
    t = time.perf_counter()
    work = n_layers * len(pieces)
    layers[:] = [_Stand(i, layer, run) for i, layer in enumerate(real)]
    try:
        for j in range(n_layers):
            # the fp16 path's own cache (its buffers grow as that path's do: each chunk's SDPA
            # then reads the whole buffer, contiguous, where a preallocated one gives strided
            # slices)
            stage = KVCache()
            stages = [stage] * n_layers  # the model's mask and rope read cache[0] / cache[j]
            at["stage"] = stage
            outs = []
            group, nbytes, ntokens = [], 0, 0  # the group being built
            for c, piece in enumerate(pieces):
                at["layer"], at["chunk"] = j, c
                probe = j == 0 and c == 0  # nothing is written yet: the fallback is clean
                if j > 0 and calls is not None:
                    at["out"] = _direct(j, c, stage)
                else:
                    try:
                        model(piece, cache=stages)
                    except _Stop:
                        pass
                    except Exception as err:  # the stand-ins do not fit this model's call
                        if at["out"] is None:
                            if not probe:
                                raise
                            _log.debug("layer-major prefill refused by the model's call: %r", err)
                            return None
                        # recording: layer 0 ran, the rest of the model's call did not fit
                        # (`_Unrecorded`, or an error past the stand-ins): later passes go
                        # through the model's call
                        calls = None
                    else:
                        if at["out"] is None:
                            if probe:
                                return None  # the model's call bypassed its layers list
                            raise RuntimeError("the model's call stopped going through its layers")
                        if calls is None or j > 0:
                            raise RuntimeError("the model's call went on past its active layer")
                        if len(calls[-1]) != n_layers:  # it did not reach every layer
                            calls = None
                if probe and stage.offset != piece.shape[1]:  # one layer wrote, once
                    return None
                out = at["out"]
                at["out"] = None
                if j < n_layers - 1:
                    outs.append(out)
                    group.append(out)
                else:  # the last layer's output feeds nothing: only its keys and values run
                    group += [stage.keys, stage.values]
                nbytes += chunk_bytes(stage, out)
                ntokens += piece.shape[1]
                last = c == len(pieces) - 1
                if last:  # the layer's exact keys and values into its compressed cache
                    keys, values = stage.keys[..., :total, :], stage.values[..., :total, :]
                    window = []
                    for lo, hi in spans:
                        window = cache[j].absorb(keys[:, :, lo:hi], values[:, :, lo:hi])
                    group += list(cache[j].state) + window
                    stage = stages = keys = values = at["stage"] = None
                if not (last or ntokens >= group_tokens or nbytes >= budget / 2):
                    continue
                mx.async_eval(group)
                queued.append((group, nbytes))
                group, nbytes, ntokens = [], 0, 0
                # bound what is queued: MLX allocates a launch's buffers when it is queued and
                # keeps what it reads until it has run
                while len(queued) > 1 and sum(b for _, b in queued) > budget:
                    mx.eval(queued.pop(0)[0])
                    now = time.perf_counter()
                    times.append(now - t)
                    t = now
                if progress:
                    progress(total * (j * len(pieces) + c + 1) // work, total)
            hidden = outs
    finally:
        layers[:] = real
    for group, _ in queued:
        mx.eval(group)
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times
