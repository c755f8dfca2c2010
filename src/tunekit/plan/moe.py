"""`tunekit plan`'s activations of a mixture of experts (models.experts): what autograd keeps per token in a sparse
block in place of a dense MLP, the routers' logits and balancing loss, and the expert weights that LoRA on the
experts or their 4-bit storage forms at each forward. Counted with saved-tensor hooks on Qwen3-MoE, OLMoE,
Mixtral and gpt-oss as tunekit loads them under grouped_mm (moe.kernel auto): tests/plan/test_moe_activations.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tunekit.config.schema import MoeConfig, Recipe
from tunekit.models import experts
from tunekit.models.unwrap import base_of


@dataclass(frozen=True)
class Sparse:
    """A model's sparse layers, as the plan counts them."""

    layers: int  # sparse decoder layers
    count: int  # experts per layer
    top_k: int  # experts per token
    width: int  # an expert's intermediate width
    gate_rows: float  # what the experts' gated activation keeps per routed row, in units of the width
    weights: int  # one layer's 3-D expert weights, in elements
    lora: int  # one layer's LoRA elements on those weights (0: experts not adapted)
    quantized: bool  # stored in 4 bits (QLoRA: models.expertquant), dequantized at each forward
    experts_trained: bool  # their weights (full fine-tuning) or LoRA on them take gradients
    router_trained: bool
    scopes: int  # balancing losses computed: 0 (off), 1 (the model's), 2 (moe.aux_loss_scope layer: both)
    shared: int = 0  # width of the shared experts every token goes through beside the routed (DeepSeek-V3, Qwen2-MoE)
    shared_gate: bool = False  # a one-wide linear gate scales the shared experts' output (Qwen2-MoE)


def of(model, cfg, recipe: Recipe) -> Sparse | None:
    """The sparse layers of `model` (built on the meta device, with its adapter), or None for a dense model."""
    found = experts.layout(model)
    if found is None:
        return None
    moe = recipe.moe or MoeConfig()
    text = cfg.get_text_config()
    width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    module = next(m for m in base_of(model).modules() if experts.holds_experts(m))
    weights = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 3)
    adapted = recipe.lora is not None and moe.experts
    lora = found.count * recipe.lora.r * sum(sum(p.shape[1:]) for p in module.parameters(recurse=False)
                                             if p.dim() == 3) if adapted else 0
    coef = moe.aux_loss_coef if moe.aux_loss_coef is not None else getattr(text, "router_aux_loss_coef", 0.0)
    scopes = 0 if not (moe.aux_loss and coef) else 2 if moe.aux_loss_scope == "layer" else 1
    shared, shared_gate = shared_experts(model, module)
    return Sparse(found.layers, found.count, found.top_k, width, gate_rows(module), weights, lora,
                  recipe.quantization is not None, recipe.full_finetuning or adapted,
                  recipe.full_finetuning or moe.router == "trained", scopes, shared, shared_gate)


def shared_experts(model, module) -> tuple[int, bool]:
    """(width, gated) of the dense MLP a sparse block runs every token through beside its routed experts (`module`):
    DeepSeek-V3's and GLM-4.5's shared_experts, Qwen2-MoE's shared_expert with its one-wide sigmoid gate; (0,
    False) where the block has none. Found from the block's other children: those holding linear layers (an MLP's
    width is the input of its last, the projection back to the hidden size), a linear layer one row wide (the
    gate)."""
    base = base_of(model)
    name = next(n for n, m in base.named_modules() if m is module)
    block = base.get_submodule(name.replace(".base_layer", "").rsplit(".", 1)[0])
    width, gated = 0, False
    for child in block.children():
        linear = _linear(child)
        if linear is not None:
            gated = gated or linear.out_features == 1  # the router, one row per expert, is not one wide
        elif not any(experts.holds_experts(m) for m in child.modules()):  # not the experts (under peft's wrappers)
            linears = [m for n, m in child.named_modules() if "lora_" not in n and isinstance(m, nn.Linear)]
            width += linears[-1].in_features if linears else 0  # down_proj, built last: the MLP's width
    return width, gated and width > 0


