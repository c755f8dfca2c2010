"""training.method: reward -- a reward model: the base with a one-number score head (LoRA, QLoRA or full), trained
on (prompt, chosen, rejected) pairs to score the chosen answer above the rejected one, with TRL's RewardTrainer;
its `reward:` recipe section is declared in tunekit.config.methodsettings. Pairs are tokenized as for dpo
(training.methods.pairs) and handed to TRL whole (evaluation.rewardmodel.whole_pair); its measures: docs/methods.md,
"Reward models"."""

from __future__ import annotations

import logging

from tunekit.training.methods.base import register
from tunekit.training.methods.pairs import PreferenceMethod, build

log = logging.getLogger("tunekit")


class Reward(PreferenceMethod):
    name = "reward"

    def trainer_class(self):
        from tunekit.training.trainers.reward import RewardModelTrainer

        return RewardModelTrainer

    def build_data(self, recipe, tokenizer):
        """The pairs as dpo builds them, each as its two whole sequences (prompt + answer, cut at data.max_length).
        The score is read at the last token that is not the pad token (models.tokenizer sets one: the
        end-of-sequence token where the tokenizer has none)."""
        from tunekit.evaluation.rewardmodel import whole_pair

        bundle = build(recipe, tokenizer)
        cut = recipe.data.max_length
        bundle.train = bundle.train.map(lambda p: whole_pair(p, cut), remove_columns=["prompt_ids"])
        if bundle.eval is not None:
            bundle.eval = bundle.eval.map(lambda p: whole_pair(p, cut), remove_columns=["prompt_ids"])
        return bundle

    def trainer_config(self, args, recipe):
        from trl import RewardConfig

        return RewardConfig(**self.trl_kwargs(args, recipe),
                            center_rewards_coefficient=recipe.reward.center_rewards_coefficient)

    def make_trainer(self, inputs):
        inputs.generation_eval = None  # a reward model generates nothing; its evaluations log pair accuracy
        trainer, collate = super().make_trainer(inputs)
        if inputs.recipe.quantization is not None:
            from tunekit.models import loader

            loader.trainable_in_fp32(trainer.model)  # TRL casts a quantized model's trained weights to bf16
        return trainer, collate


register(Reward())
