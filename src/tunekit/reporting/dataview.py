"""`tunekit data`'s output from a data.preview.Preview: text for a terminal or a pipe, or JSON lines; and a
run's training examples (data-examples.jsonl) as HTML for the report page.

Trained tokens show in black on green on a terminal and between `[[` and `]]` elsewhere (a pipe, a file,
NO_COLOR set); the legend under the examples says which."""

from __future__ import annotations

import html
import json
import os
import sys

from tunekit.data import split
from tunekit.data.preview import Preview

OPEN, CLOSE = "[[", "]]"  # plain markers around trained tokens
TRAINED, RESET = "\x1b[30;42m", "\x1b[0m"  # black on green
BAR = 30  # histogram bar width, characters


def colour_wanted(stream=None) -> bool:
    """Colour on a terminal unless NO_COLOR is set (https://no-color.org)."""
    stream = stream or sys.stdout
    return stream.isatty() and not os.environ.get("NO_COLOR")


def marked(segments: list[dict], colour: bool) -> str:
    """An example's text, trained segments highlighted (colour) or between plain markers."""
    out = []
    for s in segments:
        if not s["trained"]:
            out.append(s["text"])
        elif colour:  # per line, so a highlight never runs into the next line's margin
            out.append("\n".join(f"{TRAINED}{line}{RESET}" if line else "" for line in s["text"].split("\n")))
        else:
            out.append(f"{OPEN}{s['text']}{CLOSE}")
    return "".join(out)


def legend(colour: bool) -> str:
    shown = f"{TRAINED}like this{RESET}" if colour else f"{OPEN}like this{CLOSE}"
    return (f"legend: trained tokens {shown} (label != -100: the loss is computed on them); the rest is context "
            "the model reads but is not trained to write")


def _roles_table(p: Preview) -> list[str]:
    lines = [f"  {'tokens per role':<16}{'trained':>12}{'untrained':>12}"]
    for role, n in sorted(p.roles.items(), key=lambda kv: -(kv[1]["trained"] + kv[1]["untrained"])):
        lines.append(f"  {role:<16}{n['trained']:>12,}{n['untrained']:>12,}")
    return lines


def _histogram(p: Preview) -> list[str]:
    most = max((b["examples"] for b in p.lengths), default=0) or 1
    lines = [f"  {'length (tokens)':<16}{'examples':>12}"]
    for b in p.lengths:
        bar = "#" * round(BAR * b["examples"] / most)
        lines.append(f"  {b['from']:>6,}-{b['to']:<9,}{b['examples']:>12,}  {bar}".rstrip())
    return lines


def summary_text(p: Preview, facts: dict, found: dict) -> list[str]:
    s = p.stats
    return [split.line(facts), found.get("line", ""),
            f"train: {s.examples:,} examples, {s.tokens:,} tokens, {s.trained_tokens:,} trained "
            f"({100 * p.trained_share:.1f}%); {s.truncated:,} truncated to {p.max_length} tokens; "
            f"{s.dropped_no_target:,} dropped with no trained token; prompt tokens "
            f"{'masked' if p.mask_prompt else 'trained'}",
            *_roles_table(p), *_histogram(p), *(f"note: {n}" for n in p.notes)]


def text(p: Preview, facts: dict, found: dict, colour: bool) -> str:
    """The whole report: summary, then each shown example, then the legend."""
    lines = [line for line in summary_text(p, facts, found) if line]
    for ex in p.shown:
        flags = [f"truncated to {p.max_length} tokens"] * ex.truncated + ["dropped: no trained token"] * ex.dropped
        head = f"example {ex.index} ({ex.where}): {ex.tokens} tokens, {ex.trained_tokens} trained"
        lines += ["", "-- " + head + "".join(f"; {f}" for f in flags), marked(ex.segments, colour)]
    if p.shown:
        lines += ["", legend(colour)]
    return "\n".join(lines) + "\n"


def json_lines(p: Preview, facts: dict, found: dict) -> str:
    """A summary object, then one object per shown example."""
    head = {"summary": p.summary(), "split": facts,
            "contamination": {k: v for k, v in found.items() if not k.endswith("_examples")}}
    rows = [head] + [ex.to_json() for ex in p.shown]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def html_example(row: dict) -> str:
    """One example of a run's data-examples.jsonl: its text, trained segments in <mark>."""
    parts = [f"<mark>{html.escape(s['text'])}</mark>" if s.get("trained") else html.escape(s.get("text", ""))
             for s in row.get("segments", [])]
    return f"<pre class=\"example\">{''.join(parts)}</pre>"
