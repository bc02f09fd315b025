"""Settings: one module reads them, typed, documented; kernels import only mlx."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from longctx import config
from longctx.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_values_are_parsed_and_bad_values_refused(monkeypatch):
    assert config.get("segment_tokens") == 0 and config.get("ranker") == "bm25"
    monkeypatch.setenv("LONGCTX_SEGMENT_TOKENS", "8")
    monkeypatch.setenv("LONGCTX_PEER_TIMEOUT", "5")
    monkeypatch.setenv("LONGCTX_RANKER", "model")
    assert config.get("segment_tokens") == 8 and config.get("peer_timeout") == 5
    assert config.get("ranker") == "model"
    monkeypatch.setenv("LONGCTX_RANKER", "sometimes")
    with pytest.raises(ConfigError, match="LONGCTX_RANKER='sometimes' is not valid"):
        config.get("ranker")
    monkeypatch.setenv("LONGCTX_SEGMENT_TOKENS", "-1")
    with pytest.raises(ConfigError, match="LONGCTX_SEGMENT_TOKENS"):
        config.get("segment_tokens")


def test_openblas_is_a_path_or_off(monkeypatch):
    for raw, want in (
        ("", None),
        ("1", None),
        ("on", None),
        ("0", False),
        ("off", False),
        ("/opt/libopenblas.so", "/opt/libopenblas.so"),
    ):
        monkeypatch.setenv("LONGCTX_OPENBLAS", raw)
        assert config.get("openblas") == want, raw


def test_a_changed_or_removed_variable_is_read_again(monkeypatch):
    """A variable set, changed, set back or removed after a read is seen at the next read, as
    os.environ says it; a bad value is refused at every read."""
    for raw, want in (("8", 8), ("16", 16), ("8", 8)):
        monkeypatch.setenv("LONGCTX_SEGMENT_TOKENS", raw)
        assert config.get("segment_tokens") == want
    monkeypatch.delenv("LONGCTX_SEGMENT_TOKENS")
    assert config.get("segment_tokens") == 0
    monkeypatch.setenv("LONGCTX_PEER_TIMEOUT", "maybe")
    for _ in range(2):
        with pytest.raises(ConfigError, match="LONGCTX_PEER_TIMEOUT"):
            config.get("peer_timeout")


def test_settings_are_few_and_a_users():
    """At most 8 settings, each a user's; experiments are keyword arguments (issue #56)."""
    assert len(config.SETTINGS) <= 8
    assert all(s.env.startswith("LONGCTX_") for s in config.SETTINGS.values())


def test_nothing_else_reads_longctx_settings_from_the_environment():
    offenders = []
    for path in (ROOT / "longctx").rglob("*.py"):
        if path.name == "config.py":
            continue
        text = path.read_text()
        if re.search(r"environ(\.get)?\(?\[?[\"']LONGCTX_", text) or re.search(r"getenv\([\"']LONGCTX_", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_every_setting_is_in_the_configuration_docs():
    docs = (ROOT / "docs" / "configuration.md").read_text()
    assert config.table() in docs


def test_kernels_import_only_mlx():
    for path in (ROOT / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            else:
                continue
            for name in names:
                allowed = (
                    "mlx",
                    "__future__",
                    "math",
                    "hashlib",
                    "contextlib",
                    "dataclasses",
                    "functools",
                    "warnings",
                    "sys",
                    "types",
                )
                assert name.split(".")[0] in allowed, (path.name, name)
