"""Scores on lists of strings: sacreBLEU BLEU and chrF, ROUGE with a Unicode-aware tokenizer,
exact match. No model code.

evaluate.load() fetches metric scripts from the Hub and fails offline, so the built-in metrics call
sacrebleu and rouge-score directly; `evaluate` only serves extra metrics a recipe names. The built-in
ones are a registry (METRICS): each is declared in tunekit.config.metrickinds (the recipe's eval.metrics choices, its
rows and settings) and its scoring function registered here under that name; the eval table reads METRICS."""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Callable

from tunekit.config import plugins
from tunekit.config.metrickinds import DECLARED
from tunekit.tooluse.textcalls import tool_calls_in

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")

# CJK ideographs, kana, hangul and CJK punctuation: scored one character per token, since these
# scripts do not separate words with spaces.
_CJK = (
    "\u2e80-\u2fdf\u3000-\u303f\u3040-\u30ff\u3100-\u312f\u3130-\u318f\u31a0-\u31ff\u3400-\u4dbf"
    "\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef\U00020000-\U0002fa1f"
)
_TOKEN = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+", re.UNICODE)
_HAS_CJK = re.compile(rf"[{_CJK}]")


class UnicodeTokenizer:
    """rouge_score's default tokenizer keeps only [a-z0-9], so "café" becomes "caf" and two
    identical Chinese sentences score 0. This one lower-cases, NFKC-normalises, keeps every
    letter and digit of every script, and splits CJK text into characters."""

    def tokenize(self, text: str) -> list[str]:
        return _TOKEN.findall(unicodedata.normalize("NFKC", text).lower())


def _normalize(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).split())


@dataclass(frozen=True)
class Metric:
    """A metric a recipe can name in eval.metrics: its declaration's facts (config.metrickinds.MetricSpec) and
    `score`, which maps (predictions, references) to scores; None marks a metric computed from the model
    (loss), not from text."""

    name: str
    score: Callable[[list[str], list[str]], dict] | None
    rows: tuple[tuple[str, str], ...]
    settings: str
    default: bool = True


METRICS: dict[str, Metric] = {}


def register(name: str):
    """Register the scoring function of a declared metric (config.metrickinds)."""
    spec = DECLARED.get(name)
    if spec is None:
        raise ValueError(f"metric {name!r} is not declared in tunekit.config.metrickinds")
    if not spec.scored:
        raise ValueError(f"metric {name!r} is declared unscored (computed from the model) in "
                         "tunekit.config.metrickinds")
    if name in METRICS:
        raise ValueError(f"metric {name!r} is registered twice")

    def add(fn):
        METRICS[name] = Metric(name, fn, spec.rows, spec.settings, spec.default)
        return fn
    return add


@register("bleu")
def bleu(predictions: list[str], references: list[str]) -> dict:
    import sacrebleu

    tokenize = "zh" if any(_HAS_CJK.search(r) for r in references) else "13a"
    metric = sacrebleu.BLEU(tokenize=tokenize)
    result = metric.corpus_score(predictions, [references])
    return {"bleu": result.score, "bleu_signature": str(metric.get_signature())}


@register("chrf")
def chrf(predictions: list[str], references: list[str]) -> dict:
    import sacrebleu

    metric = sacrebleu.CHRF()
    return {"chrf": metric.corpus_score(predictions, [references]).score, "chrf_signature": str(metric.get_signature())}


@register("rouge")
def rouge(predictions: list[str], references: list[str]) -> dict:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), tokenizer=UnicodeTokenizer())
    # plain means over examples (no bootstrap resampling); rougeLsum splits sentences on newlines
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for pred, ref in zip(predictions, references):
        scores = scorer.score(ref, pred)
        for key in ROUGE_TYPES:
            totals[key] += scores[key].fmeasure
    n = max(len(predictions), 1)
    return {key: 100.0 * totals[key] / n for key in ROUGE_TYPES}


@register("exact_match")
def exact_match(predictions: list[str], references: list[str]) -> dict:
    hits = sum(_normalize(p) == _normalize(r) for p, r in zip(predictions, references))
    return {"exact_match": 100.0 * hits / max(len(predictions), 1)}


def _canonical(value) -> str:
    """A JSON value as comparable text: key order ignored, 2 and 2.0 alike, true and 1 not."""
    def norm(v):
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return json.dumps(norm(value), sort_keys=True, ensure_ascii=False)


@register("tool_calls")
def tool_calls(predictions: list[str], references: list[str]) -> dict:
    valid = name = args = calling = spurious = quiet = 0
    for pred, ref in zip(predictions, references):
        wanted, made = tool_calls_in(ref), tool_calls_in(pred)
        if not wanted:
            quiet += 1
            spurious += bool(made)
            continue
        calling += 1
        valid += bool(made)
        name += sorted(n for n, _ in made) == sorted(n for n, _ in wanted)
        args += sorted((n, _canonical(a)) for n, a in made) == sorted((n, _canonical(a)) for n, a in wanted)
    share = lambda hits, of: 100.0 * hits / of if of else None  # noqa: E731
    return {"tool_call_valid_json": share(valid, calling), "tool_call_name": share(name, calling),
            "tool_call_args": share(args, calling), "tool_call_spurious": share(spurious, quiet)}


# held-out loss needs the model, so evaluation computes it; it is listed here to be named and shown
METRICS["loss"] = Metric("loss", None, DECLARED["loss"].rows, DECLARED["loss"].settings, DECLARED["loss"].default)


def score(predictions: list[str], references: list[str], names: list[str]) -> dict:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    out: dict = {}
    for name in names:
        metric = METRICS[name]
        if metric.score is not None:
            out.update(metric.score(predictions, references))
    return out


def extra(predictions: list[str], references: list[str], names: list[str]) -> dict:
    """Metrics from the `evaluate` library, by Hub name (needs the Hub) or local script path."""
    if not names:
        return {}
    from tunekit.core.errors import TunekitError

    try:
        import evaluate
    except ImportError:
        raise TunekitError("eval.extra_metrics needs the `evaluate` package: "
                           "pip install 'tunekit[extra-metrics]'") from None
    out = {}
    for name in names:
        try:
            metric = evaluate.load(name)
        except Exception as e:  # evaluate raises FileNotFoundError/ConnectionError/... offline
            raise TunekitError(f"eval.extra_metrics: cannot load {name!r} ({str(e).splitlines()[0][:160]})") from None
        result = metric.compute(predictions=predictions, references=references)
        out.update({f"{name}/{k}": v for k, v in result.items() if isinstance(v, (int, float))})
    return out


plugins.run("register_metrics")  # installed plugins' implementations (config.plugins)
