"""Layer-major prefill (`longctx.prefill_layers`): what it stores, when it runs, what it restores."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from longctx import engine, kvcache, prefill_layers
from longctx.runtime import models

from conftest import make_tiny_model
from families import COMPRESSED

CHUNK = 96  # several chunks, the last one short


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-3", layers=3, attn_gain=2.0)
    return models.load(models.resolve(str(path)))


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 200, n).tolist()


def _arrays(cache: list, preset) -> dict:
    kvcache.seal(cache)
    return {k: np.array(v.astype(mx.float32)) for k, v in kvcache.to_arrays(cache, preset).items()}


def _prefill(model, tokens, preset, order: str, progress=None, pairs=0, layer_call_tokens=0, **options):
    """A prefill in CHUNK's chunks, `order` first. These tests hold the layer-major loop to the
    chunk-by-chunk oracle below: one layer call per chunk (`layer_call_tokens` 0). Runs of
    chunks, the default's included, are tested by
    `test_longer_layer_calls_store_what_an_fp16_prefill_in_those_calls_makes` and
    `test_the_default_calls_store_what_an_fp16_prefill_in_those_calls_makes`."""
    cache = kvcache.make(model, preset)
    stats = engine.prefill(
        model,
        tokens,
        cache,
        chunk=CHUNK,
        progress=progress,
        pairs=pairs,
        order=order,
        layer_call_tokens=layer_call_tokens,
        **options,
    )
    return cache, stats


def _fp16_then_compressed(model, tokens, preset, pairs=0, fp16_chunk=CHUNK):
    """The oracle: an fp16 prefill (token-major, exact attention; in chunks of `fp16_chunk`),
    then each layer's keys and values appended to a fresh compressed cache in CHUNK's chunks,
    as the model's own calls append them (`update_and_fetch`, not the `absorb` under test)."""
    exact = kvcache.make(model, kvcache.get_preset("fp16"))
    engine.prefill(model, tokens, exact, chunk=fp16_chunk, pairs=pairs, order="token")
    cache = kvcache.make(model, preset)
    bounds, lo = [], 0
    while lo < len(tokens):
        hi = min(len(tokens), lo + engine.chunk_at(lo, CHUNK, pairs))
        bounds.append((lo, hi))
        lo = hi
    for c, e in zip(cache, exact):
        k, v = e.keys[..., : e.offset, :], e.values[..., : e.offset, :]
        for lo, hi in bounds:
            c.update_and_fetch(k[:, :, lo:hi], v[:, :, lo:hi])
    return cache


@pytest.mark.parametrize("name", ["tq4", "rvq2+2"])
def test_layer_major_stores_the_compression_of_the_fp16_prefills_keys(lm, name):
    preset = kvcache.get_preset(name)
    tokens = _tokens(5 * CHUNK + 37)
    layered, _ = _prefill(lm.model, tokens, preset, "layer")
    want = _arrays(_fp16_then_compressed(lm.model, tokens, preset), preset)
    got = _arrays(layered, preset)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # and it is not what the token-major loop stores (its later layers' keys come from the
    # earlier layers' compressed attention): the test tells the two paths apart
    tokenwise = _arrays(_prefill(lm.model, tokens, preset, "token")[0], preset)
    assert any(not np.array_equal(tokenwise[k], want[k]) for k in want if k.startswith("1."))


def test_layer_major_answers_as_its_oracle_cache_does(lm):
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(4 * CHUNK)
    layered, _ = _prefill(lm.model, tokens, preset, "layer")
    oracle = _fp16_then_compressed(lm.model, tokens, preset)
    question = _tokens(9, seed=1)
    got = engine.greedy_tokens(lm.model, question, kvcache.fork(layered), 12)
    want = engine.greedy_tokens(lm.model, question, kvcache.fork(oracle), 12)
    assert got == want and len(got) == 12


def test_layer_major_keeps_the_chunks_the_pairs_bound_cuts(lm):
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(6 * CHUNK)
    pairs = CHUNK * 3 * CHUNK  # chunks shrink past 2 chunks of prefix
    layered, _ = _prefill(lm.model, tokens, preset, "layer", pairs=pairs)
    want = _arrays(_fp16_then_compressed(lm.model, tokens, preset, pairs=pairs), preset)
    got = _arrays(layered, preset)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_progress_reaches_the_total_and_never_goes_back(lm):
    seen = []
    tokens = _tokens(5 * CHUNK + 3)
    _prefill(
        lm.model,
        tokens,
        kvcache.get_preset("tq4"),
        "layer",
        progress=lambda done, total: seen.append((done, total)),
        group_tokens=2 * CHUNK,
    )
    assert seen[-1] == (len(tokens), len(tokens))
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    # three layers of six chunks, queued every two chunks: nine reports
    assert len(seen) == 9


