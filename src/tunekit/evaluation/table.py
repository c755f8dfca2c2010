"""Scores as a text table, without torch: the rows every score is shown in (one per metric, then the
preference measures and the example count), side by side for one or two targets. `tunekit eval`,
the end-of-training eval, the demo and the report page all use these rows."""

from __future__ import annotations

from pathlib import Path

from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import read_json
from tunekit.evaluation import metrics

PREFERENCE_ROWS = [("preference_accuracy", "prefers chosen"), ("reward_accuracy", "reward accuracy"),
                   ("reward_margin", "reward margin")]


def table_rows(columns: list[dict] = ()) -> list[tuple[str, str]]:
    """The rows shown, in order; GRPO's rewards (reward, reward/<name>) where the scores hold them."""
    named = sorted({k for scores in columns for k in scores if k.startswith("reward/")})
    rewards = [("reward", "reward (weighted sum)")] + [(k, f"reward {k.removeprefix('reward/')}") for k in named]
    return ([row for metric in metrics.METRICS.values() for row in metric.rows] + PREFERENCE_ROWS + rewards
            + [("examples", "examples")])


def baseline_scores(path: Path, flag: str = "--baseline") -> dict:
    """The scores of a `tunekit eval` of the base model (its --out directory, or its metrics.json): the
    "before" beside a run's "after" (the report page's and the model card's before/after tables)."""
    fix = "give the --out directory of a `tunekit eval` of the base model"
    if not path.exists():
        raise TunekitError(f"{flag} {path}: does not exist; {fix}")
    file = path / "metrics.json" if path.is_dir() else path
    if not file.is_file():
        raise TunekitError(f"{flag} {path}: no metrics.json; {fix}")
    return read_json(file, fix).get("scores", {})


def format_table(columns: list[tuple[str, dict]]) -> str:
    """Scores side by side; a last 'change' column when there are two."""
    headers = ["metric"] + [label for label, _ in columns] + (["change"] if len(columns) == 2 else [])
    rows = []
    for key, name in table_rows([scores for _, scores in columns]):
        values = [scores.get(key) for _, scores in columns]
        if all(v is None for v in values):
            continue
        cells = [name] + ["-" if v is None else (f"{v:d}" if isinstance(v, int) else f"{v:.2f}") for v in values]
        if len(columns) == 2 and None not in values and key != "examples":
            cells.append(f"{values[1] - values[0]:+.2f}")
        elif len(columns) == 2:
            cells.append("")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [headers] + rows) for i in range(len(headers))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])
