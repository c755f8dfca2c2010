"""training.method: orpo -- odds-ratio preference optimization on the same pairs as dpo: SFT and preference in
one loss without a reference model, TRL's ORPOTrainer (trl.experimental in 1.16); its `orpo:` recipe section is
declared in tunekit.config.methodsettings."""

from __future__ import annotations

import functools

from tunekit.training.methods.base import built_on_use, register
from tunekit.training.methods.pairs import PreferenceMethod


class Orpo(PreferenceMethod):
    name = "orpo"

    def trainer_class(self):
        return trainer_class()

    def trainer_config(self, args, recipe):
        return _orpo().ORPOConfig(**self.trl_kwargs(args, recipe), beta=recipe.orpo.beta)

def _orpo():
    """trl.experimental.orpo: TRL 1.16 keeps ORPO there and warns on import (pinned)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental import orpo
    return orpo


@functools.cache
def pair_counter():
    """PairCounter: token counts of ORPO's batches (a data.collating.CountingCollator)."""
    from tunekit.data.collating import CountingCollator

    class PairCounter(CountingCollator):
        """Token counts of ORPO's batches: chosen and rejected rows, each with its own mask, run as one batch of
        the wider width."""

        @staticmethod
        def count(batch, features) -> tuple[int, int]:
            masks = [batch["chosen_attention_mask"], batch["rejected_attention_mask"]]
            return sum(int(m.sum()) for m in masks), 2 * len(features) * max(m.shape[1] for m in masks)

    PairCounter.__module__, PairCounter.__qualname__ = __name__, "PairCounter"
    return PairCounter


@functools.cache
def trainer_class():
    """OrpoTrainer, built on first use (imports TRL and torch)."""
    import torch.nn.functional as F

    from tunekit.data.tokenizing import IGNORE
    from tunekit.training.trainer import GenerationEval, SafeState

    class OrpoTrainer(SafeState, GenerationEval, _orpo().ORPOTrainer):
        """ORPOTrainer as DpoTrainer is DPOTrainer, fed the same pairs.

        Two changes to TRL's loss. TRL takes the SFT term of ORPO over the whole chosen sequence, prompt included
        (its comment: "orpo chosen nll loss is computed over the full prompt and response"); here it covers
        exactly the answer tokens SFT trains, as the ORPO paper's SFT term does and as every other tunekit method
        does. TRL averages that term over each micro-batch's tokens, so the result depends on how an optimizer
        step is split into micro-batches and processes; here it is averaged over the answer tokens of the whole
        step, as tunekit's SFT loss is, and 2 processes train exactly as 1 does (the odds-ratio term is a
        per-pair mean)."""

        loss_is_scaled_for_ga = False  # the Trainer divides by the accumulation steps; the token count undoes it
        token_counter = pair_counter()  # pairs.PreferenceMethod.make_trainer wraps the collator in it

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

    OrpoTrainer.__module__, OrpoTrainer.__qualname__ = __name__, "OrpoTrainer"
    return OrpoTrainer


__getattr__ = built_on_use(__name__, OrpoTrainer=trainer_class, PairCounter=pair_counter)


register(Orpo())
