"""engine.prefill's statistics: the longest single chunk evaluation (the Metal watchdog's unit)."""

from __future__ import annotations

import time

import mlx.core as mx

from longctx import engine, kvcache
from longctx.runtime import models


class _Layer:
    def __init__(self):
        self.state = mx.zeros((1,))


class _SlowChunkModel:
    """Stands in for a model: the third forward pass takes `delay` seconds, the others none."""

    def __init__(self, delay: float):
        self.delay, self.calls = delay, 0

    def __call__(self, ids, cache):
        self.calls += 1
        if self.calls == 3:
            time.sleep(self.delay)
        for layer in cache:
            layer.state = layer.state + ids.shape[1]
        return ids


def test_max_eval_seconds_is_the_longest_chunk_not_the_mean():
    model = _SlowChunkModel(0.3)
    cache = [_Layer(), _Layer()]
    stats = engine.prefill(model, list(range(10 * 16)), cache, chunk=16)
    assert model.calls == 10 and stats.tokens == 160
    assert 0.3 <= stats.max_eval_seconds < 0.3 + 0.25
    assert stats.max_eval_seconds <= stats.seconds
    assert cache[0].state.item() == 160  # every chunk's state was evaluated
    assert len(stats.chunk_seconds) == 10 and max(stats.chunk_seconds) == stats.max_eval_seconds
    assert stats.max_steady_eval_seconds == stats.max_eval_seconds  # the third chunk is steady


def test_the_steady_maximum_leaves_out_the_first_two_chunks_and_the_last():
    for slow in (1, 2, 10):  # compiling chunks: the first, the first with a prefix, the tail
        model = _SlowChunkModel(0.0)
        model.__class__ = type("Slow", (_SlowChunkModel,), {"__call__": _slow_at(slow)})
        stats = engine.prefill(model, list(range(10 * 16)), [_Layer()], chunk=16)
        assert stats.max_eval_seconds >= 0.2 and stats.max_steady_eval_seconds < 0.2, slow


def _slow_at(n: int):
    def call(self, ids, cache):
        self.calls += 1
        if self.calls == n:
            time.sleep(0.2)
        for layer in cache:
            layer.state = layer.state + ids.shape[1]
        return ids
    return call


def test_max_eval_seconds_of_a_real_prefill(tiny_model):
    lm = models.load(models.resolve(str(tiny_model)))
    cache = kvcache.make(lm.model, kvcache.get_preset("fp16"))
    stats = engine.prefill(lm.model, list(range(3, 200)), cache, chunk=64)
    assert 0 < stats.max_eval_seconds <= stats.seconds
    assert cache[0].offset == 197
