"""DpoTrainer: the trainer of training.method: dpo (training.methods.dpo)."""

from __future__ import annotations

from trl import DPOTrainer

from tunekit.training.trainer import TrainerAdditions
from tunekit.training.trainers.reference import BaseReference


class DpoTrainer(TrainerAdditions, BaseReference, DPOTrainer):
    """DPOTrainer with tunekit's checkpoints and generation metrics, fed the pairs tokenized by tunekit's renderer
    (training.methods.pairs), the adapter-off base as the reference, without TRL's adapter copy."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # already prompt_ids / chosen_ids / rejected_ids from tunekit's renderer
