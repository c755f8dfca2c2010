"""training.method: kto -- Kahneman-Tversky optimization on completions labelled desirable or not (data.format:
unpaired_preference) with TRL's KTOTrainer; its `kto:` recipe section is declared in
tunekit.config.methodsettings."""

from __future__ import annotations

from tunekit.training.methods.base import register
from tunekit.training.methods.pairs import PreferenceMethod, build, tokenize_unpaired


class Kto(PreferenceMethod):
    name = "kto"

    def build_data(self, recipe, tokenizer):
        # KTOTrainer samples in order (its KL term pairs neighbours), so the order is drawn here
        return build(recipe, tokenizer, tokenize_unpaired, shuffle=True, what="train examples")

    def trainer_class(self):
        from tunekit.training.trainers.kto import KtoTrainer

        return KtoTrainer

    def trainer_config(self, args, recipe):
        from trl import KTOConfig

        k = recipe.kto
        kwargs = self.trl_kwargs(args, recipe)
        kwargs["train_sampling_strategy"] = "sequential"  # KTO's KL term pairs each example with its neighbours
        return KTOConfig(**kwargs, beta=k.beta, loss_type=k.loss_type, desirable_weight=k.desirable_weight,
                         undesirable_weight=k.undesirable_weight)


register(Kto())
