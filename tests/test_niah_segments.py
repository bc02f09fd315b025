"""Needle in a haystack past the context (`longctx.bench.niah_segments`): recall bookkeeping on
synthetic rankings, the paraphrase table, and the harness end to end on a tiny random-weight
model whose 1024-token context splits a ~3k-token haystack into several segment caches."""

from __future__ import annotations

import json

import pytest

from longctx import retrieval
from longctx.bench import haystack as hay
from longctx.bench import niah, niah_segments as ns
from longctx.errors import ConfigError


def _cell(task, ranker, length, depth, needle, ranking, score):
    return ns.Cell(
        task,
        ranker,
        length,
        depth,
        length - 10,
        len(ranking),
        needle,
        depth,
        "q?",
        ["1234567"],
        ranking,
        ns.recall_at(ranking, needle, 1),
        ns.recall_at(ranking, needle, 2),
        ranking[0],
        "1234567" if score else "no",
        score,
        0.5,
        0.2,
        0.1,
        1.0,
    )


def test_recall_at_k():
    assert ns.recall_at([2, 0, 1], 2, 1) == 1.0
    assert ns.recall_at([2, 0, 1], 0, 1) == 0.0 and ns.recall_at([2, 0, 1], 0, 2) == 1.0
    assert ns.recall_at([2, 0, 1], 1, 2) == 0.0 and ns.recall_at([2, 0, 1], 1, 3) == 1.0
    assert ns.recall_at([0, 1], -1, 2) == 0.0  # needle not found in any segment: never recalled


def test_needle_segment_is_found_by_needle_then_value():
    needle = "The special magic number for the iron anchor is: 7654321."
    assert ns.needle_segment(["prose", "more " + needle + " prose", needle], needle, "7654321") == 1
    assert ns.needle_segment(["a", "the iron\nanchor is: 7654321."], needle, "7654321") == 1
    assert ns.needle_segment(["a", "b"], needle, "7654321") == -1


def test_summary_and_grid_from_synthetic_rankings(tmp_path):
    res = ns.Results(
        "tiny",
        "tiny",
        1024,
        "tq4",
        [2048, 4096],
        [0.0, 1.0],
        ["bm25", "model"],
        ["literal", "paraphrase"],
        0,
        segments={"2048": [3], "4096": [5, 6]},
    )
    rows = [  # task, ranker, length, depth, needle segment, ranking, score
        ("literal", "bm25", 2048, 0.0, 0, [0, 1, 2], 1.0),
        ("literal", "bm25", 2048, 1.0, 2, [1, 2, 0], 0.0),
        ("literal", "bm25", 4096, 0.0, 0, [3, 4, 1, 0, 2], 0.0),
        ("literal", "bm25", 4096, 1.0, 4, [4, 0, 1, 2, 3], 1.0),
        ("literal", "model", 2048, 0.0, 0, [0, 1, 2], 1.0),
        ("literal", "model", 2048, 1.0, 2, [2, 1, 0], 1.0),
        ("paraphrase", "bm25", 4096, 1.0, 4, [0, 1, 2, 3, 4], 0.0),
    ]
    res.cells = [_cell(*r) for r in rows]
    s = res.summary()
    lit = s["literal"]["bm25"]
    assert lit["all"]["recall_at_1"] == 0.5 and lit["all"]["recall_at_2"] == 0.75
    assert lit["all"]["accuracy"] == 0.5 and lit["all"]["cells"] == 4
    assert lit["2048"] == {**lit["2048"], "recall_at_1": 0.5, "recall_at_2": 1.0, "accuracy": 0.5}
    assert lit["4096"]["recall_at_1"] == 0.5 and lit["4096"]["recall_at_2"] == 0.5
    assert s["literal"]["model"]["all"]["recall_at_1"] == 1.0
    assert s["literal"]["model"]["4096"] == {}  # nothing ran there
    assert set(s["paraphrase"]) == {"bm25"}  # no model cells for paraphrase
    assert s["paraphrase"]["bm25"]["all"]["recall_at_2"] == 0.0
    assert res.grid("bm25", "literal") == [[1.0, 0.0], [0.0, 1.0]]
    assert res.grid("bm25", "literal", "recall_at_1") == [[1.0, 0.0], [0.0, 1.0]]
    assert res.grid("model", "literal") == [[1.0, None], [1.0, None]]
    path = ns.save(res, tmp_path / "r.json")
    back = ns.load(path)
    assert back.to_json() == json.loads(path.read_text()) == res.to_json()
    assert back.cells[1].ranking == [1, 2, 0]


