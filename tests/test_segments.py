"""Splitting documents into segments (longctx.segments) and ranking them (longctx.retrieval)."""

from __future__ import annotations

import re

import pytest

from longctx import retrieval, segments
from longctx.documents import Document


def _doc(name: str, text: str, kind: str = "text", pages: int = 1) -> Document:
    return Document(path=name, name=name, kind=kind, text=text, pages=pages, sha256="0" * 64)


def _count(text: str) -> int:
    return len(text.split())  # a word tokenizer: easy to reason about


def _prompt(title: str, text: str) -> int:
    return 20 + _count(title) + _count(text)  # a 20-token template


def _pdf(pages: int, words: int) -> Document:
    body = "\n".join(f"[Page {p}]\n" + " ".join(f"w{p}x{i}" for i in range(words)) for p in range(1, pages + 1))
    return _doc("r.pdf", body, "pdf", pages)


def test_a_document_that_fits_is_one_segment_of_its_whole_text():
    doc = _doc("a.txt", "alpha beta\n\ngamma delta")
    out = segments.split([doc], "a.txt", _count, _prompt, budget=100)
    assert len(out) == 1 and out[0].title == "a.txt"
    assert out[0].text == "alpha beta\n\ngamma delta"
    assert out[0].label == "a.txt lines 1\u20133"


def test_pdf_pages_are_never_cut_and_every_segment_fits():
    doc = _pdf(pages=12, words=30)
    out = segments.split([doc], "r.pdf", _count, _prompt, budget=120)
    assert len(out) > 3
    for s in out:
        assert _prompt(s.title, s.text) <= 120
        pages = [int(p) for p in re.findall(r"^\[Page (\d+)\]$", s.text, re.M)]
        assert pages == list(range(s.spans[0].first, s.spans[0].last + 1))
        assert s.title == f"r.pdf ({s.label})" and s.label.startswith("r.pdf p. ")
    got = [p for s in out for p in re.findall(r"^\[Page (\d+)\]$", s.text, re.M)]
    assert got == [str(p) for p in range(1, 13)]  # every page once, in order


def test_a_unit_larger_than_the_budget_is_split_and_nothing_is_lost():
    words = [f"t{i}." for i in range(400)]  # one 400-word paragraph of sentences
    doc = _doc("big.txt", " ".join(words))
    out = segments.split([doc], "big.txt", _count, _prompt, budget=130)
    assert len(out) >= 4
    assert all(_prompt(s.title, s.text) <= 130 for s in out)
    assert " ".join(s.text for s in out).split() == words


def test_markdown_headings_start_segments_once_a_segment_is_well_filled():
    parts = []
    for i in range(8):
        parts += [f"# Section {i}", " ".join(f"s{i}w{j}" for j in range(18))]
    doc = _doc("m.md", "\n\n".join(parts), "markdown")
    out = segments.split([doc], "m.md", _count, _prompt, budget=100)
    assert len(out) > 1
    assert all(s.text.startswith("# Section") for s in out)  # cut at headings, not mid-section


def test_collections_mark_each_file_and_span_files():
    docs = [_doc("a.md", "one two three", "markdown"), _doc("b.md", "four five six", "markdown")]
    out = segments.split(docs, "set", _count, _prompt, budget=100)
    assert len(out) == 1
    assert out[0].text == "[File a.md]\n\none two three\n\n[File b.md]\n\nfour five six"
    assert [s.file for s in out[0].spans] == ["a.md", "b.md"]


def test_a_budget_without_room_for_text_is_refused():
    with pytest.raises(ValueError, match="no room"):
        segments.split([_pdf(3, 50)], "r.pdf", _count, _prompt, budget=40)


def test_bm25_finds_the_segment_with_the_rare_words_and_folds_plurals():
    texts = [
        "The cat sat on the mat.",
        "Dogs bark at night near the harbour.",
        "These licenses grant the right to copy the software.",
    ]
    assert retrieval.rank_bm25("Which license lets me copy it?", texts)[0] == 2
    assert retrieval.rank_bm25("where do dogs bark", texts)[0] == 1
    assert retrieval._fold("licenses") == retrieval._fold("license") == retrieval._fold("licensed")
    assert retrieval.bm25_scores("zzz", texts) == [0.0, 0.0, 0.0]


def test_the_model_ranker_reorders_bm25s_best_by_the_models_score():
    texts = ["apple pie recipe", "apple orchard", "banana", "apple juice", "apple tart", "kiwi"]
    calls = []

    def score(i: int) -> float:
        calls.append(i)
        return {3: 5.0}.get(i, 0.0)

    order = retrieval.rank("apple", texts, "model", score, rerank=4)
    assert order[0] == 3 and len(calls) == 4 and set(order) == set(range(6))
    assert 2 not in calls and 5 not in calls  # no model work beyond BM25's best 4


def test_cite_names_the_page_that_matches_the_answer():
    text = "[Page 4]\nRevenue grew.\n[Page 5]\nThe launch code is ORCHID-7731.\n[Page 6]\nEnd."
    assert retrieval.cite(text, "launch code ORCHID-7731", "r.pdf") == "r.pdf p. 5"
    coll = "[File a.md]\nnothing here\n\n[File b.md]\nthe password is tulip"
    assert retrieval.cite(coll, "password tulip", "x") == "b.md"