def test_the_layers_list_is_restored_even_when_progress_raises(lm):
    layers = list(lm.model.layers)

    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _prefill(lm.model, _tokens(3 * CHUNK), kvcache.get_preset("tq4"), "layer", progress=stop)
    assert all(a is b for a, b in zip(lm.model.layers, layers))
    assert len(lm.model.layers) == len(layers)


class _Bypass:
    """A model whose call does not run through its `layers` list (a copy of it)."""

    def __init__(self, model):
        self.model, self.layers = model, list(model.layers)
        self._own = list(model.layers)

    def __call__(self, ids, cache=None):
        inner = self.model.model
        h = inner.embed_tokens(ids)
        mask = "causal" if ids.shape[1] > 1 else None
        for layer, c in zip(self._own, cache):
            h = layer(h, mask, cache=c)
        return inner.embed_tokens.as_linear(inner.norm(h))


def test_a_model_that_bypasses_its_layers_list_gets_the_token_major_loop(lm):
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(3 * CHUNK)
    bypass = _Bypass(lm.model)
    layers = list(bypass.layers)
    got = _arrays(_prefill(bypass, tokens, preset, "layer")[0], preset)
    assert all(a is b for a, b in zip(bypass.layers, layers))  # restored after the probe
    want = _arrays(_prefill(lm.model, tokens, preset, "token")[0], preset)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_when_it_applies(lm, monkeypatch):
    model = lm.model
    tq4, fp16 = kvcache.get_preset("tq4"), kvcache.get_preset("fp16")
    assert prefill_layers.applies(model, kvcache.make(model, tq4))  # "layer", the default
    assert prefill_layers.applies(model, kvcache.make(model, tq4), "layer")
    assert not prefill_layers.applies(model, kvcache.make(model, fp16), "layer")
    filled = kvcache.make(model, tq4)
    engine.prefill(model, _tokens(CHUNK), filled, chunk=CHUNK, layer_call_tokens=0)
    assert not prefill_layers.applies(model, filled, "layer")  # a cached prefix: token-major
    assert not prefill_layers.applies(model, kvcache.make(model, tq4), "token")
    monkeypatch.setattr("longctx.kernels.backend", lambda: "cpu")
    assert not prefill_layers.applies(model, kvcache.make(model, tq4), "auto")
    monkeypatch.setattr("longctx.kernels.backend", lambda: "cuda")
    assert prefill_layers.applies(model, kvcache.make(model, tq4), "auto")
    with pytest.raises(ValueError, match="order"):
        prefill_layers.applies(model, kvcache.make(model, tq4), "sideways")


ON_GPU = __import__("longctx.kernels", fromlist=["backend"]).backend() in ("metal", "cuda")


@pytest.mark.skipif(not ON_GPU, reason="needs a Metal or CUDA device")
@pytest.mark.parametrize("name", ["tq4", "tq4k3v"])
def test_gpu_layer_major_is_the_default_and_stores_the_fp16_prefills_keys(lm, name):
    """On a GPU the default order is layer-major; its kernels (the fused encode, SDPA over the
    staging cache) store the oracle's codes up to the last bit of a rounding tie."""
    preset = kvcache.get_preset(name)
    tokens = _tokens(5 * CHUNK + 37)
    layered, _ = _prefill(lm.model, tokens, preset, "auto")
    want = _arrays(_fp16_then_compressed(lm.model, tokens, preset), preset)
    got = _arrays(layered, preset)
    tokenwise = _arrays(_prefill(lm.model, tokens, preset, "token")[0], preset)
    assert got.keys() == want.keys()
    for k in want:
        if k.endswith("idx"):
            assert np.mean(got[k] == want[k]) > 0.99, k
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-2, atol=2e-2, err_msg=k)
    later = [k for k in want if k.startswith("2.") and k.endswith("idx")]
    assert np.mean([np.mean(got[k] == want[k]) for k in later]) > np.mean([np.mean(tokenwise[k] == want[k]) for k in later])


