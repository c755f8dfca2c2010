"""The package's shape: packages by job, layered so that imports flow one way (from the command line
down to the shared core), with no import loop between modules.

A module may import modules of its own package and of packages below it. The registries are the
exception, by design: the recipe schema takes its choices from them (data formats, metrics, model
sources, training methods) and plan and evaluation look methods up in them, so any layer may import a
registry, and a registry's module-level imports stay within the core (its heavier work imports what it
needs inside the functions that do it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tunekit

PACKAGE = Path(tunekit.__file__).parent
# lowest first: a module may import from its own package and the packages before it
PACKAGES = ["core", "config", "models", "data", "runs", "evaluation", "plan", "training", "export", "reporting",
            "cli"]
REGISTRIES = ["data.formats", "evaluation.metrics", "evaluation.rewards", "models.sources", "training.methods"]
SECTION = "config.section"  # the recipe section base class, which registered settings derive from


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """tunekit modules that the file imports (at the top, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    known = modules()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tunekit"):
            base = node.module.split(".", 1)[1] if "." in node.module else ""
            for alias in node.names:
                full = f"{base}.{alias.name}".strip(".")
                found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("tunekit."))
    return {f for f in found if f and f != "__version__"}


def package(module: str) -> str:
    return module.split(".")[0]


def is_registry(module: str) -> bool:
    return any(module == r or module.startswith(r + ".") for r in REGISTRIES)


def test_every_module_sits_in_a_layered_package():
    loose = [m for m in modules() if package(m) not in PACKAGES and m != "__main__"]
    assert not loose, f"modules outside the layered packages: {loose}"
    assert sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()) == sorted(PACKAGES)


def test_imports_flow_down_between_packages():
    wrong = []
    for module, path in modules().items():
        if module == "__main__":
            continue
        rank = PACKAGES.index(package(module))
        for dep in sorted(imports(path)):
            if is_registry(dep) or package(dep) not in PACKAGES:
                continue
            if PACKAGES.index(package(dep)) > rank:
                wrong.append(f"{module} imports {dep}")
    assert not wrong, wrong


def test_registries_import_only_the_core_when_imported():
    wrong = [f"{m} imports {d}" for m, p in modules().items() if is_registry(m)
             for d in sorted(imports(p, top_level_only=True))
             if package(d) != "core" and d != SECTION and not is_registry(d)]
    assert not wrong, wrong


def test_imports_are_absolute():
    """The checks above read `from tunekit.x import y`; a relative import would slip past them."""
    relative = [f"{m}: from {'.' * n.level}{n.module or ''}" for m, p in modules().items()
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, relative


def test_registries_never_import_what_drives_a_run():
    """A method builds its data, model and trainer from the layers below the runner; it never reaches the
    runner or a command, so the recipe importing the registry cannot pull a run in."""
    drivers = ("training.runner",)
    wrong = [f"{m} imports {d}" for m, p in modules().items() if is_registry(m) for d in sorted(imports(p))
             if d in drivers or PACKAGES.index(package(d)) > PACKAGES.index(package(m))]
    assert not wrong, wrong


def test_no_import_cycle_between_modules():
    graph = {m: {d for d in imports(p, top_level_only=True) if d in modules()} for m, p in modules().items()}
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> list[str] | None:
        if state.get(m) == 1:
            return trail + [m]
        if state.get(m) == 2:
            return None
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            loop = visit(d, trail + [m])
            if loop:
                return loop
        state[m] = 2
        return None

    for m in sorted(graph):
        loop = visit(m, [])
        assert loop is None, " -> ".join(loop)


def test_the_checker_sees_a_wrong_import(tmp_path, monkeypatch):
    """The layering check can fail: a core module importing the CLI is reported."""
    fake = tmp_path / "tunekit"
    (fake / "core").mkdir(parents=True)
    (fake / "cli").mkdir()
    for d in ("", "core", "cli"):
        (fake / d / "__init__.py").write_text("")
    (fake / "core" / "bad.py").write_text("from tunekit.cli.main import main\n")
    (fake / "cli" / "main.py").write_text("def main(): pass\n")
    monkeypatch.setattr("test_layout.PACKAGE", fake)
    monkeypatch.setattr("test_layout.PACKAGES", ["core", "cli"])
    try:
        test_imports_flow_down_between_packages()
    except AssertionError as e:
        assert "core.bad imports cli.main" in str(e)
    else:
        raise AssertionError("a core module importing the CLI was not reported")


def test_the_run_directory_layout_is_named_in_one_module():
    """Its file names, and its folders joined onto a path, are spelled out only in runs/layout.py."""
    layout = re.compile(r'"(run\.json|recipe\.yaml|loss_history\.jsonl|tunekit\.json|deepspeed\.json)"'
                        r'|/ "(adapter|model|eval|checkpoints)"')
    for path in PACKAGE.rglob("*.py"):
        if path != PACKAGE / "runs" / "layout.py":
            found = layout.search(path.read_text())
            assert found is None, f"{path.name} spells out {found.group(0)}; use the name from runs.layout"
