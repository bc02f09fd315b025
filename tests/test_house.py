"""The house's checkable rules: the generated result tables are current, the README stays short,
the product benchmarks stay few, and the library keeps its settings few."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_result_tables_are_generated_from_the_results_files():
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tables.py"), "--check"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_readme_is_short_and_has_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    blocks = text.split("```bash\n")[1:]
    commands = [b.split("```")[0].strip() for b in blocks]
    assert commands[:2] == [
        'bash scripts/setup.sh && .venv/bin/longctx ingest samples/report.pdf && .venv/bin/longctx ask '
        '"Who is the chief engineer of the cooperative?"',
        "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q",
    ]
    assert len(commands) == 2


def test_ci_runs_the_readme_test_command_and_ruff():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q" in ci
    assert "ruff check" in ci and "ruff format --check" in ci


def _import_graph() -> dict[str, set[str]]:
    """longctx's modules and the longctx modules each imports, at module or function level."""
    import ast

    mods = {}
    for p in [*ROOT.glob("longctx/**/*.py"), *ROOT.glob("kernels/*.py")]:
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "kernels":
            parts = ["longctx", "kernels", *parts[1:]]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p

    def known(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {m: set() for m in mods}
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from P import n`: the module P.n where n is one, else P's own namespace
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for n in names:
                target = known(n) if n.startswith("longctx") else ""
                if target and target != m:
                    graph[m].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_modules():
    """No import cycle among longctx's modules, package __init__ files included (function-level
    imports count: a deferred import is still a dependency)."""
    assert _cycles(_import_graph()) == []


def test_no_module_reaches_into_another_modules_private_names():
    """No longctx module imports or reads another longctx module's underscore names (`_prelude`,
    the kernels' shared launcher that ../shared/tools/metal_check drives by that name, is the
    one module whose own name starts with one)."""
    import ast

    bad = []
    for p in [*ROOT.glob("longctx/**/*.py"), *ROOT.glob("kernels/*.py")]:
        tree = ast.parse(p.read_text())
        aliases = set()  # names bound to longctx modules in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("longctx")):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_prelude":
                        bad.append(f"{p.relative_to(ROOT)}:{node.lineno} imports {a.name}")
                    aliases.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                aliases.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("longctx"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert bad == []


def test_function_level_imports_of_longctx_say_why_they_are_deferred():
    """A longctx module imported inside a function defers start-up cost (MLX, FastAPI, or the
    other commands' modules at the CLI): each such import, or the run of imports it is in, carries
    a `# deferred: ...` comment saying what it defers. Every other import stands at the top."""
    import ast

    bad = []
    for p in [*ROOT.glob("longctx/**/*.py"), *ROOT.glob("kernels/*.py")]:
        lines = p.read_text().splitlines()
        runs = {}  # first line of a run of consecutive function-level imports -> its lines

        def visit(node, in_func):
            for c in ast.iter_child_nodes(node):
                if in_func and isinstance(c, (ast.Import, ast.ImportFrom)):
                    mod = c.module or "" if isinstance(c, ast.ImportFrom) else c.names[0].name
                    if getattr(c, "level", 0) or mod.startswith("longctx"):
                        yield c
                yield from visit(c, in_func or isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)))

        start = end = None
        for n in sorted(visit(ast.parse("\n".join(lines)), False), key=lambda n: n.lineno):
            if end is None or n.lineno != end + 1:
                start = n.lineno
            end = n.end_lineno
            runs.setdefault(start, []).append(n.lineno)
        for start, members in runs.items():
            if not any("# deferred" in lines[i - 1] for i in (start - 1, *members) if i >= 1):
                bad.append(f"{p.relative_to(ROOT)}:{start}")
    assert bad == []
