"""The model a run trained, loaded as it was trained: base + adapter (the base re-quantized exactly as in
training for QLoRA), full fine-tuned weights, a merged directory, or a base model alone. Sits above
rundir (which only knows the run directory's files) and models (which loads weights)."""

from __future__ import annotations

import torch

from tunekit.config.schema import Recipe
from tunekit.core.hardware import DTYPES, Precision
from tunekit.models import loader
from tunekit.runs.layout import MODEL_DIR, RunRecord, Target, weights_dir


def trained_precision(record: RunRecord) -> Precision:
    return Precision(record.precision["name"], record.precision["reason"])


def quantization_as_trained(recipe: Recipe, record: RunRecord, compute: torch.dtype):
    """(load dtype, bitsandbytes config) that re-quantize the base exactly as in training (the same
    load dtype gives the same 4-bit codes and scales), computing in `compute`."""
    quant = loader.quantization_config(recipe, trained_precision(record))
    quant.bnb_4bit_compute_dtype = compute
    return DTYPES[record.precision["name"]], quant


def load_trained(target: Target, dtype: torch.dtype):
    """The model as the target defines it (base + adapter, quantized base for QLoRA; full weights; a merged
    directory; the base model alone), on this process's GPU where there is one: eval and chat generate there."""
    return on_device(_load_trained(target, dtype))


def on_device(model):
    """On this process's GPU where there is one (a 4-bit base is there already)."""
    if torch.cuda.is_available() and next(model.parameters()).device.type == "cpu":
        model = model.to(f"cuda:{torch.cuda.current_device()}")
    return model


def _load_trained(target: Target, dtype: torch.dtype):
    recipe = target.recipe
    if target.kind == "merged":
        return loader.load_base(recipe.model.model_copy(update={"name_or_path": str(target.location)}), dtype)
    if target.kind == "base":
        return loader.load_base(recipe.model, dtype)
    weights = weights_dir(target.location)
    if weights.name == MODEL_DIR:
        return loader.load_base(recipe.model.model_copy(update={"name_or_path": str(weights)}), dtype)
    if recipe.quantization is None:
        return loader.load_adapter_model(recipe.model, weights, dtype)
    load_dtype, quant = quantization_as_trained(recipe, RunRecord.load(target.location), dtype)
    return loader.load_adapter_model(recipe.model, weights, load_dtype, quant)
