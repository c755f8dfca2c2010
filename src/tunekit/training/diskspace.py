"""Checks before any model is loaded: will the checkpoints fit on the disk?"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from tunekit.config.schema import Recipe

log = logging.getLogger("tunekit")

GB = 1024**3


def checkpoint_bytes(trainable: int) -> int:
    """fp32 trainable weights plus AdamW's two fp32 moments."""
    return trainable * 4 * 3


def warn_if_disk_short(recipe: Recipe, run_dir: Path) -> None:
    from tunekit.plan import estimate

    try:  # trainable parameters counted exactly on the meta device, as `tunekit plan` does
        _, model = estimate.meta_model(recipe)
        trainable = estimate.count(recipe, model).trainable
    except (OSError, ValueError, AttributeError, TypeError):
        return  # no config to count from (e.g. an unreachable hub model): loading will say so
    keep = recipe.training.save_total_limit or 10
    need = checkpoint_bytes(trainable) * keep + trainable * 4
    where = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    free = shutil.disk_usage(where).free
    if free < need * 1.1:
        log.warning("free disk at %s is %.1f GB; %d checkpoints of ~%.1f GB each plus the final weights need "
                    "~%.1f GB: lower training.save_total_limit or free space", where, free / GB, keep,
                    checkpoint_bytes(trainable) / GB, need / GB)
