"""A CPU proxy of the GPU check's overhead-bound regime: tunekit's SFT LoRA step against TRL's SFTTrainer
(bench/trl_sft.py) on short chat rows, where a step's time is per-step work (Python, operator dispatch, host
syncs), not arithmetic.

The model has Llama-3.2-1B's layer count and LoRA targets (16 layers, LoRA r16 on all seven linear layers:
224 trainable tensors, as on the GPU) with narrow widths (hidden 64) and the tiny 400-token tokenizer, so the
head costs neither side anything; the data are bench/gpu_check.py's chat rows of at most --max-tokens tokens
(~1400 tokens a micro-batch of 8; the GPU check's rows make ~1000). Both sides run the same rows, batch,
steps, fp32 on one thread, padding-free batches, adamw_torch, no gradient checkpointing, a log line every
step, and each gets the same clock: a callback that reads the process's CPU time and the wall clock at every
step's end (steady: the steps after the first 3; on a shared machine CPU time is the steadier of the two), and
the time of each garbage collection while training.

With --ops, a second run of each side counts the torch operators between the same steps (torch.profiler,
CPU, shapes off): on a GPU each is a kernel launch or more, and each aten::_local_scalar_dense (.item(),
bool(), int() of a tensor) or aten::nonzero (a boolean selection) is a host sync.

    python bench/step_overhead.py [--work DIR] [--steps 40] [--repeats 2] [--ops] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
WARM = 3
# one thread: on a shared machine, torch's second thread waits on a busy core (a 1400x64 linear: 0.3 ms on
# one thread, 12 ms on two while other processes run)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
KEPT = ("steady_cpu_ms_per_step", "steady_ms_per_step", "gc_seconds_by_generation")  # of each timed run
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")


def prepare(work: Path, max_tokens: int, layers: int) -> tuple[Path, Path]:
    """The tiny tokenizer, chat rows of at most `max_tokens` tokens, and the model (fp32, random)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import gpu_check
    from tunekit.models import tiny

    model_dir, data = work / "model", work / "chat-short.jsonl"
    if (model_dir / "config.json").is_file() and data.is_file():
        return model_dir, data
    work.mkdir(parents=True, exist_ok=True)
    tok = tiny.build_tokenizer(work / "tokenizer")
    rows = [json.loads(line) for line in gpu_check.write_data(work, tok, n_chat=2000, n_text=1)["chat"].open()]
    short = [r for r in rows if len(tok(tok.apply_chat_template(r["messages"], tokenize=False))["input_ids"])
             <= max_tokens]
    data.write_text("".join(json.dumps(r) + "\n" for r in short), encoding="utf-8")
    cfg = gpu_check.shape_config("llama-1b", tok, True)
    cfg.update(vocab_size=len(tok), num_hidden_layers=layers, torch_dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir, data


# --- a child: one side's run, with the clock (and the operator count) installed on its Trainer -------------

def child(side: str, model: Path, data: Path, work: Path, steps: int, ops: bool, out: Path) -> None:
    import torch
    from transformers import Trainer, TrainerCallback

    points: list[float] = []  # wall clock at each step's end
    cpu: list[float] = []  # this process's CPU time at each step's end
    counted: dict[str, int] = {}
    collections: list[tuple[int, float]] = []  # (generation, seconds) of each garbage collection while training
    started: dict[int, float] = {}

    def gc_clock(phase, info):
        if not points:
            return
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        elif info["generation"] in started:
            collections.append((info["generation"], time.perf_counter() - started.pop(info["generation"])))

    class Clock(TrainerCallback):
        profiler = None

        def on_step_end(self, args, state, control, **kwargs):
            points.append(time.perf_counter())
            cpu.append(time.process_time())
            if ops and state.global_step == WARM + 1:
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profiler.__enter__()
            elif self.profiler is not None and state.global_step == steps:
                self.profiler.__exit__(None, None, None)
                for e in self.profiler.key_averages():
                    counted[e.key] = counted.get(e.key, 0) + e.count
                self.profiler = None

    train = Trainer.train

    def clocked(self, *args, **kwargs):
        self.add_callback(Clock())
        return train(self, *args, **kwargs)

    Trainer.train = clocked
    gc.callbacks.append(gc_clock)
    run_dir = work / "runs" / side
    if side == "tunekit":
        from tunekit.cli.main import main

        sets = [f"model.name_or_path={model}", f"data.train={data}", "data.eval=null", "data.eval_fraction=0",
                "data.format=chat", "data.max_length=512", f"training.max_steps={steps}", "training.warmup_steps=1",
                "training.logging_steps=1", f"training.save_steps={steps}", "eval=null", f"output_dir={run_dir}",
                "training.micro_batch_size=8", "training.precision=fp32"]
        if main(["train", str(ROOT / "recipes" / "smollm2_lora.yaml"), "--force",
                 *[a for s in sets for a in ("--set", s)]]):
            sys.exit("tunekit train failed")
    else:
        import trl_sft

        sys.argv = ["trl_sft.py", "--model", str(model), "--train", str(data), "--format", "chat", "--steps",
                    str(steps), "--out", str(run_dir) + ".json", "--batch", "8", "--precision", "fp32"]
        trl_sft.main()
    n = len(points) - 1 - WARM
    result = {"side": side, "steps": len(points), "steady_ms_per_step": 1000 * (points[-1] - points[WARM]) / n,
              "steady_cpu_ms_per_step": 1000 * (cpu[-1] - cpu[WARM]) / n,
              "step_ms": [round(1000 * (b - a), 1) for a, b in zip(points, points[1:])],
              "gc_objects": len(gc.get_objects()),
              "gc_seconds_by_generation": {g: round(sum(s for h, s in collections if h == g), 3) for g in range(3)},
              "gc_collections_by_generation": {g: sum(h == g for h, _ in collections) for g in range(3)}}
    if ops:
        n = steps - WARM - 1
        result["ops_per_step"] = sum(counted.values()) / n
        result["syncs_per_step"] = sum(counted.get(k, 0) for k in SYNC_OPS) / n
        result["ops"] = {k: v / n for k, v in sorted(counted.items(), key=lambda kv: -kv[1])}
    out.write_text(json.dumps(result, indent=1))


def run_side(side: str, model: Path, data: Path, work: Path, steps: int, ops: bool) -> dict:
    out = work / f"{side}{'-ops' if ops else ''}.json"
    log = work / f"{side}{'-ops' if ops else ''}.log"
    cmd = [sys.executable, __file__, "--child", side, "--work", str(work), "--steps", str(steps)] + ["--ops"] * ops
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, **ONE_THREAD, "TUNEKIT_PROGRESS": "lines"}).returncode
    if rc != 0:
        sys.exit(f"step-overhead: {side} failed (exit {rc}), see {log}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/step-overhead"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each side, alternating (default 2)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--ops", action="store_true", help="also count the torch operators per step on each side")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", choices=("tunekit", "trl"), help=argparse.SUPPRESS)
    a = p.parse_args()
    model, data = prepare(a.work, a.max_tokens, a.layers)
    if a.child:
        child(a.child, model, data, a.work, a.steps, a.ops, a.work / f"{a.child}{'-ops' if a.ops else ''}.json")
        return
    runs: dict[str, list[dict]] = {"tunekit": [], "trl": []}
    for _ in range(a.repeats):
        for side in runs:
            runs[side].append(run_side(side, model, data, a.work, a.steps, False))
    result = {side: {key: round(statistics.median(r[key] for r in rs), 1)
                     for key in ("steady_cpu_ms_per_step", "steady_ms_per_step")}
              | {"runs": [{k: r[k] for k in KEPT} for r in rs]}
              for side, rs in runs.items()}
    if a.ops:
        for side in runs:
            o = run_side(side, model, data, a.work, a.steps, True)
            result[side].update(ops_per_step=round(o["ops_per_step"], 1), syncs_per_step=round(o["syncs_per_step"], 2),
                                ops={k: round(v, 2) for k, v in o["ops"].items()})
    for side, r in result.items():
        extra = f", {r['ops_per_step']:.0f} ops, {r['syncs_per_step']:.1f} syncs a step" if "ops_per_step" in r else ""
        print(f"step-overhead: {side:8s} {r['steady_cpu_ms_per_step']:7.1f} CPU ms a step, "
              f"{r['steady_ms_per_step']:7.1f} wall ms (medians of {a.repeats}){extra}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
