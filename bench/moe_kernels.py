"""How transformers' experts implementations train a mixture of experts on this CPU: eager (a loop over the experts a
batch reaches), grouped_mm (one grouped matmul over them) and batched_mm (every token through its top-k experts'
weights, gathered), each as tunekit trains a LoRA adapter (attention + the experts' 3-D weights, peft's
target_parameters), fwd + bwd + AdamW.

The models: Qwen3-MoE's configuration scaled down, random weights, Qwen3's tokenizer: `tiny` (tunekit.models.families'
test model: hidden 64, 16 experts, top-4) and `small` (hidden 512, 4 layers, 32 experts of 256, top-4). The data:
real text with its natural lengths (bench/realdata.py's translate set: Ding's English -> German entries), batches of
8 padded to their longest row. The implementations run one after the other, --repeats times; the median step time
and tokens/s of each. Writes bench/moe_kernels.json (fp32) or --out, with the machine's facts; the last runs:
bench/moe_kernels.json and bench/moe_kernels_bf16.json. They are why moe.kernel auto keeps transformers' default,
grouped_mm, on CPU too (models.experts.choose_kernel).

    python bench/moe_kernels.py [--steps 12] [--repeats 3] [--dtype fp32|bf16] [--out FILE]
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
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
import realdata  # noqa: E402

KERNELS = ("eager", "grouped_mm", "batched_mm")
SHAPES = {"tiny": {}, "small": dict(hidden_size=512, moe_intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=4, num_experts=32, head_dim=64)}


def build(shape: str, where: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunekit.models import families

    tok = families.build_family_model(where, "qwen3_moe")
    if SHAPES[shape]:
        cfg = AutoConfig.from_pretrained(where)
        for key, value in SHAPES[shape].items():
            setattr(cfg, key, value)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(where)
    return tok


def batches(tok, steps: int, size: int = 8) -> list[dict]:
    rows = realdata.translate_rows()[: steps * size]
    out = []
    for i in range(steps):
        texts = [f"{r['instruction']}\n{r['input']}\n{r['output']}{tok.eos_token}"
                 for r in rows[i * size:(i + 1) * size]]
        enc = tok(texts, return_tensors="pt", padding=True)
        enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        out.append(dict(enc))
    return out


def run(where: Path, kernel: str, data: list[dict], dtype: torch.dtype) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tunekit.models import experts

    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype)
    model.set_experts_implementation(kernel)
    cfg = experts.scope_lora(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                               task_type="CAUSAL_LM"), None, say=False)
    model = get_peft_model(model, cfg)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times, tokens = [], []
    for batch in data:
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        tokens.append(int(batch["attention_mask"].sum()))
    used = model.get_base_model().config._experts_implementation
    times, tokens = times[2:], tokens[2:]  # the first steps warm allocators and caches
    return {"kernel": used, "step_s": statistics.median(times), "tokens_per_s": sum(tokens) / sum(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "moe_kernels.json")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    record = {"machine": machine.facts(), "dtype": args.dtype, "steps": args.steps, "threads": torch.get_num_threads(),
              "shapes": {}}
    for shape in SHAPES:
        with tempfile.TemporaryDirectory() as tmp:
            tok = build(shape, Path(tmp))
            data = batches(tok, args.steps)
            runs: dict[str, list[dict]] = {k: [] for k in KERNELS}
            for _ in range(args.repeats):
                for kernel in KERNELS:
                    runs[kernel].append(run(Path(tmp), kernel, data, dtype))
        record["shapes"][shape] = {
            k: {"ran": r[0]["kernel"], "step_s": round(statistics.median(x["step_s"] for x in r), 4),
                "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in r), 1)} for k, r in runs.items()}
        for k, r in record["shapes"][shape].items():
            print(f"{shape:6} {k:11} ran {r['ran']:11} {r['step_s']:.4f} s/step {r['tokens_per_s']:9.1f} tokens/s")
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
