"""training.learning_rate: auto: the range test's rule on known curves, and on a tiny random Llama: the rate
found and its curve in run.json, training starting from a fresh model, the same result under DDP."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import cut_after_checkpoint, reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import defaults, recipefile
from tunekit.reporting import report
from tunekit.runs.layout import RunRecord
from tunekit.training import arguments, lrfind, runner


def test_rates_rise_geometrically_from_low_to_high():
    r = lrfind.rates(16)
    assert r[0] == pytest.approx(lrfind.LOW) and r[-1] == pytest.approx(lrfind.HIGH)
    ratios = {round(b / a, 9) for a, b in zip(r, r[1:])}
    assert len(ratios) == 1


def test_the_rule_takes_the_rate_where_the_loss_diverged_divided_by_ten():
    lrs = lrfind.rates(16)
    # noisy small batches: one spike at step 1 is not divergence; steps 13 and 14 both above 1.5 x the lowest are
    losses = [3.8, 7.3, 3.7, 4.4, 4.1, 3.6, 5.2, 4.0, 3.8, 3.8, 4.0, 4.2, 4.6, 6.4, 9.7, 10.1]
    assert lrfind.diverged_at(losses) == 13
    value, rule = lrfind.pick(lrs, losses)
    assert value == pytest.approx(lrs[13] / 10) and "diverged" in rule
    # never diverging: the highest rate tried / 10
    assert lrfind.pick(lrs, [4.0 - 0.1 * k for k in range(16)])[0] == pytest.approx(lrfind.HIGH / 10)


def test_non_finite_losses_count_as_divergence_and_all_non_finite_is_an_error():
    lrs = lrfind.rates(5)
    assert lrfind.diverged_at([2.0, 1.0, 1.1, float("nan"), float("inf")]) == 3
    value, _ = lrfind.pick(lrs, [2.0, 1.0, 1.1, float("nan"), float("inf")])
    assert value == pytest.approx(lrs[3] / 10)
    with pytest.raises(Exception, match="learning_rate: auto"):
        lrfind.pick(lrs, [float("nan")] * 5)


@pytest.mark.slow
def test_auto_finds_a_rate_records_its_curve_and_trains_from_a_fresh_model(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(64))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"learning_rate": "auto", "max_steps": 6,
                                                                      "save_steps": 3})
    result = runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    info = RunRecord.load(result.run_dir)
    found = info.learning_rate
    assert found["steps"] == len(found["curve"]) <= 16
    assert lrfind.LOW <= found["value"] <= lrfind.HIGH
    assert found["value"] == pytest.approx(lrfind.pick([p["lr"] for p in found["curve"]],
                                                       [p["loss"] for p in found["curve"]])[0])
    assert result.trainer.args.learning_rate == pytest.approx(found["value"])
    # training started from the model as loaded: the run equals a fixed-rate run at the found rate
    fixed = tiny_recipe(tiny_model, data, tmp_path / "fixed", training={"learning_rate": found["value"],
                                                                         "max_steps": 6})
    other = runner.run(recipefile.load(write_recipe(tmp_path / "f.yaml", fixed)))
    a = load_file(str(result.run_dir / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(other.run_dir / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "learning_rate: auto" in (result.run_dir / "recipe.yaml").read_text().replace("'", "")
    losses = [p["loss"] for p in found["curve"]]
    assert min(losses) < losses[0]  # the rising rate lowered the loss
    assert found["steps"] == 16 or lrfind.diverged_at(losses) == found["steps"] - 2  # stopped once diverged

    page = report.write([result.run_dir]).read_text()
    assert 'class="range-test"' in page and f"chose {found['value']:.3g}" in page

    # --resume takes the recorded rate (no second range test) and ends where the whole run ended
    cut = cut_after_checkpoint(result.run_dir, tmp_path / "cut", 3)
    resumed = runner.run(recipefile.load(cut / "recipe.yaml"), resume=True)
    assert resumed.trainer.args.learning_rate == pytest.approx(found["value"])
    c = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=1e-5, atol=1e-6)


def test_validate_names_the_automatic_learning_rate_and_neftune_reaches_the_trainer(tmp_path, tiny_model):
    from tunekit.core.hardware import Precision

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"learning_rate": "auto",
                                                                      "neftune_noise_alpha": 5})
    path = write_recipe(tmp_path / "r.yaml", raw)
    res = run_cli("validate", str(path))
    assert res.returncode == 0, res.stderr
    assert "training.learning_rate: auto (a range test of 16 steps" in res.stderr
    args = arguments.training_arguments(recipefile.load(path), Precision("fp32", ""), tmp_path / "run", False)
    assert args.neftune_noise_alpha == 5 and args.learning_rate == arguments.PROVISIONAL_RATE
    # a recipe without a rate: the measured default is named with its reason, by validate and by train
    raw["training"].pop("learning_rate")
    raw["lora"].pop("use_rslora")
    path = write_recipe(tmp_path / "r.yaml", raw)
    res = run_cli("validate", str(path))
    line = next(x for x in res.stderr.splitlines() if "training.learning_rate" in x)
    assert line == f"tunekit: {defaults.applied(recipefile.load(path))[0]}"
    assert "0.0002 (default: kept by bench/quality.py's rule" in line and "bench/RESULTS.md" in line
    assert "tunekit: lora.use_rslora: false (default: bench/quality.py's rule (3 seeds" in res.stderr
    assert recipefile.load(path).lora.use_rslora is False
    raw["lora"]["use_rslora"] = True  # set in the recipe: kept, no line
    res = run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert "lora.use_rslora" not in res.stderr and recipefile.load(tmp_path / "r.yaml").lora.use_rslora is True
    raw["lora"]["use_rslora"] = False
    res = run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert "lora.use_rslora" not in res.stderr and "training.learning_rate: 0.0002 (default" in res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    pytest.param({"adapter": "none", "lora": None}, id="full-finetuning"),
    pytest.param({"quantization": {"bits": 4}}, id="qlora"),
])
def test_auto_works_for_full_finetuning_and_qlora(tmp_path, tiny_model, settings):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(64))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"learning_rate": "auto", "max_steps": 4},
                      **settings)
    result = runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    found = RunRecord.load(result.run_dir).learning_rate
    assert result.trainer.args.learning_rate == pytest.approx(found["value"])
    smoothed = [p["smoothed"] for p in found["curve"]]
    assert min(smoothed) < smoothed[0]  # the rising rate lowered the loss before the pick
