"""Attention alone against attention and the experts: what LoRA on a mixture of experts' 3-D expert weights costs
and buys, on the MoE demo (recipes/moe_upcycle.py's 8-expert top-2 Mixtral upcycled from SmolLM2-135M-Instruct,
recipes/smollm2_moe.yaml's extraction task and settings, the routers trained in both). Each scope trains from the
same base for --steps steps in a `tunekit train` process of its own, then answers the held-out set (--limit rows);
recorded per scope: trainable parameters, real tokens per second, the last logged loss, held-out exact match and
ROUGE-L, the end-of-training eval's seconds, the process's peak RSS and the held-out expert load's imbalance (worst
and median layer). A third run trains attention and experts with the balancing loss counted over all layers together
(moe.aux_loss_scope: model, transformers' own) against the recipe's per-layer count. Writes bench/moe_scope.json or
--out, with the machine's facts.

    python bench/moe_scope.py [--steps 20] [--limit 40] [--base DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402

SCOPES = {"attention": ["moe.experts=false"], "attention + experts": ["moe.experts=true"],
          # the same, the balancing loss counted over all layers together (transformers' own): the control for
          # moe.aux_loss_scope: layer, which the recipe ships with
          "attention + experts, aux_loss_scope model": ["moe.experts=true", "moe.aux_loss_scope=model"]}


def train(base: Path, out: Path, steps: int, limit: int, scope: list[str]) -> dict:
    sets = [f"model.name_or_path={base}", f"output_dir={out}", f"training.max_steps={steps}",
            f"training.save_steps={steps}", f"eval.limit={limit}", *scope]
    cmd = [sys.executable, "-m", "tunekit", "train", str(ROOT / "recipes" / "smollm2_moe.yaml")]
    cmd += [a for s in sets for a in ("--set", s)]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    wall = time.time() - start
    run = json.loads((out / "run.json").read_text())
    scores = json.loads((out / "eval" / "metrics.json").read_text())["scores"]
    history = [json.loads(line) for line in (out / "loss_history.jsonl").read_text().splitlines()]
    losses = [h["loss"] for h in history if "loss" in h]
    throughput = run["throughput"]
    *_, load = (json.loads(line) for line in (out / "expert_load.jsonl").read_text().splitlines())
    imbalance = sorted(max(t) / (sum(t) / len(t)) for t in load["layers"].values())
    return {"trainable_parameters": run["parameters"]["trainable"], "total_parameters": run["parameters"]["total"],
            "real_tokens_per_s": round(throughput["real_tokens_per_s"], 1),
            "train_seconds": round(throughput["train_runtime_s"], 1), "first_loss": round(losses[0], 4),
            "last_loss": round(losses[-1], 4), "exact_match": scores["exact_match"], "rougeL": scores["rougeL"],
            "eval_examples": scores["examples"], "wall_seconds": round(wall, 1),
            "eval_seconds_about": round(wall - throughput["train_runtime_s"], 1),
            "peak_rss_gib": round(usage.ru_maxrss / 1024**2, 2),
            # the held-out expert load: each layer's busiest expert over its mean (8 experts, top-2: at most 4)
            "imbalance_worst_layer": round(imbalance[-1], 2),
            "imbalance_median_layer": round(imbalance[len(imbalance) // 2], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--base", type=Path, help="an upcycled base already written (recipes/moe_upcycle.py)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "moe_scope.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = args.base
        if base is None:
            base = Path(tmp) / "base"
            sys.path.insert(0, str(ROOT))
            from recipes.moe_upcycle import write_model

            write_model(base)
        results = {}
        for name, scope in SCOPES.items():
            print(f"{name}: training {args.steps} steps, then {args.limit} held-out answers", flush=True)
            results[name] = train(base, Path(tmp) / name.replace(" ", ""), args.steps, args.limit, scope)
            print(json.dumps(results[name]), flush=True)
    record = {"machine": machine.facts(), "steps": args.steps, "limit": args.limit,
              "recipe": "recipes/smollm2_moe.yaml", "results": results}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
