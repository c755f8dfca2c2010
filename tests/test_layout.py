"""The package's shape: imports flow one way, from the command line down to the recipe, so that no
module needs one above it (and no import loop can form)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tunekit

PACKAGE = Path(tunekit.__file__).parent
# lowest first: a module may import only modules listed before it
LAYERS = ["errors", "quiet", "statefile", "tiny", "demo_data", "distributed", "sources", "hub", "hardware", "metrics", "scoretable",
          "formats", "dsconfig", "losspath", "packing", "checkpointdir",
          "recipe", "outputs", "rundir", "runlist", "report", "modelinfo", "data", "arrowdata", "models", "trained", "dscheckpoint",
          "trainer", "preference", "checkpoints", "plan",
          "preflight", "evaluation", "trackers", "train", "merge", "export_source", "model_license", "modelfile", "gguf_writer",
          "export_check", "export_formats", "export", "demo", "cli", "__main__"]


def imports(module: Path) -> set[str]:
    """tunekit modules that `module` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            found.update(n for n in names if n != "__version__")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tunekit."):
            found.add(node.module.split(".")[1])
    return found


def test_every_module_has_a_layer():
    assert sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__") == sorted(LAYERS)


def test_imports_flow_one_way():
    wrong = [f"{m} imports {d}" for m in LAYERS for d in sorted(imports(PACKAGE / f"{m}.py"))
             if d not in LAYERS or LAYERS.index(d) >= LAYERS.index(m)]
    assert not wrong, wrong


def test_the_run_directory_layout_is_named_in_one_module():
    """Its file names, and its folders joined onto a path, are spelled out only in rundir.py."""
    layout = re.compile(r'"(run\.json|recipe\.yaml|loss_history\.jsonl|tunekit\.json|deepspeed\.json)"'
                        r'|/ "(adapter|model|eval|checkpoints)"')
    for path in PACKAGE.glob("*.py"):
        if path.stem != "rundir":
            found = layout.search(path.read_text())
            assert found is None, f"{path.name} spells out {found.group(0)}; use the name from rundir"

