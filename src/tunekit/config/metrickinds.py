"""The built-in metrics a recipe may name (eval.metrics), declared: names, the rows they log and print,
what is recorded of their settings, and whether they are scored by default. The schema and the reward kinds
take them from here; the scoring functions live in tunekit.evaluation.metrics and register against them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricSpec:
    """`rows` are the (score key, label) pairs logged and printed in eval tables; `settings` is recorded in
    metrics.json. `default`: scored when a recipe's eval section names no metrics (a task-specific metric, such
    as tool calls, is named). `scored`: computed from text by a scoring function; False marks a metric computed
    from the model (loss)."""

    name: str
    rows: tuple[tuple[str, str], ...]
    settings: str
    default: bool = True
    scored: bool = True


DECLARED: dict[str, MetricSpec] = {m.name: m for m in (
    MetricSpec("bleu", (("bleu", "BLEU"),), "sacreBLEU corpus BLEU; tokenizer 13a, or zh when references contain CJK"),
    MetricSpec("chrf", (("chrf", "chrF"),), "sacreBLEU corpus chrF (character 6-grams, beta 2)"),
    MetricSpec("rouge", (("rouge1", "ROUGE-1"), ("rouge2", "ROUGE-2"), ("rougeL", "ROUGE-L"),
                         ("rougeLsum", "ROUGE-Lsum")),
               "F-measure x100, mean over examples; Unicode-aware tokenizer (NFKC, lower-case, CJK per character), "
               "no stemming"),
    MetricSpec("exact_match", (("exact_match", "exact match %"),), "x100, after NFKC and whitespace normalisation"),
    MetricSpec("tool_calls", (("tool_call_valid_json", "tool call parsed %"), ("tool_call_name", "tool call name %"),
                              ("tool_call_args", "tool call arguments %"),
                              ("tool_call_spurious", "spurious tool call %")),
               "over the examples whose reference makes a tool call: % whose answer holds a parseable call (a JSON "
               "object with name and arguments or parameters, anywhere in the text), % calling the same functions, % "
               "with the same functions and arguments (equal as JSON values; calls compared as a multiset); "
               "spurious: % of the examples whose reference makes no call where the answer makes one. null when "
               "there are no such examples", default=False),
    # held-out loss needs the model, so evaluation computes it; it is declared to be named and shown
    MetricSpec("loss", (("eval_loss", "eval loss"), ("perplexity", "perplexity")),
               "mean cross-entropy per trained token (prompt tokens masked as in training); perplexity = exp(loss)",
               scored=False),
)}


def declare(spec: MetricSpec) -> MetricSpec:
    """Declare one more metric (a plugin's declare(): tunekit.config.plugins)."""
    if spec.name in DECLARED:
        raise ValueError(f"metric {spec.name!r} is declared twice")
    DECLARED[spec.name] = spec
    return spec


def defaults() -> list[str]:
    """The metrics an eval section scores when it names none."""
    return [name for name, metric in DECLARED.items() if metric.default]
