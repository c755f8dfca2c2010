"""GrpoTrainer: the trainer of training.method: grpo (training.methods.grpo)."""

from __future__ import annotations

from trl import GRPOTrainer
from trl.trainer import grpo_trainer

from tunekit.training import sampling
from tunekit.training.trainer import TrainerAdditions
from tunekit.training.trainers.reference import BaseReference
from tunekit.training.trainers.rollouts import Rollouts


class GrpoTrainer(TrainerAdditions, Rollouts, BaseReference, GRPOTrainer):
    """GRPOTrainer with tunekit's checkpoints and generation metrics, sampling as Rollouts does, the reference
    chosen as for DPO (BaseReference)."""

    trl_module = grpo_trainer

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self.seeded(images, multimodal_fields):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        if self.episodes is not None:
            return self.play(prompt_ids), None
        return sampling.generate(self, prompt_ids), None
