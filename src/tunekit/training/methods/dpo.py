"""training.method: dpo -- direct preference optimization on (prompt, chosen, rejected) pairs with TRL's
DPOTrainer; its `dpo:` recipe section (read from its earlier name `preference:` too) is declared in
tunekit.config.methodsettings."""

from __future__ import annotations

import functools

from tunekit.training.methods.base import built_on_use, register
from tunekit.training.methods.pairs import PreferenceMethod


class Dpo(PreferenceMethod):
    name = "dpo"

    def trainer_class(self):
        return trainer_class()

    def trainer_config(self, args, recipe):
        from trl import DPOConfig

        p = recipe.dpo
        return DPOConfig(**self.trl_kwargs(args, recipe), beta=p.beta, loss_type=[p.loss_type],
                         label_smoothing=p.label_smoothing, truncation_mode="keep_start", padding_free=False)

@functools.cache
def trainer_class():
    """DpoTrainer: TRL's DPOTrainer with tunekit's checkpoints and generation metrics, fed the pairs
    tokenized by pairs.build (TRL imported here, on first use)."""
    from trl import DPOTrainer

    from tunekit.training.methods.pairs import BaseReference
    from tunekit.training.trainer import GenerationEval, SafeState

    class DpoTrainer(SafeState, GenerationEval, BaseReference, DPOTrainer):
        """DPOTrainer with tunekit's checkpoints and generation metrics, fed the pairs tokenized by tunekit's
        renderer (pairs.BaseReference: the adapter-off base as the reference, without TRL's adapter copy)."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # already prompt_ids / chosen_ids / rejected_ids from tunekit's renderer

    DpoTrainer.__module__, DpoTrainer.__qualname__ = __name__, "DpoTrainer"
    return DpoTrainer


__getattr__ = built_on_use(__name__, DpoTrainer=trainer_class)


register(Dpo())
