"""training.method: kto -- Kahneman-Tversky optimization on completions labelled desirable or not (data.format:
unpaired_preference) with TRL's KTOTrainer; the `kto:` recipe section."""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import Field

from tunekit.config.section import Section
from tunekit.training.methods.base import register
from tunekit.training.methods.pairs import DEFAULT_BETA, PreferenceMethod, build, tokenize_unpaired

KTO_LOSSES = ("kto", "apo_zero_unpaired")


class KtoSettings(Section):
    beta: float = Field(DEFAULT_BETA, gt=0, description="KTO: how far the policy may move from the reference "
                        "(higher: closer).")
    loss_type: Literal[KTO_LOSSES] = Field(  # type: ignore[valid-type]
        "kto", description="KTO loss, as TRL names them: kto (with the KL estimate from mismatched completions in "
        "each micro-batch, which needs micro_batch_size >= 2) or apo_zero_unpaired.")
    desirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the desirable examples' loss (to balance "
                                    "unequal numbers of desirable and undesirable examples).")
    undesirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the undesirable examples' loss.")


class Kto(PreferenceMethod):
    name = "kto"
    summary = ("Kahneman-Tversky optimization on completions labelled desirable or not (data.format: "
               "unpaired_preference), TRL's KTOTrainer")
    settings = KtoSettings
    data_formats = ("unpaired_preference",)
    data_description = "(prompt, completion, desirable or not) examples"
    owned_formats = data_formats
    has_reference = True
    no_grad_forwards = 3  # its KL batch, the reference and the reference's KL

    def check(self, recipe) -> None:
        super().check(recipe)
        if recipe.kto.loss_type == "kto" and recipe.training.micro_batch_size < 2:
            raise ValueError("training.micro_batch_size: KTO's loss kto estimates its KL term from the other "
                             "examples of a micro-batch; use 2 or more (or kto.loss_type: apo_zero_unpaired)")

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


def __getattr__(name: str):
    if name == "KtoTrainer":  # `from tunekit.training.methods.kto import KtoTrainer` builds it (imports TRL)
        return trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register(Kto())
