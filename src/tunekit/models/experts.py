"""Mixture-of-experts models: their experts and routers found from the model itself, LoRA aimed at them as the
recipe's `moe` section says, and the router's load-balancing loss switched on.

In transformers 5 a sparse block keeps all its experts in one module as 3-D parameters (experts x out x in:
Qwen3-MoE's, OLMoE's, Mixtral's and gpt-oss's `mlp.experts.gate_up_proj` and `down_proj`) beside a router module
that returns (logits, scores, indices). Neither is an nn.Linear, so peft's all-linear reaches attention only; peft
trains LoRA on the 3-D parameters themselves (`target_parameters`, one low-rank pair per expert), which is what is
used here rather than unpacking the experts into Linear layers. The model's config keeps the router's balancing
loss off (`output_router_logits: false`) unless asked; training turns it on at the config's coefficient."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

from torch import nn

from tunekit.config.schema import MoeConfig
from tunekit.core.errors import TunekitError
from tunekit.models import peftconvert, routerloss
from tunekit.models.unwrap import base_of

log = logging.getLogger("tunekit")


@dataclass(frozen=True)
class Layout:
    """Where a model's experts and routers are: names relative to a decoder layer ("mlp.experts.gate_up_proj"),
    the count of sparse layers, experts per layer and experts each token uses."""

    experts: tuple[str, ...]  # the experts' 3-D parameters
    routers: tuple[str, ...]  # the router modules
    layers: int
    count: int
    top_k: int
    parameters: int  # all the experts' parameters, every layer

    @property
    def inactive(self) -> int:
        """Expert parameters a token does not use (those of the experts its router did not pick)."""
        return self.parameters - self.parameters * self.top_k // self.count


def _relative(name: str) -> str:
    """"model.layers.3.mlp.experts.down_proj" -> "mlp.experts.down_proj": the name inside a decoder layer."""
    parts = name.split(".")
    digits = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[digits[0] + 1:]) if digits else name


def _shape(p) -> tuple:
    """A parameter's shape, also where ZeRO-3 partitioned it as the model loaded (its data then empty)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def experts_per_token(config) -> int | None:
    return getattr(config.get_text_config(), "num_experts_per_tok", None)


def own_weights(module: nn.Module) -> dict[str, tuple]:
    """A module's own parameters by name and shape; one stored in 4 bits (models.expertquant: a parametrization
    over its codes) by the shape it reads as."""
    found = {n: _shape(p) for n, p in module.named_parameters(recurse=False)}
    for name, chain in getattr(module, "parametrizations", {}).items():
        shape = getattr(chain[0], "weight_shape", None)
        found[name] = tuple(shape) if shape is not None else _shape(chain.original)
    return found


def holds_experts(module: nn.Module) -> bool:
    """Whether a module is a sparse block's experts: it holds 3-D parameters of its own (experts x out x in), more
    than one expert (a vision tower's pooling probe, 1 x 1 x hidden, is not)."""
    return any(len(shape) == 3 and shape[0] > 1 for shape in own_weights(module).values())


def layout(model: nn.Module) -> Layout | None:
    """The model's experts and routers, or None for a dense model. An experts module is one that holds 3-D
    parameters of its own; its router is the sibling whose weight has one row per expert."""
    base = base_of(model)
    top_k = experts_per_token(base.config)
    if not top_k:
        return None
    experts, routers, total, layers, count = set(), set(), 0, 0, 0
    modules = dict(base.named_modules())
    for found_at, module in modules.items():
        if not holds_experts(module):
            continue
        own = {n: shape for n, shape in own_weights(module).items() if len(shape) == 3}
        name = found_at.replace(".base_layer", "")  # under peft's wrappers (LoRA on the experts) as before them
        layers += 1
        count = next(iter(own.values()))[0]
        # the experts' biases (gpt-oss) and their LoRA pairs (under peft's wrappers) too: each expert's own
        total += sum(math.prod(shape) for m in modules[name].modules() for shape in own_weights(m).values()
                     if not isinstance(m, nn.ModuleDict) and type(m).__name__ != "ParametrizationList")
        experts.update(_relative(f"{name}.{n}") for n in own)
        block = name.rsplit(".", 1)[0]
        for child, sub in modules[block].named_children():
            weight = getattr(sub, "weight", None)
            if sub is not module and isinstance(weight, nn.Parameter) and _shape(weight)[0] == count:
                routers.add(_relative(f"{block}.{child}"))
    if not layers:
        return None
    return Layout(tuple(sorted(experts)), tuple(sorted(routers)), layers, count, top_k, total)


