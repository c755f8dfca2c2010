"""A run that diverges stops at once, in one line: a non-finite loss or gradient norm as the Trainer logs them, or a
non-finite trained weight where the weights are read (at steps that save, evaluate or end)."""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from tunekit.core.errors import TunekitError


def all_finite(tensors: list) -> bool:
    """Whether every element of every tensor is finite, with one host sync: the largest |element| of each
    (torch._foreach_norm at ord inf: a few fused kernels on a GPU; NaN and inf carry through a maximum,
    which never overflows) taken per device and dtype. Tensors of other kinds (FSDP's DTensors) are asked
    one by one."""
    groups: dict[tuple, list] = {}
    for t in tensors:
        t = t.detach()
        if type(t) is torch.Tensor:
            groups.setdefault((t.device, t.dtype), []).append(t)
        elif not bool(t.isfinite().all()):
            return False
    if not groups:
        return True
    largest = [m.float() for g in groups.values() for m in torch._foreach_norm(g, math.inf)]
    devices = {m.device for m in largest}
    return all(bool(torch.stack([m for m in largest if m.device == d]).isfinite().all()) for d in devices)


class StopOnNonFinite(TrainerCallback):
    """Stop at a non-finite loss, gradient norm or weight before a checkpoint, an evaluation or the end can take it.
    A logged step is judged by the loss and gradient norm the Trainer logs (already on the host); the weights are
    read only at a step that saves, evaluates or ends (one host sync there, none on other steps: a non-finite weight
    stays so through AdamW's updates, so it is still there to be found)."""

    def __init__(self):
        self.model = None
        self.named = None  # the model's named parameters, listed once (walking the modules costs a few ms a step)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model, self.named = model, None

    def on_step_end(self, args, state, control, **kwargs):
        # the Trainer's flow callback ran first and set what this step does next
        if self.model is None or not (control.should_save or control.should_evaluate or control.should_training_stop):
            return
        if self.named is None:
            self.named = list(self.model.named_parameters())
        trained = [(name, p) for name, p in self.named if p.requires_grad and p.numel()]
        if all_finite([p for _, p in trained]):
            return
        for name, p in trained:  # the first one, in the model's order
            if not bool(p.detach().isfinite().all()):
                raise TunekitError(f"training diverged by step {state.global_step}: weight {name} is not finite; "
                                   "lower training.learning_rate (the last good checkpoint is kept)")

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        loss, norm = logs.get("loss"), logs.get("grad_norm")
        if loss is not None and not math.isfinite(loss):
            raise TunekitError(f"training loss is {loss} at step {state.global_step}; lower training.learning_rate "
                               "or check the data (the last good checkpoint is kept)")
        if isinstance(norm, float) and not math.isfinite(norm):
            raise TunekitError(f"training diverged at step {state.global_step}: the gradient norm is {norm}; lower "
                               "training.learning_rate (the last good checkpoint is kept)")
