"""`tunekit report RUN [RUN ...]`: one self-contained HTML page (no network, no external script) with a
run's curves against steps, its eval scores, best step, data counts and a sample of predictions beside
references with the differences marked; several runs overlay in the same plots and share one table.
The plots are drawn in the browser from the data embedded in the page (inline SVG)."""

from __future__ import annotations

import difflib
import html
import json
import os
from pathlib import Path

from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import read_json, read_jsonl
from tunekit.data.preview import EXAMPLES_FILE
from tunekit.evaluation import benchtable
from tunekit.evaluation.table import baseline_scores, table_rows
from tunekit.reporting import dataview, expertload, listing
from tunekit.runs import curves, history
from tunekit.runs.layout import BENCHMARKS_DIR, EVAL_DIR, RUN_FILE, RunRecord, eval_scores

REPORT_FILE = "report.html"
SAMPLES = 8  # predictions shown per run


BENCHMARKS_FIX = "run the benchmarks again: tunekit eval RUN --benchmarks TASKS --compare base --force"
PREDICTIONS_FIX = "run the eval again, or delete the file for a report without predictions"
EXAMPLES_FIX = f"delete {EXAMPLES_FILE} for a report without training examples"


def _predictions(run_dir: Path) -> list[dict]:
    path = run_dir / EVAL_DIR / "predictions.jsonl"
    if not path.is_file():
        return []
    rows = read_jsonl(path, PREDICTIONS_FIX, limit=SAMPLES)
    return [{k: str(r.get(k, "")) for k in ("prompt", "reference", "prediction")} for r in rows]


def _examples(run_dir: Path) -> list[dict]:
    """The first training examples the run wrote (data-examples.jsonl), as segments."""
    path = run_dir / EXAMPLES_FILE
    return read_jsonl(path, EXAMPLES_FIX) if path.is_file() else []


def load(run_dir: Path) -> dict:
    if not run_dir.exists():
        raise TunekitError(f"report: {run_dir} does not exist; give the output_dir of a tunekit train run")
    if not run_dir.is_dir():
        raise TunekitError(f"report: {run_dir} is a file; give a run directory (the output_dir of a tunekit train run)")
    if not (run_dir / RUN_FILE).is_file():
        raise TunekitError(f"report: {run_dir} is not a run directory (no {RUN_FILE}); give the output_dir of a "
                           "tunekit train run")
    record = RunRecord.load(run_dir)
    row = listing.read(run_dir, run_dir.parent)
    scores = eval_scores(run_dir) or {}
    bench_file = run_dir / BENCHMARKS_DIR / "benchmarks.json"
    bench = read_json(bench_file, BENCHMARKS_FIX) if bench_file.is_file() else None
    return {"name": run_dir.name, "path": str(run_dir), "status": row.status, "steps": row.steps,
            "wall": listing._duration(row.wall_s), "output": row.output, "record": record,
            "series": history.series(history.rows(run_dir), record.effective_batch or 1), "scores": scores,
            "predictions": _predictions(run_dir), "examples": _examples(run_dir),
            "expert_load": expertload.read(run_dir), "benchmarks": bench}


def marked_diff(reference: str, prediction: str) -> tuple[str, str]:
    """Both texts as HTML, words of the reference the prediction lacks in <del>, words it adds in <ins>."""
    ref, pred = reference.split(), prediction.split()
    left, right = [], []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=ref, b=pred, autojunk=False).get_opcodes():
        a, b = html.escape(" ".join(ref[i1:i2])), html.escape(" ".join(pred[j1:j2]))
        if op == "equal":
            left.append(a), right.append(b)
        else:
            if a:
                left.append(f"<del>{a}</del>")
            if b:
                right.append(f"<ins>{b}</ins>")
    return " ".join(left), " ".join(right)


def _table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.4f}" if abs(v) < 10 else f"{v:.2f}"


def _score(v) -> str:
    """Scores as the eval table prints them: 0-100 with two decimals."""
    return "-" if v is None else (f"{v:,}" if isinstance(v, int) else f"{v:.2f}")


