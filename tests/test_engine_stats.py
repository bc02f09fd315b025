"""engine.prefill's statistics: the longest single chunk evaluation (the Metal watchdog's unit)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

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


def test_chunks_shrink_past_the_pair_bound():
    """With a query-key pair bound, chunks shrink as the cache grows (in steps of MIN_CHUNK,
    never below it); without one (the default) they stay whole."""
    assert [engine.chunk_at(d, 512, 0) for d in (0, 10**6)] == [512, 512]
    assert engine.chunk_at(131000, 512) == 512  # the default setting: fixed chunks
    pairs = 5 * 2**22
    assert [engine.chunk_at(d, 512, pairs) for d in (0, 32768, 65536, 131000, 10**6)] == [512, 512, 256, 128, 64]
    for done in range(0, 300000, 7919):
        n = engine.chunk_at(done, 512, pairs)
        assert n % engine.MIN_CHUNK == 0 and (n == 64 or n * (done + n) <= pairs)


class _Offset:
    def __init__(self, offset=0):
        self.offset, self.state = offset, mx.zeros((1,))


def test_prefill_walks_the_shrinking_chunks_from_the_cached_offset():
    """The bound counts the tokens already cached (a segment or a question after a prefix)."""
    sizes = []

    def model(ids, cache):
        sizes.append(ids.shape[1])
        for layer in cache:
            layer.offset += ids.shape[1]
        return ids

    cache = [_Offset(1000)]
    stats = engine.prefill(model, list(range(3000)), cache, chunk=512, pairs=512 * 1536)
    assert sum(sizes) == 3000 and stats.tokens == 3000 and len(stats.chunk_seconds) == len(sizes)
    done = 1000
    for n in sizes[:-1]:
        assert n == engine.chunk_at(done, 512, 512 * 1536)
        done += n
    assert sizes[0] == 512 and sizes[-2] < 512


def test_a_pair_bound_prefill_fills_the_same_cache(tiny_model):
    """Shrinking chunks change only how the prompt is cut: the cached keys are the same."""
    lm = models.load(models.resolve(str(tiny_model)))
    ids = [3 + i % 200 for i in range(397)]  # ids within the tiny model's vocabulary
    caches = []
    for pairs in (0, 64 * 128):
        cache = kvcache.make(lm.model, kvcache.get_preset("fp16"))
        engine.prefill(lm.model, ids, cache, chunk=128, pairs=pairs)
        caches.append(cache)
    for a, b in zip(*caches):
        assert a.offset == b.offset == len(ids)
        for x, y in zip(a.state[:2], b.state[:2]):  # keys, values: their first `offset` rows
            x, y = x[:, :, : a.offset], y[:, :, : b.offset]
            err = (mx.linalg.norm((x - y).flatten()) / mx.linalg.norm(y.flatten())).item()
            assert err < 1e-5, err


def _count_queueing(monkeypatch) -> tuple[list, list]:
    """The in-flight bound as on a GPU, with its queueing and waits recorded: ([arrays per
    `mx.async_eval`], [arrays per wait]), cleared by the caller between prefills."""
    from collections import deque

    from longctx.kvcache import turbo

    queued, waited = [], []
    monkeypatch.setattr(turbo, "_PENDING", deque())
    monkeypatch.setattr(turbo, "_on_gpu", lambda: True)
    monkeypatch.setattr(turbo, "_queue", lambda *a: (queued.append(len(a)), mx.async_eval(*a)))
    monkeypatch.setattr(turbo, "_wait", lambda *a: (waited.append(len(a)), mx.eval(*a)))
    return queued, waited


def test_the_inflight_bound_waits_for_older_layers_and_changes_nothing(tiny_model, monkeypatch):
    """`inflight`: on a GPU a compressed prefill queues each layer's incoming keys once the
    cache holds compressed tokens and waits for older layers past the byte budget (1 byte: every
    layer but the newest; a huge one: none); no budget, no queueing; the same cache."""
    from longctx.kvcache import turbo

    lm = models.load(models.resolve(str(tiny_model)))
    ids = [3 + i % 200 for i in range(397)]
    queued, waited = _count_queueing(monkeypatch)
    caches = []
    for budget in (0, 1, 2**40):
        queued.clear()
        waited.clear()
        cache = kvcache.make(lm.model, kvcache.get_preset("tq4"))
        engine.prefill(
            lm.model, ids, cache, chunk=128, inflight=budget, queue_every=1, order="token"
        )  # the chunk-by-chunk loop's bound
        caches.append(cache)
        assert not turbo._PENDING  # drained after every chunk
        if budget == 0:
            assert queued == [] and waited == []
            continue
        # at most once per layer and chunk, two arrays (keys, values) each
        assert queued and len(queued) % len(cache) == 0 and set(queued) == {2}
        assert len(queued) < -(-len(ids) // 128) * len(cache)
        # 1 byte: each chunk waits for all its queued layers but the newest
        chunks = len(queued) // len(cache)
        assert len(waited) == (len(queued) - chunks if budget == 1 else 0)
    for other in caches[1:]:
        for a, b in zip(caches[0], other):
            assert a.offset == b.offset == len(ids)
            for (ka, va, la), (kb, vb, lb) in zip(a.view().segments, b.view().segments):
                assert la == lb
                for name in ka:
                    assert mx.array_equal(ka[name], kb[name]) and mx.array_equal(va[name], vb[name])
    # decode steps past the window's cap (its 128 slots are full) take the fused kernel: they
    # never queue nor wait (the cache keeps its prefill's 1-byte bound)
    assert caches[1][0].window_len == caches[1][0].window_cap
    assert caches[1][0].inflight == 1
    queued.clear()
    for t in range(3):
        lm.model(mx.array([[5 + t]]), cache=caches[1])
        assert queued == []


def test_the_inflight_bound_queues_every_few_layers(tiny_model, monkeypatch):
    """`queue_every` k: a compressed prefill chunk queues its graph at every k-th layer only
    (each `mx.async_eval` costs host time), waits for older layers past the byte budget as
    before, and stores the same cache as queueing at every layer."""
    from longctx.kvcache import turbo

    lm = models.load(models.resolve(str(tiny_model)))
    ids = [3 + i % 200 for i in range(397)]
    queued, waited = _count_queueing(monkeypatch)
    caches, counts = [], []
    for every in (1, 3):
        for budget in (2**40, 1):
            queued.clear()
            waited.clear()
            cache = kvcache.make(lm.model, kvcache.get_preset("tq4"))
            engine.prefill(lm.model, ids, cache, chunk=128, inflight=budget, queue_every=every)
            assert not turbo._PENDING
            caches.append(cache)
            counts.append((len(queued), len(waited)))
    layers = len(caches[0])
    chunks = counts[0][0] // layers  # chunks that queue (a compressed prefix exists)
    assert counts[0] == (chunks * layers, 0)
    assert counts[2] == (chunks * (layers // 3), 0)  # every third layer of each chunk
    # a 1-byte budget still waits for every layer but the newest of each chunk
    assert counts[1][1] == counts[3][1] == chunks * (layers - 1)
    for c in caches[1:]:
        for a, b in zip(c, caches[0]):
            for x, y in zip(a.state, b.state):
                assert mx.array_equal(x, y)


def _stepwise_case(tiny_model):
    lm = models.load(models.resolve(str(tiny_model)))
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 200, size=600).tolist()
    question = rng.integers(3, 200, size=12).tolist()
    cache = kvcache.make(lm.model, kvcache.get_preset("tq4"))
    engine.prefill(lm.model, prefix, cache)
    kvcache.seal(cache)
    return lm, cache, question


def test_stepwise_is_chosen_for_short_prompts_over_a_filled_compressed_cache(tiny_model):
    from longctx.kernels import backend

    lm, cache, question = _stepwise_case(tiny_model)
    fp16 = kvcache.make(lm.model, kvcache.get_preset("fp16"))
    engine.prefill(lm.model, question, fp16)
    assert engine.stepwise(question, cache, "1")
    assert not engine.stepwise(question[:1], cache, "1")  # one token: nothing to step through
    assert not engine.stepwise(question * 6, cache, "1")  # 72 > STEPWISE_MAX
    assert not engine.stepwise(question, fp16, "1")  # no compressed layer
    assert not engine.stepwise(question, kvcache.make(lm.model, kvcache.get_preset("tq4")), "1")
    assert engine.stepwise(question, cache) == (backend() == "cuda")  # "auto": CUDA only
    assert not engine.stepwise(question, cache, "0")


def test_a_question_fed_token_by_token_answers_as_the_batched_one(tiny_model):
    """The question's tokens one at a time (`question_stepwise`) leave the same cache (offsets,
    exact window within rounding) and give the same greedy answer as one batched pass."""
    lm, cache, question = _stepwise_case(tiny_model)
    got, want = kvcache.fork(cache), kvcache.fork(cache)
    lengths = []

    def model(ids, cache):  # the model, recording each call's token count
        lengths.append(ids.shape[1])
        return lm.model(ids, cache=cache)

    a = engine.greedy_tokens(model, question, got, 8, question_stepwise="1")
    assert lengths == [1] * (12 + 7)
    lengths.clear()
    b = engine.greedy_tokens(model, question, want, 8, question_stepwise="0")
    assert lengths == [12] + [1] * 7
    assert a == b
    for x, y in zip(got, want):
        assert x.offset == y.offset == 600 + 12 + 7  # the answer's tokens but its last
        kx, vx = x.window
        ky, vy = y.window
        assert kx.shape == ky.shape
        np.testing.assert_allclose(np.array(kx), np.array(ky), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(vx), np.array(vy), rtol=1e-4, atol=1e-4)
