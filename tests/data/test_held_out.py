"""Held-out means held out: with data.max_examples and data.eval_fraction together, every path that trains or
scores (the prepared SFT sets, preference and unpaired pairs, generation during training, the end-of-training
eval, `tunekit eval RUN`, several processes) sees one split, taken from the first max_examples records."""

from __future__ import annotations

import json
import re

import pytest

from conftest import history, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data import arrow, split
from tunekit.runs.layout import RunRecord

pytestmark = pytest.mark.slow  # each test prepares data sets, trains or generates: seconds

WORDS = ["cat", "dog", "bird", "fish", "lion", "wolf", "bear", "frog", "duck", "goat", "mole", "crab"]


def distinct_rows(n: int) -> list[dict]:
    """n alpaca rows, no two alike, so that an answer names the one example it belongs to."""
    rows = []
    for i in range(n):
        word = f"{WORDS[i % len(WORDS)]}{i:04d}"
        rows.append({"instruction": "Reverse the word.", "input": word, "output": word[::-1]})
    return rows


def line_of(where: str) -> int:
    return int(re.fullmatch(r".* line (\d+)", where).group(1))


def test_the_issue_case_scores_only_what_training_held_out(tmp_path, tiny_tokenizer):
    """1,000 records, max_examples 100, eval_fraction 0.1: 90 train, 10 held out, all from the first 100; the
    prepared eval set, the records every scorer reads and the preference path agree."""
    path = write_jsonl(tmp_path / "d.jsonl", distinct_rows(1000))
    cfg = DataConfig(train=str(path), max_examples=100, eval_fraction=0.1)
    bundle = arrow.build(cfg, tiny_tokenizer, seed=7)
    held = split.held_out(cfg, seed=7)
    assert len(bundle.train) == 90 and bundle.eval_stats.examples == 10 and len(held) == 10
    assert bundle.split == {"train_records_read": 100, "max_examples": 100, "train": 90, "held_out": 10,
                            "held_out_from": "data.eval_fraction",
                            "held_out_fingerprint": split.fingerprint(split.of(held))}
    assert all(line_of(r.where) <= 100 for r in held)
    assert [r.where for r in bundle.eval_rendered] == [r.where for r in held]
    train_text = "\n".join(tiny_tokenizer.decode(ids) for ids in bundle.train["input_ids"])
    train, held_again, facts = split.train_and_held(cfg, seed=7)
    assert all(r.values["input"] in train_text for r in train)
    assert not any(r.values["input"] in train_text for r in held)
    assert len(train) == 90 and [r.where for r in held_again] == [r.where for r in held] and facts == bundle.split
    assert not {r.where for r in train} & {r.where for r in held}


def test_a_separate_eval_file_is_held_out_whole_and_max_examples_caps_training_only(tmp_path, tiny_tokenizer):
    train_file = write_jsonl(tmp_path / "t.jsonl", distinct_rows(30))
    eval_file = write_jsonl(tmp_path / "e.jsonl", distinct_rows(40)[30:])
    cfg = DataConfig(train=str(train_file), eval=str(eval_file), max_examples=12)
    bundle = arrow.build(cfg, tiny_tokenizer, seed=0)
    assert len(bundle.train) == 12 and bundle.eval_stats.examples == 10
    assert bundle.split["held_out_from"] == "data.eval" and bundle.split["train_records_read"] == 12
    assert [r.where for r in split.held_out(cfg, 0)] == [f"{eval_file} line {n}" for n in range(1, 11)]


@pytest.mark.parametrize("method, fmt", [("dpo", "preference"), ("kto", "unpaired_preference")])
def test_preference_and_unpaired_data_split_as_sft_data_does(tmp_path, tiny_model, tiny_tokenizer, method, fmt):
    from tunekit.data.demodata import unpaired
    from tunekit.training import methods

    pairs = [{"prompt": f"Reverse {r['input']}", "chosen": r["output"], "rejected": r["input"]}
             for r in distinct_rows(60)]
    rows = pairs if fmt == "preference" else unpaired(pairs)
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"method": method},
                      data={"format": fmt, "max_examples": 40, "eval_fraction": 0.25})
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    bundle = methods.of(recipe).build_data(recipe, tiny_tokenizer)
    held = split.held_out(recipe.data, recipe.training.seed)
    assert len(held) == 10 and all(line_of(r.where) <= 40 for r in held)
    assert bundle.split["held_out"] == 10 and bundle.split["train"] == 30
    assert bundle.split["held_out_fingerprint"] == split.fingerprint(split.of(held))
    assert bundle.eval_stats.examples == 10 and len(bundle.train) == 30


def test_training_evaluation_and_eval_of_the_run_score_the_same_held_out_records(tmp_path, tiny_model):
    """Training's eval loss set, generation during training, the end-of-training eval and `tunekit eval RUN`
    score exactly the records training held out, as many as it reported; once the data file changes under the
    run, `tunekit eval RUN` refuses to score what may have been trained on."""
    from tunekit.evaluation import evaluator
    from tunekit.models import loader
    from tunekit.runs.layout import resolve_target
    from tunekit.training import runner

    data = write_jsonl(tmp_path / "d.jsonl", distinct_rows(40))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", data={"max_examples": 20, "eval_fraction": 0.25},
                      training={"max_steps": 2, "eval_steps": 2}, eval={"max_new_tokens": 2})
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    runner.run(recipe)
    evaluator.end_of_training(recipe, tmp_path / "run")
    record = RunRecord.load(tmp_path / "run").data
    assert record["split"]["held_out"] == record["eval"]["examples"] == 5 and record["train"]["examples"] == 15
    assert record["contamination"]["eval_examples"] == 5 and record["contamination"]["line"].startswith("contamination")
    expected = [r.where for r in split.held_out(recipe.data, recipe.training.seed)]
    assert len(expected) == 5 and all(line_of(w) <= 20 for w in expected)

    during = runner.generation_eval(recipe, loader.load_tokenizer(recipe.model), True)
    assert [r.where for r in during.rendered] == expected
    assert history(tmp_path / "run", "eval_bleu")  # generation metrics were logged during training
    predictions = [json.loads(x) for x in (tmp_path / "run" / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert [p["where"] for p in predictions] == expected
    target = resolve_target(str(tmp_path / "run"))
    again = evaluator.evaluate(target, recipe.eval, out=tmp_path / "again")
    assert again["scores"]["examples"] == 5
    assert [json.loads(x)["where"] for x in (tmp_path / "again" / "predictions.jsonl").read_text().splitlines()] \
        == expected

    rows = distinct_rows(40)
    rows[line_of(expected[0]) - 1]["output"] = "changed"
    write_jsonl(data, rows)
    with pytest.raises(TunekitError, match="differ from those the run held out"):
        evaluator.evaluate(target, recipe.eval, out=tmp_path / "changed")