def scope_lora(model: nn.Module, peft_cfg, moe: MoeConfig | None, say: bool = True):
    """`peft_cfg` for a mixture-of-experts model: LoRA on the experts' 3-D weights with moe.experts, the routers
    trained in full (saved beside the adapter) with moe.router: trained; one line says what trains (`say`)."""
    found = layout(model)
    if found is None:
        if moe is not None:
            raise TunekitError(f"moe: {type(base_of(model)).__name__} is not a mixture-of-experts model (no 3-D expert "
                               "weights); remove the moe section")
        return peft_cfg
    moe = moe or MoeConfig()
    head = base_of(model).get_output_embeddings()
    shown = peft_cfg.target_modules if isinstance(peft_cfg.target_modules, str) else "the listed modules"
    names = [n for n, m in base_of(model).named_modules() if isinstance(m, nn.Linear) and m is not head]
    # the linear layers by their names within a decoder layer: peft reads all-linear, or a bare gate_proj, on a model
    # it knows as a mixture of experts in transformers 4's terms and would move them to the router and the experts
    # (at twice the rank on gate_up_proj); a dotted name it keeps (models.peftconvert)
    linear = sorted({_relative(n) for n in names if _reached(n, peft_cfg.target_modules)})
    if not isinstance(peft_cfg.target_modules, str):
        missed = sorted(t for t in peft_cfg.target_modules if not any(_reached(n, [t]) for n in names))
        if missed:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise TunekitError(f"lora.target_modules: {', '.join(missed)} names no linear layer of "
                               f"{type(base_of(model)).__name__} (its experts are 3-D weights, trained by "
                               "moe.experts); "
                               f"name its linear layers ({', '.join(leaves) or 'none reached'}) or use all-linear")
    peft_cfg.target_modules = linear
    if moe.experts:
        peft_cfg.target_parameters = list(found.experts)
        peft_cfg.lora_dropout = 0.0  # peft's LoRA on a parameter takes none; one asked for: refused (moecheck)
    if moe.router == "trained":
        peft_cfg.modules_to_save = [*(peft_cfg.modules_to_save or ()), *found.routers]
    say_it = log.info if say else log.debug
    say_it("lora: %s reaches the linear layers %s; the %d experts x %d layers (%s) %s; the router (%s) %s",
           shown, ", ".join(linear) or "(none)", found.count, found.layers, ", ".join(found.experts),
           "train through LoRA on their 3-D weights (moe.experts; no LoRA dropout)" if moe.experts
           else "stay frozen (moe.experts: false)", ", ".join(found.routers),
           "trains in full (moe.router: trained)" if moe.router == "trained" else "stays frozen (moe.router)")
    return peft_cfg


def _reached(name: str, targets) -> bool:
    """Whether peft's target_modules reach the Linear layer `name` (all-linear: every one but the output head)."""
    return targets == "all-linear" or any(peftconvert.reaches(name, t) for t in targets)


