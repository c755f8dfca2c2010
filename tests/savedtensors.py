"""What autograd keeps for the backward pass in one decoder layer, as the plan's activation tests count it."""

from __future__ import annotations

import torch


def kept_in_layer(model, layer: int, seq: int, autocast: bool, keep=lambda t: True) -> dict[int, int]:
    """Storage bytes by storage of the tensors autograd saves in decoder layer `layer` (>= 1) during one forward of
    `seq` random tokens, those `keep` accepts: the weights and what layer `layer - 1` saved too (the rotary tables,
    saved by every layer) left out. bf16 autocast as the Trainer runs it when `autocast`."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shared, kept = {}, {}

    def recording(store: dict, leave_out: dict):
        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if keep(t) and ptr not in weights and ptr not in leave_out:
                store[ptr] = t.untyped_storage().nbytes()
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    hooks = []
    for name, store, leave_out in ((f"layers.{layer - 1}", shared, {}), (f"layers.{layer}", kept, shared)):
        block = next(m for n, m in model.named_modules() if n.endswith(name))
        ctx = recording(store, leave_out)
        hooks.append(block.register_forward_pre_hook(lambda *_, c=ctx: c.__enter__()))
        hooks.append(block.register_forward_hook(lambda *_, c=ctx: c.__exit__(None, None, None)))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=torch.randint(0, 300, (1, seq)))
    finally:
        for hook in hooks:
            hook.remove()
    return kept
