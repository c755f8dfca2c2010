"""Checks before any model is loaded: will the checkpoints fit on the disk?"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .recipe import Recipe

log = logging.getLogger("tunekit")

GB = 1024**3


def parameter_estimate(cfg, recipe: Recipe) -> tuple[int, int]:
    """(total, trainable) parameters of a decoder-only transformer, from its config alone."""
    h, layers, inter, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", heads) * getattr(cfg, "head_dim", None) if getattr(cfg, "head_dim", None) \
        else getattr(cfg, "num_key_value_heads", heads) * (h // heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter
    total = vocab * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2) + layers * per_layer
    if recipe.lora is None:
        return total, total
    # LoRA on every linear layer of a block: r x (in + out) for q, k, v, o, gate, up, down
    return total, layers * recipe.lora.r * (9 * h + 2 * kv + 3 * inter)


def checkpoint_bytes(trainable: int) -> int:
    """fp32 trainable weights plus AdamW's two fp32 moments."""
    return trainable * 4 * 3


def warn_if_disk_short(recipe: Recipe, run_dir: Path) -> None:
    try:
        from transformers import AutoConfig

        from .models import materialize

        cfg = AutoConfig.from_pretrained(materialize(recipe.model.name_or_path),
                                         trust_remote_code=recipe.model.trust_remote_code)
        _, trainable = parameter_estimate(cfg, recipe)
    except (OSError, ValueError, AttributeError, TypeError):
        return  # no config to estimate from (e.g. an unreachable hub model): loading will say so
    keep = recipe.training.save_total_limit or 10
    need = checkpoint_bytes(trainable) * keep + trainable * 4
    where = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    free = shutil.disk_usage(where).free
    if free < need * 1.1:
        log.warning("free disk at %s is %.1f GB; %d checkpoints of ~%.1f GB each plus the final weights need "
                    "~%.1f GB: lower training.save_total_limit or free space", where, free / GB, keep,
                    checkpoint_bytes(trainable) / GB, need / GB)