def runs_table(runs: list[dict]) -> str:
    score_rows = [(k, name) for k, name in table_rows([r["scores"] for r in runs])
                  if any(k in r["scores"] for r in runs)]
    headers = ["run", "status", "steps", "method", "base model", "train examples", "trained tokens",
               "eval examples", "best", "train loss", "eval loss"] + [html.escape(n) for _, n in score_rows] + \
              ["wall", "output"]
    rows = []
    for r in runs:
        rec = r["record"]
        data = rec.data or {}
        train, held = data.get("train") or {}, data.get("eval") or {}
        best = rec.best or {}
        best_cell = f"{best['metric']} {_fmt(best['value'])} at step {best['step']}" + (
            " (stopped early)" if best.get("stopped_early") else "") if best else "-"
        rows.append([html.escape(r["name"]), r["status"], _fmt(r["steps"]), html.escape(str(rec.adapter)),
                     html.escape(str(rec.base_model)), _fmt(train.get("examples")), _fmt(train.get("trained_tokens")),
                     _fmt(held.get("examples")), html.escape(best_cell), _fmt(rec.train_loss), _fmt(rec.eval_loss)]
                    + [_score(r["scores"].get(k)) for k, _ in score_rows] + [r["wall"], html.escape(r["output"])])
    return _table(headers, rows, "runs")


def data_table(runs: list[dict]) -> str:
    """Each run's held-out split and contamination report (run.json's data.split, data.contamination)."""
    headers = ["run", "records read", "train", "held out", "duplicates in train", "eval sharing a prompt/answer",
               "eval sharing an n-gram", "train overlapping eval", "dropped", "examples"]
    rows = []
    for r in runs:
        data = r["record"].data or {}
        split, found = data.get("split") or {}, data.get("contamination") or {}
        if not (split or found):
            continue
        held = f"{_fmt(split.get('held_out'))} ({split.get('held_out_from') or 'none'})" if split else "-"
        dropped = "-" if not found else f"{_fmt(found.get('dropped'))} " \
            f"(dedup {'on' if found.get('dedup') else 'off'}, " \
            f"decontaminate {'on' if found.get('decontaminate') else 'off'})"
        where = [f"{x['train']} = {x['copy_of']}" for x in found.get("duplicate_examples", [])] + \
                [f"{x['eval']} ~ {x['train']} ({x['match']})" for x in found.get("overlap_examples", [])]
        rows.append([html.escape(r["name"]), _fmt(split.get("train_records_read")), _fmt(split.get("train")), held,
                     _fmt(found.get("duplicates")), _fmt(found.get("eval_exact")), _fmt(found.get("eval_ngram")),
                     _fmt(found.get("overlapping_train")), html.escape(dropped),
                     "<br>".join(html.escape(w) for w in where) or "-"])
    return _table(headers, rows, "data") if rows else ""


def before_after(baseline: dict, runs: list[dict]) -> str:
    """Base model's zero-shot scores beside each run's end-of-training scores, with the change."""
    headers = ["metric", "base (zero-shot)"] + [f"{html.escape(r['name'])}" for r in runs] + \
              [f"change ({html.escape(r['name'])})" for r in runs]
    rows = []
    for key, name in table_rows([baseline]):
        if key not in baseline or key == "examples":
            continue
        after = [r["scores"].get(key) for r in runs]
        change = [f"{a - baseline[key]:+.2f}" if a is not None else "-" for a in after]
        rows.append([html.escape(name), _score(baseline[key])] + [_score(a) for a in after] + change)
    return _table(headers, rows, "before-after")


def benchmarks_table(bench: dict) -> str:
    """Standard benchmarks before and after (evaluation.benchtable's rows), a change beyond two standard errors in
    bold."""
    rows = []
    for row in bench["table"]:
        cells = [html.escape(c) for c in benchtable.cells(row)]
        if row["beyond_2se"]:
            cells[5] = f"<strong>{cells[5]}</strong>"
        rows.append(cells)
    return _table(benchtable.HEADERS, rows, "benchmarks")


