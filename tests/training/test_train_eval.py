"""Generation metrics during training: logged beside eval_loss at every evaluation, equal to an eval of
the same weights afterwards, in one process and split over several (ZeRO-3)."""

from __future__ import annotations

import json

import pytest

from conftest import history, launch, reverse_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.evaluation import evaluator
from tunekit.runs.layout import RunRecord
from tunekit.training import runner

SCORES = ("bleu", "chrf", "rouge1", "rougeL", "exact_match")


def assert_last_eval_equals_end_of_training_eval(run_dir):
    """The in-training eval at the last step ran on the final weights: the end-of-training eval (one
    process, a fresh load of the saved adapter) must give the same scores."""
    last = history(run_dir, "eval_loss")[-1]
    final = json.loads((run_dir / "eval" / "metrics.json").read_text())["scores"]
    assert last["eval_chrf"] > 0  # real text was generated and scored
    for key in SCORES:
        assert last[f"eval_{key}"] == pytest.approx(final[key], abs=1e-9), key
    record = RunRecord.load(run_dir)
    assert record.eval_scores["chrf"] == last["eval_chrf"]


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_generation_metrics_are_logged_at_each_eval_and_match_an_eval_of_the_same_weights(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"max_steps": 12, "eval_steps": 6,
                                                                     "learning_rate": 1e-2},
                      eval={"data": str(data), "limit": 5, "batch_size": 2, "max_new_tokens": 6})
    raw["data"]["eval"] = str(data)
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    runner.run(recipe)
    rows = history(tmp_path / "run", "eval_loss")
    assert [r["step"] for r in rows] == [6, 12]
    assert all(f"eval_{k}" in r for r in rows for k in SCORES)
    evaluator.end_of_training(recipe, tmp_path / "run")
    assert_last_eval_equals_end_of_training_eval(tmp_path / "run")


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_off_switch_logs_the_loss_only(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"max_steps": 2},
                      eval={"limit": 2, "max_new_tokens": 4, "during_training": False})
    raw["data"]["eval"] = str(data)
    runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    (row,) = history(tmp_path / "run", "eval_loss")
    assert "eval_bleu" not in row


@pytest.mark.slow
def test_every_zero3_process_generates_its_share_and_the_scores_equal_one_process(tmp_path, tiny_model):
    """5 examples in batches of 2 over 2 processes: 3 batches, one process repeats one to keep ZeRO-3's
    collective forwards in step; the gathered scores equal a single-process eval of the final adapter."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    raw = tiny_recipe(tiny_model, data, tmp_path / "unused", training={"max_steps": 12, "eval_steps": 6,
                                                                        "learning_rate": 1e-2},
                      eval={"data": str(data), "limit": 5, "batch_size": 2, "max_new_tokens": 6})
    raw["data"]["eval"] = str(data)
    out = tmp_path / "run"
    launch(write_recipe(tmp_path / "r.yaml", raw), out, 2, "training.deepspeed=ds_configs/zero3.json",
           "training.micro_batch_size=4")
    assert [r["step"] for r in history(out, "eval_loss")] == [6, 12]
    assert_last_eval_equals_end_of_training_eval(out)
