"""Ingest → persist → restore → ask on a tiny random-weight model (no network, fast)."""

from __future__ import annotations

import hashlib

import pytest

from longctx import asking

from longctx import engine, kvcache, manage, prompt, session
from longctx.errors import CacheMismatch, ContextLengthError, EntryNotFound
from longctx.runtime import models
from longctx.store import Store


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_ingest_then_reuse(tiny_model, text_doc):
    first = session.ingest(text_doc, model=str(tiny_model))
    assert not first.reused and first.stats.tokens == first.entry.tokens > 100
    again = session.ingest(text_doc, model=str(tiny_model))
    assert again.reused and again.entry.id == first.entry.id
    forced = session.ingest(text_doc, model=str(tiny_model), force=True)
    assert not forced.reused and forced.entry.id == first.entry.id
    assert [e.id for e in manage.list_entries()] == [first.entry.id]


def test_ask_is_repeatable_and_never_changes_the_file(tiny_model, text_doc):
    entry = session.ingest(text_doc, model=str(tiny_model)).entry
    cache_file = Store().caches / entry.file
    before = _sha(cache_file)
    a1, a2 = session.Answer(), session.Answer()
    text1 = "".join(asking.ask("Who keeps the lighthouse?", max_tokens=12, answer=a1))
    text2 = "".join(asking.ask("Who keeps the lighthouse?", max_tokens=12, answer=a2))
    assert text1 == text2 and len(text1) > 0
    assert _sha(cache_file) == before
    assert a1.entry.id == entry.id and a1.first_token_seconds >= a1.restore_seconds > 0


def test_restored_cache_answers_like_a_fresh_full_prompt(tiny_model, text_doc):
    """Greedy tokens after restore equal those of one uncached run over prefix + question."""
    entry = session.ingest(text_doc, model=str(tiny_model)).entry
    lm = models.load(models.resolve(str(tiny_model)))
    store = Store()
    restored = session.restore(entry, lm, store)
    lay = prompt.layout(lm.tokenizer, entry.name, text_doc.read_text())
    prefix = prompt.prefix_tokens(lm.tokenizer, lay)
    suffix = prompt.question_tokens(lm.tokenizer, lay, "How many sheep?")
    assert len(prefix) == entry.tokens
    cached = engine.greedy_tokens(lm.model, suffix, kvcache.fork(restored), 8)
    fresh_cache = kvcache.make(lm.model, kvcache.get_preset(entry.kv_preset))
    engine.prefill(lm.model, prefix, fresh_cache)
    kvcache.seal(fresh_cache)  # ingest seals the prefix: every stored token compressed
    fresh = engine.greedy_tokens(lm.model, suffix, fresh_cache, 8)
    assert cached == fresh
    # The fork left the restored parent at the prefix length.
    assert all(c.offset == entry.tokens for c in restored)


def test_model_mismatch_is_refused(tiny_model, tiny_model_other, text_doc):
    session.ingest(text_doc, model=str(tiny_model))
    with pytest.raises(CacheMismatch, match="ingested with model"):
        list(asking.ask("q", model=str(tiny_model_other)))


def test_document_longer_than_context_is_refused(tmp_path, text_doc):
    from conftest import make_tiny_model

    small = make_tiny_model(tmp_path / "small", context=300)
    with pytest.raises(ContextLengthError, match="context is 300"):
        session.ingest(text_doc, model=str(small))
    assert manage.list_entries() == []


def test_question_longer_than_remaining_context(tmp_path, text_doc):
    from conftest import make_tiny_model

    small = make_tiny_model(tmp_path / "small", context=1000)
    session.ingest(text_doc, model=str(small))
    with pytest.raises(ContextLengthError, match="shorten the question"):
        list(asking.ask("why " * 400))


def test_unknown_document(tiny_model, text_doc):
    with pytest.raises(EntryNotFound, match="No documents ingested"):
        manage.find_entry(None)
    session.ingest(text_doc, model=str(tiny_model))
    with pytest.raises(EntryNotFound, match="facts.txt"):
        manage.find_entry("nope")


def test_plan_writes_nothing(tiny_model, text_doc, longctx_home):
    p = session.plan(text_doc, model=str(tiny_model))
    assert len(p.tokens) > 100 and p.estimated_tokens > 10 and p.context_length == 4096
    # fp16: 2 (k,v) × 2 bytes × kv heads × head dim × layers
    assert p.bytes_per_token == 2 * 2 * 2 * 32 * 2
    assert not (longctx_home / "store").exists()


def test_remove(tiny_model, text_doc):
    entry = session.ingest(text_doc, model=str(tiny_model)).entry
    path = Store().caches / entry.file
    assert path.exists()
    manage.remove_entry(entry.id[:6])
    assert not path.exists() and manage.list_entries() == []


def test_ingest_warms_the_answer_path_on_cuda_only(tiny_model, text_doc, monkeypatch):
    """On CUDA an ingest runs one decode step through a fork of the cache rebuilt from its saved
    arrays (the kernels an `ask` launches compile there); elsewhere, or off, it does not; a
    failure there never fails the ingest."""
    from longctx.kernels import _prelude
    from longctx.runtime import cuda_kernels

    calls = []

    def stream(model, tokens, cache, max_tokens, **kw):
        calls.append((tokens, [c.offset for c in cache], max_tokens))
        yield 7

    monkeypatch.setattr(engine, "token_stream", stream)
    first = session.ingest(text_doc, model=str(tiny_model))  # CPU
    assert not calls
    lm = models.load(models.resolve(str(tiny_model)))
    preset = kvcache.get_preset(first.entry.kv_preset)
    arrays, _ = Store().load(first.entry)
    with _prelude.force_backend("cuda"):
        assert session.warm_answer_path(lm, preset, arrays)
        prefix = first.entry.tokens
        assert calls == [([int(arrays["tokens"][-1].item())], [prefix] * len(calls[0][1]), 1)]
        monkeypatch.setattr(cuda_kernels, "enabled", lambda: False)  # longctx's kernel files off
        assert not session.warm_answer_path(lm, preset, arrays)
        monkeypatch.undo()
        monkeypatch.setattr(engine, "token_stream", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("kernel")))
        assert not session.warm_answer_path(lm, preset, arrays)
    warmed = []  # an ingest warms after saving, with the arrays it saved
    monkeypatch.setattr(session, "warm_answer_path", lambda lm, p, a: warmed.append((p, a)))
    forced = session.ingest(text_doc, model=str(tiny_model), force=True)
    ((p, a),) = warmed
    assert p.name == first.entry.kv_preset and a["tokens"].shape == (forced.entry.tokens,)
