"""The needle-in-a-haystack harness: haystack construction, scoring, results, CLI, and a tiny
end-to-end grid on the real default model through ingest and ask."""

from __future__ import annotations

import json
import re

import pytest

from longctx.bench import haystack as hay
from longctx.bench import niah


def _words(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def essays():
    return hay.load_corpus()


def test_corpus_is_real_varied_prose(essays):
    sentences = [u.sentence for essay in essays for u in essay]
    assert len(essays) >= 8 and len(sentences) > 300
    assert len(set(sentences)) == len(sentences)  # no sentence repeated
    assert not any(re.search(r"\d{7}", s) for s in sentences)  # nothing that looks like a needle


@pytest.mark.parametrize("target", [300, 1500, 12000])
def test_needles_sit_at_sentence_boundaries_at_their_depths(essays, target):
    needles = [f"One of the special magic numbers for key-{i} is: {1000000 + i}." for i in range(5)]
    depths = [0.0, 0.25, 0.5, 0.9, 1.0]
    pre = "Some special magic numbers are hidden within the following text.\n\n"
    h = hay.build(essays, needles, depths, target, _words, _words, seed=3, preamble=pre)
    assert h.text.startswith(pre)
    longest = max(_words(u.sentence) for e in essays for u in e)
    assert target - longest - _words(" ".join(needles)) <= h.tokens <= target
    for needle, offset, want, got in zip(needles, h.offsets, depths, h.depths):
        assert h.text[offset : offset + len(needle)] == needle
        before = h.text[len(pre) : offset].rstrip()
        # at the start of the body, or right after a sentence (or another needle) ends
        assert before == "" or before[-1] in ".!?", before[-40:]
        assert abs(got - want) <= longest / (h.tokens - _words(pre)) + 1e-9
    body = h.text[len(pre) :]
    assert body.index(needles[0]) == 0 and h.text.rstrip().endswith(needles[-1])


def test_haystack_is_deterministic_in_its_seed(essays):
    args = (essays, ["One of the special magic numbers for x is: 1234567."], [0.5], 800, _words, _words)
    a, b, c = hay.build(*args, seed=1), hay.build(*args, seed=1), hay.build(*args, seed=2)
    assert a == b and a.text != c.text


def test_long_haystacks_cycle_the_corpus_in_new_orders(essays):
    total = sum(_words(u.sentence) for e in essays for u in e)
    h = hay.build(essays, ["Needle sentence here."], [0.3], int(total * 2.5), _words, _words, seed=0)
    assert h.tokens > total * 2.4
    firsts = [p.split(". ")[0] for p in h.text.split("\n\n")[: len(essays) * 3]]
    assert len(set(firsts)) > len(essays)  # not one essay repeated


def test_make_case_fits_the_models_prompt(essays):
    from longctx import prompt
    from longctx.runtime import models

    tok = models.tokenizer(models.resolve(None))
    cache = {}

    def piece(s):
        return cache.setdefault(s, len(tok.encode(" " + s, add_special_tokens=False)))

    for task in niah.TASKS:
        case = niah.make_case(task, 2048, [0.0, 0.5], 0, 7, tok, essays, 1900, piece)
        lay = prompt.layout(tok, niah.DOC_NAME, case.text)
        assert case.tokens == len(prompt.prefix_tokens(tok, lay))
        assert 1900 - 60 <= case.tokens <= 1900
        assert len(case.probes) == 2 and [p.depth for p in case.probes] == [0.0, 0.5]
        n_answers = 4 if task == "multivalue" else 1
        for p in case.probes:
            assert len(p.answers) == n_answers
            assert all(case.text.count(a) == 1 for a in p.answers)
            key = re.search(r"for (\S+) mentioned", p.question).group(1)
            assert case.text.count(f"for {key} is:") == n_answers
        if task == "uuid":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", case.probes[0].answers[0])
        if task == "multikey":
            assert case.text.count("One of the special magic numbers for") == 2 + 3
    again = niah.make_case("single", 2048, [0.0, 0.5], 0, 7, tok, essays, 1900, piece)
    assert again == niah.make_case("single", 2048, [0.0, 0.5], 0, 7, tok, essays, 1900, piece)


def test_string_match_all():
    assert niah.string_match_all("The number is 1234567.", ["1234567"]) == 1.0
    assert niah.string_match_all("It is 123456.", ["1234567"]) == 0.0
    assert niah.string_match_all("ABC-def", ["abc-DEF"]) == 1.0
    assert niah.string_match_all("1111111 and 3333333", ["1111111", "2222222", "3333333", "4444444"]) == 0.5


def test_answers_are_cut_where_a_base_model_echoes_the_prompt():
    assert niah.cut_answer(" 1709880\n<document name=\"haystack.txt\">\nSome special") == "1709880"
    assert niah.cut_answer(" Ada Quill\nQuestion: What is the") == "Ada Quill"
    listed = "The numbers are:\n\n- 9601240\n- 8112507"
    assert niah.cut_answer(listed) == listed  # multi-line answers stay whole


@pytest.mark.parametrize("text,n", [("2k", 2048), ("7.5k", 7680), ("4096", 4096), (" 1K ", 1024)])
def test_parse_length(text, n):
    assert niah.parse_length(text) == n


def test_parse_length_rejects_nonsense():
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError):
        niah.parse_length("lots")


