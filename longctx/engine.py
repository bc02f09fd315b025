"""Chunked prefill into a cache and streaming decode from it.

Prefill runs the model over the prompt in chunks and evaluates only the cache state: MLX is lazy,
so the LM-head matmul built for each chunk is never computed (no logits for prompt positions),
the same trick mlx-lm's `generate_step` uses. On a GPU an empty compressed cache is filled layer
by layer instead (`longctx.prefill_layers`). Decoding is a small loop of our own (`token_stream`),
so answering needs no import of mlx-lm's generate module (nor, through it, of transformers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

from longctx.chunking import (  # noqa: F401  (engine.chunk_at)
    DEFAULT_CHUNK,
    GROUP_TOKENS,
    INFLIGHT,
    LAYER_CALL_TOKENS,
    LAYER_INFLIGHT,
    MIN_CHUNK,
    ORDER,
    QUEUE_EVERY,
    chunk_at,
)
from longctx import prefill_layers
from longctx.runtime.distributed import pipelined

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PrefillStats:
    tokens: int
    seconds: float
    peak_bytes: int
    # The longest single chunk (forward pass + mx.eval): one command buffer's worth of work, which
    # the Metal watchdog kills after a few seconds (mlx-lm issue #1087).
    max_eval_seconds: float = 0.0
    # every chunk's time, in order (a layer-major prefill: the time between its waits)
    chunk_seconds: tuple[float, ...] = ()

    @property
    def max_steady_eval_seconds(self) -> float:
        """The longest chunk but the first two and the last (whose new shapes may compile
        kernels: MLX's first use, the first chunk with a cached prefix, a shorter tail)."""
        steady = self.chunk_seconds[2:-1]
        return max(steady) if steady else self.max_eval_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def _cache_arrays(cache: list) -> list:
    return [c.state for c in cache]


def prefill(
    model,
    tokens: list[int],
    cache: list,
    chunk: int = DEFAULT_CHUNK,
    progress: Progress | None = None,
    pairs: int = 0,
    order: str = ORDER,
    inflight: int = INFLIGHT,
    queue_every: int = QUEUE_EVERY,
    layer_inflight: int = LAYER_INFLIGHT,
    group_tokens: int = GROUP_TOKENS,
    layer_call_tokens: int = LAYER_CALL_TOKENS,
) -> PrefillStats:
    """Run `tokens` through `model`, filling `cache` (mlx-lm cache protocol), chunk by chunk.

    Args:
        model: an mlx-lm model.
        tokens: prompt token ids.
        cache: one cache object per layer (from `longctx.kvcache.make`).
        chunk: tokens per forward pass; bounds the attention scores' memory (chunk × length).
        progress: `progress(done, total)` after every chunk.
        pairs: past this many query-key pairs per chunk and head, chunks shrink (`chunk_at`;
            0: always `chunk`).
        order: a compressed prefill of an empty cache layer by layer ("layer", where
            `prefill_layers.applies`), chunk by chunk through every layer ("token"), or layer
            by layer on a GPU only ("auto"). Every default here is `longctx.chunking`'s.
        inflight, queue_every: the chunk-by-chunk loop's bound on a GPU: most bytes of
            dequantized cache rows queued (0: no bound), and layers between two queueings
            (`kvcache.turbo.sync`).
        layer_inflight, group_tokens, layer_call_tokens: the layer-by-layer loop's bound on
            queued bytes (0: none), tokens per queued group and tokens per layer call
            (`prefill_layers.prefill`).

    Returns:
        PrefillStats with the time and MLX peak memory of the prefill.
    """
    import mlx.core as mx

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache import turbo

    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")
    mx.reset_peak_memory()
    start = time.perf_counter()
    total = len(tokens)
    start_offset = getattr(cache[0], "offset", 0) if cache else 0  # a prefix already cached
    bounds = []
    lo = 0
    while lo < total:
        hi = min(total, lo + chunk_at(start_offset + lo, chunk, pairs))
        bounds.append((lo, hi))
        lo = hi
    for c in cache:  # the compressed layers bound what a chunk keeps queued (`turbo.sync`)
        if isinstance(c, turbo.TurboQuantCache):
            c.inflight, c.queue_every = inflight, queue_every
    times = None  # on a GPU, an empty compressed cache fills layer by layer (`prefill_layers`)
    if total and prefill_layers.applies(model, cache, order):
        times = prefill_layers.prefill(
            model,
            tokens,
            cache,
            bounds,
            progress,
            pairs,
            layer_inflight=layer_inflight,
            group_tokens=group_tokens,
            layer_call_tokens=layer_call_tokens,
        )
    if times is None:
        times = []
        for lo, hi in bounds:
            t = time.perf_counter()
            piece = mx.array(tokens[lo:hi], dtype=mx.int32)[None]  # (1, T)
            model(piece, cache=cache)  # logits stay an unevaluated graph node
            mx.eval(_cache_arrays(cache))
            turbo.drain()  # the chunk's queued layers are done
            times.append(time.perf_counter() - t)
            if progress:
                progress(hi, total)
    mx.synchronize()
    return PrefillStats(total, time.perf_counter() - start, mx.get_peak_memory(), max(times, default=0.0), tuple(times))


STEPWISE_MAX = 64  # the longest prompt `question_stepwise` feeds one token at a time


def stepwise(tokens: list[int], cache: list, mode: str = "auto") -> bool:
    """Whether `token_stream` feeds `tokens` through `cache` one at a time (its
    `question_stepwise`): a prompt of 2 to STEPWISE_MAX tokens over a compressed cache that holds
    tokens, on CUDA (`auto`), anywhere (`1`) or never (`0`). On CUDA a kernel compiles the first time its variant is met (then
    it is kept on disk: `runtime.cuda_kernels`), and a batched question's decode-attend kernel and
    split combine take its row count as constants, one variant per question length; single
    tokens need only the decode step's kernel, met by every question
    (`benchmarks/diagnostics/first_step.py`)."""
    if mode not in ("0", "auto", "1"):
        raise ValueError(f"question_stepwise is one of 0, auto, 1, got {mode!r}")
    if mode == "0" or not 1 < len(tokens) <= STEPWISE_MAX:
        return False
    if mode == "auto":
        # deferred: loads mlx.core (the light commands start without it)
        from longctx.kernels import backend

        if backend() != "cuda":
            return False
    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache.turbo import TurboQuantCache

    return any(isinstance(c, TurboQuantCache) and c.offset > 0 for c in cache)


def token_stream(
    model,
    tokens: list[int],
    cache: list,
    max_tokens: int,
    temperature: float = 0.0,
    stop: frozenset | set = frozenset(),
    question_stepwise: str = "auto",
) -> Iterator[int]:
    """Token ids decoded after `tokens` (appended to `cache`), greedy or sampled, up to a stop id.

    Each step's successor is queued (`mx.async_eval`) before the step's token is read, so on a
    GPU the next forward pass runs while the caller handles the current token (as mlx-lm's
    generate_step does). A stop id ends the stream without being yielded. A long prompt is
    prefilled in chunks; a short one over a compressed cache may go one token at a time
    (`stepwise`, in its mode `question_stepwise`; never on a pipeline stage, where each token's
    send must be evaluated with its logits).
    """
    import mlx.core as mx

    if not tokens:
        raise ValueError("token_stream needs at least one prompt token")
    if len(tokens) > DEFAULT_CHUNK:  # long prompts: chunked like any prefill, last token below
        prefill(model, tokens[:-1], cache)
        tokens = tokens[-1:]
    elif stepwise(tokens, cache, question_stepwise) and not pipelined(
        model
    ):  # one token at a time, as decoding runs (their logits unused)
        for t in tokens[:-1]:
            model(mx.array([[t]], dtype=mx.int32), cache=cache)
        tokens = tokens[-1:]

    def step(ids: mx.array) -> mx.array:
        logits = model(ids, cache=cache)[:, -1, :]
        if temperature == 0:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(logits.astype(mx.float32) * (1.0 / temperature))

    y = step(mx.array(tokens, dtype=mx.int32)[None])
    mx.async_eval(y)
    for n in range(max_tokens):
        nxt = None
        if n + 1 < max_tokens:
            nxt = step(y.reshape(1, 1))
            mx.async_eval(nxt)
        token = int(y.item())
        if token in stop:
            return
        yield token
        y = nxt


def generate(
    model, tokenizer, tokens: list[int], cache: list, max_tokens: int = 256, temperature: float = 0.0, seed: int | None = None
) -> Iterator[str]:
    """Decode an answer after `tokens`, which are appended to `cache`; yields text pieces.

    Args:
        tokenizer: anything with `decode(ids) -> str` and `eos_token_ids` (mlx-lm's wrapper,
            or `longctx.runtime.light.TextTokenizer`).
        tokens: the suffix (question) tokens; the cache already holds everything before them.
        cache: a cache positioned at the end of the prefix (use a fork to keep the parent clean).
        max_tokens: the most tokens to generate.
        temperature: 0 for greedy decoding.
        seed: seeds the sampler when temperature > 0.
    """
    import mlx.core as mx

    if seed is not None:
        mx.random.seed(seed)
    stop = frozenset(getattr(tokenizer, "eos_token_ids", None) or ())
    ids: list[int] = []
    shown = text = ""
    for token in token_stream(model, tokens, cache, max_tokens, temperature, stop):
        ids.append(token)
        text = tokenizer.decode(ids)
        # Hold back a trailing partial UTF-8 sequence, and anything a later token re-renders.
        if text.endswith("\ufffd") or not text.startswith(shown):
            continue
        if len(text) > len(shown):
            yield text[len(shown) :]
            shown = text
    if text.startswith(shown) and len(text) > len(shown):  # what was held back at the end
        yield text[len(shown) :]


def greedy_tokens(model, tokens: list[int], cache: list, n: int, question_stepwise: str = "auto") -> list[int]:
    """The first `n` greedy token ids after `tokens` (used to compare cached and fresh runs)."""
    return list(token_stream(model, tokens, cache, n, question_stepwise=question_stepwise))
