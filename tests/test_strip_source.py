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
    src = ('#define ADD(a, b) \\\n      ((a) +   (b))   // sum\n'
           '  int s = "a  // not a comment /* nor this */";  /* one\n two */ int t;\n'
           "  char q = '\"'; int u = 1'000; // it's\n\n\tfloat x = y / *p;\n")
    out = strip(src)
    assert out.count("\n") == src.count("\n")
    assert out.split("\n") == [
        "#define ADD(a, b) \\", " ((a) + (b))",
        'int s = "a  // not a comment /* nor this */";',
        "int t;", "char q = '\"'; int u = 1'000;", "", "float x = y / *p;", ""]
    assert strip(out) == out


def _kernel_modules():
    for m in pkgutil.iter_modules(kernels.__path__):
        yield importlib.import_module(f"longctx.kernels.{m.name}")


def test_every_spec_and_prelude_is_stripped():
    specs = [v for mod in _kernel_modules() for v in vars(mod).values()
             if isinstance(v, _prelude.KernelSpec)]
    assert len(specs) >= 10
    for spec in specs + [_prelude.KernelSpec("x", (), (), "int a; // b\n")]:
        assert strip(spec.source) == spec.source
        assert "//" not in re.sub(r'"(\\.|[^"\\\n])*"', "", spec.source)
        assert strip(spec.header) == spec.header
    for text in (_prelude.CUDA_HEADER, _prelude.METAL_HEADER, _prelude.COMMON,
                 _prelude.CUDA_IDS, _prelude.METAL_IDS):
        assert strip(text) == text


def _tokens(text: str) -> list[str]:
    """The lines of `text` as the C preprocessor sees them before expanding anything (g++
    -fpreprocessed: comments out, directives kept), blanks collapsed outside nothing else."""
    res = subprocess.run(["g++", "-fpreprocessed", "-dD", "-E", "-P", "-x", "c++", "-"],
                         input=text, capture_output=True, text=True, check=True)
    return [" ".join(line.split()) for line in res.stdout.splitlines() if line.strip()]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (its preprocessor)")
def test_the_preprocessor_sees_the_same_tokens_in_every_kernel_text():
    """Every kernel text as written (the modules' source constants, before a KernelSpec strips
    them) and stripped: the same tokens, line by line (a lost `//` inside a string, a macro's
    continuation glued to its previous line, would differ)."""
    texts = [(mod.__name__, name, v) for mod in _kernel_modules() for name, v in vars(mod).items()
             if isinstance(v, str) and name.lstrip("_").isupper() and ";" in v and len(v) > 100]
    assert len(texts) >= 10
    for module, name, raw in texts:
        assert strip(raw).count("\n") == raw.count("\n"), (module, name)
        assert _tokens(strip(raw)) == _tokens(raw), (module, name)
