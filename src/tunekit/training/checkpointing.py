"""Trainer checkpoints that resume can trust: a checkpoint counts only once its marker is written,
after the Trainer has finished every file in it (weights, optimizer, scheduler, RNG, data position).
The folder's layout and what resume picks from it (torch-free) live in runs.checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

from transformers import TrainerCallback

from tunekit.core.errors import TunekitError
from tunekit.runs.checkpoints import MARKER


class MarkComplete(TrainerCallback):
    """on_save runs after the Trainer wrote the whole checkpoint: mark it complete."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            (ckpt / MARKER).write_text(json.dumps({"step": state.global_step}) + "\n")


class StopOnNonFinite(TrainerCallback):
    """Stop at the first non-finite loss or weight, before that step can be checkpointed."""

    def __init__(self):
        self.model = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        if self.model is None:
            return
        for name, p in self.model.named_parameters():
            if p.requires_grad and p.numel() and not bool(p.detach().isfinite().all()):
                raise TunekitError(f"training diverged at step {state.global_step}: weight {name} is not finite; "
                                   "lower training.learning_rate (the last good checkpoint is kept)")

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            raise TunekitError(f"training loss is {loss} at step {state.global_step}; lower training.learning_rate "
                               "or check the data (the last good checkpoint is kept)")