def choose_kernel(model: nn.Module, moe: MoeConfig | None) -> str | None:
    """Set how the experts compute (moe.kernel) and return the implementation transformers runs, or None for a dense
    model. auto: grouped_mm (one grouped matmul over the experts a batch reaches: transformers' own default) wherever
    torch can dispatch it, CUDA and CPU alike, else eager (a loop over those experts). On 2 CPU cores grouped_mm
    trained a Qwen3-MoE-shaped model 2.3x as fast as eager in bf16 and fp32 (bench/moe_kernels.json); batched_mm
    3.4-4.4x slower than eager. transformers falls back to eager where grouped_mm cannot dispatch; the value read
    back is what runs."""
    base = base_of(model)
    if layout(base) is None:
        return None
    wanted = (moe or MoeConfig()).kernel
    try:
        base.set_experts_implementation(None if wanted == "auto" else wanted)
    except (ValueError, ImportError, RuntimeError) as e:
        raise TunekitError(f"moe.kernel: {wanted} cannot run {type(base).__name__} here ({str(e).splitlines()[0]}); "
                           "use auto or eager") from None
    return getattr(base.config, "_experts_implementation", None) or "eager"


def balance_router(model: nn.Module, moe: MoeConfig | None) -> float | None:
    """The router's load-balancing loss on (moe.aux_loss, the default), at moe.aux_loss_coef or the config's own
    coefficient; returns the coefficient (0 with the loss off), or None for a dense model. The model reads the
    coefficient into an attribute when it is built, so that attribute is set too."""
    base = base_of(model)
    if layout(base) is None:
        return None
    moe = moe or MoeConfig()
    config = base.config
    if not computes_balancing_loss(base):
        if moe.aux_loss_coef or moe.aux_loss_scope == "layer":  # a config that sets none: refused by moecheck
            raise TunekitError(f"moe.aux_loss: {type(base).__name__} computes no load-balancing loss in transformers; "
                               "remove moe.aux_loss_coef and moe.aux_loss_scope")
        return 0.0
    if not hasattr(base, "_tunekit_router_as_loaded"):
        base._tunekit_router_as_loaded = {k: getattr(config, k, None) for k in ("output_router_logits",
                                                                                "router_aux_loss_coef")}
    coef = moe.aux_loss_coef if moe.aux_loss_coef is not None else getattr(config, "router_aux_loss_coef", 0.0)
    coef = coef if moe.aux_loss else 0.0  # TRL's trainers add the loss whenever the coefficient is not 0
    config.output_router_logits = coef > 0
    config.router_aux_loss_coef = coef
    if hasattr(base, "router_aux_loss_coef"):
        base.router_aux_loss_coef = coef
    if coef and not getattr(base, "_tunekit_router_logits_for_losses", False):
        base.register_forward_pre_hook(_router_logits_for_losses_only, with_kwargs=True)
        base._tunekit_router_logits_for_losses = True
        if moe.aux_loss_scope == "layer":
            found = layout(base)
            routerloss.per_layer(base, found.count, found.top_k)
    return coef


def computes_balancing_loss(base: nn.Module) -> bool:
    """Whether transformers computes a load-balancing loss for this model (routerloss.loss_function); a router
    without one (DeepSeek-V3's score-correction bias) stays as loaded."""
    return routerloss.loss_function(base) is not None


@contextlib.contextmanager
def router_config_as_loaded(model: nn.Module):
    """The config's router settings as the model loaded, while it is saved: training's output_router_logits would
    travel with full fine-tuning's weights, and a model loaded from them would compute the balancing loss at every
    forward (and fail generating under a KV cache: _router_logits_for_losses_only)."""
    base = base_of(model)
    as_loaded = getattr(base, "_tunekit_router_as_loaded", None) or {}
    now = {k: getattr(base.config, k, None) for k in as_loaded}
    for key, value in as_loaded.items():
        setattr(base.config, key, value)
    try:
        yield
    finally:
        for key, value in now.items():
            setattr(base.config, key, value)


def _router_logits_for_losses_only(module, args, kwargs):
    """A forward without labels (generation: eval, chat, GRPO's sampling) computes no loss for the balancing term to
    join, and under a KV cache transformers' balancing loss fails on the attention mask (the whole sequence's,
    beside the router logits of the new tokens only); TRL's trainers ask for the logits by argument where they
    add the term themselves."""
    if kwargs.get("labels") is None and kwargs.get("output_router_logits") is None:
        kwargs["output_router_logits"] = False
    return args, kwargs
