"""The report's expert-load table: per sparse layer of a mixture-of-experts run, how the tokens of the held-out
batches were spread over the experts at the first and the last evaluation (training.routerbalance counts them)."""

from __future__ import annotations

import html
from pathlib import Path

from tunekit.core.jsonfiles import read_jsonl
from tunekit.runs.layout import EXPERT_LOAD_FILE

FIX = f"delete {EXPERT_LOAD_FILE} for a report without the expert load"


def read(run_dir: Path) -> list[dict]:
    path = run_dir / EXPERT_LOAD_FILE
    return read_jsonl(path, FIX) if path.is_file() else []


def spread(tokens: list[int]) -> tuple[float, int]:
    """(the busiest expert's tokens over the mean per expert, experts that got no token)."""
    mean = sum(tokens) / len(tokens) if tokens else 0.0
    return (max(tokens) / mean if mean else 0.0), sum(1 for t in tokens if t == 0)


def rows(evaluations: list[dict]) -> list[list[str]]:
    if not evaluations:
        return []
    first, last = evaluations[0], evaluations[-1]
    out = []
    for layer, tokens in last["layers"].items():
        before = spread(first["layers"].get(layer, []))
        after = spread(tokens)
        out.append([html.escape(layer), str(len(tokens)), str(sum(tokens) // max(1, last.get("top_k", 1))),
                    f"{before[0]:.2f} / {before[1]}", f"{after[0]:.2f} / {after[1]}"])
    return out


def headers(evaluations: list[dict]) -> list[str]:
    first, last = evaluations[0]["step"], evaluations[-1]["step"]
    return ["router", "experts", "tokens", f"busiest / mean, idle experts (step {first})",
            f"busiest / mean, idle experts (step {last})"]


def note(evaluations: list[dict]) -> str:
    last = evaluations[-1]
    count = len(next(iter(last["layers"].values()), []))
    return (f"Busiest expert's tokens over the mean: 1 is an even spread, {count} / {last.get('top_k')} "
            "(experts / top-k) every token on the same experts. Tokens: the held-out batches' at the last "
            "evaluation.")
