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

from longctx.chunking import DEFAULT_CHUNK, MIN_CHUNK, chunk_at  # noqa: F401  (engine.chunk_at)

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


def prefill(model, tokens: list[int], cache: list, chunk: int = DEFAULT_CHUNK,
            progress: Progress | None = None, pairs: int | None = None) -> PrefillStats:
    """Run `tokens` through `model`, filling `cache` (mlx-lm cache protocol), chunk by chunk.

    Args:
        model: an mlx-lm model.
        tokens: prompt token ids.
        cache: one cache object per layer (from `longctx.kvcache.make`).
        chunk: tokens per forward pass; bounds the attention scores' memory (chunk × length).
        progress: `progress(done, total)` after every chunk.
        pairs: past this many query-key pairs per chunk and head, chunks shrink (`chunk_at`;
            None: the `prefill_pairs` setting; 0: always `chunk`).

    Returns:
        PrefillStats with the time and MLX peak memory of the prefill.
    """
    import mlx.core as mx

    from longctx import prefill_layers
    from longctx.kvcache import turbo

    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")
    mx.reset_peak_memory()
    start = time.perf_counter()
    total = len(tokens)
    if pairs is None:
        from longctx import config

        pairs = config.get("prefill_pairs")
    start_offset = getattr(cache[0], "offset", 0) if cache else 0  # a prefix already cached
    bounds = []
    lo = 0
    while lo < total:
        hi = min(total, lo + chunk_at(start_offset + lo, chunk, pairs))
        bounds.append((lo, hi))
        lo = hi
    times = None  # on a GPU, an empty compressed cache fills layer by layer (`prefill_layers`)
    if total and prefill_layers.applies(model, cache):
        times = prefill_layers.prefill(model, tokens, cache, bounds, progress, pairs)
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
    return PrefillStats(total, time.perf_counter() - start, mx.get_peak_memory(),
                        max(times, default=0.0), tuple(times))


STEPWISE_MAX = 64  # the longest prompt `question_stepwise` feeds one token at a time


def stepwise(tokens: list[int], cache: list) -> bool:
    """Whether `token_stream` feeds `tokens` through `cache` one at a time (`question_stepwise`):
    a prompt of 2 to STEPWISE_MAX tokens over a compressed cache that holds tokens, on CUDA
    (`auto`) or anywhere (`1`). On CUDA a kernel compiles the first time its variant is met (then
    it is kept on disk: `runtime.cuda_kernels`), and a batched question's decode-attend kernel and
    split combine take its row count as constants, one variant per question length; single
    tokens need only the decode step's kernel, met by every question
    (`benchmarks/diagnostics/first_step.py`)."""
    from longctx import config

    mode = config.get("question_stepwise")
    if mode == "0" or not 1 < len(tokens) <= STEPWISE_MAX:
        return False
    if mode == "auto":
        from longctx.kernels import backend

        if backend() != "cuda":
            return False
    from longctx.kvcache.turbo import TurboQuantCache

    return any(isinstance(c, TurboQuantCache) and c.offset > 0 for c in cache)


def token_stream(model, tokens: list[int], cache: list, max_tokens: int, temperature: float = 0.0,
                 stop: frozenset | set = frozenset()) -> Iterator[int]:
    """Token ids decoded after `tokens` (appended to `cache`), greedy or sampled, up to a stop id.

    Each step's successor is queued (`mx.async_eval`) before the step's token is read, so on a
    GPU the next forward pass runs while the caller handles the current token (as mlx-lm's
    generate_step does). A stop id ends the stream without being yielded. A long prompt is
    prefilled in chunks; a short one over a compressed cache may go one token at a time
    (`stepwise`).
    """
    import mlx.core as mx

    if not tokens:
        raise ValueError("token_stream needs at least one prompt token")
    if len(tokens) > DEFAULT_CHUNK:  # long prompts: chunked like any prefill, last token below
        prefill(model, tokens[:-1], cache)
        tokens = tokens[-1:]
    elif stepwise(tokens, cache):  # one token at a time, as decoding runs (their logits unused)
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


def generate(model, tokenizer, tokens: list[int], cache: list, max_tokens: int = 256,
             temperature: float = 0.0, seed: int | None = None) -> Iterator[str]:
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
            yield text[len(shown):]
            shown = text
    if text.startswith(shown) and len(text) > len(shown):  # what was held back at the end
        yield text[len(shown):]


def greedy_tokens(model, tokens: list[int], cache: list, n: int) -> list[int]:
    """The first `n` greedy token ids after `tokens` (used to compare cached and fresh runs)."""
    return list(token_stream(model, tokens, cache, n))
