"""training.method: dpo -- direct preference optimization on (prompt, chosen, rejected) pairs with TRL's
DPOTrainer; its `dpo:` recipe section (read from its earlier name `preference:` too) is declared in
tunekit.config.methodsettings."""

from __future__ import annotations

from tunekit.training.methods.base import register
from tunekit.training.methods.pairs import PreferenceMethod


class Dpo(PreferenceMethod):
    name = "dpo"

    def trainer_class(self):
        from tunekit.training.trainers.dpo import DpoTrainer

        return DpoTrainer

    def trainer_config(self, args, recipe):
        from trl import DPOConfig

        p = recipe.dpo
        return DPOConfig(**self.trl_kwargs(args, recipe), beta=p.beta, loss_type=[p.loss_type],
                         label_smoothing=p.label_smoothing, truncation_mode="keep_start", padding_free=False)


register(Dpo())