def test_absorb_spans():
    bounds = [(0, 512), (512, 1024), (1024, 1536), (1536, 2048), (2048, 2100)]
    assert prefill_layers.absorb_spans(bounds, most=1024) == [(0, 512), (512, 1536), (1536, 2100)]
    assert prefill_layers.absorb_spans(bounds, most=100) == bounds
    assert prefill_layers.absorb_spans(bounds[:1]) == bounds[:1]
    assert prefill_layers.absorb_spans([]) == []


def test_absorbing_in_longer_spans_stores_the_same_arrays(lm, monkeypatch):
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(6 * CHUNK + 5)
    want = _arrays(_fp16_then_compressed(lm.model, tokens, preset), preset)  # chunk by chunk
    monkeypatch.setattr(prefill_layers, "ABSORB_TOKENS", 3 * CHUNK)
    got = _arrays(_prefill(lm.model, tokens, preset, "layer")[0], preset)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_the_filled_cache_holds_no_span_buffers(lm):
    """Once filled, a layer-major cache holds no more memory than a token-major one: the window
    is copied out of the spans it was a slice of (the staging keys, the span's centered and
    rotated rows), which a slice would keep alive (2.2x the token-major cache's memory here)."""
    import gc

    preset = kvcache.get_preset("tq4")
    tokens = _tokens(8 * CHUNK)

    def held_by(order: str) -> int:
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        cache, _ = _prefill(lm.model, tokens, preset, order)
        gc.collect()
        mx.clear_cache()
        held = mx.get_active_memory() - before
        del cache
        return held

    # a first pass of each fills what a process keeps (compiled steps, kernels' constant
    # arrays; on the H200 a first token-major pass measured -167 KB, freeing earlier tests')
    for order in ("token", "layer"):
        held_by(order)
    held = {order: held_by(order) for order in ("token", "layer")}
    assert held["token"] > 0, held
    assert held["layer"] <= 1.1 * held["token"], held


@pytest.mark.parametrize("budget, groups_per_layer", [(0, 1), (1, 6)])
def test_the_inflight_bound_cuts_groups_and_waits(lm, monkeypatch, budget, groups_per_layer):
    """No bound (0): one group per layer, nothing waited for until the end. A 1-byte bound: a
    group per chunk, and at most two in flight (the newest and the one being queued). The stored
    arrays are the same either way."""
    queued, waited = [], []
    real_async, real_eval = mx.async_eval, mx.eval
    # (any number of arrays: a module that binds mx.async_eval at its import, as
    # kvcache.turbo does, may bind this stand-in when it is first imported inside this test)
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(len(waited)), real_async(*a))[1])
    monkeypatch.setattr(mx, "eval", lambda *a: (waited.append(1), real_eval(*a))[1])
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(6 * CHUNK)
    got = _prefill(lm.model, tokens, preset, "layer", layer_inflight=budget, group_tokens=10**6)[0]
    assert len(queued) == 3 * groups_per_layer
    if budget:  # when a group is queued, every group but the one before it was waited for
        assert queued == [max(0, i - 1) for i in range(len(queued))]
    else:  # nothing waited for before the last group was queued
        assert queued == [0] * len(queued)
    monkeypatch.setattr(mx, "async_eval", real_async)
    monkeypatch.setattr(mx, "eval", real_eval)
    want = _arrays(_fp16_then_compressed(lm.model, tokens, preset), preset)
    got = _arrays(got, preset)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("n", [1, 7, 129])
def test_short_prompts(lm, n):
    """A prompt of a few tokens (inside the window, or, at 129, just past it and over two
    chunks) stores what the oracle does."""
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(n)
    got = _arrays(_prefill(lm.model, tokens, preset, "layer")[0], preset)
    want = _arrays(_fp16_then_compressed(lm.model, tokens, preset), preset)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("family", sorted(COMPRESSED))
