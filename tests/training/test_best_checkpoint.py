"""training.metric_for_best keeps the best checkpoint as the run's output; early stopping; both on resume."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import cut_after_checkpoint, history, reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.core.errors import TunekitError
from tunekit.runs.layout import RunRecord
from tunekit.training import runner

ADAPTER = "adapter_model.safetensors"


def recipe_for(tmp_path, tiny_model, out, **training):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    raw = tiny_recipe(tiny_model, data, out, training={"max_steps": 8, "eval_steps": 2, "learning_rate": 1e-2,
                                                       "save_total_limit": 2, **training})
    raw["data"]["eval"] = str(data)
    return write_recipe(tmp_path / f"{out.name}.yaml", raw)


def eval_losses(run_dir):
    return {r["step"]: r["eval_loss"] for r in history(run_dir, "eval_loss")}


def same_weights(a, b):
    wa, wb = load_file(str(a / ADAPTER)), load_file(str(b / ADAPTER))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_the_final_adapter_is_the_best_checkpoint_not_the_last(tmp_path, tiny_model):
    """Loss falls, so with greater_is_better the best eval_loss is the first evaluation's (step 2):
    the final adapter must be step 2's, not step 8's, although 2 checkpoints are kept by the limit."""
    out = tmp_path / "run"
    runner.run(recipefile.load(recipe_for(tmp_path, tiny_model, out, metric_for_best="eval_loss",
                                       greater_is_better=True)))
    losses = eval_losses(out)
    assert list(losses) == [2, 4, 6, 8] and losses[8] < losses[2]
    best = RunRecord.load(out).best
    assert best["step"] == 2 and best["value"] == pytest.approx(losses[2]) and not best["stopped_early"]
    assert same_weights(out / "adapter", out / "checkpoints" / "checkpoint-2")
    assert not same_weights(out / "adapter", out / "checkpoints" / "checkpoint-8")


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_lower_is_better_for_eval_loss_by_default(tmp_path, tiny_model):
    out = tmp_path / "run"
    runner.run(recipefile.load(recipe_for(tmp_path, tiny_model, out, metric_for_best="eval_loss", max_steps=4)))
    losses = eval_losses(out)
    best = RunRecord.load(out).best
    assert best["step"] == min(losses, key=losses.get) and best["greater_is_better"] is False


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_early_stopping_ends_a_run_that_no_longer_improves(tmp_path, tiny_model):
    out = tmp_path / "run"
    runner.run(recipefile.load(recipe_for(tmp_path, tiny_model, out, metric_for_best="eval_loss",
                                       greater_is_better=True, early_stopping_patience=2)))
    best = RunRecord.load(out).best
    assert list(eval_losses(out)) == [2, 4, 6]  # steps 4 and 6 did not beat step 2: stop at 6 of 8
    assert best["stopped_early"] and best["last_step"] == 6 and best["step"] == 2
    assert same_weights(out / "adapter", out / "checkpoints" / "checkpoint-2")


@pytest.mark.slow
def test_resume_keeps_the_best_checkpoint_and_the_patience_count(tmp_path, tiny_model):
    """Killed after step 4 (best: step 2, one evaluation without improvement), resumed in a copy whose
    original is gone: it stops at step 6 and outputs step 2's adapter, as the uninterrupted run does."""
    full = tmp_path / "full"
    recipe = recipe_for(tmp_path, tiny_model, full, metric_for_best="eval_loss", greater_is_better=True,
                        early_stopping_patience=2)
    runner.run(recipefile.load(recipe))
    cut = cut_after_checkpoint(full, tmp_path / "cut", 4)
    expected = load_file(str(full / "adapter" / ADAPTER))
    shutil.rmtree(full)
    res = run_cli("train", str(cut / "recipe.yaml"), "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    best = RunRecord.load(cut).best
    assert best["step"] == 2 and best["stopped_early"] and best["last_step"] == 6
    resumed = load_file(str(cut / "adapter" / ADAPTER))
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)


def test_metric_for_best_must_be_logged(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"metric_for_best": "bleu"})
    with pytest.raises(TunekitError, match="metric_for_best: bleu is not logged.*add an eval section"):
        recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    raw["eval"] = {"metrics": ["rouge"]}
    with pytest.raises(TunekitError, match="logged: eval_loss, rouge1"):
        recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    raw["eval"] = {"metrics": ["bleu"]}
    recipefile.load(write_recipe(tmp_path / "r.yaml", raw))  # fine
    raw["training"]["early_stopping_patience"] = 2
    raw["training"]["metric_for_best"] = None
    with pytest.raises(TunekitError, match="need training.metric_for_best"):
        recipefile.load(write_recipe(tmp_path / "r.yaml", raw))


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_metric_for_best_without_held_out_data_is_one_line(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"metric_for_best": "eval_loss"})
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode != 0 and "needs held-out data" in res.stderr and "Traceback" not in res.stderr
