"""LoRA layers whose forward adds the adapter's product in one fused multiply-add (`addmm`). `fuse` installs it on
every LoRA linear layer; what it does not cover goes through peft's own forward unchanged. What it saves and
what it leaves to peft: docs/precision-and-speed.md, "The fused LoRA product"."""

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
