"""training.method: rloo -- REINFORCE leave-one-out from the same rewards as grpo, with TRL's RLOOTrainer; its
`rloo:` recipe section is declared in tunekit.config.methodsettings (grpo's sampling, reward and tool settings,
less loss_type and scale_rewards, plus normalize_advantages).

Each prompt is answered `completions` times; a completion's advantage is its reward minus the mean reward of the
other completions of its group (the leave-one-out baseline), with the KL to the reference (rloo.beta > 0) taken
off the reward. Prompts, rewards, seeded sampling and held-out rewards are grpo's (training.methods.rollouts).
The reference: the base with the adapter switched off under LoRA/QLoRA (TRL's RLOOTrainer keeps no copy of a
starting adapter), a frozen copy of the base under full fine-tuning.
"""

from __future__ import annotations

import functools

from tunekit.training.methods import rollouts
from tunekit.training.methods.base import Method, TrainerInputs, built_on_use, register


class Rloo(Method):
    name = "rloo"

    def build_data(self, recipe, tokenizer):
        return rollouts.build(recipe, tokenizer)

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

    def make_trainer(self, inputs: TrainerInputs):
        recipe, g = inputs.recipe, inputs.recipe.rloo
        ref_args, reference = self.reference(recipe, inputs.precision, inputs.start_adapter)
        scorers = rollouts.scorers_of(g.rewards, g.max_completion_length, "rloo")
        rollouts.log_start("rloo", g, scorers, reference)
        trainer = trainer_class()(
            model=inputs.model, reward_funcs=scorers, args=inputs.args, train_dataset=inputs.data.train,
            eval_dataset=inputs.data.eval, processing_class=inputs.tokenizer, callbacks=inputs.callbacks,
            generation_eval=inputs.generation_eval, add_special_tokens=inputs.data.add_special_tokens,
            data=inputs.data, **ref_args)
        return trainer, trainer.tokens


@functools.cache
def trainer_class():
    """RlooTrainer, built on first use (imports TRL)."""
    from trl import RLOOTrainer
    from trl.trainer import rloo_trainer

    from tunekit.training import sampling
    from tunekit.training.methods.acting import MaskedLogps
    from tunekit.training.trainer import GenerationEval, SafeState

    class RlooTrainer(SafeState, GenerationEval, MaskedLogps, rollouts.mixin(), RLOOTrainer):
        """RLOOTrainer with tunekit's checkpoints and generation metrics, sampling as rollouts.mixin does, tool
        results left out of its sequence log probabilities (acting.MaskedLogps)."""

        trl_module = rloo_trainer

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
            if not self.seeded(images, multimodal_fields):
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields)
            if self.episodes is not None:
                return self.play(prompt_ids)
            return sampling.generate(self, prompt_ids)

    RlooTrainer.__module__, RlooTrainer.__qualname__ = __name__, "RlooTrainer"
    return RlooTrainer


__getattr__ = built_on_use(__name__, RlooTrainer=trainer_class)


register(Rloo())
