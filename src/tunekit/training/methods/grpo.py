"""training.method: grpo -- group relative policy optimization from rewards a program checks, with TRL's
GRPOTrainer; its `grpo:` recipe section is declared in tunekit.config.methodsettings, its rewards in
tunekit.config.rewardkinds and scored by tunekit.evaluation.rewards.

Each prompt is answered `completions` times by sampling; every completion is scored by the recipe's rewards
(weighted sum), and the policy moves toward the completions that beat their group's mean. Prompts come from
any record with a prompt: data.format prompt (a prompt, an optional reference answer), prompt_completion,
alpaca or chat (the conversation up to its last assistant turn, which becomes the reference). They are rendered
by tunekit's renderer exactly as `tunekit eval` renders them, so what GRPO samples from is what eval generates
from (training.methods.rollouts, shared with rloo). The reference model (grpo.beta > 0): the base with the
adapter switched off under LoRA/QLoRA (TRL's own path, no second copy), a frozen copy of the base under full
fine-tuning.
"""

from __future__ import annotations

import functools

from tunekit.training.methods import rollouts
from tunekit.training.methods.base import Method, TrainerInputs, built_on_use, register
from tunekit.training.methods.rollouts import build, frozen_base, scorers_of


class Grpo(Method):
    name = "grpo"

    def build_data(self, recipe, tokenizer):
        return build(recipe, tokenizer)

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
            return frozen_base(recipe, precision)
        if start_adapter is not None:
            return ({"reference_is_base": False},
                    f"the base with the starting adapter (a frozen copy of {start_adapter})")
        return {"reference_is_base": True}, "the base with the adapter switched off (no second copy)"

    def make_trainer(self, inputs: TrainerInputs):
        recipe, g = inputs.recipe, inputs.recipe.grpo
        ref_args, reference = self.reference(recipe, inputs.precision, inputs.start_adapter)
        scorers = scorers_of(g.rewards, g.max_completion_length)
        rollouts.log_start("grpo", g, scorers, reference, f", loss {g.loss_type}")
        trainer = trainer_class()(
            model=inputs.model, reward_funcs=scorers, args=inputs.args, train_dataset=inputs.data.train,
            eval_dataset=inputs.data.eval, processing_class=inputs.tokenizer, callbacks=inputs.callbacks,
            generation_eval=inputs.generation_eval, add_special_tokens=inputs.data.add_special_tokens,
            data=inputs.data, **ref_args)
        return trainer, trainer.tokens


@functools.cache
def trainer_class():
    """GrpoTrainer, built on first use (imports TRL)."""
    from trl import GRPOTrainer
    from trl.trainer import grpo_trainer

    from tunekit.training import sampling
    from tunekit.training.methods.pairs import BaseReference
    from tunekit.training.trainer import GenerationEval, SafeState

    class GrpoTrainer(SafeState, GenerationEval, rollouts.mixin(), BaseReference, GRPOTrainer):
        """GRPOTrainer with tunekit's checkpoints and generation metrics, sampling as rollouts.mixin does, the
        reference chosen as for DPO (pairs.BaseReference)."""

        trl_module = grpo_trainer

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            if not self.seeded(images, multimodal_fields):
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            if self.episodes is not None:
                return self.play(prompt_ids), None
            return sampling.generate(self, prompt_ids), None

    GrpoTrainer.__module__, GrpoTrainer.__qualname__ = __name__, "GrpoTrainer"
    return GrpoTrainer


__getattr__ = built_on_use(__name__, GrpoTrainer=trainer_class)


register(Grpo())