def test_segment_heatmaps_per_ranker(tmp_path):
    pytest.importorskip("matplotlib")
    from longctx.bench import plot

    res = ns.Results(
        "tiny", "tiny", 1024, "tq4", [2048], [0.0], ["bm25", "model"], ["literal", "paraphrase"], 0, segments={"2048": [3]}
    )
    res.cells = [_cell(t, r, 2048, 0.0, 0, [0, 1, 2], 1.0) for t in res.tasks for r in res.rankers]
    paths = plot.segment_heatmaps(res, tmp_path, "seg")
    assert [p.name for p in paths] == ["seg_bm25.png", "seg_model.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_paraphrases_share_no_content_word_with_their_key():
    keys = [k for k, _ in ns.PARAPHRASES]
    assert len(set(keys)) == len(keys) >= 15
    for key, para in ns.PARAPHRASES:
        needle = f"The special magic number for the {key} is: 1234567."
        case = ns.Case(16384, 0.5, "", 0, key, para, "1234567", needle, 0.5)
        asked = set(retrieval.words(case.question("paraphrase")))
        # the key's words never; of the needle's, only "number" (what the question asks for)
        assert set(retrieval.words(para)) <= asked and asked & set(retrieval.words(needle)) == {"number"}
        assert not set(retrieval.words(para)) & set(retrieval.words(needle)), key
        assert key in case.question("literal") and para in case.question("paraphrase")
        assert key not in case.question("paraphrase")
    with pytest.raises(ConfigError):
        case.question("riddle")


def test_make_case_is_deterministic_and_holds_one_needle():
    essays = hay.load_corpus()

    def count(text):
        return len(text.split())

    class Words:  # a tokenizer counting words
        def encode(self, text, add_special_tokens=False):
            return text.split()

    a = ns.make_case(3000, 0.5, 0, Words(), essays, count)
    assert a == ns.make_case(3000, 0.5, 0, Words(), essays, count)
    assert a != ns.make_case(3000, 0.5, 1, Words(), essays, count)
    assert 2800 <= a.tokens <= 3000 == a.length
    assert a.text.count(a.value) == 1 and a.text.count(a.needle) == 1
    assert abs(a.text.index(a.needle) / len(a.text) - 0.5) < 0.05


@pytest.fixture(scope="module")
def tiny_1k(tmp_path_factory):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-1k", context=1024)


def test_harness_end_to_end_on_segments(tiny_1k, tmp_path):
    from longctx import manage
    from longctx.store import Store, groups

    seen = []
    res = ns.run(str(tiny_1k), lengths=[3072], depths=[0.0, 0.5, 1.0], workdir=tmp_path / "docs", keep=True, on_cell=seen.append)
    assert res.context_length == 1024 and res.lengths == [3072] and res.preset == "tq4"
    assert len(res.cells) == 3 * 2 * len(ns.RANKERS) == len(seen)  # depths x tasks x rankers
    assert min(res.segments["3072"]) >= 3
    store = Store(cleanup=False)
    try:
        texts = {c.group: [groups.text(store, s) for s in groups.get(store, c.group).segment_ids] for c in res.cells}
    finally:
        store.close()
    assert len(texts) == 3  # one group per depth, shared by its tasks and rankers
    for c in res.cells:
        t = texts[c.group]
        assert c.segments == len(t) > 1
        holding = [i for i, x in enumerate(t) if c.expected[0] in x]
        assert holding == [c.needle_segment]
        assert c.needle_segment == {0.0: 0, 1.0: len(t) - 1}.get(c.depth, c.needle_segment)
        assert 0 < c.needle_segment < len(t) - 1 or c.depth != 0.5
        assert sorted(c.ranking) == list(range(len(t)))
        assert c.recall_at_1 == float(c.ranking[0] == c.needle_segment)
        assert c.recall_at_2 == float(c.needle_segment in c.ranking[:2])
        assert c.answer_segment == c.ranking[0]
        assert c.score == niah.string_match_all(c.answer, c.expected)
        assert c.tokens <= 3072 and 0 < c.restore_seconds <= c.answer_seconds
    by = {(c.task, c.ranker, c.depth): c for c in res.cells}
    for d in res.depths:
        for task in res.tasks:
            bm25 = by[(task, "bm25", d)]
            for name in ("model", "attention"):
                # the model reranks BM25's best RERANK, the rest keep BM25's order
                other, k = by[(task, name, d)], retrieval.RERANK
                assert sorted(other.ranking[:k]) == sorted(bm25.ranking[:k])
                assert other.ranking[k:] == bm25.ranking[k:]
        # the literal question's key words are in the needle's segment only
        assert by[("literal", "bm25", d)].recall_at_1 == 1.0
    summary = res.summary()
    assert summary["literal"]["bm25"]["3072"]["recall_at_1"] == 1.0
    data = json.loads(json.dumps(res.to_json()))
    assert data["environment"]["backend"] and set(data["grids"]) == set(ns.RANKERS)
    assert len(manage.list_entries()) == 3  # kept groups only; segments are listed through them


def test_lengths_that_fit_are_refused(tiny_1k, tmp_path):
    with pytest.raises(ConfigError, match="exceed"):
        ns.run(str(tiny_1k), lengths=[900, 3072], depths=[0.5], workdir=tmp_path)
    with pytest.raises(ConfigError, match="ranker"):
        ns.run(str(tiny_1k), lengths=[3072], rankers=["tfidf"], workdir=tmp_path)


def test_cli_runs_lengths_past_the_context_as_segments(tiny_1k, tmp_path):
    from typer.testing import CliRunner

    from longctx import manage
    from longctx.cli import app

    out = tmp_path / "res"
    run = CliRunner().invoke(
        app, ["bench", "niah", "--model", str(tiny_1k), "--lengths", "512,2k", "--depths", "50", "--kv", "tq4", "--out", str(out)]
    )
    assert run.exit_code == 0, run.output
    seg = ns.load(out / "niah_segments_tiny-1k.json")
    assert seg.lengths == [2048] and seg.depths == [0.5] and seg.preset == "tq4"
    assert {(c.task, c.ranker) for c in seg.cells} == {(t, r) for t in ns.TASKS for r in ns.RANKERS}
    assert all(c.segments > 1 for c in seg.cells)
    fit = json.loads((out / "niah_tiny-1k_single.json").read_text())
    assert fit["lengths"] == [512] and fit["skipped_lengths"] == []
    for line in ("recall@1", "literal bm25", "paraphrase model"):
        assert line in run.output
    assert manage.list_entries() == []  # the run removes its groups and entries
