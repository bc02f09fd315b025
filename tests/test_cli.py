"""The CLI in-process (typer's CliRunner), fast: the error boundary, warnings, management commands.

Every failure is one line on stderr and exit code 1 (usage errors: 2); answers go to stdout.
"""

from __future__ import annotations

import json
import warnings

import pytest
from typer.testing import CliRunner

import longctx
from longctx import manage, session
from longctx.cli import app


def _invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_error_line(result, prefix: str) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_version():
    result = _invoke("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"longctx {longctx.__version__}"


def test_unexpected_exception_is_one_internal_error_line(tiny_model, text_doc, monkeypatch):
    def boom(*a, **k):
        raise TypeError("expand_dims(): incompatible function arguments\nInvoked with: ...")

    monkeypatch.setattr(session, "ingest", boom)
    line = _one_error_line(_invoke("ingest", text_doc, "--model", tiny_model), "internal error: ")
    assert line == (
        "internal error: TypeError: expand_dims(): incompatible function arguments; rerun with --debug for the traceback"
    )
    debug = _invoke("--debug", "ingest", text_doc, "--model", tiny_model)
    assert debug.exit_code == 1 and isinstance(debug.exception, TypeError)


def test_usage_errors_still_exit_2(text_doc):
    assert _invoke("ingest").exit_code == 2
    assert _invoke("ask", "q", "--max-tokens", "0").exit_code == 2


@pytest.mark.filterwarnings("default::longctx.kernels._prelude.KernelFallbackWarning")
def test_library_warning_is_one_line(tiny_model, text_doc, monkeypatch):
    from longctx.kernels._prelude import KernelFallbackWarning

    real = session.ingest

    def warn_then_ingest(*a, **k):
        warnings.warn(
            "kernel lc_decode_attend failed on metal (Unable to build metal library)\nsecond line", KernelFallbackWarning
        )
        return real(*a, **k)

    monkeypatch.setattr(session, "ingest", warn_then_ingest)
    result = _invoke("ingest", text_doc, "--model", tiny_model)
    assert result.exit_code == 0, result.output
    warned = [ln for ln in result.stderr.splitlines() if ln.startswith("warning:")]
    assert warned == ["warning: kernel lc_decode_attend failed on metal (Unable to build metal library)"]


@pytest.fixture(scope="module")
def gemma2_model(tmp_path_factory):
    from conftest import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-gemma2",
        model_type="gemma2",
        query_pre_attn_scalar=32,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )


def test_soft_capped_attention_without_a_shim_is_refused(gemma2_model, text_doc, monkeypatch):
    """Soft-capped attention that `kvcache.softcap` does not route (here Gemma-2's own, with the
    shim told not to recognize it) is refused by the compressed presets in one line; fp16 serves
    it. (Gemma-2 itself answers compressed: tests/test_models_matrix.py.)"""
    from longctx.kvcache import softcap

    monkeypatch.setattr(softcap, "serves", lambda cls: False)
    line = _one_error_line(_invoke("ingest", text_doc, "--model", gemma2_model), "error: ")
    assert "soft-capped attention scores" in line and "--kv fp16" in line and "tq4" in line
    assert manage.list_entries() == []
    fp16 = _invoke("ingest", text_doc, "--model", gemma2_model, "--kv", "fp16")
    assert fp16.exit_code == 0, fp16.output
    answer = _invoke("ask", "Who keeps the lighthouse?", "--max-tokens", "4")
    assert answer.exit_code == 0 and answer.stdout, answer.output


def test_management_commands(tiny_model, text_doc, tmp_path):
    assert _invoke("ingest", text_doc, "--model", tiny_model).exit_code == 0
    listed = _invoke("list", "--json")
    entries = json.loads(listed.stdout)
    assert listed.exit_code == 0 and [e["name"] for e in entries] == ["facts.txt"]
    eid = entries[0]["id"]
    table = _invoke("list")
    assert table.exit_code == 0 and eid in table.stdout
    info = json.loads(_invoke("info", eid, "--json").stdout)
    assert info["id"] == eid and info["tokens"] > 100 and info["kv_preset"] == "tq4"
    out = tmp_path / "exported.safetensors"
    exported = _invoke("export", eid, "--out", out)
    assert exported.exit_code == 0 and out.stat().st_size > 0
    assert _invoke("rm", eid).exit_code == 0
    assert json.loads(_invoke("list", "--json").stdout) == []
    _one_error_line(_invoke("info", eid), "error: ")


@pytest.mark.parametrize("width", [60, 80, 120])
def test_list_fits_the_terminal(width, tiny_model, text_doc):
    from rich.console import Console

    from longctx.cli import _entries_table

    assert _invoke("ingest", text_doc, "--model", tiny_model).exit_code == 0
    entries = manage.list_entries()
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(_entries_table(entries, width))
    lines = console.export_text().splitlines()
    assert max(len(ln) for ln in lines) <= width
    assert len(lines) == 5  # top border, header, rule, one row, bottom border: nothing wrapped
    assert entries[0].id in lines[3]
