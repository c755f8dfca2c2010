"""The package's shape: imports flow one way, from the command line down to the recipe, so that no
module needs one above it (and no import loop can form)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tunekit

PACKAGE = Path(tunekit.__file__).parent
# lowest first: a module may import only modules listed before it; a nested module by its dotted name
LAYERS = ["errors", "quiet", "statefile", "tiny", "demo_data", "distributed", "sources", "hub", "hardware", "metrics", "scoretable",
          "formats", "dsconfig", "losspath", "packing", "checkpointdir", "section",
          "methods.base", "methods.pairs", "methods.sft", "methods.dpo", "methods.kto", "methods.orpo", "methods",
          "recipe", "outputs", "rundir", "runlist", "report", "modelinfo", "data", "arrowdata", "models", "trained", "dscheckpoint",
          "trainer", "checkpoints", "plan",
          "preflight", "evaluation", "trackers", "train", "merge", "export_source", "model_license", "modelfile", "gguf_writer",
          "export_check", "export_formats", "export", "demo", "cli", "__main__"]
# A training method's module (methods/) is read by the recipe schema, so its top-level imports sit below the
# recipe; the training stages it runs import what they need (data, models, the Trainer) inside functions, at
# run time. Those deferred imports stay below DEFERRED_CEILING: never the modules that drive a run.
DEFERRED = "methods."
DEFERRED_CEILING = "checkpoints"


def module_names() -> list[str]:
    """Every module of the package, a nested one dotted (a subpackage by its own name, for its __init__)."""
    names = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            names.append(".".join(parts))
    return names


def module_path(name: str) -> Path:
    path = PACKAGE.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imports(name: str, deferred: bool = True) -> set[str]:
    """tunekit modules that module `name` imports, at the top or (`deferred`) inside functions too."""
    path, known = module_path(name), set(module_names())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    found = set()
    for node in (ast.walk(tree) if deferred else tree.body):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base, module = package[:len(package) - node.level + 1], node.module
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tunekit."):
            base, module = [], node.module.removeprefix("tunekit.")
        else:
            continue
        for parts in ([base + module.split(".")] if module else [base + [a.name] for a in node.names]):
            # the longest dotted prefix that is a module; `from . import Name` names the package itself
            hit = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known),
                       ".".join(base))
            if hit and hit != name:
                found.add(hit)
    return found


def test_every_module_has_a_layer():
    assert sorted(module_names()) == sorted(LAYERS)


def test_imports_flow_one_way():
    wrong = [f"{m} imports {d}" for m in LAYERS for d in sorted(imports(m, deferred=not m.startswith(DEFERRED)))
             if d not in LAYERS or LAYERS.index(d) >= LAYERS.index(m)]
    assert not wrong, wrong


def test_training_methods_defer_only_what_a_trainer_needs():
    ceiling = LAYERS.index(DEFERRED_CEILING)
    wrong = [f"{m} imports {d}" for m in LAYERS if m.startswith(DEFERRED) for d in sorted(imports(m))
             if d not in LAYERS or LAYERS.index(d) >= ceiling]
    assert not wrong, wrong


def test_the_run_directory_layout_is_named_in_one_module():
    """Its file names, and its folders joined onto a path, are spelled out only in rundir.py."""
    layout = re.compile(r'"(run\.json|recipe\.yaml|loss_history\.jsonl|tunekit\.json|deepspeed\.json)"'
                        r'|/ "(adapter|model|eval|checkpoints)"')
    for path in PACKAGE.glob("*.py"):
        if path.stem != "rundir":
            found = layout.search(path.read_text())
            assert found is None, f"{path.name} spells out {found.group(0)}; use the name from rundir"

