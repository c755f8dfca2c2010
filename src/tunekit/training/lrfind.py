"""`training.learning_rate: auto`: a learning-rate range test on the run's own training data (Smith 2017; fastai's
lr_find): the rate rises geometrically from LOW to HIGH until the loss diverges, and the rate chosen is the one at
which it diverged divided by DIVISOR. The test trains a throwaway copy; training then starts fresh. The rule and
how it runs: docs/recipes.md, "The learning rate: `auto`"."""

from __future__ import annotations

import dataclasses
import gc
import math

from transformers import TrainerCallback

from tunekit.core import console, distributed
from tunekit.core.errors import TunekitError

LOW, HIGH = 1e-5, 1e-1
SMOOTHING = 0.5  # exponential moving average of the losses, bias-corrected (drawn on the report page)
DIVERGED = 1.5  # a loss above this multiple of the lowest before it, two steps running, is divergence
DIVISOR = 10.0


@dataclasses.dataclass
class Found:
    """The chosen rate and how: what run.json keeps under "learning_rate"."""

    value: float
    steps: int
    rule: str
    curve: list[dict]  # per step: lr, loss, smoothed

    def describe(self) -> str:
        return f"learning rate: auto -> {self.value:.2g} (range test, {self.steps} steps; {self.rule})"


def rates(steps: int) -> list[float]:
    """The rate at each step, LOW to HIGH geometrically."""
    return [LOW * (HIGH / LOW) ** (k / max(steps - 1, 1)) for k in range(steps)]


def smooth(losses: list[float]) -> list[float]:
    out, avg = [], 0.0
    for k, loss in enumerate(losses, 1):
        avg = SMOOTHING * avg + (1 - SMOOTHING) * loss
        out.append(avg / (1 - SMOOTHING ** k))
    return out


def diverged_at(losses: list[float]) -> int | None:
    """The first step whose loss and the next one's are both above DIVERGED x the lowest loss before it (a
    single noisy batch is not divergence; NaN and infinity are)."""
    for k in range(1, len(losses) - 1):
        floor = min((x for x in losses[:k] if math.isfinite(x)), default=math.inf)
        high = [not math.isfinite(x) or x > DIVERGED * floor for x in losses[k:k + 2]]
        if math.isfinite(floor) and all(high):
            return k
    return None


def pick(lrs: list[float], losses: list[float]) -> tuple[float, str]:
    """The rate at which the loss diverged / DIVISOR (the rule bench/quality.py measured against fixed rates);
    without divergence, the highest rate tried / DIVISOR."""
    if not any(math.isfinite(x) for x in losses):
        raise TunekitError("training.learning_rate: auto: every loss of the range test was NaN or infinite even at "
                           f"{LOW:g}; check the data and training.precision, or set training.learning_rate")
    k = diverged_at(losses)
    if k is None:
        return lrs[-1] / DIVISOR, f"no divergence up to {lrs[-1]:.2g}, / {DIVISOR:g}"
    return lrs[k] / DIVISOR, f"the loss diverged at {lrs[k]:.2g}, / {DIVISOR:g}"


class RangeTest(TrainerCallback):
    """Sets each step's rate (every parameter group keeps its ratio to the base rate: LoRA+) and records the
    losses; stops once the loss diverges."""

    def __init__(self, steps: int):
        self.rates = rates(steps)
        self.ratios: list[float] | None = None
        self.losses: list[float] = []
        self.bar = console.Progress("learning-rate range test", steps, unit="steps")

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        groups = optimizer.param_groups
        if self.ratios is None:
            self.ratios = [g["lr"] / args.learning_rate for g in groups]
        for g, ratio in zip(groups, self.ratios):
            g["lr"] = self.rates[state.global_step] * ratio

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        self.losses.append(float(logs["loss"]))
        self.bar.update_to(len(self.losses))
        if diverged_at(self.losses) is not None:
            control.should_training_stop = True

    def found(self) -> Found:
        self.bar.close()
        lrs = self.rates[:len(self.losses)]
        value, rule = pick(lrs, self.losses)
        curve = [{"lr": lr, "loss": loss, "smoothed": s} for lr, loss, s in zip(lrs, self.losses, smooth(self.losses))]
        return Found(value, len(self.losses), rule, curve)


def test_arguments(args, steps: int):
    """The run's arguments for the test: `steps` steps at a constant base rate (the callback sets it), nothing
    saved or evaluated, a loss logged every step."""
    return dataclasses.replace(args, max_steps=steps, lr_scheduler_type="constant", warmup_steps=0,
                               save_strategy="no", eval_strategy="no", load_best_model_at_end=False,
                               logging_steps=1, logging_first_step=True)


def find(make_trainer, args, steps: int) -> Found:
    """Run the test on the trainer `make_trainer(test_args, callback)` builds (a fresh model), then free it."""
    from tunekit.training import progress

    callback = RangeTest(steps)
    trainer = make_trainer(test_arguments(args, steps), callback)
    progress.remove_printers(trainer)
    trainer.train()
    found = callback.found()
    _release(trainer)
    chosen = distributed.gather_objects(found)[0] if distributed.rank_and_world()[1] > 1 else found
    return chosen


def _release(trainer) -> None:
    """Drop the test's model, optimizer and (under DeepSpeed) engine before the run's own are built."""
    import torch

    engine = getattr(trainer, "model_wrapped", None)
    if hasattr(engine, "destroy"):
        engine.destroy()
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def recorded(run_json: dict) -> float | None:
    """The rate a run chose before (run.json), for --resume."""
    found = run_json.get("learning_rate") or {}
    return found.get("value")
