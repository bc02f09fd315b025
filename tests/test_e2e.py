"""End to end on the real default model (SmolLM2-135M-Instruct) and the sample report PDF.

Ingest and each question run in separate processes, as a user would run them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longctx import engine, kvcache, manage, prompt, session
from longctx.documents import read_document
from longctx.runtime import models
from longctx.store import Store

pytestmark = pytest.mark.slow
REPORT = Path(__file__).resolve().parent.parent / "samples" / "report.pdf"


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LONGCTX_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    home = tmp_path_factory.mktemp("e2e-home")
    run = _cli("ingest", str(REPORT), "--kv", "fp16", "--json", home=home)
    assert run.returncode == 0, run.stderr
    return home, json.loads(run.stdout)


def test_ingest_reports_the_document(ingested):
    _, entry = ingested
    assert entry["name"] == "report.pdf" and entry["pages"] == 4
    assert 1000 < entry["tokens"] < 2000 and not entry["reused"]
    assert entry["model_id"] == "SmolLM2-135M-Instruct" and entry["kv_preset"] == "fp16"


@pytest.mark.parametrize(
    "question,fact",
    [
        ("Who is the chief engineer of the cooperative?", "Marta Okonkwo"),
        ("In what year was the cooperative founded?", "1987"),
    ],
)
def test_answers_contain_the_facts(ingested, question, fact):
    home, _ = ingested
    run = _cli("ask", question, "--max-tokens", "40", home=home)
    assert run.returncode == 0, run.stderr
    assert fact in run.stdout


def test_reingest_reuses_the_entry(ingested):
    home, entry = ingested
    run = _cli("ingest", str(REPORT), "--kv", "fp16", "--json", home=home)
    assert run.returncode == 0 and json.loads(run.stdout)["reused"] is True
    assert json.loads(run.stdout)["id"] == entry["id"]


def test_restored_answer_matches_a_fresh_full_prompt_run(ingested, monkeypatch):
    home, entry = ingested
    monkeypatch.setenv("LONGCTX_HOME", str(home))
    stored = manage.find_entry(entry["id"])
    lm = models.load(models.resolve(None))
    restored = session.restore(stored, lm, Store())
    lay = prompt.layout(lm.tokenizer, REPORT.name, read_document(REPORT).text)
    prefix = prompt.prefix_tokens(lm.tokenizer, lay)
    suffix = prompt.question_tokens(lm.tokenizer, lay, "Which turbine model does the cooperative use?")
    assert len(prefix) == stored.tokens
    cached = engine.greedy_tokens(lm.model, suffix, kvcache.fork(restored), 8)
    fresh = engine.greedy_tokens(lm.model, prefix + suffix, kvcache.make(lm.model, kvcache.get_preset("fp16")), 8)
    assert cached == fresh
    assert "Selkie" in lm.tokenizer.decode(cached)


def test_errors_are_one_line_and_exit_1(ingested, tmp_path):
    home, _ = ingested
    for args in (["ingest", str(tmp_path / "missing.pdf")], ["ask", "q", "--doc", "nope"], ["info", "nope"]):
        run = _cli(*args, home=home)
        assert run.returncode == 1, (args, run.stderr)
        assert run.stderr.strip().startswith("error:") and "Traceback" not in run.stderr


@pytest.fixture(scope="module")
def ingested_tq4(ingested):
    home, _ = ingested
    run = _cli("ingest", str(REPORT), "--json", home=home)  # the default preset
    assert run.returncode == 0, run.stderr
    return home, json.loads(run.stdout)


QUESTIONS = [
    ("Who is the chief engineer of the cooperative?", "Marta Okonkwo"),
    ("In what year was the cooperative founded?", "1987"),
    ("Which turbine model does the cooperative use?", "Selkie T-40"),
    ("What is the largest tidal array of the cooperative?", "Gannet Reef"),
]


def _answer(home, entry_id: str, question: str) -> str:
    run = _cli("ask", question, "--doc", entry_id, "--max-tokens", "30", home=home)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_tq4_cache_is_smaller(ingested, ingested_tq4):
    _, fp16 = ingested
    _, tq4 = ingested_tq4
    assert tq4["kv_preset"] == "tq4" and tq4["id"] != fp16["id"]
    assert tq4["bytes"] < fp16["bytes"] / 3.5  # ~4.3 vs 16 bits per channel
    assert 4.25 <= tq4["bits_per_channel"] < 4.4


@pytest.mark.parametrize("question,fact", QUESTIONS)
def test_tq4_answers_like_fp16(ingested, ingested_tq4, question, fact):
    """Greedy answers from the restored tq4 cache carry the fact and equal the fp16 answers.

    Known gap (README, quality): for the chief-engineer question tq4 words the answer differently
    ("of the cooperative" vs "of the Northwind Tidal Energy Cooperative"), a near-tie at one
    token; tq5k4v matches fp16 on all four (next test).
    """
    home, fp16 = ingested
    _, tq4 = ingested_tq4
    ours, reference = _answer(home, tq4["id"], question), _answer(home, fp16["id"], question)
    assert fact in ours
    if question.startswith("Who is the chief engineer"):
        pytest.xfail(f"tq4 rewords this answer: {ours!r} vs fp16 {reference!r}")
    assert ours == reference


def test_tq5k4v_answers_equal_fp16(ingested):
    home, fp16 = ingested
    run = _cli("ingest", str(REPORT), "--kv", "tq5k4v", "--json", home=home)
    assert run.returncode == 0, run.stderr
    entry = json.loads(run.stdout)
    for question, fact in QUESTIONS:
        ours = _answer(home, entry["id"], question)
        assert fact in ours and ours == _answer(home, fp16["id"], question)


def test_export_to_mlx_lm_prompt_cache(ingested_tq4, tmp_path):
    from mlx_lm.models.cache import KVCache, load_prompt_cache

    home, tq4 = ingested_tq4
    out = tmp_path / "report-cache.safetensors"
    run = _cli("export", tq4["id"], "--out", str(out), home=home)
    assert run.returncode == 0, run.stderr
    cache, meta = load_prompt_cache(str(out), return_metadata=True)
    assert len(cache) == 30 and all(type(c) is KVCache for c in cache)
    assert cache[0].offset == tq4["tokens"] and meta["longctx_entry"] == tq4["id"]
    assert Path(meta["model"]).is_dir()
    # mlx-lm's own CLI answers from the exported cache (it prefills only the question).
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--prompt-cache-file",
            str(out),
            "--prompt",
            "Who is the chief engineer of the cooperative?",
            "--max-tokens",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Marta Okonkwo" in run.stdout
