"""FSDP2 and ZeRO-3 in `tunekit plan`: the full parameters a device gathers, and when, and the gradient
buffers before they are reduce-scattered, on top of the 1/world shards plan.modelstate.shard divides.

Each term is live at one or more moments of the step (`Term.when`). How the terms follow accelerate's,
torch's and DeepSpeed's code, and which versions were read: docs/plan.md, "What FSDP2 and ZeRO-3 gather"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tunekit.models import experts, vision

DEEPSPEED_DEFAULTS = {"stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
                      "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                      "reduce_bucket_size": 500_000_000}
AUTO = "auto"

GATHERED, GRADIENTS = "gathered parameters", "gradient buffers"


@dataclass
class Param:
    unit: str  # "layer", "embed" (untied input embeddings) or "head" (final norm, output head, the rest)
    layer: int  # its decoder layer, -1 outside one
    numel: int
    kind: str  # "trainable", "quantized" or "frozen"


@dataclass
class Term:
    key: str
    bytes: float
    when: tuple  # of "forward", "backward", "end", "sampling", "step" (see above)
    category: str


def kind(recipe, name: str, module, pname: str, unquantized: set, p) -> str:
    """trainable, quantized or frozen; `unquantized`: ids of the weights a quantized load leaves in a float dtype
    (the output head; a vision-language model's tower and projector, models.vision)."""
    if recipe.full_finetuning:  # all but what stays frozen (a vision-language model's tower, models.vision)
        return "trainable" if p.requires_grad else "frozen"
    if "lora_" in name or "modules_to_save" in name:
        return "trainable"
    if recipe.quantization is not None and id(p) not in unquantized and (
            (isinstance(module, torch.nn.Linear) and pname == "weight")
            or (len(p.shape) == 3 and experts.holds_experts(module))):  # 4-bit experts too (models.expertquant)
        return "quantized"
    return "frozen"


def params(recipe, model) -> list[Param]:
    """Every parameter once (tied ones count once), in registration order (the forward order of a
    decoder-only model), with the FSDP2 unit it belongs to."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    layer_of: dict[int, int] = {}
    for i, layer in enumerate(m for m in model.modules() if type(m).__name__ in classes):
        layer_of.update((id(p), i) for p in layer.parameters())
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    head = {id(p) for p in output.parameters()} if output is not None else set()
    embed = {id(p) for p in inputs.parameters()} - head if inputs is not None else set()
    image_side = vision.image_side(model)
    out, seen = [], set()
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            unit = "layer" if id(p) in layer_of else "embed" if id(p) in embed else "head"
            out.append(Param(unit, layer_of.get(id(p), -1), p.numel(),
                             kind(recipe, name, module, pname, head | image_side, p)))
    return out


def gathered_bytes(p: Param, elem: int, quant_bits: int) -> float:
    """Bytes of `p` gathered whole: the compute dtype, or a quantized weight's packed codes (stored in the
    compute dtype under FSDP2 and ZeRO-3: the bytes of the packing, whatever the dtype)."""
    return p.numel * quant_bits / 8 if p.kind == "quantized" else p.numel * elem


def by_layer(ps: list[Param], size) -> list[float]:
    layers = [0.0] * (max((p.layer for p in ps), default=-1) + 1)
    for p in ps:
        if p.unit == "layer":
            layers[p.layer] += size(p)
    return layers


def fsdp_terms(ps: list[Param], s, elem: int, quant_bits: int) -> list[Term]:
    """FSDP2's gathered units and unsharded gradients per device (how: docs/plan.md, "What FSDP2 and ZeRO-3 gather")."""
    reduce = 4 if (s.fsdp_reduce_dtype == "float32" or elem == 4) else elem
    gathered = by_layer(ps, lambda p: gathered_bytes(p, elem, quant_bits))
    trained = by_layer(ps, lambda p: p.numel if p.kind == "trainable" else 0)
    head = sum(gathered_bytes(p, elem, quant_bits) for p in ps if p.unit == "head")
    embed = sum(gathered_bytes(p, elem, quant_bits) for p in ps if p.unit == "embed")
    terms = []
    if not s.fsdp_auto_wrap or not s.fsdp_reshard_after_forward:
        # the root unit (every decoder layer without auto_wrap) is kept too; the embeddings' unit follows
        # reshard_after_forward
        kept = sum(gathered) + (0 if s.fsdp_reshard_after_forward else embed)
        what = "every decoder layer" + ("" if s.fsdp_reshard_after_forward else " + embeddings")
        why = "kept to backward" if s.fsdp_auto_wrap else "one unit"
        terms += [Term(f"FSDP2 gathered: {what} ({why}) + head unit", kept + head, ("forward",), GATHERED),
                  Term(f"FSDP2 gathered: {what} ({why})", kept, ("backward",), GATHERED)]
    else:
        terms += [Term("FSDP2 gathered: head unit (final norm, output head)", head, ("forward",), GATHERED),
                  Term("FSDP2 gathered: a decoder layer + the next (prefetch)",
                       sum(sorted(gathered)[-2:]), ("backward",), GATHERED)]
    if s.sampled:  # generation runs the sharded model: its units are gathered as in a forward pass
        terms.append(Term("FSDP2 gathered: units in use while sampling", terms[0].bytes + terms[1].bytes
                          if s.fsdp_auto_wrap and s.fsdp_reshard_after_forward else terms[0].bytes,
                          ("sampling",), GATHERED))
    if s.fsdp_auto_wrap:
        terms.append(Term("FSDP2: a layer's gradients before reduce-scatter",
                          max(trained, default=0) * (elem + reduce), ("backward",), GRADIENTS))
    else:  # the root unit reduce-scatters once, after the last layer's backward
        terms.append(Term("FSDP2: every layer's gradients before reduce-scatter (one unit)",
                          sum(trained) * (elem + reduce), ("end",), GRADIENTS))
    if s.accumulation > 1:
        total = sum(p.numel for p in ps if p.kind == "trainable")
        terms.append(Term("FSDP2: unsharded gradients over micro-batches (no_sync)", total * reduce,
                          ("step",), GRADIENTS))
    return [t for t in terms if t.bytes]