def samples(run: dict) -> str:
    """The held-out generations against their references; with GRPO, each one's rewards."""
    rows = []
    for p in run["predictions"]:
        ref, pred = marked_diff(p["reference"], p["prediction"])
        prompt = html.escape(p["prompt"][-300:])
        earned = ", ".join(f"{k} {v:.2f}" for k, v in p.items() if k not in SAMPLE_KEYS and isinstance(v, (int, float)))
        rows.append([f"<pre>{prompt}</pre>", ref, pred] + ([html.escape(earned)] if earned else []))
    headers = ["prompt (end)", "reference (missing words struck)", "prediction (added words marked)"]
    return _table(headers + (["rewards"] if rows and len(rows[0]) > 3 else []), rows, "samples")


SAMPLE_KEYS = {"where", "prompt", "reference", "prediction", "step"}  # predictions.jsonl's own keys


def training_examples(run: dict) -> str:
    """A run's first training examples, trained tokens highlighted."""
    rows = [[_fmt(e.get("example")), f"{_fmt(e.get('tokens'))} ({_fmt(e.get('trained_tokens'))} trained)",
             dataview.html_example(e)] for e in run["examples"]]
    return _table(["example", "tokens", "text as trained: highlighted tokens are trained (label != -100)"], rows,
                  "examples")


def _baseline(path: Path | None) -> dict | None:
    return baseline_scores(path) if path is not None else None


def render(runs: list[dict], baseline: dict | None = None) -> str:
    titled = history.titled({k for r in runs for k in r["series"]})
    data = {"curves": titled, "runs": [{"name": r["name"], "series": r["series"],
                                        "best": (r["record"].best or {}).get("step")} for r in runs]}
    payload = json.dumps(data).replace("</", "<\\/")
    title = "tunekit report: " + ", ".join(r["name"] for r in runs)
    sections = [f"<h1>{html.escape(title)}</h1>", "<h2>Runs</h2>", runs_table(runs)]
    if table := data_table(runs):
        sections += ["<h2>Data: held-out split and contamination</h2>", table]
    if baseline:
        sections += ["<h2>Before and after</h2>", before_after(baseline, runs)]
    for r in runs:
        if bench := r.get("benchmarks"):
            base = bench.get("base")
            sections += [f"<h2>Benchmarks (lm-evaluation-harness): {html.escape(r['name'])}</h2>",
                         f"<p>{html.escape(benchtable.note(base['label'] if base else None, bench['tuned']['label']))}"
                         "</p>", benchmarks_table(bench)]
    sections += ['<h2>Curves</h2><div id="plots"></div>']
    for r in runs:
        if r["record"].learning_rate:
            found = r["record"].learning_rate
            sections += [f"<h2>Learning rate: {html.escape(r['name'])}</h2>",
                         f"<p>training.learning_rate: auto chose {found['value']:.3g} after a range test of "
                         f"{found['steps']} steps ({html.escape(found['rule'])}).</p>",
                         f'<div class="range-test">{curves.range_test_svg(found)}</div>']
    for r in runs:
        if load := expertload.rows(r.get("expert_load") or []):
            sections += [f"<h2>Expert load: {html.escape(r['name'])}</h2>",
                         f"<p>{html.escape(expertload.note(r['expert_load']))}</p>",
                         _table(expertload.headers(r["expert_load"]), load, "expert-load")]
    for r in runs:
        if r.get("examples"):
            sections += [f"<h2>Training examples: {html.escape(r['name'])} (first {len(r['examples'])})</h2>",
                         training_examples(r)]
    for r in runs:
        if r["predictions"]:
            sections += [f"<h2>Predictions: {html.escape(r['name'])} (first {len(r['predictions'])})</h2>", samples(r)]
    return PAGE.format(title=html.escape(title), body="\n".join(sections), data=payload, script=SCRIPT)


