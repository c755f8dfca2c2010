"""The model's state on a device in `tunekit plan`: weights, gradients and optimizer state by part, as tunekit
loads them (full fine-tuning's fp32 masters, LoRA's frozen base, QLoRA's 4-bit codes beside what it keeps
unquantized), then divided as ZeRO or FSDP2 shard them, less what offload moves to CPU RAM. `s` is a
plan.estimate.Settings, `c` its Counts."""

from __future__ import annotations

from tunekit.config.schema import Recipe
from tunekit.plan.sizes import quantized_bytes, size_words

OPTIMIZER_BYTES = {"adamw_torch": 8, "adamw_torch_fused": 8, "paged_adamw_32bit": 8, "adamw_8bit": 2,
                   "paged_adamw_8bit": 2, "sgd": 0, "adafactor": 0}

QUANTIZED = "weights (quantized, incl. constants)"


def state_parts(recipe: Recipe, s, c) -> dict[str, float]:
    """Weights, gradients and optimizer state on one device before any sharding."""
    w_elem = 4 if (recipe.full_finetuning or s.precision == "fp32") else 2
    parts: dict[str, float] = {}
    q = recipe.quantization
    if q is not None:
        parts[QUANTIZED] = quantized_bytes(c.quantized, q.bits, q.double_quant)
        compute = 4 if s.precision == "fp32" else 2  # models.loader.prepare_quantized: the training precision
        parts[embeddings_key(s)] = c.embeddings * compute
        parts["weights (unquantized norms and biases, fp32)"] = (c.frozen_plain - c.embeddings) * 4
    elif not recipe.full_finetuning:
        dtype = 'fp32' if w_elem == 4 else s.precision
        parts[f"weights (frozen base, {dtype})"] = (c.frozen_plain - c.frozen_experts) * w_elem
        if c.frozen_experts:  # a mixture of experts: most of its weights, apart
            parts[f"weights (frozen experts, {dtype})"] = c.frozen_experts * w_elem
    if s.extra_forwards and recipe.full_finetuning:  # the reference: a frozen copy in the training precision
        parts[f"weights (frozen reference copy, {s.precision})"] = c.total * (4 if s.precision == "fp32" else 2)
    opt_key = f"optimizer ({s.optimizer})"
    if s.zero_stage > 0 and s.precision != "fp32":
        # DeepSpeed mixed precision: the model trains in bf16/fp16 and the optimizer keeps fp32 masters
        parts[f"weights (trainable, {s.precision})"] = c.trainable * 2
        parts["gradients (fp32)"] = c.trainable * 4
        parts[opt_key] = c.trainable * OPTIMIZER_BYTES.get(s.optimizer, 8)
        parts["master weights (fp32, in the optimizer)"] = c.trainable * 4
    else:  # without DeepSpeed tunekit trains fp32 weights (FSDP2 shards them; autocast or its policy casts)
        parts["weights (trainable, fp32)"] = c.trainable * 4
        parts["gradients (fp32)"] = c.trainable * 4
        parts[opt_key] = c.trainable * OPTIMIZER_BYTES.get(s.optimizer, 8)
    return parts


def embeddings_key(s) -> str:
    return f"weights (unquantized embeddings and head, {'fp32' if s.precision == 'fp32' else s.precision})"


def remarks(recipe: Recipe, s, parts: dict) -> dict[str, str]:
    """Notes on parts: what QLoRA's embeddings and head would take in fp32, as peft upcasts them."""
    key = embeddings_key(s)
    if recipe.quantization is None or s.precision == "fp32" or not parts.get(key):
        return {}
    return {key: f"{size_words(parts[key])} less than with peft's prepare_model_for_kbit_training, which "
                 "upcasts them to fp32"}


def shard(parts: dict, recipe: Recipe, s, c) -> float:
    """Divide what ZeRO or FSDP2 shards by the world size, in place, and take out what offload moves to
    CPU RAM; returns those bytes. FSDP2 shards what ZeRO-3 does (weights, gradients, optimizer state). A
    quantized weight is sharded as its packed codes, not its constants (quant_state, no parameter): under
    both, tunekit stores the codes in the compute dtype, the same bytes (plan.sharding)."""
    n = s.world_size // s.tp  # the processes holding the same weights (tp splits them first: plan.splitting)
    stage = 3 if s.fsdp or (s.tp > 1 and n > 1) else s.zero_stage
    optimizer_side = [k for k in parts if k.startswith(("optimizer (", "master weights"))]
    weights = [k for k in parts if k.startswith("weights")]
    codes = c.quantized * recipe.quantization.bits / 8 if recipe.quantization is not None else 0
    split = {QUANTIZED: codes / n} if QUANTIZED in parts else {}  # the sharded share of a part
    if stage >= 1:
        for key in optimizer_side:
            parts[key] /= n
    if stage >= 2:
        parts["gradients (fp32)"] /= n
    if stage >= 3:
        for key in weights:
            parts[key] = parts[key] - codes + split[key] if key in split else parts[key] / n
    if s.fsdp:  # cpu_offload moves every sharded part, gradients too
        moved = optimizer_side + weights + ["gradients (fp32)"] if s.fsdp_offload else []
    else:
        moved = ((optimizer_side if s.offload_optimizer and stage >= 1 else [])
                 + (weights if s.offload_params and stage >= 3 else []))
    cpu = 0.0
    for key in moved:
        share = split.get(key, parts[key])
        cpu += share
        parts[key] -= share
        if not parts[key]:
            parts.pop(key)
    return cpu
