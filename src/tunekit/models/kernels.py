"""training.kernels: fused GPU kernels (liger, cut_cross_entropy) in place of tunekit's own loss path
(models.losspath). `require` refuses the setting before any weight loads where no CUDA GPU is; `apply` patches
the loaded model and marks it for the Trainer (training.trainer), which picks the loss path from the mark.
How each is applied: docs/precision-and-speed.md, "Fused kernels"."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from tunekit.config.schema import Recipe
from tunekit.core.errors import TunekitError
from tunekit.models import hub, info, losspath
from tunekit.models.unwrap import base_of

log = logging.getLogger("tunekit")

MARK = "_tunekit_kernels"  # attribute of the patched model: which kernels it runs


@dataclass(frozen=True)
class Kernels:
    name: str  # training.kernels value
    module: str  # import name
    dist: str  # package name (the `kernels` extra installs it)
    what: str  # for the log line and errors


KERNELS = {k.name: k for k in (
    Kernels("liger", "liger_kernel", "liger-kernel", "Liger's fused linear cross-entropy, RMSNorm, RoPE and SwiGLU"),
    Kernels("cut_cross_entropy", "cut_cross_entropy", "cut-cross-entropy", "Cut Cross-Entropy's linear cross-entropy"),
)}


def liger_families() -> dict:
    """model_type -> Liger's patch function, Liger's own table (liger_kernel.transformers.monkey_patch)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def _check_liger_family(model_type: str | None) -> None:
    if model_type not in liger_families():
        from importlib.metadata import version

        raise TunekitError(f"training.kernels: liger has no kernels for model family {model_type!r} (liger-kernel "
                           f"{version('liger-kernel')}); set training.kernels: cut_cross_entropy or none")


def require(recipe: Recipe) -> None:
    """Refuse training.kernels where it cannot run, before any weight loads: no CUDA GPU, the package missing,
    a model family Liger does not cover."""
    name = recipe.training.kernels
    if name == "none":
        return
    if not torch.cuda.is_available():
        raise TunekitError(f"training.kernels: {name} runs Triton kernels, which need a CUDA GPU, and this machine "
                           "has none; remove training.kernels or set it to none")
    kernels = KERNELS[name]
    if importlib.util.find_spec(kernels.module) is None:
        raise TunekitError(f"training.kernels: {name} needs {kernels.dist}, which is not installed: "
                           "pip install 'tunekit[kernels]'")
    if name == "liger":
        try:
            model_type = info.model_config(recipe.model).model_type
        except (hub.Unavailable, OSError, ValueError):
            return  # loading the model says why it cannot be had
        _check_liger_family(model_type)


def cce_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 rows: int | None = None) -> torch.Tensor:
    """losspath.linear_cross_entropy_sum's contract, computed by Cut Cross-Entropy: the summed cross-entropy
    of the head on `hidden` [N, H] against `targets` [N], in the autocast dtype when autocast is on (the
    kernel takes both operands in one dtype; autocast does not reach Triton)."""
    from cut_cross_entropy import linear_cross_entropy

    assert bias is None, "cut_cross_entropy takes no head bias (refused in kernels.apply)"
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, reduction="sum")


def apply(model, name: str):
    """Patch the loaded base model (before the adapter wraps it) with the recipe's kernels and mark it; a model
    the kernels cannot serve is refused in one line naming it and the fix."""
    if name == "none":
        return model
    if name == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _check_liger_family(getattr(model.config, "model_type", None))
        _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=True, cross_entropy=False,
                                        rms_norm=True, rope=True, swiglu=True)
    else:
        reason = losspath.unsupported_reason(model)
        head = model.get_output_embeddings()
        if reason is None and getattr(head, "bias", None) is not None:
            reason = "its output head has a bias, which cut-cross-entropy's function does not take"
        if reason is not None:
            raise TunekitError(f"training.kernels: cut_cross_entropy computes the loss from the output head of "
                               f"{type(model).__name__}, and {reason}; set training.kernels: liger or none")
    setattr(model, MARK, name)
    log.info("kernels: %s (training.kernels: %s)", KERNELS[name].what, name)
    return model


def applied(model) -> str | None:
    """The kernels `apply` patched into `model` (or the model an adapter wraps), or None."""
    base = base_of(model)
    return getattr(base, MARK, None)
