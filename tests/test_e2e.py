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

from longctx import engine, kvcache, prompt, session
from longctx.documents import read_document
from longctx.runtime import models
from longctx.store import Store

pytestmark = pytest.mark.slow
REPORT = Path(__file__).resolve().parent.parent / "samples" / "report.pdf"


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LONGCTX_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True,
                          env=env, timeout=900)


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


@pytest.mark.parametrize("question,fact", [
    ("Who is the chief engineer of the cooperative?", "Marta Okonkwo"),
    ("In what year was the cooperative founded?", "1987"),
])
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
    stored = session.find_entry(entry["id"])
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
    for args in (["ingest", str(tmp_path / "missing.pdf")], ["ask", "q", "--doc", "nope"],
                 ["info", "nope"]):
        run = _cli(*args, home=home)
        assert run.returncode == 1, (args, run.stderr)
        assert run.stderr.strip().startswith("error:") and "Traceback" not in run.stderr


@pytest.fixture(scope="module")
def ingested_tq4(ingested):
    home, _ = ingested
    run = _cli("ingest", str(REPORT), "--json", home=home)  # the default preset
    assert run.returncode == 0, run.stderr
    return home, json.loads(run.stdout)


def test_tq4_cache_is_smaller_and_answers_like_fp16(ingested, ingested_tq4):
    home, fp16 = ingested
    _, tq4 = ingested_tq4
    assert tq4["kv_preset"] == "tq4" and tq4["id"] != fp16["id"]
    assert tq4["bytes"] < fp16["bytes"] / 3.5  # 4.25 vs 16 bits per channel
    for question, fact in [("Who is the chief engineer of the cooperative?", "Marta Okonkwo"),
                           ("In what year was the cooperative founded?", "1987")]:
        answers = {}
        for entry in (fp16, tq4):
            run = _cli("ask", question, "--doc", entry["id"], "--max-tokens", "24", home=home)
            assert run.returncode == 0, run.stderr
            answers[entry["kv_preset"]] = run.stdout.strip()
        assert fact in answers["tq4"]
        assert answers["tq4"] == answers["fp16"]


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
