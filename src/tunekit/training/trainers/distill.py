"""The trainer of training.method: distill (training.methods.distill says what it does): tunekit's Trainer with a
frozen teacher, on-policy examples answered by the student's seeded samples before the step's forward, the loss the
divergence to the teacher at the trained tokens plus the optional SFT loss; and its collator."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tunekit.data.collating import CountingCollator, collator
from tunekit.data.tokenizing import IGNORE
from tunekit.training import distilldivergences, sampling
from tunekit.training.trainer import SafeStateTrainer


def prompt_of(input_ids: list[int], labels: list[int]) -> list[int]:
    """The ids before the example's last answer (its last run of trained tokens)."""
    end = len(labels)
    while end and labels[end - 1] == IGNORE:
        end -= 1
    start = end
    while start and labels[start - 1] != IGNORE:
        start -= 1
    return input_ids[:start]


class Collator:
    """Batches of examples with answers (input_ids, labels padded) or of prompts alone, each with its prompt ids
    (a list per example, for sampling) and its place in the data."""

    def __init__(self, tokenizer):
        self.padded = collator(tokenizer)

    def __call__(self, features):
        batch = {}
        if "labels" in features[0]:
            batch = dict(self.padded([{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features]))
            prompts = [prompt_of(f["input_ids"], f["labels"]) for f in features]
        else:
            prompts = [list(f["prompt_ids"]) for f in features]
        batch.update(prompt_ids=prompts, index=torch.tensor([f["index"] for f in features]))
        return batch


class DistillTrainer(SafeStateTrainer):
    """tunekit's Trainer with a frozen teacher: on-policy rows answered by the student's seeded samples before
    the step's forward, the loss the divergence to the teacher at the trained tokens (plus the SFT loss)."""

    loss_is_scaled_for_ga = False  # a mean per micro-batch: the Trainer divides by the accumulation steps

    def __init__(self, *args, teacher, settings, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.tokens = CountingCollator(None)  # its counters only: real and computed tokens trained on
        self.parts = {"divergence": [0.0, 0], "sft_loss": [0.0, 0], "on_policy": [0.0, 0]}
        self.teacher, self.teacher_placement = self.place(teacher, settings.teacher_placement)
        unwrapped = self.accelerator.unwrap_model(self.model)
        eos = unwrapped.generation_config.eos_token_id
        self.eos_ids = sorted({self.processing_class.eos_token_id,
                               *([] if eos is None else [eos] if isinstance(eos, int) else eos)})

    def place(self, teacher, placement: str):
        """(teacher, how it is placed): sharded under ZeRO-3 (a DeepSpeed inference engine of the run's
        config, as TRL prepares reference models) or FSDP, else a whole copy on each process's device."""
        from trl.models.utils import prepare_deepspeed, prepare_fsdp

        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        if placement == "sharded" and zero3:
            return prepare_deepspeed(teacher, self.accelerator), "sharded across the processes (ZeRO-3)"
        if placement == "sharded" and self.is_fsdp_enabled:
            return prepare_fsdp(teacher, self.accelerator), "sharded across the processes (FSDP)"
        if not getattr(teacher, "is_loaded_in_4bit", False):
            teacher = teacher.to(self.accelerator.device)
        whole = "a whole copy on each process" if self.accelerator.num_processes > 1 else "one copy"
        return teacher, whole

    # ------------------------------------------------------------ on-policy answers

    def on_policy_rows(self, index: list[int]) -> list[bool]:
        s = self.settings
        if s.mode == "off_policy":
            return [False] * len(index)
        if s.mode == "on_policy":
            return [True] * len(index)
        draws = (sampling._seed(self.args.seed, "distill-mix", self.state.global_step, i) / 2**63 for i in index)
        return [u < s.on_policy_fraction for u in draws]

    def answered(self, inputs: dict) -> dict:
        """The batch with its on-policy rows answered by the student's own samples (labelled: the samples)."""
        index = inputs["index"].tolist()
        chosen = self.on_policy_rows(index)
        self.tally("on_policy", sum(chosen), len(chosen), training=True)
        if not self.anywhere(any(chosen)):
            return inputs
        s, prompts = self.settings, inputs["prompt_ids"]
        rows = [i for i, c in zip(index, chosen) if c]
        # a process with nothing to sample samples its first prompt and drops it: under ZeRO-3 and FSDP,
        # generate() keeps the processes in step, every one taking part in each forward
        picked = [p for p, c in zip(prompts, chosen) if c] or prompts[:1]
        key = (self.args.seed, "distill", self.state.global_step)
        sampler = sampling.SeededSampling(key, rows or index[:1], max(map(len, picked)), s.temperature,
                                          s.top_p, 0)
        was_training = self.model.training
        self.model.eval()
        try:
            samples = iter(sampling.sample(self.model_wrapped, self.accelerator, self.processing_class.pad_token_id,
                                           picked, sampler, s.max_completion_length, self.eos_ids))
        finally:
            self.model.train(was_training)
        if not rows:
            return inputs
        sequences = []
        for n, c in enumerate(chosen):
            if c:
                answer = next(samples)
                sequences.append((prompts[n] + answer, [IGNORE] * len(prompts[n]) + answer))
            else:
                ids = inputs["input_ids"][n][inputs["attention_mask"][n].bool()].tolist()
                labels = inputs["labels"][n][:len(ids)].tolist()
                sequences.append((ids, labels))
        return {**self.padded(sequences), "on_policy": torch.tensor(chosen)}

    def anywhere(self, mine: bool) -> bool:
        """Whether any process samples this micro-batch: then all of them do (see answered)."""
        if self.accelerator.num_processes == 1:
            return mine
        flag = torch.tensor([float(mine)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "sum").item())

    def padded(self, sequences: list[tuple[list[int], list[int]]]) -> dict:
        width = max(len(ids) for ids, _ in sequences)
        pad = self.processing_class.pad_token_id
        return {"input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in sequences]),
                "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in sequences]),
                "labels": torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in sequences])}

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = self.answered(inputs)
        mask = inputs["attention_mask"]
        self.tokens.real += int(mask.sum())
        self.tokens.computed += mask.numel()
        return super().training_step(model, inputs, None)

    # ------------------------------------------------------------ the loss

    def tally(self, part: str, total: float, n: int, training: bool | None = None) -> None:
        """A training step's share of a logged part of the loss (evaluations add none)."""
        if self.model.training if training is None else training:
            self.parts[part][0] += total
            self.parts[part][1] += n

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        s = self.settings
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        with torch.no_grad():
            teacher = self.teacher(input_ids=ids, attention_mask=mask).logits[:, :-1]
        targets = inputs["labels"][:, 1:]
        trained = targets != IGNORE
        width = min(logits.shape[-1], teacher.shape[-1])  # rows past the tokenizer's ids pad the embeddings
        student, teacher = logits[trained][:, :width], teacher[trained][:, :width]
        divergence = distilldivergences.per_token(student, teacher, s.divergence, s.jsd_beta, s.temperature, s.top_k)
        loss = divergence.mean() if divergence.numel() else logits.sum() * 0
        self.tally("divergence", float(divergence.detach().sum()), divergence.numel())
        if s.sft_weight:
            on = inputs.get("on_policy", torch.zeros(len(ids), dtype=torch.bool)).to(trained.device)
            off = (~on)[:, None].expand_as(trained)[trained]  # answers from the data, not the student's samples
            if off.any():
                ce = F.cross_entropy(student[off].float(), targets[trained][off])
                loss = loss + s.sft_weight * ce
                self.tally("sft_loss", float(ce.detach()) * int(off.sum()), int(off.sum()))
        return (loss, {"logits": logits}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Held-out answers: the divergence to the teacher on them, teacher-forced (nothing is sampled);
        prompts alone: no loss (the eval section's generation metrics judge them)."""
        if "labels" not in inputs:
            return None, None, None
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict, start_time=None) -> None:
        if "loss" in logs:  # training logs: the loss's parts since the last log, over every process
            sums = torch.tensor([x for total_n in self.parts.values() for x in total_n], dtype=torch.float64,
                                device=self.accelerator.device)
            sums = self.accelerator.reduce(sums, "sum").tolist()
            for i, name in enumerate(self.parts):
                total, n = sums[2 * i], sums[2 * i + 1]
                if n and (name != "on_policy" or self.settings.samples):
                    logs[f"distill/{name}"] = float(f"{total / n:.6g}")
            self.parts = {k: [0.0, 0] for k in self.parts}
        super().log(logs, start_time)
