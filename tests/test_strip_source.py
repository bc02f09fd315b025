"""`kernels._prelude.strip_source`: what MLX compiles (and hashes at every launch) is the kernels'
source without comments and indentation, with the same tokens on the same lines."""

from __future__ import annotations

import importlib
import pkgutil
import re
import shutil
import subprocess

import pytest

from longctx import kernels
from longctx.kernels import _prelude

strip = _prelude.strip_source


def test_comments_and_blanks_go_strings_and_lines_stay():
    src = (
        '#define ADD(a, b) \\\n      ((a) +   (b))   // sum\n'
        '  int s = "a  // not a comment /* nor this */";  /* one\n two */ int t;\n'
        "  char q = '\"'; int u = 1'000; // it's\n\n\tfloat x = y / *p;\n"
    )
    out = strip(src)
    assert out.count("\n") == src.count("\n")
    assert out.split("\n") == [
        "#define ADD(a, b) \\",
        " ((a) + (b))",
        'int s = "a  // not a comment /* nor this */"; \\',
        " int t;",
        "char q = '\"'; int u = 1'000;",
        "",
        "float x = y / *p;",
        "",
    ]
    assert strip(out) == out


@pytest.mark.parametrize(
    "src, want",
    [
        ("a // x \\\n b\nc", "a\n\nc"),  # a comment's spliced line is the comment's
        ("#define A x /* c\n d */ y\nz", "#define A x \\\n y\nz"),  # the directive goes on
        ("a  /* x */  b", "a b"),
        ("x /* a\nb\nc */ y", "x \\\n \\\n y"),
    ],
)
def test_comments_that_splice_or_span_lines(src, want):
    assert strip(src) == want and strip(want) == want


def _kernel_modules():
    for m in pkgutil.iter_modules(kernels.__path__):
        yield importlib.import_module(f"longctx.kernels.{m.name}")


def test_what_every_spec_assembles_to_is_stripped():
    """What MLX gets (`assemble`, on both backends) has no comment left and keeps the spec's
    lines; the preludes are stripped where they are defined (metal_check maps lines by their
    lengths)."""
    specs = [v for mod in _kernel_modules() for v in vars(mod).values() if isinstance(v, _prelude.KernelSpec)]
    assert len(specs) >= 10
    for spec in specs + [_prelude.KernelSpec("x", (), (), "int a; // b\n", "int c; /* d */")]:
        for which in ("cuda", "metal"):
            header, body = _prelude.assemble(spec, which)
            for text in (header, body):
                assert strip(text) == text
                assert "//" not in re.sub(r'"(\\.|[^"\\\n])*"', "", text)
                assert "/*" not in text
            assert body.endswith(strip(spec.source))
            assert body.count("\n") - spec.source.count("\n") == (_prelude.PRELUDES[which][1].count("\n"))
    for text in (_prelude.CUDA_HEADER, _prelude.METAL_HEADER, _prelude.COMMON, _prelude.CUDA_IDS, _prelude.METAL_IDS):
        assert strip(text) == text


def _tokens(text: str) -> list[str]:
    """The lines of `text` as the C preprocessor sees them before expanding anything (g++
    -fpreprocessed: comments out, directives kept, no line splicing), blanks collapsed."""
    res = subprocess.run(
        ["g++", "-fpreprocessed", "-dD", "-E", "-P", "-x", "c++", "-"], input=text, capture_output=True, text=True, check=True
    )
    return [" ".join(line.split()) for line in res.stdout.splitlines() if line.strip()]


def _raw_texts() -> list[tuple[str, int, str]]:
    """Every kernel text as the files write it (before a KernelSpec or the prelude strips it):
    the string literals of kernels/*.py with a `;` and 100+ characters, module constants and
    the `source=` of KernelSpec calls alike, found by parsing the files."""
    import ast
    from pathlib import Path

    texts = []
    for path in sorted(Path(kernels.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)  # docstrings are prose
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
                and ";" in node.value
                and len(node.value) > 100
            ):
                texts.append((path.name, node.lineno, node.value))
    return texts


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (its preprocessor)")
def test_the_preprocessor_sees_the_same_tokens_in_every_kernel_text():
    """Every kernel text as written and stripped: the same tokens, line by line, and the same
    token stream once backslash-newlines are spliced (a lost `//` inside a string, a macro's
    continuation glued to its previous line, a comment's spliced line would differ)."""
    texts = _raw_texts()
    assert len(texts) >= 25
    for where, line, raw in texts:
        out = strip(raw)
        assert out.count("\n") == raw.count("\n"), (where, line)
        assert _tokens(out) == _tokens(raw), (where, line)
        assert " ".join(_tokens(out.replace("\\\n", ""))) == " ".join(_tokens(raw.replace("\\\n", ""))), (where, line)
