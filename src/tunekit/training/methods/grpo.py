"""training.method: grpo -- group relative policy optimization from rewards a program checks, with TRL's
GRPOTrainer; its `grpo:` recipe section is declared in tunekit.config.methodsettings, its rewards in
tunekit.config.rewardkinds and scored by tunekit.evaluation.rewards, its trainer is training.trainers.grpo.
Prompts are rendered as `tunekit eval` renders them (training.methods.rollouts, shared with rloo). How it trains:
docs/methods.md, "GRPO: rewards a program checks"."""

from __future__ import annotations

from tunekit.training.methods import rollouts
from tunekit.training.methods.base import register


class Grpo(rollouts.SampledMethod):
    name = "grpo"

    def trainer_class(self):
        from tunekit.training.trainers.grpo import GrpoTrainer

        return GrpoTrainer

    def trainer_config(self, args, recipe):
        from trl import GRPOConfig

        g = recipe.grpo
        kwargs = rollouts.config_kwargs(args, g)
        kwargs.update(loss_type=g.loss_type, scale_rewards=g.scale_rewards)
        return GRPOConfig(**kwargs)

    def reference(self, recipe, precision, start_adapter) -> tuple[dict, str]:
        if recipe.grpo.beta == 0:
            return {}, "none (grpo.beta: 0)"
        if recipe.full_finetuning:
            return rollouts.frozen_base(recipe, precision)
        if start_adapter is not None:
            return ({"reference_is_base": False},
                    f"the base with the starting adapter (a frozen copy of {start_adapter})")
        return {"reference_is_base": True}, "the base with the adapter switched off (no second copy)"

    def log_more(self, g) -> str:
        return f", loss {g.loss_type}"


register(Grpo())
