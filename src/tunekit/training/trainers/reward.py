"""RewardModelTrainer: the trainer of training.method: reward (training.methods.reward)."""

from __future__ import annotations

import torch
from trl import RewardTrainer

from tunekit.training.trainer import TrainerAdditions


class RewardModelTrainer(TrainerAdditions, RewardTrainer):
    """RewardTrainer with tunekit's pickle-free checkpoints. Its held-out accuracy and margin are counted over
    the pairs (TRL averages the batches' values, which weighs a short last batch as a full one) and reach the
    evaluation's metrics (eval_accuracy, eval_margin: the callbacks, metric_for_best), not only the logged
    line."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # already chosen_ids / rejected_ids from tunekit's renderer, cut at data.max_length

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        if not self.model.training:
            chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
            right = self.accelerator.gather_for_metrics((chosen > rejected).sum().reshape(1)).sum()
            margin = self.accelerator.gather_for_metrics((chosen - rejected).float().sum().reshape(1)).sum()
            total = self.accelerator.gather_for_metrics(torch.tensor([len(chosen)], device=chosen.device)).sum()
            self._pairs_right = getattr(self, "_pairs_right", 0) + int(right)
            self._pairs_margin = getattr(self, "_pairs_margin", 0.0) + float(margin)
            self._pairs_seen = getattr(self, "_pairs_seen", 0) + int(total)
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self._pairs_right = self._pairs_seen = 0
        self._pairs_margin = 0.0
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                         metric_key_prefix)
        if self._pairs_seen:
            self._metrics["eval"].pop("accuracy", None)
            self._metrics["eval"].pop("margin", None)
            output.metrics[f"{metric_key_prefix}_accuracy"] = self._pairs_right / self._pairs_seen
            output.metrics[f"{metric_key_prefix}_margin"] = self._pairs_margin / self._pairs_seen
        return output
