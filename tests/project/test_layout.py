"""The package's shape: packages by job, layered so that imports flow one way (from the command line down to
the shared core), with no import circle between modules, counting the imports inside functions.

A module may import modules of its own package and of packages below it, nothing above. The registries are no
exception: what the recipe must know of one (method, data format, metric and reward names and facts) is
declared on the ground floor (config/), and the implementations above register against those names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import tunekit

PACKAGE = Path(tunekit.__file__).parent
# lowest first: a module may import from its own package and the packages before it
PACKAGES = ["core", "config", "models", "tooluse", "data", "runs", "evaluation", "plan", "training", "export",
            "reporting", "api", "cli"]
OPTIONAL = {"api"}  # being written: tolerated while its folder does not exist yet
ENTRY = "__main__"  # `python -m tunekit`: above every package
# The package root (tunekit/__init__.py: __version__ from core.version, and the API's names looked up on first use)
# is no node of the graph, and no module imports it (test_no_module_imports_the_package_root).


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """tunekit modules that the file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tunekit" and not node.level:
            base = node.module.partition(".")[2]
            for alias in node.names:
                full = f"{base}.{alias.name}".strip(".")
                found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found.update(a.name.partition(".")[2] for a in node.names if a.name.startswith("tunekit."))
    return {f for f in found if f in known}


def graph() -> dict[str, set[str]]:
    """module -> the tunekit modules it imports (function-level imports included)."""
    found = modules()
    return {m: imports(p, set(found)) for m, p in found.items()}


def rank(module: str) -> int:
    return len(PACKAGES) if module == ENTRY else PACKAGES.index(module.split(".")[0])


def back_arrows(edges: dict[str, set[str]]) -> list[str]:
    """Each import from a lower package to a higher one."""
    return [f"{m} imports {d}" for m in sorted(edges) for d in sorted(edges[m]) if rank(d) > rank(m)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module, or a module importing itself
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = []
            while True:
                d = stack.pop()
                component.append(d)
                if d == m:
                    break
            if len(component) > 1 or m in edges.get(m, ()):
                found.append(sorted(component))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return found


def test_every_module_sits_in_a_layered_package():
    loose = [m for m in modules() if m != ENTRY and m.split(".")[0] not in PACKAGES]
    assert not loose, f"modules outside the layered packages: {loose}"
    present = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert set(PACKAGES) - OPTIONAL <= set(present) <= set(PACKAGES), present


def test_imports_flow_down_between_packages():
    wrong = back_arrows(graph())
    assert not wrong, wrong


def test_no_module_imports_the_package_root():
    """The root reaches tunekit.api on first use; a module importing it would be an arrow from below to the top."""
    importers = sorted(m for m, p in modules().items()
                       for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                       if isinstance(node, ast.ImportFrom) and node.module == "tunekit" and not node.level
                       and any(a.name != "api" for a in node.names))
    assert not importers, f"modules importing from the package root (tunekit/__init__.py): {importers}"


def test_no_import_cycle_between_modules():
    circles = cycles(graph())
    assert not circles, [" <-> ".join(c) for c in circles]


def test_the_checker_reports_a_back_arrow_and_a_cycle():
    """The checks can fail: a made-up graph with an arrow back up (core importing the CLI) and a circle of three
    data modules, beside a clean chain, reports exactly those."""
    edges = {"core.a": {"cli.main"}, "cli.main": {"config.schema"}, "config.schema": {"core.errors"},
             "core.errors": set(), "data.x": {"data.y"}, "data.y": {"data.z"}, "data.z": {"data.x", "core.errors"}}
    assert back_arrows(edges) == ["core.a imports cli.main"]
    assert cycles(edges) == [["data.x", "data.y", "data.z"]]
    assert cycles({"data.x": {"data.x"}}) == [["data.x"]]


def test_the_checker_reads_imports_inside_functions(tmp_path):
    (tmp_path / "low.py").write_text("def f():\n    from tunekit.cli.main import main\n    import tunekit.api.x\n")
    assert imports(tmp_path / "low.py", {"cli.main", "api.x"}) == {"cli.main", "api.x"}


def test_imports_are_absolute():
    """The checks above read `from tunekit.x import y`; a relative import would slip past them."""
    relative = [f"{m}: from {'.' * n.level}{n.module or ''}" for m, p in modules().items()
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, relative


def _registries():
    from tunekit.config import dataformats, methods, metrickinds, rewardkinds
    from tunekit.data import formats
    from tunekit.evaluation import metrics, rewards
    from tunekit.training import methods as trainers

    return {"data formats": (dataformats.DECLARED, formats.FORMATS, formats.register),
            "metrics": (metrickinds.DECLARED, metrics.METRICS, metrics.register),
            "rewards": (rewardkinds.DECLARED, rewards.KINDS, rewards.register),
            "training methods": (methods.DECLARED, trainers.METHODS, _register_method)}


def _register_method(name: str):
    from tunekit.training import methods

    return methods.register(type("Undeclared", (methods.Method,), {"name": name})())


@pytest.mark.parametrize("registry", ["data formats", "metrics", "rewards", "training methods"])
def test_every_declared_name_is_implemented_and_nothing_else(registry):
    declared, implemented, register = _registries()[registry]
    assert list(implemented) == list(declared), f"{registry}: declared and implemented differ"
    with pytest.raises(ValueError, match="'nonesuch' is not declared in tunekit.config"):
        register("nonesuch")
    with pytest.raises(ValueError, match="registered twice"):
        register(next(iter(declared)))
    assert list(implemented) == list(declared)


def test_the_run_directory_layout_is_named_in_one_module():
    """Its file names, and its folders joined onto a path, are spelled out only in runs/layout.py."""
    layout = re.compile(r'"(run\.json|recipe\.yaml|loss_history\.jsonl|tunekit\.json|deepspeed\.json)"'
                        r'|/ "(adapter|model|eval|checkpoints)"')
    for path in PACKAGE.rglob("*.py"):
        if path != PACKAGE / "runs" / "layout.py":
            found = layout.search(path.read_text())
            assert found is None, f"{path.name} spells out {found.group(0)}; use the name from runs.layout"
