"""DeepSpeed config against the recipe: fill every "auto" the recipe decides, and refuse a hand-set
value that contradicts it, naming both; then let DeepSpeed's own config model judge the rest.
Pure Python apart from that last check (check_file), which imports deepspeed.

transformers fills "auto" too, but only once the Trainer is built, and on machines without a GPU it
assumes one process (train_batch_size comes out wrong under torchrun); resolving here lets
`tunekit validate --world-size N` show the real config before launch and the Trainer gets numbers."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
from pathlib import Path
from typing import Any, Iterator

from tunekit.core.errors import TunekitError

AUTO = "auto"
ADAMW_BETAS = [0.9, 0.999]
ADAMW_EPS = 1e-8


def zero_stage(ds: dict) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0) or 0)


# DeepSpeed's pydantic section models, by the JSON key they read, to name a rejected key in full
SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16", "DeepSpeedFP16Config": "fp16",
            "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
            "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
            "DeepSpeedMonitorConfig": "monitor", "CompileConfig": "compile", "CommsLoggerConfig": "comms_logger"}


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def read(path: str | Path, source: str | None = None) -> dict:
    """The JSON object in `path`; a key given twice in one object, at any depth, is refused
    (json.loads keeps the last silently)."""
    where = source or str(path)
    try:
        parsed = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise TunekitError(f"{where} line {e.lineno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise TunekitError(f"{where}: not UTF-8 text") from None
    except ValueError as e:  # from _unique_keys
        raise TunekitError(f"{where}: {e}; keep one") from None
    if not isinstance(parsed, dict):
        raise TunekitError(f"{where}: must hold a JSON object")
    return parsed


def _without_auto(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_auto(v) for k, v in node.items() if v != AUTO}
    return node


def check_with_deepspeed(ds: dict, source: str) -> None:
    """Validate with DeepSpeed's own config class, as `deepspeed.initialize` will at launch.

    Values still "auto" are filled by transformers from the model at launch; they are left out here,
    so DeepSpeed judges them by its defaults. Outside a process group DeepSpeed assumes one process,
    which is why the batch triple is only checked when it is self-consistent for world size 1."""
    from pydantic import ValidationError

    with _quiet_deepspeed():
        from deepspeed.runtime.config import DeepSpeedConfig

        trial = _without_auto(ds)
        trial.pop("train_batch_size", None)  # depends on the world size; resolve() checks it
        trial.setdefault("train_micro_batch_size_per_gpu", 1)
        try:
            DeepSpeedConfig(trial)
        except ValidationError as e:
            err = e.errors()[0]
            section = SECTIONS.get(e.title, e.title)
            key = ".".join([section, *(str(p) for p in err["loc"])])
            raise TunekitError(f"{source}: {key}: DeepSpeed rejects {json.dumps(err.get('input'))}: "
                               f"{err['msg']}") from None
        except (AssertionError, ValueError, KeyError, TypeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TunekitError(f"{source}: DeepSpeed rejects this config: {first}") from None


def check_file(path: str | Path) -> None:
    """DeepSpeed's own check of a recipe's training.deepspeed file. It imports deepspeed and torch (seconds),
    so loading a recipe does not run it: `tunekit train` does, before loading anything, and so does
    `tunekit validate --world-size N`."""
    where = f"training.deepspeed {path}"
    check_with_deepspeed(read(path, where), where)


@contextlib.contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    """Importing deepspeed logs its accelerator choice at WARNING; that line is noise here."""
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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
            + f", train_batch_size {ds.get('train_batch_size')}"
            f" = micro-batch {ds.get('train_micro_batch_size_per_gpu')}"
            f" x accumulation {ds.get('gradient_accumulation_steps')} x world size")
