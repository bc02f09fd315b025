"""Chunked prefill into a cache and streaming decode from it.

Prefill runs the model over the prompt in chunks and evaluates only the cache state: MLX is lazy,
so the LM-head matmul built for each chunk is never computed (no logits for prompt positions),
the same trick mlx-lm's `generate_step` uses. Decode goes through mlx-lm's `stream_generate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

Progress = Callable[[int, int], None]
DEFAULT_CHUNK = 512


@dataclass(frozen=True)
class PrefillStats:
    tokens: int
    seconds: float
    peak_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def _cache_arrays(cache: list) -> list:
    return [c.state for c in cache]


def prefill(model, tokens: list[int], cache: list, chunk: int = DEFAULT_CHUNK,
            progress: Progress | None = None) -> PrefillStats:
    """Run `tokens` through `model`, filling `cache` (mlx-lm cache protocol), chunk by chunk.

    Args:
        model: an mlx-lm model.
        tokens: prompt token ids.
        cache: one cache object per layer (from `longctx.kvcache.make`).
        chunk: tokens per forward pass; bounds the attention scores' memory (chunk × length).
        progress: `progress(done, total)` after every chunk.

    Returns:
        PrefillStats with the time and MLX peak memory of the prefill.
    """
    import mlx.core as mx

    mx.reset_peak_memory()
    start = time.perf_counter()
    total = len(tokens)
    for lo in range(0, total, chunk):
        piece = mx.array(tokens[lo : lo + chunk], dtype=mx.int32)[None]  # (1, T)
        model(piece, cache=cache)  # logits stay an unevaluated graph node
        mx.eval(_cache_arrays(cache))
        if progress:
            progress(min(lo + chunk, total), total)
    mx.synchronize()
    return PrefillStats(total, time.perf_counter() - start, mx.get_peak_memory())


def generate(model, tokenizer, tokens: list[int], cache: list, max_tokens: int = 256,
             temperature: float = 0.0, seed: int | None = None) -> Iterator[str]:
    """Decode an answer after `tokens`, which are appended to `cache`; yields text pieces.

    Args:
        tokens: the suffix (question) tokens; the cache already holds everything before them.
        cache: a cache positioned at the end of the prefix (use a fork to keep the parent clean).
        max_tokens: the most tokens to generate.
        temperature: 0 for greedy decoding.
        seed: seeds the sampler when temperature > 0.
    """
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp=temperature)
    prompt = mx.array(tokens, dtype=mx.int32)
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                     sampler=sampler, prompt_cache=cache):
        if response.text:
            yield response.text


def greedy_tokens(model, tokens: list[int], cache: list, n: int) -> list[int]:
    """The first `n` greedy token ids after `tokens` (used to compare cached and fresh runs)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    prompt = mx.array(tokens, dtype=mx.int32)
    for token, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache,
                                  sampler=lambda logp: mx.argmax(logp, axis=-1)):
        out.append(int(token))
    return out
