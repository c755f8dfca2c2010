"""Metric values against hand-computed cases, including Chinese and accented text."""

from __future__ import annotations

import math

import pytest
from rouge_score import rouge_scorer

from tunekit.config import metrickinds
from tunekit.evaluation import metrics


def test_bleu_hand_computed():
    # 1-gram 5/6 (the second "the" is clipped), 2-gram 3/5, 3-gram 2/4, 4-gram 1/3; equal length so BP = 1
    expected = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    got = metrics.bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert got["bleu"] == pytest.approx(expected, abs=1e-6)
    assert "tok:13a" in got["bleu_signature"] and "nrefs:1" in got["bleu_signature"]
    assert metrics.bleu(["a b c d"], ["a b c d"])["bleu"] == pytest.approx(100)


def test_bleu_chinese_uses_character_tokenization():
    got = metrics.bleu(["我爱北京天安门"], ["我爱北京天安门"])
    assert got["bleu"] == pytest.approx(100) and "tok:zh" in got["bleu_signature"]
    # 7 characters vs 7: 1-gram 5/7, 2-gram 3/6, 3-gram 1/5, 4-gram 0/4 -> smoothed, but far from 0 and 100
    partial = metrics.bleu(["我爱上海天安门"], ["我爱北京天安门"])["bleu"]
    assert 0 < partial < 60


def test_rouge_hand_computed_english():
    got = metrics.rouge(["the cat sat"], ["the cat ran"])
    assert got["rouge1"] == pytest.approx(200 / 3)  # P = R = 2/3
    assert got["rouge2"] == pytest.approx(50)  # 1 of 2 bigrams
    assert got["rougeL"] == pytest.approx(200 / 3)  # LCS "the cat"


def test_rouge_chinese_per_character():
    got = metrics.rouge(["我爱北京"], ["我爱上海"])
    assert got["rouge1"] == pytest.approx(50)  # 我 爱 of 4 characters
    assert got["rouge2"] == pytest.approx(100 / 3)  # 我爱 of 3 bigrams
    assert got["rougeL"] == pytest.approx(50)
    assert metrics.rouge(["東京タワー"], ["東京タワー"])["rougeL"] == pytest.approx(100)
    # the library's default tokenizer drops these characters and scores identical text 0
    default = rouge_scorer.RougeScorer(["rougeL"]).score("我爱北京", "我爱北京")["rougeL"].fmeasure
    assert default == 0.0


def test_rouge_accented_words_kept_whole():
    assert metrics.UnicodeTokenizer().tokenize("Café Straße naïve") == ["café", "straße", "naïve"]
    assert metrics.rouge(["café crème"], ["café noir"])["rouge1"] == pytest.approx(50)
    assert metrics.rouge(["naïve façade"], ["naïve façade"])["rougeL"] == pytest.approx(100)
    # "café" and "cafe" are different words (the default tokenizer would make both "caf")
    assert metrics.rouge(["cafe"], ["café"])["rouge1"] == 0


def test_rouge_is_mean_over_examples():
    got = metrics.rouge(["a b", "x"], ["a b", "y"])
    assert got["rouge1"] == pytest.approx(50)


def test_chrf_and_exact_match():
    assert metrics.chrf(["hello world"], ["hello world"])["chrf"] == pytest.approx(100)
    assert 0 < metrics.chrf(["hello word"], ["hello world"])["chrf"] < 100
    got = metrics.exact_match(["  Paris ", "Lyon", "東京"], ["Paris", "Nice", "東京"])
    assert got["exact_match"] == pytest.approx(200 / 3)


def test_score_selects_metrics_and_checks_lengths():
    got = metrics.score(["a"], ["a"], ["rouge", "exact_match"])
    assert set(got) == {"rouge1", "rouge2", "rougeL", "rougeLsum", "exact_match"}
    with pytest.raises(ValueError):
        metrics.score(["a"], ["a", "b"], ["bleu"])
    assert math.isclose(metrics.score(["a b c d"], ["a b c d"], ["bleu"])["bleu"], 100)


