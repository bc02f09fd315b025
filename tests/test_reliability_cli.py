"""Every bad input through the CLI: one line on stderr, exit code 1, nothing written to the store.

In-process through typer's CliRunner with the tiny model (`--model <dir>`); PDFs are built with
pypdf in tmp_path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longctx.cli import app
from pdfs import text_pdf
from longctx.store import Store


def _snapshot(home: Path) -> tuple:
    """What the store holds: entry ids and cache files (empty if it was never created)."""
    if not (home / "store").exists():
        return (), ()
    store = Store(cleanup=False)
    try:
        return tuple(e.id for e in store.entries()), tuple(sorted(os.listdir(store.caches)))
    finally:
        store.close()


def _invoke(args: list) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def _fails_cleanly(args: list, home: Path, *words: str) -> str:
    before = _snapshot(home)
    result = _invoke(args)
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert _snapshot(home) == before
    return lines[0]


LONG = "The lighthouse keeper is Ada Quill. " * 3


@pytest.mark.parametrize(
    ("name", "data", "words"),
    [
        ("missing.txt", None, ["not found"]),
        ("adir", "DIR", ["directory"]),
        ("empty.txt", b"", ["empty", "nothing to ingest"]),
        ("garbage.pdf", bytes(range(256)) * 4, ["not a PDF"]),
        ("broken.pdf", b"%PDF-1.7\n" + bytes(range(256)) * 8, ["damaged or truncated"]),
        ("locked.pdf", "ENCRYPTED", ["encrypted", "--password"]),
        ("scan.pdf", "IMAGES", ["no extractable text", "OCR"]),
        ("latin1.txt", "café au lait".encode("latin-1"), ["not UTF-8", "iconv"]),
    ],
)
def test_bad_documents(tiny_model, tmp_path, longctx_home, name, data, words):
    path = tmp_path / name
    if data == "DIR":
        path.mkdir()
    elif data == "ENCRYPTED":
        path.write_bytes(text_pdf([LONG], password="s3cret"))
    elif data == "IMAGES":
        path.write_bytes(text_pdf(["", "", ""]))
    elif data is not None:
        path.write_bytes(data)
    _fails_cleanly(["ingest", path, "--model", tiny_model], longctx_home, *words)


def test_encrypted_pdf_with_password_ingests(tiny_model, tmp_path, longctx_home):
    path = tmp_path / "locked.pdf"
    path.write_bytes(text_pdf([LONG], password="s3cret"))
    _fails_cleanly(["ingest", path, "--model", tiny_model, "--password", "guess"], longctx_home, "Wrong password")
    result = _invoke(["ingest", path, "--model", tiny_model, "--password", "s3cret"])
    assert result.exit_code == 0, result.stderr
    assert len(_snapshot(longctx_home)[0]) == 1


def test_pdf_with_empty_pages_ingests_the_rest_and_warns(tiny_model, tmp_path, longctx_home):
    path = tmp_path / "gaps.pdf"
    path.write_bytes(text_pdf([LONG, "", LONG, ""]))
    result = _invoke(["ingest", path, "--model", tiny_model])
    assert result.exit_code == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "2 of 4 pages" in warning[0] and "pages 2, 4" in warning[0]
    assert len(_snapshot(longctx_home)[0]) == 1
    again = _invoke(["ingest", path, "--model", tiny_model])  # also on a cache hit
    assert "pages 2, 4" in again.stderr and "cached" in again.stderr


def test_document_longer_than_the_context(tmp_path, text_doc, longctx_home):
    from conftest import make_tiny_model

    small = make_tiny_model(tmp_path / "small", context=300)
    _fails_cleanly(["ingest", text_doc, "--model", small], longctx_home, "context is 300", "--model")


def test_question_longer_than_the_remaining_context(tmp_path, text_doc, longctx_home):
    from conftest import make_tiny_model

    small = make_tiny_model(tmp_path / "small", context=1000)
    assert _invoke(["ingest", text_doc, "--model", small]).exit_code == 0
    _fails_cleanly(["ask", "why " * 400], longctx_home, "shorten the question")


def test_corrupt_cache_through_the_cli(tiny_model, text_doc, longctx_home):
    assert _invoke(["ingest", text_doc, "--model", tiny_model]).exit_code == 0
    store = Store()
    path = store.cache_path(store.entries()[0].id)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    _fails_cleanly(
        ["ask", "Who keeps the lighthouse?"], longctx_home, "facts.txt", "corrupt", f"longctx ingest --force {text_doc}"
    )
    path.write_bytes(bytes(data[:100]))
    _fails_cleanly(["ask", "Who?"], longctx_home, "truncated")
    result = _invoke(["ingest", text_doc, "--model", tiny_model, "--force"])
    assert result.exit_code == 0 and "ingested" in result.stderr
    assert _invoke(["ask", "Who?", "--max-tokens", "2"]).exit_code == 0


@pytest.mark.parametrize("ref", ["../../etc/passwd", "[/b] not markup", "..", "/"])
def test_names_never_escape_or_break_the_error_line(tiny_model, text_doc, longctx_home, ref):
    assert _invoke(["ingest", text_doc, "--model", tiny_model]).exit_code == 0
    _fails_cleanly(["ask", "q", "--doc", ref], longctx_home, "No ingested document matches", ref)
    _fails_cleanly(["rm", ref], longctx_home, "No ingested document matches")
    _fails_cleanly(["info", ref], longctx_home, "No ingested document matches")
