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
    assert config.get("fused_max_lq") == 64 and config.get("dense_gpu") is True
    monkeypatch.setenv("LONGCTX_FUSED_MAX_LQ", "8")
    monkeypatch.setenv("LONGCTX_DENSE_GPU", "0")
    monkeypatch.setenv("LONGCTX_DECODE_ONCE_MAX_MB", "1.5")
    assert config.get("fused_max_lq") == 8 and config.get("dense_gpu") is False
    assert config.get("decode_once_max") == int(1.5 * 2**20)
    monkeypatch.setenv("LONGCTX_COMPILE", "sometimes")
    with pytest.raises(ConfigError, match="LONGCTX_COMPILE='sometimes' is not valid"):
        config.get("compile")
    with config.override(compile="0"):
        assert config.get("compile") == "0"


def test_a_changed_or_removed_variable_is_read_again(monkeypatch):
    """Parsed values are kept per raw value: a variable set, changed, set back or removed after
    a read is seen at the next read, as os.environ says it."""
    for raw, want in (("8", 8), ("16", 16), ("8", 8)):
        monkeypatch.setenv("LONGCTX_FUSED_MAX_LQ", raw)
        assert config.get("fused_max_lq") == want
    monkeypatch.delenv("LONGCTX_FUSED_MAX_LQ")
    assert config.get("fused_max_lq") == 64
    monkeypatch.setenv("LONGCTX_OPENBLAS", "")
    assert config.get("openblas") is None  # empty text: the default
    monkeypatch.setenv("LONGCTX_FUSED_STEP", "maybe")
    for _ in range(2):  # a bad value is refused at every read, not cached
        with pytest.raises(ConfigError, match="LONGCTX_FUSED_STEP"):
            config.get("fused_step")


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
                allowed = ("mlx", "__future__", "math", "hashlib", "contextlib", "dataclasses",
                           "functools", "warnings", "sys", "types")
                assert name.split(".")[0] in allowed, (path.name, name)
