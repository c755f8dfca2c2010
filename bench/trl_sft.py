"""The GPU check's opponent: a TRL SFTTrainer script with the settings TRL documents for speed.

LoRA r16 alpha 32 on all linear layers (peft's LoraConfig, as TRL's sft.py builds it), padding-free batches
(`padding_free=True`: each batch flattened into one row, position ids restarting per example; transformers
builds the block-diagonal mask from them for SDPA), completion-only loss on prompt/completion records,
gradient checkpointing off unless asked (SFTConfig turns it on by default; tunekit's checks run without),
the same model, data rows, batch, steps, learning rate and precision as tunekit's run. TRL refuses max_length
with padding-free batches unless it packs, so the check hands both sides rows that fit its max_length. QLoRA:
the model loaded with BitsAndBytesConfig (nf4, double quant, bf16 compute) and handed to SFTTrainer, which
prepares it for k-bit training. Tokens/s: the tokens of every training batch over train_runtime (first step
included, as tunekit's run.json counts), and steady: the tokens of the steps after the first --warm over their
time, from the clock at each step's end (as bench/gpu_check.py reads tunekit's loss_history.jsonl); peak:
torch.cuda.max_memory_allocated over the whole process, loading included, as tunekit's run.json records it
(CPU: peak RSS).

    python bench/trl_sft.py --model DIR --train FILE --format chat|text --out FILE [--batch 8] [--steps 20]
        [--accumulation 1] [--profile FILE --profile-steps FIRST:LAST]

The step times are kept (`step_seconds`), and --profile writes bench/step_profile.py's summary of the steps named.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
from trl import SFTConfig, SFTTrainer

from gpu_check import rate  # the same steady measure as tunekit's side (bench/ is this script's directory)
from step_profile import StepProfile

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rows(path: str, fmt: str) -> Dataset:
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    if fmt == "chat":  # conversational prompt/completion: TRL masks the prompt
        records = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in records]
    return Dataset.from_list(records)


class Counting(SFTTrainer):
    tokens = 0

    def training_step(self, model, inputs, *args, **kwargs):
        self.tokens += int(inputs["input_ids"].numel())
        return super().training_step(model, inputs, *args, **kwargs)


class StepClock(TrainerCallback):
    """(seconds, tokens so far) at the end of every optimizer step."""

    def __init__(self, trainer: Counting):
        self.trainer, self.points = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        self.points.append((time.time(), self.trainer.tokens))




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--format", choices=("chat", "text"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--quant4", action="store_true")
    p.add_argument("--optim", default="adamw_torch")
    p.add_argument("--warm", type=int, default=3, help="steps left out of the steady tokens/s (default 3)")
    p.add_argument("--until", type=int, help="last step counted in the steady tokens/s (default: the last)")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--profile", help="write a profile of --profile-steps to this file (bench/step_profile.py)")
    p.add_argument("--profile-steps", default="", help="FIRST:LAST optimizer steps, 1-based")
    a = p.parse_args()

    cuda = torch.cuda.is_available()
    dtype = DTYPES[a.precision]
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16) if a.quant4 else None
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if quant else dtype,
                                                 quantization_config=quant, attn_implementation="sdpa",
                                                 device_map={"": 0} if cuda else None)
    tok = AutoTokenizer.from_pretrained(a.model)
    args = SFTConfig(output_dir=a.out + ".dir", max_steps=a.steps, per_device_train_batch_size=a.batch,
                     gradient_accumulation_steps=a.accumulation,
                     learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=1, logging_steps=1,
                     save_strategy="no", report_to=[], max_length=None, padding_free=True,
                     gradient_checkpointing=False, bf16=a.precision == "bf16", fp16=a.precision == "fp16",
                     optim=a.optim, use_cpu=not cuda, dataloader_num_workers=0, seed=0)
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = Counting(model=model, args=args, train_dataset=rows(a.train, a.format), processing_class=tok,
                       peft_config=peft)
    clock = StepClock(trainer)
    trainer.add_callback(clock)
    if a.profile:
        first, last = (int(x) for x in a.profile_steps.split(":"))
        trainer.add_callback(StepProfile(a.profile, first, last))
    result = trainer.train()
    runtime = result.metrics["train_runtime"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    peak = (torch.cuda.max_memory_allocated() / 2**30 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    out = {"tokens": trainer.tokens, "train_runtime_s": runtime, "tokens_per_s": trainer.tokens / runtime,
           "steady_tokens_per_s": rate(clock.points[:a.until], a.warm), "warm_steps": a.warm,
           "step_seconds": [round(b[0] - a_[0], 4) for a_, b in zip(clock.points, clock.points[1:])],
           "peak_gib": peak, "peak_measure": "cuda max_memory_allocated" if cuda else "cpu peak RSS",
           "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