def test_every_family_stores_the_oracles_arrays_or_keeps_the_token_major_loop(family, tmp_path):
    """Every family the compressed presets serve: where every layer is compressed, layer-major
    stores what the oracle does, and is not the token-major loop's result (it ran: e.g. Qwen2's
    `layers` is a new slice at every access, so the stand-ins go in its inner list); families
    with sliding-window layers keep the token-major loop."""
    extra = dict(COMPRESSED[family])
    extra.setdefault("attn_gain", 2.0)
    path = make_tiny_model(tmp_path / family, **extra)
    model = models.load(models.resolve(str(path))).model
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(2 * CHUNK + 5)
    layered = prefill_layers.applies(model, kvcache.make(model, preset), "layer")
    got = _arrays(_prefill(model, tokens, preset, "layer")[0], preset)
    tokenwise = _arrays(_prefill(model, tokens, preset, "token")[0], preset)
    if not layered:
        assert any(type(c).__name__ == "RotatingKVCache" for c in kvcache.make(model, preset))
        for k in tokenwise:
            np.testing.assert_array_equal(got[k], tokenwise[k], err_msg=k)
        return
    want = _arrays(_fp16_then_compressed(model, tokens, preset), preset)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert any(not np.array_equal(tokenwise[k], want[k]) for k in want if k.startswith("1."))


class _TupleBlock:
    """A layer called with keywords that returns a tuple (as hunyuan's and gptj's blocks do)."""

    def __init__(self, layer):
        self.layer, self.self_attn = layer, layer.self_attn

    def __call__(self, *, inputs, mask, cache, shared):
        return self.layer(inputs, mask, cache=cache), shared + 1


class _TupleModel:
    """A model whose loop unpacks (h, shared) from every layer, called with keywords."""

    def __init__(self, model):
        self.inner = model.model
        self.layers = [_TupleBlock(layer) for layer in model.layers]

    def __call__(self, ids, cache=None):
        from mlx_lm.models.base import create_attention_mask

        h = self.inner.embed_tokens(ids)
        mask = create_attention_mask(h, cache[0])
        shared = mx.array(0)
        for layer, c in zip(self.layers, cache):
            h, shared = layer(inputs=h, mask=mask, cache=c, shared=shared)
        return self.inner.embed_tokens.as_linear(self.inner.norm(h)) + 0 * shared


def test_layers_called_with_keywords_that_return_tuples(lm):
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(3 * CHUNK + 11)
    model = _TupleModel(lm.model)
    assert prefill_layers.applies(model, kvcache.make(model, preset), "layer")
    got = _arrays(_prefill(model, tokens, preset, "layer")[0], preset)
    want = _arrays(_fp16_then_compressed(model, tokens, preset), preset)
    tokenwise = _arrays(_prefill(model, tokens, preset, "token")[0], preset)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert any(not np.array_equal(tokenwise[k], want[k]) for k in want if k.startswith("1."))


