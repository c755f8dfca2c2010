"""varlen against SDPA with transformers' block-causal mask on the same packed batches: logits, loss and the
speed of a LoRA forward+backward, so the GPU check can show the kernel computes what SDPA does and how much
faster (models/attention.py). On a CUDA GPU `varlen` is torch's variable-length flash kernel; on a CPU the per-
sequence kernel.

    python bench/varlen_parity.py --model DIR --train chat.jsonl --out FILE [--batch 8] [--batches 8]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def batches(tok, path: str, batch: int, count: int) -> list[dict]:
    from tunekit.data.collating import collator

    rows = [json.loads(line) for line in open(path, encoding="utf-8")][:batch * count]
    features = []
    for r in rows:
        ids = tok.apply_chat_template(r["messages"], tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]  # a BatchEncoding in transformers 5
        features.append({"input_ids": ids, "labels": ids})
    collate = collator(tok, packing=True, boundaries=True)
    return [collate(features[i:i + batch]) for i in range(0, len(features), batch)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=8)
    a = p.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunekit.models import attention, lorafused

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    lorafused.fuse(model)
    attention.register()
    data = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()} for b in batches(
        tok, a.train, a.batch, a.batches)]
    keys = {"sdpa": ("input_ids", "position_ids", "labels"), attention.NAME: tuple(data[0])}
    out: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "dtype": str(dtype),
                 "tokens_per_batch": sum(b["input_ids"].numel() for b in data) / len(data)}
    if cuda:
        from torch.nn.attention.varlen import varlen_attn

        out["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    results = {}
    for name in ("sdpa", attention.NAME):
        model.get_base_model().set_attn_implementation(name)
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            first = model(**{k: data[0][k] for k in keys[name]})
        results[name] = (first.logits.float(), float(first.loss))
        times = []
        for _ in range(2):  # a warm-up pass, then the timed one
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for b in data:
                with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                    loss = model(**{k: b[k] for k in keys[name]}).loss
                loss.backward()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        out[f"{name}_tokens_per_s"] = out["tokens_per_batch"] * len(data) / times[-1]
    (ls, loss_s), (lv, loss_v) = results["sdpa"], results[attention.NAME]
    out.update(max_abs_logit_diff=float((lv - ls).abs().max()), logit_scale=float(ls.abs().max()),
               loss_sdpa=loss_s, loss_varlen=loss_v, speedup=out[f"{attention.NAME}_tokens_per_s"] /
               out["sdpa_tokens_per_s"])
    # bf16: the two kernels round differently; fp32 (a CPU): summation order only
    out["tolerance"] = 5e-2 * out["logit_scale"] if cuda else 1e-4 * out["logit_scale"]
    out["ok"] = out["max_abs_logit_diff"] <= out["tolerance"] and abs(loss_v - loss_s) <= 2e-2 * abs(loss_s)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
