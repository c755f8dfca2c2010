"""RlooTrainer: the trainer of training.method: rloo (training.methods.rloo)."""

from __future__ import annotations

from trl import RLOOTrainer
from trl.trainer import rloo_trainer

from tunekit.training import sampling
from tunekit.training.trainer import TrainerAdditions
from tunekit.training.trainers.rollouts import Rollouts
from tunekit.training.trainers.tooluse import MaskedLogps


class RlooTrainer(TrainerAdditions, MaskedLogps, Rollouts, RLOOTrainer):
    """RLOOTrainer with tunekit's checkpoints and generation metrics, sampling as Rollouts does, tool results left
    out of its sequence log probabilities (MaskedLogps)."""

    trl_module = rloo_trainer

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        if not self.seeded(images, multimodal_fields):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields)
        if self.episodes is not None:
            return self.play(prompt_ids)
        return sampling.generate(self, prompt_ids)
