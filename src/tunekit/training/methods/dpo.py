"""training.method: dpo -- direct preference optimization on (prompt, chosen, rejected) pairs with TRL's
DPOTrainer; the `dpo:` recipe section (read from its earlier name `preference:` too)."""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import Field, model_validator

from tunekit.config.section import Section
from tunekit.training.methods import pairs
from tunekit.training.methods.base import register
from tunekit.training.methods.pairs import DEFAULT_BETA, PAIR_FORMATS, PAIRS, PreferenceMethod

# DPO losses TRL's DPOTrainer implements (trl 1.16, DPOConfig.loss_type)
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft")
SMOOTHED = ("robust", "exo_pair", "aot", "aot_unpaired")  # the losses that read label_smoothing (trl 1.16)


class DpoSettings(Section):
    beta: float = Field(DEFAULT_BETA, gt=0, description="DPO: how far the policy may move from the reference "
                        "(higher: closer to it). For loss_type ipo, the regularization strength.")
    loss_type: Literal[DPO_LOSSES] = Field(  # type: ignore[valid-type]
        "sigmoid", description="DPO loss, as TRL names them: " + ", ".join(DPO_LOSSES) + ".")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="DPO: assumed probability that a pair's "
                                   "preference is flipped; TRL reads it in the losses " + ", ".join(SMOOTHED) + ".")

    @model_validator(mode="after")
    def _smoothing_where_read(self):
        if self.label_smoothing and self.loss_type not in SMOOTHED:
            raise ValueError(f"dpo.label_smoothing applies to loss_type {', '.join(SMOOTHED)}; TRL's "
                             f"{self.loss_type} loss takes none: set one of those or remove label_smoothing")
        return self


class Dpo(PreferenceMethod):
    name = "dpo"
    summary = ("direct preference optimization on (prompt, chosen, rejected) pairs (data.format: preference) "
               "with TRL's DPOTrainer")
    settings = DpoSettings
    old_sections = ("preference",)
    data_formats = PAIR_FORMATS
    data_description = PAIRS
    has_reference = True
    sequences = 2  # chosen and rejected in one batch
    no_grad_forwards = 1  # the reference

    def trainer_class(self):
        return trainer_class()

    def trainer_config(self, args, recipe):
        from trl import DPOConfig

        p = recipe.dpo
        return DPOConfig(**self.trl_kwargs(args, recipe), beta=p.beta, loss_type=[p.loss_type],
                         label_smoothing=p.label_smoothing, truncation_mode="keep_start", padding_free=False)

    def measures(self, model, tokenizer, recipe, records, limit, batch_size) -> dict:
        return pairs.measures(model, tokenizer, recipe, records, limit, batch_size, reward_beta=recipe.dpo.beta)


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


def __getattr__(name: str):
    if name == "DpoTrainer":  # `from tunekit.training.methods.dpo import DpoTrainer` builds it (imports TRL)
        return trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register(Dpo())
