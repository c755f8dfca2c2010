"""A run's logged history (loss_history.jsonl) as curves: every numeric logged quantity as [step, value]
points, plus the throughput between log lines. The report page and the model card's training curves read
it here."""

from __future__ import annotations

from pathlib import Path

from tunekit.core.jsonfiles import read_jsonl
from tunekit.runs.layout import HISTORY_FILE

# (key in loss_history.jsonl, title); throughput is derived from the log times
CURVES = [("loss", "train loss"), ("eval_loss", "eval loss"), ("learning_rate", "learning rate"),
          ("grad_norm", "gradient norm"), ("examples_per_s", "throughput (examples/s)"),
          ("reward", "GRPO: mean reward (weighted sum)"), ("eval_reward", "GRPO: held-out reward (greedy)"),
          ("kl", "GRPO: KL to the reference"), ("completions/mean_length", "GRPO: completion length"),
          ("tools/calls", "tools: calls per episode"), ("tools/failures", "tools: failed calls per episode"),
          ("tools/turns", "tools: turns per episode")]
SKIP = {"step", "epoch", "time", "tokens_collated", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second",
        "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}

HISTORY_FIX = "delete that line (or the whole file, for a report without curves) and run the command again"


def rows(run_dir: Path) -> list[dict]:
    """The logged lines that have a step (a cut last line, a kill's, is skipped: see read_jsonl)."""
    path = run_dir / HISTORY_FILE
    if not path.is_file():
        return []
    return [r for r in read_jsonl(path, HISTORY_FIX) if isinstance(r.get("step"), (int, float))]


def throughput(lines: list[dict], batch: int) -> list[list[float]]:
    """Examples per second between consecutive training log lines (steps x effective batch / seconds),
    not counting the evaluations that ran in between."""
    train = [r for r in lines if "loss" in r and "time" in r]
    evals = [(r["time"], r["eval_runtime"]) for r in lines if "eval_runtime" in r and "time" in r]
    points = []
    for a, b in zip(train, train[1:]):
        seconds = b["time"] - a["time"] - sum(t for when, t in evals if a["time"] < when <= b["time"])
        if seconds > 0 and b["step"] > a["step"]:
            points.append([b["step"], (b["step"] - a["step"]) * batch / seconds])
    return points


def series(lines: list[dict], batch: int) -> dict[str, list[list[float]]]:
    """Every numeric logged quantity as [step, value] points, plus the throughput."""
    out: dict[str, list[list[float]]] = {}
    for r in lines:
        for k, v in r.items():
            if k not in SKIP and isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(k, []).append([r["step"], v])
    points = throughput(lines, batch)
    if points:
        out["examples_per_s"] = points
    return out


def titled(keys) -> list[tuple[str, str]]:
    """(key, title) of each curve among `keys`: the known ones in CURVES' order, then the eval metrics, then
    the rest by name."""
    keys = set(keys)
    curves = [(k, t) for k, t in CURVES if k in keys]
    metric_keys = sorted(k for k in keys if k.startswith("eval_") and k != "eval_loss")
    curves += [(k, k.removeprefix("eval_") + " (eval)") for k in metric_keys if k not in dict(curves)]
    return curves + [(k, k) for k in sorted(keys - {k for k, _ in curves})]