def _counting(model, monkeypatch) -> list:
    """Every call of `model`'s class, by its token count (the class's __call__ wrapped)."""
    calls, cls = [], type(model)
    plain = cls.__call__

    def counted(self, ids, *args, **kwargs):
        calls.append(ids.shape[1])
        return plain(self, ids, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", counted)
    return calls


def test_past_the_first_layer_the_layers_are_called_directly(lm, monkeypatch):
    """The first layer's pass records what the model passes each layer; later passes call the
    layer with it (no model call), and store what the model's calls would."""
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(3 * CHUNK + 11)
    want = _arrays(_fp16_then_compressed(lm.model, tokens, preset), preset)
    calls = _counting(lm.model, monkeypatch)
    # (the array bound counts arrays only: not the staging cache, whatever it holds)
    monkeypatch.setattr(prefill_layers, "RECORD_MAX_BYTES", 0)
    got = _arrays(_prefill(lm.model, tokens, preset, "layer")[0], preset)
    assert calls == [CHUNK] * 3 + [11]  # one per chunk, in the first layer's pass only
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_model_whose_layers_do_not_pass_on_the_hidden_states_is_called_per_layer(lm, monkeypatch):
    """Layers called with keywords and returning tuples: the recording stops at the second
    layer, so every later pass goes through the model's call, as before."""
    preset = kvcache.get_preset("tq4")
    model = _TupleModel(lm.model)
    calls = _counting(model, monkeypatch)
    _prefill(model, _tokens(3 * CHUNK + 11), preset, "layer")
    assert calls == ([CHUNK] * 3 + [11]) * len(model.layers)


class _ArrayMaskModel:
    """A model handing its layers an explicit mask array (positional arguments otherwise)."""

    def __init__(self, model):
        self.inner = model.model
        self.layers = model.layers

    def __call__(self, ids, cache=None):
        from mlx_lm.models.base import create_attention_mask

        h = self.inner.embed_tokens(ids)
        mask = create_attention_mask(h, cache[0], return_array=True)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.inner.embed_tokens.as_linear(self.inner.norm(h))


@pytest.mark.parametrize("most, direct", [(2**20, True), (0, False)])
def test_a_large_array_argument_stops_the_recording(lm, monkeypatch, most, direct):
    """An explicit mask over RECORD_MAX_BYTES is not kept for every chunk: that model is called
    per layer; either way the arrays are the oracle's."""
    preset = kvcache.get_preset("tq4")
    model = _ArrayMaskModel(lm.model)
    tokens = _tokens(3 * CHUNK + 11)
    want = _arrays(_fp16_then_compressed(model, tokens, preset), preset)
    monkeypatch.setattr(prefill_layers, "RECORD_MAX_BYTES", most)
    calls = _counting(model, monkeypatch)
    got = _arrays(_prefill(model, tokens, preset, "layer")[0], preset)
    chunks = [CHUNK] * 3 + [11]
    assert calls == (chunks if direct else chunks * len(model.layers))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_call_spans():
    b = [(0, 4), (4, 8), (8, 12), (12, 14)]
    assert prefill_layers.call_spans(b, 0) == b  # off: one call per chunk
    assert prefill_layers.call_spans(b, 8) == [(0, 8), (8, 14)]
    assert prefill_layers.call_spans(b, 100) == [(0, 14)]
    assert prefill_layers.call_spans(b, 100, pairs=8 * 8) == [(0, 8), (8, 12), (12, 14)]
    assert prefill_layers.call_spans(b, 2) == b  # a chunk longer than `most` stays one call
    far = [(0, 512), (512, 1024)]  # near 128k keys a merge would pass CALL_PAIRS
    at = [(lo + 130048, hi + 130048) for lo, hi in far]
    assert prefill_layers.call_spans(at, 2048) == at
    assert prefill_layers.call_spans(far, 2048) == [(0, 1024)]


def test_longer_layer_calls_store_what_an_fp16_prefill_in_those_calls_makes(lm, monkeypatch):
    """`layer_call_tokens`: each layer is called on runs of two chunks; the cache holds
    the compression of the keys an fp16 prefill in chunks of that length makes (appended in the
    original chunks: the same codes), and the model is called once per run."""
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(5 * CHUNK + 37)
    calls = _counting(lm.model, monkeypatch)
    got = _arrays(_prefill(lm.model, tokens, preset, "layer", layer_call_tokens=2 * CHUNK)[0], preset)
    assert calls == [2 * CHUNK, 2 * CHUNK, CHUNK + 37]
    calls.clear()
    want = _arrays(_fp16_then_compressed(lm.model, tokens, preset, fp16_chunk=2 * CHUNK), preset)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_the_default_calls_store_what_an_fp16_prefill_in_those_calls_makes(lm, monkeypatch):
    """The default `layer_call_tokens` (2048, mlx-lm's own prefill step): a prompt of five and
    a half chunks is one call per layer, and the cache holds the compression of an fp16
    prefill in one chunk."""
    default = engine.LAYER_CALL_TOKENS
    assert default >= 6 * CHUNK
    preset = kvcache.get_preset("tq4")
    tokens = _tokens(5 * CHUNK + 37)
    calls = _counting(lm.model, monkeypatch)
    got = _arrays(_prefill(lm.model, tokens, preset, "layer", layer_call_tokens=default)[0], preset)
    assert calls == [len(tokens)]
    calls.clear()
    want = _arrays(_fp16_then_compressed(lm.model, tokens, preset, fp16_chunk=default), preset)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("upto", [None, 3 * CHUNK + 5])
def test_the_quality_benchmarks_compression_is_what_ingest_stores(lm, upto):
    """`bench.quality.compressed` (one exact prefill serving every preset, truncated or whole)
    stores what a layer-major ingest of that prefix stores."""
    from longctx.bench import quality

    preset = kvcache.get_preset("tq4")
    tokens = _tokens(5 * CHUNK + 37)
    exact = kvcache.make(lm.model, kvcache.get_preset("fp16"))
    engine.prefill(lm.model, tokens, exact, chunk=CHUNK, order="token")
    got = _arrays(quality.compressed(lm.model, exact, "tq4", chunk=CHUNK, upto=upto), preset)
    want = _arrays(_prefill(lm.model, tokens[:upto], preset, "layer")[0], preset)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
