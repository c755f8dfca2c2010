"""`tunekit runs [DIR]`: the runs under a directory, one line each, read from what they wrote (run.json,
eval/metrics.json, their checkpoints and lock file); nothing is loaded or changed."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tunekit.core import outputs
from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import DamagedFile, read_json
from tunekit.runs import checkpoints
from tunekit.runs.layout import CHECKPOINTS_DIR, EVAL_DIR, MERGED_MARKER, METRICS_FIX, RUN_FILE, RunRecord

log = logging.getLogger("tunekit")

TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"
# shown, in this order, when present: the tool-call metric's right-arguments share, GRPO's held-out mean reward
SCORES = ("eval_loss", "bleu", "chrf", "rougeL", "exact_match", "tool_call_args", "reward")
LOWER_IS_BETTER = {"eval_loss", "perplexity", "train_loss", "wall_s"}


@dataclass
class Row:
    name: str
    status: str  # completed | failed | running | interrupted (run.json says running, no process holds it),
                 # or unreadable (a damaged run.json or metrics.json: output says which and why)
    steps: int | None
    output: str
    wall_s: float | None
    values: dict[str, float] = field(default_factory=dict)  # eval scores and losses, by key


def _alive(run_dir: Path) -> bool:
    """A tunekit process holds the run: its lock file exists (removed on release) and names a live pid."""
    lock = outputs.lock_path(run_dir.absolute())
    try:
        pid = int(lock.read_text().split()[1].rstrip(":"))
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    return True


def _seconds(start: str | None, end: str | None) -> float | None:
    try:
        begin = datetime.strptime(start, TIME_FORMAT).timestamp() if start else None
        finish = datetime.strptime(end, TIME_FORMAT).timestamp() if end else time.time()
    except ValueError:
        return None
    return None if begin is None else max(finish - begin, 0.0)


def read(run_dir: Path, root: Path) -> Row:
    record = RunRecord.load(run_dir)
    status = record.status
    if status == "running" and not _alive(run_dir):
        status = "interrupted"
    steps = record.global_step if record.global_step is not None else record.failed_at_step
    if steps is None:
        newest = checkpoints.newest_complete(run_dir / CHECKPOINTS_DIR)
        steps = checkpoints.step_of(newest) if newest else None
    values = {k: v for k, v in (("train_loss", record.train_loss), ("eval_loss", record.eval_loss)) if v is not None}
    metrics_file = run_dir / EVAL_DIR / "metrics.json"
    if metrics_file.is_file():
        scores = read_json(metrics_file, METRICS_FIX).get("scores", {})
        values.update({k: v for k, v in scores.items() if isinstance(v, (int, float)) and k != "examples"})
    output = record.output or "-"
    merged = [p.name for p in run_dir.iterdir() if p.is_dir() and (p / MERGED_MARKER).is_file()]
    if merged:
        output += f" +{','.join(sorted(merged))}"
    wall = _seconds(record.started, record.finished if status != "running" else None)
    if status in ("failed", "interrupted") and record.finished is None:
        wall = None  # the end is unknown
    return Row(str(run_dir.relative_to(root)) if run_dir != root else run_dir.name, status, steps, output,
               wall, values | ({"wall_s": wall} if wall is not None else {}))


def collect(root: Path) -> list[Row]:
    if not root.is_dir():
        raise TunekitError(f"{root}: no such directory; give the directory holding your runs (default runs/)")
    found = sorted({p.parent for p in root.rglob(RUN_FILE) if CHECKPOINTS_DIR not in p.parent.parts})
    rows = []
    for run_dir in found:
        try:
            rows.append(read(run_dir, root))
        except DamagedFile as e:  # one damaged run does not hide the others: its row says which file and why
            log.warning("%s", e)
            rows.append(Row(str(run_dir.relative_to(root)), "unreadable", None,
                            f"{e.path.relative_to(run_dir)}: {e.problem}", None))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # a value of an unexpected type
            rows.append(Row(str(run_dir.relative_to(root)), "unreadable", None, f"{RUN_FILE}: {type(e).__name__}",
                            None))
    return rows


def sort(rows: list[Row], metric: str) -> list[Row]:
    """Best first by `metric` (losses and wall time ascending, scores descending); runs without it last."""
    known = sorted({k for r in rows for k in r.values} | {"steps"})
    if metric not in known:
        raise TunekitError(f"--sort {metric}: no run has it; choose one of {', '.join(known)}")
    value = (lambda r: r.steps) if metric == "steps" else (lambda r: r.values.get(metric))
    sign = 1 if metric in LOWER_IS_BETTER else -1
    return sorted(rows, key=lambda r: (value(r) is None, sign * (value(r) or 0)))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"


def table(rows: list[Row]) -> str:
    shown = [k for k in SCORES if any(k in r.values for r in rows)]
    headers = ["run", "status", "steps", *shown, "wall", "output"]
    lines = [[r.name, r.status, "-" if r.steps is None else str(r.steps),
              *[f"{r.values[k]:.4f}" if k == "eval_loss" and k in r.values else
                (f"{r.values[k]:.2f}" if k in r.values else "-") for k in shown],
              _duration(r.wall_s), r.output] for r in rows]
    widths = [max(len(x[i]) for x in [headers] + lines) for i in range(len(headers))]
    numeric = set(range(2, 3 + len(shown)))
    fmt = lambda cells: "  ".join(c.rjust(w) if i in numeric else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines])
