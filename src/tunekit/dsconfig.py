"""DeepSpeed config against the recipe: fill every "auto" the recipe decides, and refuse a hand-set
value that contradicts it, naming both. Pure Python: no torch, no deepspeed import.

transformers fills "auto" too, but only once the Trainer is built, and on machines without a GPU it
assumes one process (train_batch_size comes out wrong under torchrun); resolving here lets
`tunekit validate --world-size N` show the real config before launch and the Trainer gets numbers."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from .errors import TunekitError

AUTO = "auto"
ADAMW_BETAS = [0.9, 0.999]
ADAMW_EPS = 1e-8


def zero_stage(ds: dict) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0) or 0)


def read(path: str) -> dict:
    return json.loads(Path(path).read_text())


def static_checks(ds: dict, adapter: str, source: str) -> None:
    """Recipe-level refusals that need no world size."""
    if adapter == "qlora" and zero_stage(ds) == 3:
        raise TunekitError(
            f"{source}: adapter qlora with ZeRO-3 is refused: ZeRO-3 partitions parameters across "
            "processes, and bitsandbytes 4-bit weights with their quantization state cannot be partitioned and "
            "gathered by it here; use ds_configs/zero2.json or zero2_offload.json (the 4-bit base is already small)"
        )


# (path in the DeepSpeed JSON, what the recipe says, which recipe key says it)
def _expected(recipe, world_size: int | None, precision: str | None) -> list[tuple[tuple[str, ...], Any, str]]:
    """What the recipe decides. Entries needing an unknown world size or precision are left out."""
    t = recipe.training
    rows = [
        (("train_micro_batch_size_per_gpu",), t.micro_batch_size, "training.micro_batch_size"),
        (("gradient_accumulation_steps",), t.gradient_accumulation_steps, "training.gradient_accumulation_steps"),
        (("train_batch_size",), t.micro_batch_size * t.gradient_accumulation_steps * (world_size or 1),
         f"training.micro_batch_size x training.gradient_accumulation_steps x world size {world_size}"),
        (("gradient_clipping",), t.max_grad_norm, "training.max_grad_norm"),
        (("bf16", "enabled"), precision == "bf16", f"training.precision={precision}"),
        (("fp16", "enabled"), precision == "fp16", f"training.precision={precision}"),
        (("optimizer", "params", "lr"), t.learning_rate, "training.learning_rate"),
        (("optimizer", "params", "weight_decay"), t.weight_decay, "training.weight_decay"),
        (("optimizer", "params", "betas"), ADAMW_BETAS, "the AdamW betas the Trainer uses"),
        (("optimizer", "params", "eps"), ADAMW_EPS, "the AdamW eps the Trainer uses"),
    ]
    return [r for r in rows if not ((world_size is None and r[0] == ("train_batch_size",))
                                    or (precision is None and r[0][0] in ("bf16", "fp16")))]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def resolve(ds: dict, recipe, world_size: int | None, precision: str | None, source: str,
            hidden_size: int | None = None) -> dict:
    """A copy of `ds` with every recipe-decided "auto" filled; contradictions raise.
    Values that depend on the model's size are filled when `hidden_size` is known."""
    static_checks(ds, recipe.adapter, source)
    out = copy.deepcopy(ds)
    for path, want, key in _expected(recipe, world_size, precision):
        node = out
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if not isinstance(node, dict) or path[-1] not in node:
            continue
        have = node[path[-1]]
        if have == AUTO:
            node[path[-1]] = want
        elif not _same(have, want):
            raise TunekitError(
                f"{source}: {'.'.join(path)} = {json.dumps(have)} contradicts {key} = {json.dumps(want)}; "
                f'set it to "auto" or make them agree'
            )
    zero = out.get("zero_optimization") or {}
    if hidden_size:
        sizes = {"reduce_bucket_size": hidden_size * hidden_size,
                 "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                 "stage3_param_persistence_threshold": 10 * hidden_size}
        for key, value in sizes.items():
            if zero.get(key) == AUTO:
                zero[key] = value
    return out


def describe(ds: dict) -> str:
    zero = ds.get("zero_optimization") or {}
    offload = [part for part in ("optimizer", "param") if (zero.get(f"offload_{part}") or {}).get("device") == "cpu"]
    return (f"ZeRO stage {zero_stage(ds)}" + (f", {' and '.join(offload)} offloaded to CPU" if offload else "")
            + f", train_batch_size {ds.get('train_batch_size')} = micro-batch {ds.get('train_micro_batch_size_per_gpu')}"
            f" x accumulation {ds.get('gradient_accumulation_steps')} x world size")