def _linear(module) -> nn.Linear | None:
    """The linear layer a module is (nn.Linear, bitsandbytes' 4-bit one) or wraps (peft's LoRA layer, its
    modules_to_save copy: a router trained in full)."""
    module = getattr(module, "original_module", getattr(module, "base_layer", module))
    return module if isinstance(module, nn.Linear) else None


def gate_rows(module) -> float:
    """What the experts' gated activation (transformers' `_apply_gate` on the gate and up projections' joined output)
    keeps for its backward per row, in units of the expert width: run on a small CPU tensor. SwiGLU keeps its input
    and SiLU(gate): 3; gpt-oss's clamped GLU its input and four products: 6."""
    apply = getattr(type(module), "_apply_gate", None)
    if apply is None:
        return 3.0
    width, kept = 8, {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    joined = torch.randn(1, 2 * width, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        apply(module, joined)
    return sum(kept.values()) / (width * joined.element_size())


def expert_elem(s, recipe: Recipe) -> int:
    """Bytes of an element the experts compute in: their weights' dtype, since grouped_mm does not autocast. Full
    fine-tuning's fp32 weights below fp32 (no ZeRO, no FSDP2: those compute on 16-bit copies) stay fp32."""
    if s.precision == "fp32" or (recipe.full_finetuning and s.zero_stage == 0 and not s.fsdp):
        return 4
    return 2


def block_bytes_per_token(sp: Sparse, cfg, s, recipe: Recipe) -> float:
    """A sparse block per token, in place of a dense MLP. Each token becomes top-k routed rows; per row the gate
    and up projections' output (2I), the gated activation's own (gate_rows - 2 more I's) and the down projection's
    output (h, weighted by the router) in the experts' dtype; with the experts trained also the inputs of both
    grouped matmuls (h + I). The router: its fp32 softmax (experts x 4), the top-k indices, sort order and weights
    (40 bytes per pick) and the weights' sum (4); with the router trained, its input (h)."""
    h, k, x = cfg.get_text_config().hidden_size, sp.top_k, expert_elem(s, recipe)
    elem = 4 if s.precision == "fp32" else 2
    rows = k * (sp.gate_rows * sp.width + h) * x
    if sp.experts_trained:
        rows += k * (h + sp.width) * x
    router = 4 * sp.count + 40 * k + 4 + (h * elem if sp.router_trained else 0)
    return rows + router


def router_loss_bytes(sp: Sparse, cfg, s) -> float:
    """The routers' logits, which the model returns (experts x compute dtype per token and sparse layer), and what
    each balancing loss keeps of them: its softmax and its top-k indices (experts x compute dtype + 8 x top-k)."""
    if not sp.scopes:
        return 0.0
    from tunekit.plan import splitting

    tokens = s.micro_batch * s.sequences * s.seq_len / splitting.pieces(s)
    elem = 4 if s.precision == "fp32" else 2
    per_layer = sp.count * elem + sp.scopes * (sp.count * elem + 8 * sp.top_k)
    return sp.layers * tokens * per_layer


def formed_weights_bytes(sp: Sparse, s, recipe: Recipe) -> float:
    """Expert weights formed at a sparse layer's forward and kept by its grouped matmuls for their backward: LoRA on
    the experts (peft's ParamWrapper, a parametrization) forms W + BA for every expert, 4-bit experts
    (models.expertquant) their dequantized weights, LoRA on 4-bit experts the one from the other. One layer's expert
    weights in the experts' dtype, with below fp32 the adapters' 16-bit casts. Per sparse layer held (every one;
    with gradient checkpointing the recomputed one)."""
    if not sp.lora and not sp.quantized:
        return 0.0
    x = expert_elem(s, recipe)
    return sp.weights * x + (sp.lora * 2 if x == 2 else 0)


def dequantized_bytes(sp: Sparse, s, recipe: Recipe) -> float:
    """LoRA on 4-bit experts: beside W + BA, the dequantized W it is formed from, for one layer at a time (measured:
    bench/plan_check_moe.json's QLoRA rows were under by one layer's expert weights without it)."""
    return sp.weights * expert_elem(s, recipe) if sp.quantized and sp.lora else 0.0
