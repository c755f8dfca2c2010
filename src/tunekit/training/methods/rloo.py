"""training.method: rloo -- REINFORCE leave-one-out from the same rewards as grpo, with TRL's RLOOTrainer; its
`rloo:` recipe section is declared in tunekit.config.methodsettings. Prompts, rewards, seeded sampling and held-out
rewards are grpo's (training.methods.rollouts); the trainer is training.trainers.rloo. How it differs from grpo:
docs/methods.md, "RLOO: the same rewards, a leave-one-out baseline"."""

from __future__ import annotations

from tunekit.training.methods import rollouts
from tunekit.training.methods.base import register


class Rloo(rollouts.SampledMethod):
    name = "rloo"

    def trainer_class(self):
        from tunekit.training.trainers.rloo import RlooTrainer

        return RlooTrainer

    def trainer_config(self, args, recipe):
        from trl import RLOOConfig

        g = recipe.rloo
        return RLOOConfig(**rollouts.config_kwargs(args, g), normalize_advantages=g.normalize_advantages)

    def reference(self, recipe, precision, start_adapter) -> tuple[dict, str]:
        if recipe.rloo.beta == 0:
            return {}, "none (rloo.beta: 0)"
        if recipe.full_finetuning:
            return rollouts.frozen_base(recipe, precision)
        return {}, "the base with the adapter switched off (no second copy)"


register(Rloo())