def _fake_results() -> niah.Results:
    res = niah.Results("single", "smollm2", "SmolLM2-135M-Instruct", 8192, [1024, 2048], [0.0, 1.0], ["fp16", "tq4"], 1, 0, False)
    for p, bits, nbytes in (("fp16", 16.0, 23000), ("tq4", 4.3, 6300)):
        for n in res.lengths:
            for d in res.depths:
                score = 0.0 if (p == "tq4" and d == 1.0 and n == 2048) else 1.0
                res.cells.append(
                    niah.Cell(
                        "single",
                        p,
                        n,
                        d,
                        0,
                        n - 100,
                        d,
                        "q?",
                        ["1234567"],
                        "1234567" if score else "no",
                        score,
                        0.5,
                        0.2,
                        0.1,
                        1.0,
                        nbytes * (n - 100),
                        bits,
                    )
                )
    return res


def test_results_grid_summary_and_json_round_trip(tmp_path):
    res = _fake_results()
    assert res.grid("fp16") == [[1.0, 1.0], [1.0, 1.0]]
    assert res.grid("tq4") == [[1.0, 1.0], [1.0, 0.0]]
    s = res.summary()
    assert s["fp16"]["score"] == 1.0 and s["tq4"]["score"] == 0.75
    assert s["tq4"]["bits_per_channel"] == 4.3 and s["tq4"]["cache_bytes_per_token"] == 6300
    path = niah.save(res, tmp_path / "r.json")
    back = niah.load(path)
    assert back.to_json() == json.loads(path.read_text()) == res.to_json()


