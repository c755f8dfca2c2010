"""loss_history.jsonl: every Trainer log line of a run, as it is logged."""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import TrainerCallback


class LossHistory(TrainerCallback):
    """Appends every Trainer log line to loss_history.jsonl as it happens (main process only), with the
    wall-clock time it was logged and, once the collator is known, the real tokens this process has collated so
    far (`tokens_collated`: throughput between lines, steady-state tokens/s in bench/gpu_check.py). The data
    loader collates one batch ahead of the step logged, except at an epoch's end."""

    def __init__(self, path: Path):
        self.path = path
        self.tokens = None  # () -> int, set once the trainer's collator exists

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            counted = {"tokens_collated": self.tokens()} if self.tokens else {}
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": state.global_step, "epoch": state.epoch, "time": round(time.time(), 3),
                                    **counted, **logs}) + "\n")
