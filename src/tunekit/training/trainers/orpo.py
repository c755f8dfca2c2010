"""OrpoTrainer: the trainer of training.method: orpo (training.methods.orpo), and the token counter of its batches."""

from __future__ import annotations

import warnings

import torch.nn.functional as F

from tunekit.data.collating import CountingCollator
from tunekit.data.tokenizing import IGNORE
from tunekit.training.trainer import TrainerAdditions

with warnings.catch_warnings():  # TRL 1.16 (pinned) keeps ORPO in trl.experimental and warns on import
    warnings.simplefilter("ignore")
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

__all__ = ["ORPOConfig", "OrpoTrainer", "PairCounter"]


class PairCounter(CountingCollator):
    """Token counts of ORPO's batches: chosen and rejected rows, each with its own mask, run as one batch of the
    wider width."""

    @staticmethod
    def count(batch, features) -> tuple[int, int]:
        masks = [batch["chosen_attention_mask"], batch["rejected_attention_mask"]]
        return sum(int(m.sum()) for m in masks), 2 * len(features) * max(m.shape[1] for m in masks)


class OrpoTrainer(TrainerAdditions, ORPOTrainer):
    """ORPOTrainer as DpoTrainer is DPOTrainer, fed the same pairs.

    Two changes to TRL's loss. TRL takes the SFT term of ORPO over the whole chosen sequence, prompt included
    (its comment: "orpo chosen nll loss is computed over the full prompt and response"); here it covers
    exactly the answer tokens SFT trains, as the ORPO paper's SFT term does and as every other tunekit method
    does. TRL averages that term over each micro-batch's tokens, so the result depends on how an optimizer
    step is split into micro-batches and processes; here it is averaged over the answer tokens of the whole
    step, as tunekit's SFT loss is, and 2 processes train exactly as 1 does (the odds-ratio term is a
    per-pair mean)."""

    loss_is_scaled_for_ga = False  # the Trainer divides by the accumulation steps; the token count undoes it
    token_counter = PairCounter  # pairs.PreferenceMethod.make_trainer wraps the collator in it

    def tokenize_row(self, feature, model=None) -> dict:
        """TRL's columns from tunekit's ids: prompt + answer cut at max_length (keep the start), prompt masked."""
        prompt = feature["prompt_ids"]
        row = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
        for side in ("chosen", "rejected"):
            ids = (prompt + feature[f"{side}_ids"])[:self.max_length]
            row.update({f"{side}_input_ids": ids, f"{side}_attention_mask": [1] * len(ids),
                        f"{side}_labels": [IGNORE] * len(prompt) + ids[len(prompt):]})
        return row

    def concatenated_forward(self, model, batch):
        out = super().concatenated_forward(model, batch)
        chosen_logits = out[2]  # the chosen rows' logits, shifted: position t predicts token t + 1
        labels = batch["chosen_labels"][:, 1:]
        labels = F.pad(labels, (0, chosen_logits.shape[1] - labels.shape[1]), value=IGNORE)
        nll = F.cross_entropy(chosen_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
        self._answer_nll = nll, labels.ne(IGNORE).sum()
        return (*out[:4], nll, *out[5:])

    def _get_num_items_in_batch(self, batch_samples, device):
        """The chosen answer tokens of the whole optimizer step, every process's included."""
        count = sum(b["chosen_labels"][..., 1:].ne(IGNORE).sum() for b in batch_samples).to(device)
        return self.accelerator.gather(count).sum() if self.args.world_size > 1 else count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._step_tokens = num_items_in_batch
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        loss, metrics = super().get_batch_loss_metrics(model, batch, train_eval)
        if train_eval == "train" and getattr(self, "_step_tokens", None):
            # micro-batch token mean -> this micro-batch's share of the step's token mean (the Trainer then
            # divides by the accumulation steps and the processes' gradients are averaged)
            nll, tokens = self._answer_nll
            share = tokens * self.accelerator.num_processes * self.current_gradient_accumulation_steps
            loss = loss + nll * (share / self._step_tokens - 1)
        return loss, metrics
