"""A run's training curves as one standalone SVG file (pure Python, no plotting library): the train and eval
loss in one panel, then each other logged quantity (learning rate, gradient norm, GRPO's rewards, the eval
metrics) in its own, against the optimizer step. The model card shows it (export.card)."""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from tunekit.config import metrickinds
from tunekit.runs import history

WIDTH, HEIGHT, COLUMNS = 420, 240, 2  # one panel, in px
LEFT, RIGHT, TOP, BOTTOM = 64, 14, 30, 36
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
LEFT_OUT = {"examples_per_s"}  # the machine's speed, not the model's: the report page shows it


def panels(series: dict[str, list[list[float]]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """(panel title, [(key, legend)]) for each panel drawn: the losses together, the held-out scores (0-100:
    BLEU, chrF, ROUGE, exact match, ...) together, then one per other curve."""
    scores = {f"eval_{key}": name for metric, m in metrickinds.DECLARED.items() if metric != "loss" for key,
              name in m.rows}
    titled = [(k, t) for k, t in history.titled(series) if k not in LEFT_OUT and len(series[k]) > 0]
    groups = [("loss", [(k, t) for k, t in titled if k in ("loss", "eval_loss")]),
              ("held-out scores", [(k, scores[k]) for k, _ in titled if k in scores])]
    grouped = {k for _, keys in groups for k, _ in keys}
    return [g for g in groups if g[1]] + [(t, [(k, t)]) for k, t in titled if k not in grouped]


def _number(v: float) -> str:
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.2e}"


def _panel(title: str, curves: list[tuple[str, str, list[list[float]]]], x0: int, y0: int,
           xlabel: str = "step", mark: float | None = None) -> list[str]:
    """One panel; `mark`: an x value drawn as a dashed vertical line."""
    points = [(s, v) for _, _, pts in curves for s, v in pts if math.isfinite(v)]
    steps, values = [p[0] for p in points], [p[1] for p in points]
    lo_s, hi_s = min(steps), max(steps)
    lo_v, hi_v = min(values), max(values)
    if hi_s == lo_s:
        lo_s, hi_s = lo_s - 1, hi_s + 1
    if hi_v == lo_v:
        pad = abs(hi_v) * 0.05 or 1.0
        lo_v, hi_v = lo_v - pad, hi_v + pad
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    px = lambda s: x0 + LEFT + (s - lo_s) / (hi_s - lo_s) * inner_w  # noqa: E731
    py = lambda v: y0 + TOP + (hi_v - v) / (hi_v - lo_v) * inner_h  # noqa: E731
    left, bottom = x0 + LEFT, y0 + TOP + inner_h
    out = [f'<g class="panel" data-title="{escape(title)}">',
           f'<text x="{x0 + WIDTH / 2:.1f}" y="{y0 + 18}" text-anchor="middle" font-weight="bold">'
           f'{escape(title)}</text>',
           f'<rect x="{left}" y="{y0 + TOP}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#999"/>',
           f'<text x="{left - 4}" y="{y0 + TOP + 4}" text-anchor="end">{_number(hi_v)}</text>',
           f'<text x="{left - 4}" y="{bottom}" text-anchor="end">{_number(lo_v)}</text>',
           f'<text x="{left}" y="{bottom + 14}" text-anchor="middle">{_number(lo_s)}</text>',
           f'<text x="{left + inner_w}" y="{bottom + 14}" text-anchor="middle">{_number(hi_s)}</text>',
           f'<text x="{left + inner_w / 2}" y="{bottom + 28}" text-anchor="middle">{escape(xlabel)}</text>']
    if mark is not None and lo_s <= mark <= hi_s:
        out.append(f'<line class="mark" x1="{px(mark):.1f}" y1="{y0 + TOP}" x2="{px(mark):.1f}" y2="{bottom}" '
                   'stroke="#555" stroke-dasharray="4 3"/>')
    for i, (key, legend, pts) in enumerate(curves):
        colour = COLOURS[i % len(COLOURS)]
        drawn = [(px(s), py(v)) for s, v in pts if math.isfinite(v)]
        d = " ".join(f"{'M' if j == 0 else 'L'}{x:.1f},{y:.1f}" for j, (x, y) in enumerate(drawn))
        out.append(f'<path class="curve" data-key="{escape(key)}" d="{d}" fill="none" stroke="{colour}" '
                   'stroke-width="1.5"/>')
        if len(drawn) <= 30:  # few points (evaluations): each one marked, so a single point shows
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colour}"/>' for x, y in drawn]
        if len(curves) > 1:
            out.append(f'<text x="{left + inner_w - 4}" y="{y0 + TOP + 14 + 14 * i}" text-anchor="end" '
                       f'fill="{colour}">{escape(legend)}</text>')
    return out + ["</g>"]


def svg(series: dict[str, list[list[float]]]) -> str | None:
    """The SVG document, or None when nothing was logged."""
    found = [(title, [(k, legend, series[k]) for k, legend in keys]) for title, keys in panels(series)]
    found = [(t, c) for t, c in found if any(math.isfinite(v) for _, _, pts in c for _, v in pts)]
    if not found:
        return None
    rows = math.ceil(len(found) / COLUMNS)
    body = []
    for i, (title, curves) in enumerate(found):
        body += _panel(title, curves, WIDTH * (i % COLUMNS), HEIGHT * (i // COLUMNS))
    return _document(WIDTH * min(COLUMNS, len(found)), HEIGHT * rows, body)


def _document(width: int, height: int, body: list[str]) -> str:
    """A standalone SVG document of `body` on white."""
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                      f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
                      f'<rect width="{width}" height="{height}" fill="white"/>', *body, "</svg>"]) + "\n"


def range_test_svg(found: dict) -> str:
    """training.learning_rate: auto's range test (run.json's "learning_rate"): the loss and its smoothed value
    against log10 of the rate, the chosen rate dashed."""
    curve = found["curve"]
    pts = lambda key: [[math.log10(p["lr"]), p[key]] for p in curve]  # noqa: E731
    panel = _panel(f"learning-rate range test: chose {_number(found['value'])}",
                   [("loss", "loss", pts("loss")), ("smoothed", "smoothed", pts("smoothed"))], 0, 0,
                   xlabel="log10 learning rate", mark=math.log10(found["value"]))
    return _document(WIDTH, HEIGHT, panel)
