"""training.method: kto -- Kahneman-Tversky optimization on completions labelled desirable or not (data.format:
unpaired_preference) with TRL's KTOTrainer; its `kto:` recipe section is declared in
tunekit.config.methodsettings."""

from __future__ import annotations

import functools

from tunekit.training.methods.base import built_on_use, register
from tunekit.training.methods.pairs import PreferenceMethod, build, tokenize_unpaired


class Kto(PreferenceMethod):
    name = "kto"

    def build_data(self, recipe, tokenizer):
        # KTOTrainer samples in order (its KL term pairs neighbours), so the order is drawn here
        return build(recipe, tokenizer, tokenize_unpaired, shuffle=True, what="train examples")

    def trainer_class(self):
        return trainer_class()

    def trainer_config(self, args, recipe):
        from trl import KTOConfig

        k = recipe.kto
        kwargs = self.trl_kwargs(args, recipe)
        kwargs["train_sampling_strategy"] = "sequential"  # KTO's KL term pairs each example with its neighbours
        return KTOConfig(**kwargs, beta=k.beta, loss_type=k.loss_type, desirable_weight=k.desirable_weight,
                         undesirable_weight=k.undesirable_weight)


@functools.cache
def trainer_class():
    """KtoTrainer, built on first use (imports TRL)."""
    from trl import KTOTrainer

    from tunekit.training.methods.pairs import BaseReference
    from tunekit.training.trainer import GenerationEval, SafeState

    class KtoTrainer(SafeState, GenerationEval, BaseReference, KTOTrainer):
        """KTOTrainer as DpoTrainer is DPOTrainer, fed tunekit's prompt_ids / completion_ids / label."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if not self.calculate_KL:
                return dataset

            # TRL's KL estimate, as its own preparation builds it: each micro-batch's completions rotated by one,
            # so every prompt meets a completion written for another prompt of the same batch.
            def rotate(batch):
                return {"KL_completion_ids": batch["completion_ids"][-1:] + batch["completion_ids"][:-1]}

            return dataset.map(rotate, batched=True, batch_size=args.per_device_train_batch_size)

    KtoTrainer.__module__, KtoTrainer.__qualname__ = __name__, "KtoTrainer"
    return KtoTrainer


__getattr__ = built_on_use(__name__, KtoTrainer=trainer_class)


register(Kto())
