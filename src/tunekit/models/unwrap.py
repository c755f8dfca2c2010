"""The transformers model inside a peft wrapper: what its config, modules and forward hooks are read from. Imports
nothing heavy: commands that refuse bad input before loading torch reach it (models.vision)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def base_of(model: nn.Module) -> nn.Module:
    """The model under peft's PeftModel (get_base_model), or `model` itself when nothing wraps it."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
