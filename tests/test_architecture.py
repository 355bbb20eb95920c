"""The layout's rules, checked on the import graph (docs/architecture.md says why each holds):

* simcore, the runtime model, imports nothing of kernelsight outside itself;
* nothing imports the command-line modules (``kernelsight.cli`` and each package's ``cli``) but the main CLI
  and the ``__main__`` entry points;
* no import cycle, between modules or between packages.

Every import counts: module-level, inside functions, and under ``if TYPE_CHECKING:`` (a cycle hidden from the
interpreter is still two modules that cannot be understood apart).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name → file, for every .py file of ``package`` below ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import names: the longest known prefix of the dotted name (``a.b.func`` → ``a.b``)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in modules:
            return cand
    return None


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module → the package's modules it imports (anywhere in the file)."""
    modules = module_files(root, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:     # relative: from the module's own package upward
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one
                names = [f"{base}.{a.name}" for a in node.names] or [base]
            for name in names:
                target = _resolve(name, modules)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def room(module: str) -> str:
    """The package (or top-level module) a module belongs to: ``kernelsight.server.wire.routes.chat`` → ``server``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Room → the rooms it imports. A ``__main__`` entry point is left out: nothing imports it, so it closes no
    cycle (``python -m kernelsight.server`` runs the main CLI, which attaches the server's subcommand)."""
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        if mod.endswith(".__main__"):
            continue
        out.setdefault(room(mod), set()).update(room(d) for d in deps if room(d) != room(mod))
    return out


def violations(graph: dict[str, set[str]], package: str) -> list[str]:
    """Every broken rule of the layout, one line each."""
    errs = []
    core = f"{package}.simcore"
    for mod, deps in sorted(graph.items()):
        if mod == core or mod.startswith(core + "."):
            errs += [f"{mod} (simcore) imports {d}" for d in sorted(deps)
                     if not (d == core or d.startswith(core + "."))]
        cli_users_ok = mod == f"{package}.cli" or mod.endswith(".__main__")
        if not cli_users_ok:
            errs += [f"{mod} imports the CLI module {d}" for d in sorted(deps) if d.split(".")[-1] == "cli"]
    errs += [f"module cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    errs += [f"package cycle: {' <-> '.join(c)}" for c in cycles(package_graph(graph))]
    return errs


def _write(root: Path, files: Iterable[tuple[str, str]]) -> None:
    for rel, text in files:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


# -- the project -------------------------------------------------------------------------------------------
def test_kernelsight_keeps_the_layout_rules():
    graph = import_graph(ROOT, "kernelsight")
    assert "kernelsight.simcore.step_model" in graph and graph["kernelsight.simcore.step_model"], \
        "the graph was read (step_model imports its peers)"
    assert violations(graph, "kernelsight") == []


def test_simcore_is_the_bottom_of_the_graph():
    pg = package_graph(import_graph(ROOT, "kernelsight"))
    assert pg["simcore"] == set()
    assert "simcore" in pg["server"] and "simcore" in pg["calibrate"] and "simcore" in pg["loadgen"]


# -- the checker itself finds what it is for ---------------------------------------------------------------
def test_checker_finds_each_kind_of_violation(tmp_path):
    _write(tmp_path, [
        ("pkg/__init__.py", ""),
        ("pkg/cli.py", "from pkg.server import cli\n"),
        ("pkg/simcore/__init__.py", ""),
        ("pkg/simcore/a.py", "from pkg.simcore import b\n"),
        # a cycle through a function-level import, and simcore reaching out (under TYPE_CHECKING)
        ("pkg/simcore/b.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.loadgen import x\n"
                             "def f():\n    from . import a\n"),
        ("pkg/loadgen/__init__.py", ""),
        ("pkg/loadgen/x.py", "import math\nfrom pkg.server.y import thing\n"),
        ("pkg/server/__init__.py", ""),
        ("pkg/server/cli.py", ""),
        ("pkg/server/y.py", "from pkg.loadgen.x import other\nfrom pkg.cli import main\n"),
    ])
    errs = violations(import_graph(tmp_path, "pkg"), "pkg")
    assert "pkg.simcore.b (simcore) imports pkg.loadgen.x" in errs
    assert "pkg.server.y imports the CLI module pkg.cli" in errs
    assert "module cycle: pkg.simcore.a <-> pkg.simcore.b" in errs
    assert "module cycle: pkg.loadgen.x <-> pkg.server.y" in errs
    assert any(e.startswith("package cycle:") and "loadgen" in e and "server" in e for e in errs)
    # the main CLI may import a package's cli module; a relative import resolves from its package
    assert not any(e.startswith("pkg.cli ") for e in errs)


def test_checker_passes_a_clean_tree(tmp_path):
    _write(tmp_path, [
        ("pkg/__init__.py", ""),
        ("pkg/cli.py", "from pkg.server.cli import add\n"),
        ("pkg/simcore/__init__.py", ""),
        ("pkg/simcore/a.py", "import numpy\nfrom pkg.simcore.b import f\n"),
        ("pkg/simcore/b.py", "import math\n"),
        ("pkg/server/__init__.py", ""),
        ("pkg/server/cli.py", "from .y import z\n"),
        ("pkg/server/y.py", "from pkg.simcore import a\n"),
        ("pkg/server/__main__.py", "from pkg.cli import main\n"),
    ])
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.server.cli"] == {"pkg.server.y"}
    assert graph["pkg.server.y"] == {"pkg.simcore.a"}
    assert violations(graph, "pkg") == []
