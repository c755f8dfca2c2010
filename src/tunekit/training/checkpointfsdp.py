"""FSDP2 checkpoints as full state dicts in safetensors (checkpointfile), independent of the number of processes.

accelerate's FSDP writers save either torch.distributed.checkpoint folders (their metadata is a pickle)
or a torch.save'd full state dict, and the Trainer reads model weights back only through them. Here every
rank takes part in gathering the full, unsharded state (torch.distributed.checkpoint.state_dict), rank 0
writes it, and on resume every rank reads the full state and keeps its own shard, so a run saved by N
processes resumes on M. Weights come from the checkpoint's ordinary safetensors files (the Trainer saves
them gathered); only the optimizer state needs this module's writer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import TrainerCallback

log = logging.getLogger("tunekit")

WEIGHT_FILES = ("adapter_model.safetensors", "model.safetensors", "model.safetensors.index.json")


def model_state(model) -> dict:
    """The whole model's weights under their parameter names, on rank 0 (empty elsewhere); a collective."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model, optimizer) -> dict:
    """The whole optimizer state keyed by parameter name, on rank 0 (empty elsewhere); a collective."""
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, optimizer, state: dict) -> None:
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _model_keys(model, saved: dict) -> dict:
    """The checkpoint's tensors under the model's own parameter names. peft saves an adapter without its
    name (`lora_A.weight` for `lora_A.default.weight`); `model.safetensors` uses the model's names."""
    names = {}
    for key in model.state_dict():
        plain = key
        for adapter in getattr(model, "peft_config", {}):
            plain = plain.replace(f".{adapter}.", ".")
        names.setdefault(plain, key)
    missing = [k for k in saved if k not in names]
    if missing:
        raise KeyError(f"checkpoint tensor {missing[0]} matches no parameter of the model")
    return {names[k]: v for k, v in saved.items()}


def load_weights(model, checkpoint: str | Path) -> None:
    """The checkpoint's trained weights (adapter or whole model) into the sharded model; every rank."""
    path = next((Path(checkpoint) / f for f in WEIGHT_FILES if (Path(checkpoint) / f).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"{checkpoint} holds none of {', '.join(WEIGHT_FILES)}")
    if path.suffix == ".json":  # a large model saved in shards
        saved = {}
        for shard in sorted(set(json.loads(path.read_text())["weight_map"].values())):
            saved.update(load_file(str(path.parent / shard)))
    else:
        saved = load_file(str(path))
    full = _model_keys(model, saved)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


class ReportUnits(TrainerCallback):
    """Says, once the model is prepared, how many FSDP units it was sharded into: what ran, not what was asked."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)] if model is not None else []
        if not units:
            raise RuntimeError("training.fsdp: the model was not sharded")
        log.info("fsdp: %d units sharded over %d processes", len(units), args.world_size)
