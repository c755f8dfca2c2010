"""Trainer checkpoints that resume can trust: a checkpoint counts only once its marker is written,
after the Trainer has finished every file in it (weights, optimizer, scheduler, RNG, data position)."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from pathlib import Path

from transformers import TrainerCallback

from .errors import TunekitError
from .trainer import OPTIMIZER

log = logging.getLogger("tunekit")

MARKER = "tunekit-complete"
_NAME = re.compile(r"^checkpoint-(\d+)$")


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


def step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else -1


def newest_complete(checkpoint_dir: Path) -> Path | None:
    done = [p for p in checkpoint_dir.glob("checkpoint-*") if p.is_dir() and (p / MARKER).is_file()]
    return max(done, key=step_of) if done else None


def discard_incomplete(checkpoint_dir: Path) -> list[Path]:
    """Remove checkpoints a kill interrupted while they were being written."""
    gone = [p for p in checkpoint_dir.glob("checkpoint-*") if p.is_dir() and not (p / MARKER).is_file()]
    for p in gone:
        shutil.rmtree(p)
    return gone


def truncate_history(history: Path, step: int) -> None:
    """Drop log lines written after the checkpoint a run resumes from."""
    if not history.is_file():
        return
    kept = [line for line in history.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    history.write_text("".join(line + "\n" for line in kept))


def resume_point(ckpt_dir: Path) -> Path:
    """The newest complete checkpoint in `ckpt_dir`, after removing those a kill left incomplete."""
    if not ckpt_dir.is_dir():
        raise TunekitError(f"--resume: {ckpt_dir.parent} has no {ckpt_dir.name}/ to resume from; train without --resume")
    for p in discard_incomplete(ckpt_dir):
        log.warning("removed incomplete checkpoint %s (interrupted while being written)", p.name)
    found = newest_complete(ckpt_dir)
    if found is None:
        raise TunekitError(f"--resume: no complete checkpoint in {ckpt_dir}; train again with --force")
    if not (found / OPTIMIZER).is_file() and not list(found.glob("global_step*")):
        raise TunekitError(f"--resume: {found} holds no optimizer state tunekit can read ({OPTIMIZER} or "
                           "DeepSpeed global_step*/); train again with --force")
    return found