def test_heatmaps_are_drawn_per_preset(tmp_path):
    pytest.importorskip("matplotlib")
    from longctx.bench import plot

    paths = plot.heatmaps(_fake_results(), tmp_path, "niah_test")
    assert [p.name for p in paths] == ["niah_test_fp16.png", "niah_test_tq4.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_cli_bench_niah_parses_options_and_writes_results(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from longctx.cli import app

    seen = {}

    def fake_run(model, task, lengths, depths, presets, samples, seed, **kw):
        seen.update(model=model, task=task, lengths=lengths, depths=depths, presets=presets, samples=samples, shared=kw["shared"])
        return _fake_results()

    monkeypatch.setattr(niah, "run", fake_run)
    monkeypatch.delenv("LONGCTX_MODEL")  # no --model and no setting: the default reaches the run as None
    out = tmp_path / "res"
    run = CliRunner().invoke(
        app,
        [
            "bench",
            "niah",
            "--lengths",
            "1k,2k",
            "--depths",
            "0,100",
            "--kv",
            "tq4",
            "--kv",
            "tq3",
            "--samples",
            "2",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert run.exit_code == 0, run.output
    assert seen == {
        "model": None,
        "task": "single",
        "lengths": [1024, 2048],
        "depths": [0.0, 1.0],
        "presets": ["tq4", "tq3"],
        "samples": 2,
        "shared": False,
    }
    data = json.loads((out / "niah_SmolLM2-135M-Instruct_single.json").read_text())
    assert data["summary"]["tq4"]["score"] == 0.75
    assert "tq4" in run.output and "0.750" in run.output


@pytest.mark.slow
def test_tiny_grid_on_the_default_model_through_ingest_and_ask(tmp_path):
    from longctx import manage

    cells = []
    res = niah.run(
        None,
        "single",
        lengths=[640],
        depths=[0.2, 0.8],
        presets=["tq4"],
        samples=1,
        workdir=tmp_path / "docs",
        shared=True,
        on_cell=cells.append,
    )
    data = json.loads(json.dumps(res.to_json()))  # JSON-able
    assert data["presets"] == ["fp16", "tq4"] and len(data["cells"]) == 4 == len(cells)
    assert all(0.0 <= c["score"] <= 1.0 for c in data["cells"])
    assert all(640 - 160 <= c["tokens"] <= 640 - 72 for c in data["cells"])  # room for q + answer
    fp16 = [c for c in res.cells if c.preset == "fp16"]
    assert any(c.score == 1.0 for c in fp16), [c.answer for c in fp16]
    s = data["summary"]
    assert s["tq4"]["bits_per_channel"] < 5 < s["fp16"]["bits_per_channel"] == 16
    assert s["tq4"]["cache_bytes_per_token"] < s["fp16"]["cache_bytes_per_token"] / 3
    assert manage.list_entries() == []  # the run cleans up its entries


def test_rope_scaled_model_runs_past_its_trained_context_and_is_labelled(tmp_path):
    from conftest import make_tiny_model
    from typer.testing import CliRunner

    from longctx import manage
    from longctx.cli import app
    from longctx.runtime import models

    tiny = make_tiny_model(tmp_path / "tiny", context=512)
    spec = models.with_rope_scale(str(tiny), 2, "linear")
    res = niah.run(spec, "single", lengths=[768, 4096], depths=[0.5], presets=["tq4"], workdir=tmp_path / "docs", keep=True)
    assert res.context_length == 1024 and res.lengths == [768] and res.skipped_lengths == [4096]
    assert res.model_id.endswith("+linearx2") and res.rope_scaling["factor"] == 2.0
    assert res.cells and all(600 <= c.tokens <= 768 - 72 and 0.0 <= c.score <= 1.0 for c in res.cells)
    assert {e.model_id for e in manage.list_entries()} == {"tiny+linearx2"}
    base, scaled = models.resolve(str(tiny)), models.resolve(spec)
    assert base.weights_sha256 != scaled.weights_sha256  # its caches never mix with the base's

    doc = tmp_path / "short.txt"
    doc.write_text("The lighthouse keeper is Ada Quill. " * 14)  # ~700 tokens: past 512
    cli = CliRunner()
    run = cli.invoke(
        app,
        ["ingest", str(doc), "--model", str(tiny), "--rope-scale", "2", "--rope-type", "ntk-by-parts", "--kv", "fp16", "--json"],
    )
    assert run.exit_code == 0, run.output
    entry = json.loads(run.stdout[run.stdout.index("{") :])
    assert entry["model_id"] == "tiny+ntk-by-partsx2" and entry["model_spec"].endswith("#rope=ntk-by-parts:2")
    ask = cli.invoke(app, ["ask", "Who is the keeper?", "--doc", entry["id"], "--max-tokens", "4"])
    assert ask.exit_code == 0, ask.output
    bad = cli.invoke(app, ["ingest", str(doc), "--model", str(tiny), "--rope-scale", "0.5"])
    assert bad.exit_code == 1 and "RoPE scale" in bad.output
