"""A run's checkpoints/ folder as files, without torch: which checkpoints are complete (their marker
written after the Trainer finished every file), the newest of them, and the one a resume starts from.
`tunekit runs` reads it; training.checkpointmark writes the marker during training."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import read_jsonl

log = logging.getLogger("tunekit")

MARKER = "tunekit-complete"
OPTIMIZER = "optimizer.safetensors"  # the optimizer state trainer.SafeState writes into each checkpoint
_NAME = re.compile(r"^checkpoint-(\d+)$")


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
    rows = read_jsonl(history, f"delete it or cut it back to the lines of steps up to {step}, then resume again")
    history.write_text("".join(json.dumps(row) + "\n" for row in rows if row.get("step", 0) <= step))


def resume_point(ckpt_dir: Path) -> Path:
    """The newest complete checkpoint in `ckpt_dir`, after removing those a kill left incomplete."""
    if not ckpt_dir.is_dir():
        raise TunekitError(f"--resume: {ckpt_dir.parent} has no {ckpt_dir.name}/ to resume from; "
                           "train without --resume")
    for p in discard_incomplete(ckpt_dir):
        log.warning("removed incomplete checkpoint %s (interrupted while being written)", p.name)
    found = newest_complete(ckpt_dir)
    if found is None:
        raise TunekitError(f"--resume: no complete checkpoint in {ckpt_dir}; train again with --force")
    if not (found / OPTIMIZER).is_file() and not list(found.glob("global_step*")):
        raise TunekitError(f"--resume: {found} holds no optimizer state tunekit can read ({OPTIMIZER} or "
                           "DeepSpeed global_step*/); train again with --force")
    return found