def write(run_dirs: list[Path], out: Path | None = None, baseline: Path | None = None, force: bool = False) -> Path:
    runs = [load(d) for d in run_dirs]
    if out is None:
        if len(run_dirs) > 1:
            raise TunekitError("report: several runs need --out FILE.html")
        out = run_dirs[0] / REPORT_FILE
    elif out.exists() and not force:
        raise TunekitError(f"report: {out} exists; add --force to replace it")
    text = render(runs, _baseline(baseline))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 20px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }}
table.samples td {{ max-width: 420px; }}
pre {{ white-space: pre-wrap; margin: 0; font-size: 12px; }}
mark {{ background: #bfe6bf; }}
del {{ background: #fdd; }} ins {{ background: #dfd; text-decoration: none; }}
#plots {{ display: flex; flex-wrap: wrap; gap: 16px; }}
.plot {{ border: 1px solid #ddd; padding: 4px; }}
.plot text {{ font-size: 11px; fill: #444; }}
</style></head>
<body data-report="loading">
{body}
<script type="application/json" id="report-data">{data}</script>
<script>{script}</script>
</body></html>
"""

SCRIPT = r"""
"use strict";
const errors = [];
window.addEventListener("error", e => { errors.push(String(e.message));
                                        document.body.dataset.errors = errors.join(" | "); });
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const NS = "http://www.w3.org/2000/svg";
function el(name, attrs, parent) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}
function tick(v) {
  const a = Math.abs(v);
  return a === 0 ? "0" : (a >= 1e4 || a < 1e-3) ? v.toExponential(1) : String(+v.toPrecision(3));
}
function plot(key, title, runs) {
  const W = 420, H = 240, L = 56, R = 12, T = 24, B = 36;
  const lines = runs.map((r, i) => ({ name: r.name, color: COLORS[i % COLORS.length], pts: r.series[key] || [],
                                      best: r.best }))
                    .filter(l => l.pts.length);
  if (!lines.length) return;
  const xs = lines.flatMap(l => l.pts.map(p => p[0])), ys = lines.flatMap(l => l.pts.map(p => p[1]));
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  const box = document.createElement("div"); box.className = "plot"; box.dataset.key = key;
  const svg = el("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` }, box);
  el("text", { x: L, y: 14, "font-weight": "bold" }, svg).textContent = title;
  el("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#888" }, svg);
  el("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#888" }, svg);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4, x = x0 + (x1 - x0) * i / 4;
    el("text", { x: L - 4, y: sy(y) + 4, "text-anchor": "end" }, svg).textContent = tick(y);
    el("line", { x1: L, y1: sy(y), x2: W - R, y2: sy(y), stroke: "#eee" }, svg);
    el("text", { x: sx(x), y: H - B + 14, "text-anchor": "middle" }, svg).textContent = tick(Math.round(x));
  }
  el("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, svg).textContent = "step";
  lines.forEach((l, i) => {
    if (l.best != null && l.best >= x0 && l.best <= x1)
      el("line", { x1: sx(l.best), y1: T, x2: sx(l.best), y2: H - B, stroke: l.color, "stroke-dasharray": "4 3",
                   class: "best" }, svg);
    el("polyline", { points: l.pts.map(p => `${sx(p[0])},${sy(p[1])}`).join(" "), fill: "none", stroke: l.color,
                     "stroke-width": 1.5, class: "series" }, svg);
    if (l.pts.length <= 30)
      l.pts.forEach(p => el("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: l.color }, svg));
    if (lines.length > 1) {
      el("rect", { x: W - R - 110, y: T + 4 + i * 14, width: 10, height: 3, fill: l.color }, svg);
      el("text", { x: W - R - 96, y: T + 9 + i * 14 }, svg).textContent = l.name.slice(0, 16);
    }
  });
  document.getElementById("plots").appendChild(box);
}
const data = JSON.parse(document.getElementById("report-data").textContent);
for (const [key, title] of data.curves) plot(key, title, data.runs);
document.body.dataset.plots = document.querySelectorAll("#plots .plot").length;
document.body.dataset.report = errors.length ? "failed" : "ready";
"""
