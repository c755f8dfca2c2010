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


# ---------------------------------------------------------------- private upstream hooks
# transformers writes optimizer, scheduler, scaler and RNG state with torch.save and offers no public
# hook to change the format; DeepSpeed offers no safetensors checkpoint engine. tunekit overrides these
# private methods (trainer.py, dscheckpoint.py); if an upgrade renames one, the override would be
# skipped silently and pickles written again. These checks make that upgrade fail here instead.
TRAINER_HOOKS = ["_save", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "_save_scaler",
                 "_load_scaler", "_save_rng_state", "_load_rng_state"]
ENGINE_HOOKS = ["_get_ckpt_name", "_get_rank_zero_ckpt_name", "_copy_recovery_script"]


def test_the_private_trainer_methods_tunekit_overrides_still_exist_upstream():
    import inspect

    from transformers import Trainer

    from tunekit.preference import PreferenceTrainer
    from tunekit.trainer import SafeState, SafeStateTrainer

    for name in TRAINER_HOOKS:
        assert callable(getattr(Trainer, name, None)), f"transformers.Trainer.{name} is gone: update trainer.py"
        assert name in SafeState.__dict__, f"SafeState no longer overrides {name}"
        for trainer in (SafeStateTrainer, PreferenceTrainer):  # no class between them and SafeState overrides it
            assert getattr(trainer, name) is getattr(SafeState, name), f"{trainer.__name__}.{name} bypasses SafeState"
        ours = inspect.signature(SafeState.__dict__[name]).parameters
        theirs = inspect.signature(getattr(Trainer, name)).parameters
        assert list(ours)[:2] == list(theirs)[:2], f"Trainer.{name} changed its signature: {theirs}"


def test_the_private_deepspeed_engine_methods_tunekit_replaces_still_exist_upstream():
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name in ENGINE_HOOKS:
        assert callable(getattr(DeepSpeedEngine, name, None)), f"DeepSpeedEngine.{name} is gone: update dscheckpoint.py"


def test_the_other_library_internals_tunekit_relies_on_still_exist():
    """torch exposes the CPU's bf16 support only privately (hardware.py picks bf16 by it); bitsandbytes
    offers no public switch for its inference-only CPU path that stops 4-bit training (models.py); the
    GGUF header reader has no public name in transformers (modelinfo.py). A rename must fail here, not
    silently change which precision or path a run takes."""
    import inspect

    import bitsandbytes as bnb
    import torch

    assert callable(getattr(torch.cpu, "_is_avx512_bf16_supported", None))
    assert callable(getattr(torch.cpu, "_is_amx_tile_supported", None))
    layer = bnb.nn.Linear4bit(64, 64, quant_type="nf4")
    assert hasattr(layer, "support_avx512bf16_for_cpu")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    assert "return_tensors" in inspect.signature(load_gguf_checkpoint).parameters
