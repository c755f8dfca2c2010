"""training.method: orpo -- odds-ratio preference optimization on the same pairs as dpo: SFT and preference in
one loss without a reference model, TRL's ORPOTrainer (trl.experimental in 1.16); its `orpo:` recipe section is
declared in tunekit.config.methodsettings, its trainer is training.trainers.orpo."""

from __future__ import annotations

from tunekit.training.methods.base import register
from tunekit.training.methods.pairs import PreferenceMethod


class Orpo(PreferenceMethod):
    name = "orpo"

    def trainer_class(self):
        from tunekit.training.trainers.orpo import OrpoTrainer

        return OrpoTrainer

    def trainer_config(self, args, recipe):
        from tunekit.training.trainers.orpo import ORPOConfig

        return ORPOConfig(**self.trl_kwargs(args, recipe), beta=recipe.orpo.beta)


register(Orpo())
