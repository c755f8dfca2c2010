"""Benchmark scores before and after: one row per task and metric (base, tuned, change, the change's standard
error), a change beyond two standard errors marked. The two models answer the same questions, but lm-eval reports
each mean's standard error alone, so the change's is taken as if they were independent, sqrt(se_base^2 +
se_tuned^2): where the two mostly answer alike this overstates the noise (by 1.4-2x for closely related models), so
it marks fewer changes, not more. Nothing corrects for many rows: among a hundred subtasks, a few marks come by
chance."""

from __future__ import annotations

import math

MARK = "*"  # beside a change larger than two standard errors


def rows(tuned: list[dict], base: list[dict] | None) -> list[dict]:
    """`tuned` and `base`: Score dicts (evaluation.benchmarks.Score.as_dict). Rows in the tuned scores' order."""
    before = {(s["task"], s["metric"]): s for s in base or []}
    out = []
    for s in tuned:
        b = before.get((s["task"], s["metric"]))
        row = {"task": s["task"], "metric": s["metric"], "n": s["n"], "tuned": s["value"],
               "tuned_stderr": s["stderr"], "base": None, "change": None, "stderr": None, "beyond_2se": False}
        if b is not None:
            row.update(base=b["value"], change=s["value"] - b["value"])
            if s["stderr"] is not None and b["stderr"] is not None:
                row["stderr"] = math.hypot(s["stderr"], b["stderr"])
                row["beyond_2se"] = abs(row["change"]) > 2 * row["stderr"] > 0
        out.append(row)
    return out


def _num(v: float | None, signed: bool = False) -> str:
    return "-" if v is None else (f"{v:+.4f}" if signed else f"{v:.4f}")


def cells(row: dict) -> list[str]:
    """A row as the table prints it (values as lm-eval reports them, 0-1)."""
    change = _num(row["change"], signed=True) + (f" {MARK}" if row["beyond_2se"] else "")
    return [row["task"], row["metric"], str(row["n"]), _num(row["base"]), _num(row["tuned"]), change,
            _num(row["stderr"] if row["base"] is not None else row["tuned_stderr"])]


HEADERS = ["task", "metric", "n", "base", "tuned", "change", "stderr"]


def text(table: list[dict], base_label: str | None, tuned_label: str) -> str:
    """The table as text, its labels and the mark explained below it."""
    lines = [HEADERS] + [cells(r) for r in table]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADERS))]
    body = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(body + [note(base_label, tuned_label)])


def note(base_label: str | None, tuned_label: str) -> str:
    """What the columns are."""
    return f"tuned: {tuned_label}" + (f"; base: {base_label}; {MARK}: a change beyond two standard errors "
                                      "(stderr: the change's)" if base_label else "; stderr: lm-eval's")
