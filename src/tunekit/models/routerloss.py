"""The router's load-balancing loss counted per sparse layer (moe.aux_loss_scope: layer).

transformers' load_balancing_loss_func (Switch Transformer's loss, as Mixtral, Qwen3-MoE and OLMoE compute it)
joins every layer's router logits before counting: the fraction of tokens each expert receives and its mean routing
probability are averaged over all layers first. Layers that each favour their own few experts then look even to it
(an upcycled SmolLM2-MoE's routers reached 3.83 of a possible 4 busiest-over-mean in one layer while its loss read
2.0, its minimum). Switch Transformer adds the loss at each sparse layer; here it is the same function on each
layer's logits alone, averaged over the layers, so it keeps the coefficient's scale."""

from __future__ import annotations

import sys

from torch import nn

from tunekit.core.errors import TunekitError


def loss_function(base: nn.Module):
    """transformers' load_balancing_loss_func for this model (its modeling module's: Mixtral's, Qwen2/3-MoE's,
    OLMoE's, gpt-oss's), or None where transformers computes none (DeepSeek-V3's and GLM-4.5's routers balance by a
    score-correction bias). Read along the class's bases: FSDP2 wraps a model in a class of its own."""
    for cls in type(base).__mro__:
        found = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if found is not None:
            return found
    return None


def per_layer(base: nn.Module, experts: int, top_k: int) -> None:
    """Replace the model's balancing loss in its output (loss and aux_loss) by the mean of its layers' own."""
    loss_func = loss_function(base)
    if loss_func is None:
        raise TunekitError(f"moe.aux_loss_scope: {type(base).__name__} computes no load-balancing loss of "
                           "transformers' kind to count per layer; use aux_loss_scope: model")

    def hook(module, _args, kwargs, output):
        logits = getattr(output, "router_logits", None)
        if getattr(output, "aux_loss", None) is None or not logits:
            return output
        aux = layer_mean(loss_func, logits, experts, top_k, kwargs.get("attention_mask"))
        if output.loss is not None and kwargs.get("labels") is not None:
            device, coef = output.loss.device, module.router_aux_loss_coef
            output.loss = output.loss + coef * (aux.to(device) - output.aux_loss.to(device))
        output.aux_loss = aux
        return output

    base.register_forward_hook(hook, with_kwargs=True)


def layer_mean(loss_func, logits, experts: int, top_k: int, mask=None):
    """`loss_func` (transformers' load_balancing_loss_func) on each layer's router logits alone, averaged."""
    return sum(loss_func((layer,), experts, top_k, mask) for layer in logits) / len(logits)