def zero3_numbers(recipe, s, hidden_size: int) -> dict:
    """stage3_* sizes and reduce_bucket_size in elements, "auto" filled as tunekit fills it."""
    from tunekit.config import dsconfig

    raw = {"reduce_bucket_size": s.zero3_reduce_bucket, "stage3_prefetch_bucket_size": s.zero3_prefetch,
           "stage3_param_persistence_threshold": s.zero3_persistence}
    zero = {k: AUTO if v is None else v for k, v in raw.items()}
    filled = dsconfig.resolve({"zero_optimization": zero}, recipe, None, None, "plan", hidden_size=hidden_size)
    return filled["zero_optimization"]


def reused(ps: list[Param], sizes: list[float], reuse: int, factor: int) -> list[bool]:
    """Whether each parameter is used again within `reuse` elements of the trace after its forward use:
    the rest of the forward pass and the backward pass back to it, `factor` x what follows it."""
    out, after = [False] * len(ps), 0.0
    for i in range(len(ps) - 1, -1, -1):
        out[i] = factor * after < reuse
        after += sizes[i]
    return out


def zero3_terms(recipe, ps: list[Param], s, elem: int, quant_bits: int, hidden_size: int) -> list[Term]:
    """ZeRO-3's persistent and gathered parameters and its gradient buffers per device (see above)."""
    z = zero3_numbers(recipe, s, hidden_size)
    nbytes = [gathered_bytes(p, elem, quant_bits) for p in ps]
    numel = [b / elem for b in nbytes]  # DeepSpeed counts the elements of the stored tensor
    persistent = [n < z["stage3_param_persistence_threshold"] for n in numel]
    kept = reused(ps, numel, s.zero3_reuse, 3 if s.gradient_checkpointing else 2)
    at_turn = sum(b for b, k, q in zip(nbytes, kept, persistent) if k and not q)
    in_layers = sum(b for b, k, q, p in zip(nbytes, kept, persistent, ps) if k and not q and p.unit == "layer")
    largest = max((n for n, p in zip(numel, ps) if p.unit == "layer"), default=0)
    prefetch = min(max(z["stage3_prefetch_bucket_size"], largest), s.zero3_max_live)
    # a recomputed layer's parameters are used again by its backward at once: the whole layer stays gathered
    in_use = max(by_layer(ps, lambda p: gathered_bytes(p, elem, quant_bits)), default=0) / elem \
        if s.gradient_checkpointing else largest
    largest_trained = max((p.numel for p in ps if p.kind == "trainable" and p.unit == "layer"), default=0)
    bucket = z["reduce_bucket_size"] if s.zero3_contiguous_gradients else 0
    terms = [
        Term("ZeRO-3: parameters under the persistence threshold",
             sum(b for b, q in zip(nbytes, persistent) if q), ("step",), GATHERED),
        Term("ZeRO-3 gathered: head + parameters within max_reuse_distance",
             at_turn, ("forward",), GATHERED),
        Term("ZeRO-3 gathered: in use + prefetch bucket, or kept for reuse",
             max(in_layers, (in_use + prefetch) * elem), ("backward",), GATHERED),
        Term("ZeRO-3: reduce bucket (contiguous_gradients)", bucket * elem, ("step",), GRADIENTS),
        # TRL generates with every parameter gathered (GRPOConfig.ds3_gather_for_generation, true by default)
        Term("ZeRO-3 gathered: the whole model while sampling", sum(nbytes) if s.sampled else 0, ("sampling",),
             GATHERED),
        Term("ZeRO-3: a parameter's gradient before the reduce bucket", largest_trained * elem,
             ("backward",), GRADIENTS),
    ]
    return [t for t in terms if t.bytes]


def zero3_settings(zero: dict) -> dict:
    """Settings fields from a stage-3 config's zero_optimization section ("auto" as None: filled later)."""
    def size(key, auto=None):
        value = zero.get(key, DEEPSPEED_DEFAULTS[key])
        return auto if value == AUTO else int(value)

    return {"zero3_prefetch": size("stage3_prefetch_bucket_size"),
            "zero3_persistence": size("stage3_param_persistence_threshold"),
            "zero3_max_live": size("stage3_max_live_parameters", DEEPSPEED_DEFAULTS["stage3_max_live_parameters"]),
            "zero3_reuse": size("stage3_max_reuse_distance", DEEPSPEED_DEFAULTS["stage3_max_reuse_distance"]),
            "zero3_reduce_bucket": size("reduce_bucket_size"),
            "zero3_contiguous_gradients": bool(zero.get("contiguous_gradients", True))}


def transient_terms(recipe, s, cfg, model) -> list[Term]:
    """FSDP2's or ZeRO-3's gathered parameters and gradient buffers (none without either)."""
    if not (s.fsdp or s.zero_stage >= 3):
        return []
    elem = 4 if s.precision == "fp32" else 2
    ps = params(recipe, model)
    bits = recipe.quantization.bits if recipe.quantization is not None else 4
    if s.fsdp:
        return fsdp_terms(ps, s, elem, bits)
    return zero3_terms(recipe, ps, s, elem, bits, cfg.hidden_size)