def test_the_registry_drives_the_recipe_schema_and_the_table():
    """A metric is added by registering one function in metrics.py; the recipe accepts its name, its
    default list includes it unless registered with default=False, and the eval table shows every score key
    it returns."""
    import typing

    from tunekit.config.schema import EvalConfig
    from tunekit.evaluation import evaluator

    allowed = typing.get_args(typing.get_args(EvalConfig.model_fields["metrics"].annotation)[0])
    assert list(allowed) == list(metrics.METRICS)
    assert EvalConfig().metrics == [name for name, metric in metrics.METRICS.items() if metric.default]
    rows = dict(evaluator.table_rows())
    for metric in metrics.METRICS.values():
        assert all(key in rows for key, _ in metric.rows), metric.name
        if metric.score is not None:
            keys = {k for k in metric.score(["a b c"], ["a b d"]) if not k.endswith("_signature")}
            assert keys == {key for key, _ in metric.rows}, metric.name


def test_only_default_metrics_are_scored_when_an_eval_section_names_none():
    from tunekit.config.schema import EvalConfig

    assert EvalConfig().metrics == ["bleu", "chrf", "rouge", "exact_match", "loss"] == metrickinds.defaults()
    assert not metrics.METRICS["tool_calls"].default
    assert EvalConfig(metrics=["tool_calls", "rouge"]).metrics == ["tool_calls", "rouge"]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'


def test_tool_call_scores_hand_computed():
    ref_call = CALL
    other_args = CALL.replace("celsius", "fahrenheit")
    other_name = CALL.replace("get_weather", "get_forecast")
    broken = CALL.replace("}}", "}")
    reordered = '{"arguments": {"unit": "celsius", "city": "Oslo"}, "name": "get_weather"}'
    predictions = [ref_call, reordered, other_args, other_name, broken, "It is sunny.", CALL, "Hello!"]
    references = [ref_call, ref_call, ref_call, ref_call, ref_call, "It is sunny.", "Hi there.", "Hi!"]
    got = metrics.tool_calls(predictions, references)
    # 5 references make a call: 4 answers parse (not the broken one), 3 name get_weather, 2 also match arguments
    assert got["tool_call_valid_json"] == pytest.approx(80)
    assert got["tool_call_name"] == pytest.approx(60)
    assert got["tool_call_args"] == pytest.approx(40)
    # 3 references make none: one answer calls anyway
    assert got["tool_call_spurious"] == pytest.approx(100 / 3)


def test_tool_call_scores_compare_calls_as_a_multiset_of_json_values():
    two = ('<tool_call>\n{"name": "a", "arguments": {"n": 2}}\n</tool_call>\n'
           '<tool_call>\n{"name": "b", "arguments": {"x": null}}\n</tool_call>')
    swapped = ('<tool_call>\n{"name": "b", "arguments": {"x": null}}\n</tool_call>'
               '<tool_call>\n{"name": "a", "arguments": {"n": 2.0}}\n</tool_call>')
    got = metrics.tool_calls([swapped, two.split("\n<tool_call>")[0], two.replace("2", '"2"')], [two] * 3)
    assert got["tool_call_valid_json"] == pytest.approx(100)
    assert got["tool_call_name"] == pytest.approx(200 / 3)  # the one-call answer misses b
    assert got["tool_call_args"] == pytest.approx(100 / 3)  # "2" is not 2; 2.0 is
    assert metrics.tool_calls(['{"name": "a", "arguments": {"on": 1}}'],
                              ['{"name": "a", "arguments": {"on": true}}'])["tool_call_args"] == 0
    # no reference makes a call: the call scores are null (shown as "-", not logged during training)
    assert metrics.tool_calls(["a"], ["b"]) == {"tool_call_valid_json": None, "tool_call_name": None,
                                                "tool_call_args": None, "tool_call_spurious": 0.0}


def test_tool_call_rows_in_the_eval_table():
    from tunekit.evaluation.table import format_table

    scores = metrics.score([CALL, "x"], [CALL, "y"], ["tool_calls", "exact_match"])
    table = format_table([("base", {**scores, "tool_call_args": 0.0}), ("tuned", scores)])
    assert "tool call arguments %" in table and "+100.00" in table and "spurious tool call %" in table
