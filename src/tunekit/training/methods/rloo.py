"""training.method: rloo -- REINFORCE leave-one-out from the same rewards as grpo, with TRL's RLOOTrainer; its
`rloo:` recipe section is declared in tunekit.config.methodsettings (grpo's sampling, reward and tool settings,
less loss_type and scale_rewards, plus normalize_advantages).

Each prompt is answered `completions` times; a completion's advantage is its reward minus the mean reward of the
other completions of its group (the leave-one-out baseline), with the KL to the reference (rloo.beta > 0) taken
off the reward. Prompts, rewards, seeded sampling and held-out rewards are grpo's (training.methods.rollouts).
The trainer is training.trainers.rloo. The reference: the base with the adapter switched off under LoRA/QLoRA
(TRL's RLOOTrainer keeps no copy of a starting adapter), a frozen copy of the base under full fine-tuning.
"""

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
