"""The Trainer's console: a training bar (loss, learning rate, tokens/s, time left), a bar for each
evaluation's loss pass, and each log as one aligned line, in place of transformers' ProgressCallback and
PrinterCallback. The log dict itself is untouched: loss_history.jsonl and the trackers get it as the
Trainer made it. Without a terminal the bars are left out and the log lines carry the same facts
(core.console)."""

from __future__ import annotations

import logging
import math
import time

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from tunekit.core import console

log = logging.getLogger("tunekit")

# Trainer log keys -> the name shown; keys not listed are shown as they are (TRL's rewards/chosen, ...)
NAMES = {"loss": "loss", "grad_norm": "grad norm", "learning_rate": "lr", "epoch": "epoch",
         "train_loss": "train loss", "train_runtime": "time"}
LEFT_OUT = {"total_flos"}  # and every *_per_second (steps and samples per second: tokens/s says it better)
# GRPO's finer facts (TRL), kept in loss_history.jsonl and the trackers but too many for one line
LEFT_OUT_PREFIXES = ("num_tokens", "completions/min_", "completions/max_", "completions/mean_terminated",
                     "clip_ratio/", "frac_reward_zero_std", "step_time")
WIDTH = 8  # a value's column: 5.8820, 5.00e-03, 0:00:04 and 1,234 fit, so lines with the same keys align


def number(key: str, value) -> str:
    if key == "learning_rate":
        return f"{value:.2e}"
    if key == "epoch":
        return f"{value:.2f}"
    if key.endswith("runtime"):
        return f"{value:.1f}s"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)[:40]
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value) or (value != 0 and not 1e-3 <= abs(value) < 1e5):
        return f"{value:.3e}"
    return f"{value:.4f}"


def fields(pairs: list[tuple[str, str]], width: int = WIDTH) -> str:
    """`name value` pairs, each value but the last padded to `width`."""
    parts = [f"{name} {value:<{width}}" for name, value in pairs[:-1]] + [f"{n} {v}" for n, v in pairs[-1:]]
    return "  ".join(parts)


def log_line(logs: dict, step: int, max_steps: int, rates: list[tuple[str, str]] = ()) -> str:
    """One Trainer log as text: `step 2/4  loss 5.8820  grad norm 0.7750  lr 5.00e-03 ...`; an evaluation's
    as `eval 2/4  loss 5.7550  bleu 12.3400 ...`; the end-of-training summary as `done 4/4  train loss ...`."""
    width = len(str(max_steps))
    evaluation = any(k.startswith("eval_") for k in logs)
    head = "eval" if evaluation else "done" if "train_runtime" in logs else "step"
    shown = [("time" if k == "eval_runtime" else k.removeprefix("eval_") if evaluation else NAMES.get(k, k), k, v)
             for k, v in logs.items() if k not in LEFT_OUT and not k.endswith("_per_second")
             and not k.removeprefix("eval_").startswith(LEFT_OUT_PREFIXES)]
    pairs = [(name, number(k, v)) for name, k, v in shown] + list(rates)
    return f"{head} {step:>{width}}/{max_steps}  " + fields(pairs)


class Console(TrainerCallback):
    """Bars and log lines on the main process; `tokens()` is the count of real tokens batched so far (the
    method's CountingCollator), which gives tokens/s."""

    def __init__(self, tokens=None):
        self.tokens = tokens or (lambda: 0)
        self.bar = self.eval_bar = None
        self.loss = self.lr = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.first_step, self.started, self.first_tokens = state.global_step, time.monotonic(), self.tokens()
        self.eval_seconds, self.eval_tokens, self.evals = 0.0, 0, 0
        self.step_ended = (self.started, self.first_tokens)
        self.bar = console.Progress("training", state.max_steps, unit="steps", every=0, keep=True,
                                    initial=state.global_step, rate=False)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is None:
            return
        self.step_ended = (time.monotonic(), self.tokens())
        self.bar.update_to(state.global_step)
        self.bar.postfix(fields(self.facts(args, state), 0))

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not state.is_world_process_zero or eval_dataloader is None or not hasattr(eval_dataloader, "__len__"):
            return
        if self.eval_bar is None:
            self.eval_bar = console.Progress("eval loss", len(eval_dataloader), unit="batches", every=0)
        self.eval_bar.update()
        if self.eval_bar.done >= self.eval_bar.total:  # the loss pass is over; generation may follow
            self.eval_bar.close()

    def on_evaluate(self, args, state, control, **kwargs):
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None
        if self.bar is not None:  # an evaluation during training: its time and batches are not training's
            ended, tokens = self.step_ended
            self.eval_seconds += time.monotonic() - ended
            self.eval_tokens += self.tokens() - tokens
            self.evals += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        training = "loss" in logs and self.bar is not None
        if training:
            self.loss, self.lr = logs["loss"], logs.get("learning_rate")
            self.bar.postfix(fields(self.facts(args, state), 0))
        log.info("%s", log_line(logs, state.global_step, state.max_steps, self.facts(args, state, False)
                                if training else []))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        for bar in (self.eval_bar, self.bar):
            if bar is not None:
                bar.close()
        self.bar = self.eval_bar = None

    def facts(self, args, state, with_loss: bool = True) -> list[tuple[str, str]]:
        """The bar's facts (`with_loss`: the last logged loss and learning rate), tokens/s and time left,
        from the training time so far (evaluations taken out, then added back for those still to come)."""
        now = time.monotonic()
        seconds = now - self.started - self.eval_seconds
        steps = state.global_step - self.first_step
        out = []
        if with_loss and self.loss is not None:
            out += [("loss", number("loss", self.loss))]
            out += [("lr", number("learning_rate", self.lr))] if self.lr is not None else []
        if steps and seconds > 0:
            # this process's count times the number of processes, which batch alike
            tokens = (self.tokens() - self.first_tokens - self.eval_tokens) * args.world_size
            left = (state.max_steps - state.global_step) * seconds / steps
            if self.evals:
                left += evaluations_left(args, state) * self.eval_seconds / self.evals
            out += ([("tokens/s", f"{tokens / seconds:,.0f}")] if tokens else []) + [("left", console.duration(left))]
        return out


def evaluations_left(args, state) -> int:
    """Evaluations still to come by the Trainer's schedule."""
    strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    if strategy == "steps" and args.eval_steps:
        every = args.eval_steps if args.eval_steps >= 1 else math.ceil(state.max_steps * args.eval_steps)
        return state.max_steps // int(every) - state.global_step // int(every)
    if strategy == "epoch" and state.epoch is not None:
        return max(math.ceil(state.num_train_epochs) - math.floor(state.epoch + 1e-9), 0)
    return 0


def remove_printers(trainer) -> None:
    """Remove the Trainer's printing callbacks (a notebook's too)."""
    for callback in list(trainer.callback_handler.callbacks):
        if isinstance(callback, (ProgressCallback, PrinterCallback)) or \
                type(callback).__name__ == "NotebookProgressCallback":
            trainer.remove_callback(callback)


def install(trainer, tokens=None) -> None:
    """Replace the Trainer's printing callbacks with Console."""
    remove_printers(trainer)
    trainer.add_callback(Console(tokens))
