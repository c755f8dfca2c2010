"""LoRA layers whose forward adds the adapter's product in one fused multiply-add.

peft's LoRA forward (0.21) computes `result + lora_B(lora_A(dropout(x))) * scaling`: three module calls, a multiply
and an add over the layer's whole output, and, for an fp32 adapter on 16-bit activations, a cast of the input to
fp32 that autocast casts straight back. Here the same sum is one `addmm(result, A x, B^T, alpha=scaling)`: the
scaling and the add ride in the matmul, no input is cast, and the product rounds once instead of three times. On
a CPU it made a LoRA step of SmolLM2-135M 10-17% faster (bench/RESULTS.md); on a GPU it is two kernels and three
module calls fewer per adapted linear, where steps are bound by the host.

`fuse` installs it on every LoRA linear layer (plain, 4-bit and 8-bit bases) as an instance `forward`; whatever
it does not cover goes through peft's own forward unchanged: disabled or merged adapters, several active ones,
variants (DoRA...), a bias on B, mixed dtypes without autocast, and weights that ZeRO-3 partitions or that are
DTensors (those are gathered by hooks on the submodule calls this path skips).
"""

from __future__ import annotations

import types

import torch


def _plain(p: torch.Tensor) -> bool:
    return type(p.data) is torch.Tensor and not hasattr(p, "ds_id")


def fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA layer's forward (bound to it by `fuse`); peft's where this one does not apply."""
    fallback = type(self).forward
    if self.disable_adapters or self.merged or len(self.active_adapters) != 1 or kwargs.get("adapter_names"):
        return fallback(self, x, *args, **kwargs)
    name = self.active_adapters[0]
    if name not in self.lora_A or name in self.lora_variant:
        return fallback(self, x, *args, **kwargs)
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    a, b = lora_a.weight, lora_b.weight
    autocast = torch.is_autocast_enabled(x.device.type)
    if lora_b.bias is not None or not (_plain(a) and _plain(b)) or not (autocast or x.dtype == a.dtype == b.dtype):
        return fallback(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    if not autocast and result.dtype != a.dtype:
        return fallback(self, x, *args, **kwargs)
    hidden = torch.nn.functional.linear(self.lora_dropout[name](x), a)
    flat, h = result.reshape(-1, result.shape[-1]), hidden.reshape(-1, hidden.shape[-1])
    if autocast and result.dtype != torch.get_autocast_dtype(x.device.type):
        # a wider base output (a 4-bit layer on fp32 norms returns fp32): the sum stays in its dtype, as peft's does
        with torch.autocast(x.device.type, enabled=False):
            out = torch.addmm(flat, h.to(result.dtype), b.t().to(result.dtype), alpha=self.scaling[name])
    else:
        out = torch.addmm(flat, h, b.t(), alpha=self.scaling[name])
    return out.view(result.shape)


def _lora_linear_classes() -> tuple[type, ...]:
    from peft.tuners.lora import layer

    classes = [layer.Linear]
    try:
        from peft.tuners.lora import bnb
    except ImportError:  # no bitsandbytes
        return tuple(classes)
    return tuple(classes + [getattr(bnb, n) for n in ("Linear4bit", "Linear8bitLt") if hasattr(bnb, n)])


def fuse(model) -> int:
    """Install `fused_forward` on every LoRA linear layer of `model`; how many."""
    classes = _lora_linear_classes()
    layers = [m for m in model.modules() if type(m) in classes]
    for m in layers:
        m.forward = types.MethodType(fused_forward, m)
    return len(layers)
