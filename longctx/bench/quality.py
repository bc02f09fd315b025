"""Compression quality on one long prefix, prefilled once for every preset.

An ingest that compresses layer by layer (`longctx.prefill_layers`, the path of every compressed
ingest) attends each layer's keys and values exactly and then stores their compression, chunk by
chunk (`TurboQuantCache.absorb`). So one uncompressed prefill of a document yields the cache that
ingesting it would store under every preset: `compressed` absorbs the uncompressed prefill's
keys and values as ingest does. On a 2-core CPU that turns a 16k-token comparison of eight
presets from eight prefills (hours) into one.

- `answer_scores`: teacher-forced continuation of the prefix from an answering fork of each
  preset (`kvcache.fork`, as `ask` answers): KL(fp16 || preset), perplexity and top-1 agreement
  over the continuation's tokens.
- `ask`: a question's greedy answer from a fork of a cache (the needle-in-a-haystack questions).

References: RULER (Hsieh et al., 2024) for needles and scoring; TurboQuant (Zandieh et al., 2025)
for the quality claim measured here.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from longctx import engine, kvcache

Progress = Callable[[int, int], None]


def prefill_exact(
    model, tokens: list[int], chunk: int = engine.DEFAULT_CHUNK, progress: Progress | None = None
) -> tuple[list, float]:
    """The uncompressed cache (the `fp16` preset: the model's dtype) of `tokens`, and its seconds."""
    cache = kvcache.make(model, kvcache.get_preset("fp16"))
    stats = engine.prefill(model, tokens, cache, chunk=chunk, progress=progress)
    return cache, stats.seconds


def compressed(model, exact: list, preset, chunk: int = engine.DEFAULT_CHUNK, upto: int | None = None) -> list:
    """The sealed cache an ingest under `preset` stores for the prefix `exact` holds (its first
    `upto` tokens: the exact cache of a shorter prefix is a truncation of a longer one's)."""
    import mlx.core as mx

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache.turbo import TurboQuantCache

    preset_ = kvcache.get_preset(preset) if isinstance(preset, str) else preset
    cache = kvcache.make(model, preset_)
    for src, dst in zip(exact, cache):
        n = src.offset if upto is None else min(upto, src.offset)
        keys, values = src.keys[..., :n, :], src.values[..., :n, :]
        if isinstance(dst, TurboQuantCache):
            for lo in range(0, n, chunk):
                mx.eval(dst.absorb(keys[..., lo : lo + chunk, :], values[..., lo : lo + chunk, :]) + dst.state)
        else:  # mlx-lm's own caches (affine presets, sliding windows) take the prefix whole
            dst.update_and_fetch(keys, values)
            mx.eval(dst.state)
    kvcache.seal(cache)
    # what a restore from the entry's file yields (the arrays), prepared for answers as
    # `session.restore` prepares it (on the CPU: the prefix decoded once)
    dtype = next(c for c in exact if hasattr(c, "keys")).keys.dtype
    cache = kvcache.from_arrays(kvcache.to_arrays(cache, preset_), model, preset_, dtype)
    mx.eval([c.state for c in cache])
    if mx.default_device().type == mx.DeviceType.cpu:
        kvcache.decode_once(cache)
    return cache


def _logp(model, tokens: list[int], cache: list):
    import mlx.core as mx

    logits = model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)  # (T, V)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def answer_scores(
    model, caches: dict[str, list | Callable[[], list]], continuation: list[int], step: int = 16, ref: list | None = None
) -> dict:
    """Per preset: ppl, KL(reference || preset), top-1 agreement over `continuation[1:]`,
    teacher-forced in steps of `step` tokens (a question and its answer) from an answering fork of
    each cache, or from the fresh cache a function builds (caches `kvcache.fork` cannot fork).

    The reference is the first preset's log-probs, appended to `ref`; pass an earlier call's `ref`
    to score more caches against the same reference.
    """
    import mlx.core as mx

    inputs, targets = continuation[:-1], mx.array(continuation[1:])
    ref = [] if ref is None else ref
    out = {}
    for name, cache in caches.items():
        fork = cache() if callable(cache) else kvcache.fork(cache)
        nll = kl = 0.0
        top1 = 0
        start = time.perf_counter()
        for j, lo in enumerate(range(0, len(inputs), step)):
            logp = _logp(model, inputs[lo : lo + step], fork)
            mx.eval(logp)
            if j == len(ref):
                ref.append(logp)
            t = targets[lo : lo + step]
            nll += float(-mx.take_along_axis(logp, t[:, None], axis=-1).sum())
            kl += float((mx.exp(ref[j]) * (ref[j] - logp)).sum())
            top1 += int((ref[j].argmax(-1) == logp.argmax(-1)).sum())
        n = len(inputs)
        out[name] = {"ppl": math.exp(nll / n), "kl": kl / n, "top1": top1 / n, "seconds": time.perf_counter() - start}
    return out


def ask(model, tokenizer, cache: list, suffix: list[int], max_tokens: int) -> str:
    """The greedy answer to a question (its suffix tokens) from a fork of `cache`."""
    return "".join(engine.generate(model, tokenizer, suffix, kvcache.fork(cache), max_tokens=max_tokens))
