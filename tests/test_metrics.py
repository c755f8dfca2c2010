"""Metric values against hand-computed cases, including Chinese and accented text."""

from __future__ import annotations

import math

import pytest
from rouge_score import rouge_scorer

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
    default list includes it, and the eval table shows every score key it returns."""
    import typing

    from tunekit.evaluation import runner as evaluation
    from tunekit.config.schema import EvalConfig

    allowed = typing.get_args(typing.get_args(EvalConfig.model_fields["metrics"].annotation)[0])
    assert list(allowed) == list(metrics.METRICS) == EvalConfig().metrics
    rows = dict(evaluation.table_rows())
    for metric in metrics.METRICS.values():
        assert all(key in rows for key, _ in metric.rows), metric.name
        if metric.score is not None:
            keys = {k for k in metric.score(["a b c"], ["a b d"]) if not k.endswith("_signature")}
            assert keys == {key for key, _ in metric.rows}, metric.name
