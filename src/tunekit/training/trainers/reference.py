"""The reference model of TRL's DPO, KTO and GRPO trainers when it is the base itself."""

from __future__ import annotations


class BaseReference:
    """Mixin for TRL's DPO, KTO and GRPO trainers: removes TRL's "ref" adapter copy when the reference is the base
    itself.

    Given a PEFT model, TRL copies its adapter into a second adapter "ref" and uses that as the
    reference. With a freshly initialised LoRA adapter (B = 0) that copy computes exactly the base
    model, so it is removed again: TRL then takes the reference log-probabilities with the adapter
    switched off, and no copy of anything is held or saved. An adapter that starts from an earlier run
    (model.adapter_from) keeps TRL's copy: the reference is then the model that run produced."""

    def __init__(self, *args, reference_is_base: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if reference_is_base and "ref" in getattr(self.model, "peft_config", {}):
            self.model.delete_adapter("ref")
