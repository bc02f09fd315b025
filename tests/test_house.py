"""The house's checkable rules: the generated result tables are current, the README stays short,
the product benchmarks stay few, and the library keeps its settings few."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_result_tables_are_generated_from_the_results_files():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "tables.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_readme_is_short_and_has_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    blocks = text.split("```bash\n")[1:]
    commands = [b.split("```")[0].strip() for b in blocks]
    assert commands[:2] == [
        'bash scripts/setup.sh && .venv/bin/longctx ingest samples/report.pdf && .venv/bin/longctx ask '
        '"Who is the chief engineer of the cooperative?"',
        "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q"]
    assert len(commands) == 2


def test_ci_runs_the_readme_test_command_and_ruff():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q" in ci
    assert "ruff check" in ci
