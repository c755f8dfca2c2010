"""KtoTrainer: the trainer of training.method: kto (training.methods.kto)."""

from __future__ import annotations

from trl import KTOTrainer

from tunekit.training.trainer import TrainerAdditions
from tunekit.training.trainers.reference import BaseReference


class KtoTrainer(TrainerAdditions, BaseReference, KTOTrainer):
    """KTOTrainer as DpoTrainer is DPOTrainer, fed tunekit's prompt_ids / completion_ids / label."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if not self.calculate_KL:
            return dataset

        # TRL's KL estimate, as its own preparation builds it: each micro-batch's completions rotated by one,
        # so every prompt meets a completion written for another prompt of the same batch.
        def rotate(batch):
            return {"KL_completion_ids": batch["completion_ids"][-1:] + batch["completion_ids"][:-1]}

        return dataset.map(rotate, batched=True, batch_size=args.per_device_train_batch_size)
