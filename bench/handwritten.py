"""The baseline: a LoRA fine-tuning script of the kind a competent user writes by hand with
transformers and peft, as TRL and peft's examples do: chat template, prompt tokens masked, each batch
padded to its longest example (DataCollatorForSeq2Seq), plain Trainer. `--pad-to-max-length` pads
every example to max_length instead (the older examples' way; an extra row in the bench). Rows are
alpaca (instruction/input/output) or chat (messages). Prints a JSON line with its measurements. Used by
bench/run.py (throughput: lr 1e-3 constant, bf16) and bench/quality.py (the usual settings of peft's and
TRL's LoRA examples: lr 2e-4, linear decay after 3% warmup, LoRA dropout 0.05)."""

import argparse
import json
import resource
import time

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--train", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max-length", type=int, default=256)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--pad-to-max-length", action="store_true")
p.add_argument("--max-steps", type=int, default=-1)
p.add_argument("--scheduler", default="constant")
p.add_argument("--warmup-ratio", type=float, default=0.0)
p.add_argument("--dropout", type=float, default=0.0)
p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
a = p.parse_args()

tok = AutoTokenizer.from_pretrained(a.model)
rows = [json.loads(line) for line in open(a.train)]


def encode(row):
    if "messages" in row:
        turns, answer = row["messages"][:-1], row["messages"][-1]["content"]
    else:
        turns = [{"role": "user", "content": row["instruction"] + ("\n\n" + row["input"] if row.get("input") else "")}]
        answer = row["output"]
    prompt = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(turns + [{"role": "assistant", "content": answer}], tokenize=False)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    enc = tok(full, add_special_tokens=False, truncation=True, max_length=a.max_length,
              padding="max_length" if a.pad_to_max_length else False)
    labels = [t if (i >= n_prompt and m == 1) else -100
              for i, (t, m) in enumerate(zip(enc["input_ids"], enc["attention_mask"]))]
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


ds = Dataset.from_list([encode(r) for r in rows])
torch.manual_seed(a.seed)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if a.precision == "bf16" else torch.float32)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=a.dropout, target_modules="all-linear",
                                         task_type="CAUSAL_LM"))
args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=a.batch_size, num_train_epochs=1,
                         max_steps=a.max_steps, learning_rate=a.lr, lr_scheduler_type=a.scheduler,
                         warmup_steps=a.warmup_ratio, logging_steps=1, bf16=a.precision == "bf16",
                         use_cpu=not torch.cuda.is_available(),
                         report_to="none", save_strategy="no", seed=a.seed, data_seed=a.seed, disable_tqdm=True)
computed = 0


PAD = default_data_collator if a.pad_to_max_length else DataCollatorForSeq2Seq(tok, padding=True,
                                                                              label_pad_token_id=-100)


def collate(features, pad=PAD):
    global computed
    batch = pad(features)
    computed += batch["input_ids"].numel()
    return batch


trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate)
start = time.perf_counter()
out = trainer.train()
elapsed = time.perf_counter() - start
model.save_pretrained(a.out + "/adapter")
real = sum(sum(m) for m in ds["attention_mask"])
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
print(json.dumps({"train_runtime_s": out.metrics["train_runtime"], "wall_s": elapsed, "tokens_real": real,
                  "tokens_computed": computed, "padding_fraction": 1 - real / computed,
                  "real_tokens_per_s": real / out.metrics["train_runtime"],
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
                  "peak_cuda_gb": torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else None,
                  "last_losses": losses[-3:]}))
