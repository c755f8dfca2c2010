"""`tunekit plan` against the measured per-process peak under training.parallelism, on CPU processes (gloo):
sequence parallel (DeepSpeed's Ulysses, ZeRO-2 and ZeRO-3) and tensor parallel (transformers' plan), each beside
the same recipe in one process. Every point is a real `tunekit train` under torchrun; a callback measures one
optimizer step in every process as bench/plan_check.py does: the bytes of every live CPU tensor at the step's
start plus the peak of the profiler's running sum over every allocation and free in the step (the CPU
counterpart of torch.cuda.max_memory_allocated). The model is a random Llama of a real shape's proportions
(8 heads, 4 key/value heads), so that activations, not the tiny vocabulary, fill the peak.

    python bench/parallel_plan_check.py [--out bench/parallel_plan_check.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
STEP = 2  # the measured optimizer step: the optimizer state exists from the first

# name, world size, recipe changes
POINTS = [
    ("sp, ZeRO-2", 1, {"training": {"deepspeed": "ds_configs/zero2.json"}}),
    ("sp, ZeRO-2", 2, {"training": {"deepspeed": "ds_configs/zero2.json", "parallelism": {"sp": 2}}}),
    ("sp, ZeRO-3", 1, {"training": {"deepspeed": "ds_configs/zero3.json"}}),
    ("sp, ZeRO-3", 2, {"training": {"deepspeed": "ds_configs/zero3.json", "parallelism": {"sp": 2}}}),
    ("tp, full", 1, {"adapter": "none", "lora": None, "data": {"max_length": 512}}),
    ("tp, full", 2, {"adapter": "none", "lora": None, "data": {"max_length": 512},
                     "training": {"parallelism": {"tp": 2}}}),
]


def live_bytes() -> int:
    """Bytes of every CPU tensor storage alive now (a tensor-parallel DTensor counts its local shard)."""
    import torch

    storages = {}
    for obj in gc.get_objects():
        if not torch.is_tensor(obj):
            continue
        t = getattr(obj, "_local_tensor", obj)
        if t.device.type != "cpu" or t.is_meta:
            continue
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def probe_callback(out: Path):
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    from plan_check import profiled_peak

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == STEP - 1:
                gc.collect()
                self.held = live_bytes()
                self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step != STEP:
                return
            self.prof.__exit__(None, None, None)
            peak = profiled_peak(self.prof)
            rank = os.environ.get("RANK", "0")
            (out / f"rank{rank}.json").write_text(json.dumps({"held": self.held, "step_peak": peak,
                                                              "measured": self.held + peak}))

    return Probe()


def probe(recipe_file: str, out: str) -> None:
    """Runs in every process of the launch: `tunekit train` with the probe among its callbacks."""
    from tunekit.api import pipeline
    from tunekit.training import runner

    stock = runner.run_callbacks
    runner.run_callbacks = lambda recipe, run_dir: [*stock(recipe, run_dir), probe_callback(Path(out))]
    pipeline.train(recipe_file, force=True)


def planned(recipe_file: Path, world: int) -> dict:
    from tunekit.api import recipeargs
    from tunekit.plan import estimate

    recipe = recipeargs.load(str(recipe_file))
    plan = estimate.make(recipe, estimate.settings_from(recipe, world, recipe.training.precision))
    return {"planned": plan.peak, "parts": plan.parts}


def build(work: Path) -> tuple[Path, Path]:
    import torch
    from transformers import LlamaForCausalLM

    from tunekit.models.tiny import CORPUS, build_tokenizer, llama_config

    model = work / "model"
    model.mkdir()
    tok = build_tokenizer(model)
    cfg = llama_config(tok, context=4096)
    cfg.update({"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 32})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(model)
    tok.save_pretrained(model)
    text = " ".join(CORPUS * 60)  # past max_length in tokens: every row is cut to full length
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": "Repeat.", "output": text}) + "\n" for _ in range(16)))
    return model, data


def recipe_for(model: Path, data: Path, out: Path, changes: dict) -> dict:
    raw = {"model": {"name_or_path": str(model)}, "adapter": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
           "data": {"train": str(data), "format": "alpaca", "max_length": 2048},
           "training": {"precision": "fp32", "max_steps": STEP + 1, "micro_batch_size": 1, "learning_rate": 1e-4,
                        "logging_steps": 1, "save_steps": 1000, "seed": 0},
           "output_dir": str(out)}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        elif value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "parallel_plan_check.json"))
    p.add_argument("--probe", nargs=2, metavar=("RECIPE", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.probe:
        probe(*a.probe)
        return 0

    import yaml

    work = Path(tempfile.mkdtemp(prefix="tunekit-parplan-"))
    model, data = build(work)
    rows = []
    for i, (name, world, changes) in enumerate(POINTS):
        point = work / f"p{i}"
        point.mkdir()
        recipe_file = point / "recipe.yaml"
        recipe_file.write_text(yaml.safe_dump(recipe_for(model, data, point / "run", changes)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               __file__, "--probe", str(recipe_file), str(point)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return 1
        ranks = [json.loads((point / f"rank{r}.json").read_text()) for r in range(world)]
        measured = max(r["measured"] for r in ranks)
        row = {"layout": name, "world_size": world, "recipe": recipe_for(model, data, Path("run"), changes),
               **planned(recipe_file, world), "measured": measured, "ranks": ranks}
        row["deviation"] = row["planned"] / measured - 1
        rows.append(row)
        print(f"{name:<12} {world} process{'es' if world > 1 else '  '}  planned {row['planned'] / 2**20:8.1f} MiB"
              f"  measured {measured / 2**20:8.1f} MiB  {100 * row['deviation']:+6.1f}%", flush=True)
    from machine import facts

    Path(a.out).write_text(json.dumps({"machine": facts(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
