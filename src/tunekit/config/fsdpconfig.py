"""training.fsdp -> the Trainer's FSDP2 arguments (accelerate's FullyShardedDataParallelPlugin builds from them).

Checkpoints do not use accelerate's FSDP writers (torch.distributed.checkpoint keeps its metadata in a
pickle, and a full state dict is written with torch.save): training.trainer gathers full state dicts and
writes them with checkpointfile, which also lets a run resume on another number of processes."""

from __future__ import annotations

from tunekit.config.trainingschema import FsdpConfig

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def trainer_arguments(fsdp: FsdpConfig | None, cuda: bool) -> dict:
    """TrainingArguments keys for FSDP2 (empty without training.fsdp). Without a GPU the sharded state already
    lives in CPU memory, and FSDP2's offload policy needs a GPU to offload from: cpu_offload is left off."""
    if fsdp is None:
        return {}
    return {
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            "reshard_after_forward": fsdp.reshard_after_forward,
            "cpu_offload": fsdp.cpu_offload and cuda,
            # TRANSFORMER_BASED_WRAP without class names wraps the model's _no_split_modules (its decoder layer)
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if fsdp.auto_wrap else "NO_WRAP",
            "activation_checkpointing": fsdp.activation_checkpointing,
            "state_dict_type": "FULL_STATE_DICT",
        },
    }


def mixed_precision_policy(fsdp: FsdpConfig, precision: str) -> dict | None:
    """FSDP2's MixedPrecisionPolicy as accelerate's plugin takes it (dtypes); None in fp32."""
    if precision == "fp32":
        return None
    import torch

    compute = getattr(torch, DTYPES[precision])
    reduce = torch.float32 if fsdp.reduce_dtype == "float32" else compute
    return {"param_dtype": compute, "reduce_dtype": reduce, "output_dtype": compute}


def describe(fsdp: FsdpConfig, cuda: bool) -> str:
    parts = ["FSDP2", "parameters, gradients and optimizer state sharded" + (
        "" if fsdp.reshard_after_forward else " (a layer's parameters kept gathered from forward to backward)")]
    if fsdp.auto_wrap:
        parts.append("one unit per decoder layer")
    if fsdp.cpu_offload:
        parts.append("offloaded to CPU" if cuda else "cpu_offload skipped: no GPU, the state is in CPU memory already")
    if fsdp.activation_checkpointing:
        parts.append("activation checkpointing")
    return ", ".join(parts)
