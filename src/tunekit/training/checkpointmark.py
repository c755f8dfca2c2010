"""Trainer checkpoints that resume can trust: a checkpoint counts only once its marker is written,
after the Trainer has finished every file in it (weights, optimizer, scheduler, RNG, data position).
The folder's layout and what resume picks from it (torch-free) live in runs.checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from tunekit.runs.checkpoints import MARKER


class MarkComplete(TrainerCallback):
    """on_save runs after the Trainer wrote the whole checkpoint: mark it complete."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            (ckpt / MARKER).write_text(json.dumps({"step": state.global_step}) + "\n")
