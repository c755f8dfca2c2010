"""training.method: reward: a reward model (the tiny model with a score head, LoRA) trained on preference pairs
learns to score the chosen answer above the rejected one; its held-out pair accuracy is logged during training and
reported by `tunekit eval`; the saved adapter and score head reload to the same scores; grpo.rewards
{reward: model, run: RUN} scores completions with it; bad recipes are refused in one line before weights load."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

from conftest import (
    NEEDS_SMOLLM2,
    history,
    logged,
    refused_in_process,
    reverse_rows,
    run_cli,
    tiny_recipe,
    write_jsonl,
    write_recipe,
)
from tunekit.config import recipefile
from tunekit.config.methodsettings import RewardSpec
from tunekit.core.errors import TunekitError
from tunekit.evaluation import evaluator, rewardmodel, rewards
from tunekit.export import merge
from tunekit.models import loader
from tunekit.plan import activations, estimate
from tunekit.runs.layout import RunRecord, resolve_target
from tunekit.runs.trained import load_trained
from tunekit.training import methods, runner
from tunekit.training.trainers.reward import RewardModelTrainer

WORDS = ["catfish", "dogduck", "birddog", "fishbear", "lioncrab", "wolflion", "bearcat", "crabfish",
         "goatmole", "moleduck", "frogcat", "duckgoat"]


def pairs(words):
    """A preference: the reversed word over the word as given."""
    return [{"prompt": f"Reverse the word.\n\n{w}", "chosen": w[::-1], "rejected": w} for w in words]


def reward_raw(tiny_model, tmp_path, **training):
    train = write_jsonl(tmp_path / "train.jsonl", pairs(WORDS[:8] * 4))
    held = write_jsonl(tmp_path / "eval.jsonl", pairs(WORDS[8:] * 2))
    raw = tiny_recipe(tiny_model, train, tmp_path / "run",
                      training={"method": "reward", "max_steps": 16, "learning_rate": 5e-3, "eval_steps": 8,
                                "seed": 1, **training})
    raw["data"].update(format="preference", eval=str(held))
    raw["eval"] = {"batch_size": 4}
    return raw


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """One reward model run on the tiny model, shared by the tests below: (recipe, run directory, trained model)."""
    tmp_path = tmp_path_factory.mktemp("reward")
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", reward_raw(tiny_model, tmp_path)))
    result = runner.run(recipe)
    evaluator.end_of_training(recipe, tmp_path / "run")
    return recipe, tmp_path / "run", result.trainer.model


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_training_lowers_the_loss_and_raises_held_out_pair_accuracy(trained):
    """The model as training starts (the base with the score head the run's seed draws) against the trained one,
    on the held-out pairs: the pair loss falls and the accuracy rises."""
    recipe, run_dir, _ = trained
    set_seed(recipe.training.seed)  # the score head as the run drew it
    untrained = loader.load_base(recipe.model, torch.float32, score_head=True)
    tok = loader.load_tokenizer(recipe.model)
    held = evaluator.held_out_records(recipe)
    before = rewardmodel.pair_scores(rewardmodel.scored_pairs(untrained, tok, recipe, held, None, 4))
    losses, eval_losses, accuracy = (logged(run_dir, key) for key in ("loss", "eval_loss", "eval_accuracy"))
    assert len(accuracy) == 2 and accuracy[-1] >= 0.75 > before["reward_accuracy"], (before, accuracy)
    assert abs(before["reward_margin"]) < 0.1 and eval_losses[-1] < math.log(2) - 0.2, (before, eval_losses)
    assert min(losses[-4:]) < losses[0] - 0.3, losses
    record = RunRecord.load(run_dir)
    assert record.training_method == "reward" and record.status == "completed"
    assert record.eval_scores["accuracy"] == accuracy[-1]


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_eval_reports_pair_accuracy_and_per_pair_scores_by_hand(trained):
    """metrics.json's reward_accuracy (the pair accuracy) is the share of predictions.jsonl's rows whose chosen
    score is above the rejected one, and equals the accuracy logged at the last evaluation of training (the same
    pairs, the same weights); nothing is generated."""
    _, run_dir, _ = trained
    scores = json.loads((run_dir / "eval" / "metrics.json").read_text())["scores"]
    rows = [json.loads(line) for line in (run_dir / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == scores["examples"] == 8 and "prediction" not in rows[0]
    by_hand = sum(r["chosen_score"] > r["rejected_score"] for r in rows) / len(rows)
    assert scores["reward_accuracy"] == pytest.approx(by_hand)
    assert scores["reward_accuracy"] == pytest.approx(RunRecord.load(run_dir).eval_scores["accuracy"])
    assert scores["reward_margin"] == pytest.approx(sum(r["chosen_score"] - r["rejected_score"] for r in rows) / 8)


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_lora_leaves_the_base_unchanged_and_saves_the_trained_score_head(trained, tiny_model):
    _, run_dir, model = trained
    base = load_file(str(tiny_model / "model.safetensors"))
    compared = 0
    for name, p in model.named_parameters():
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if "lora_" not in name and "score" not in name:
            assert torch.equal(p.detach().cpu(), base[key]), name
            compared += 1
    assert compared >= 10
    saved = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    head = [k for k in saved if "score" in k]
    assert head and not torch.equal(saved[head[0]], torch.zeros_like(saved[head[0]])), list(saved)
    assert json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_the_reloaded_model_gives_the_scores_eval_wrote(trained):
    recipe, run_dir, _ = trained
    target = resolve_target(str(run_dir))
    model = load_trained(target, torch.float32)
    tok = loader.load_tokenizer(target.recipe.model, target.tokenizer_dir)
    rows = rewardmodel.scored_pairs(model, tok, target.recipe, evaluator.records_for(target, None), None, 3)
    written = [json.loads(line) for line in (run_dir / "eval" / "predictions.jsonl").read_text().splitlines()]
    for row, old in zip(rows, written):
        assert row["chosen_score"] == pytest.approx(old["chosen_score"], abs=1e-5)
        assert row["rejected_score"] == pytest.approx(old["rejected_score"], abs=1e-5)


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_a_model_reward_scores_chosen_completions_above_rejected_ones(trained):
    _, run_dir, _ = trained
    spec = RewardSpec(reward="model", run=str(run_dir))
    (scorer,) = rewards.build([spec], 32)
    recipe = resolve_target(str(run_dir)).recipe
    from tunekit.data.mixture import Renderers
    from tunekit.data.reading import read_records

    tok = loader.load_tokenizer(recipe.model)
    renderer = Renderers(recipe.data, tok)
    records = read_records(str(run_dir.parent / "eval.jsonl"), "eval", "data.eval")
    rendered = [renderer.render(r).prompt for r in records]
    chosen = scorer(rendered, [r.values["chosen"] for r in records])
    rejected = scorer(rendered, [r.values["rejected"] for r in records])
    assert sum(c > r for c, r in zip(chosen, rejected)) >= 0.75 * len(records), (chosen, rejected)


@pytest.mark.slow  # a training run
def test_grpo_trains_on_the_reward_models_scores(trained, tiny_model, tmp_path):
    """A GRPO run whose one reward is the trained reward model: every step logs its scores, and the held-out
    generations are scored with it in `tunekit eval`."""
    _, run_dir, _ = trained
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Reverse the word.\n\n{w}", "answer": w[::-1]}
                                              for w in WORDS * 2])
    raw = tiny_recipe(tiny_model, data, tmp_path / "grpo", training={"method": "grpo", "max_steps": 2,
                                                                      "micro_batch_size": 4})
    raw["data"].update(format="prompt", eval_fraction=0.25)
    raw["grpo"] = {"completions": 4, "max_completion_length": 6, "rewards": [{"reward": "model", "run": str(run_dir)}]}
    raw["eval"] = {"max_new_tokens": 6, "batch_size": 4, "during_training": False}
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    runner.run(recipe)
    rows = history(tmp_path / "grpo")
    means = [r["rewards/model/mean"] for r in rows if "rewards/model/mean" in r]
    assert len(means) == 2 and all(math.isfinite(m) for m in means), rows
    result = evaluator.end_of_training(recipe, tmp_path / "grpo")
    assert math.isfinite(result["scores"]["reward/model"])


@pytest.mark.parametrize("make, message", [
    (lambda run, tmp: {"reward": "model"}, "grpo.rewards[0].run: reward model needs it"),
    (lambda run, tmp: {"reward": "model", "run": str(tmp / "nowhere")}, "is not a tunekit run directory"),
    (lambda run, tmp: {"reward": "model", "run": str(fake_run(tmp / "sft", "sft"))},
     "grpo.rewards[0] (model): run: "),
    (lambda run, tmp: {"reward": "model", "run": str(fake_run(tmp / "rm", "reward", "failed"))},
     "did not complete (status 'failed')"),
])
def test_a_model_reward_without_a_finished_reward_run_is_refused_in_one_line(tmp_path, tiny_model, capsys,
                                                                              monkeypatch, make, message):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi.", "answer": "hi"}] * 4)
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"method": "grpo", "micro_batch_size": 4})
    raw["data"]["format"] = "prompt"
    raw["grpo"] = {"rewards": [make(None, tmp_path)]}
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    line = refused_in_process(["train", str(recipe)], tmp_path, capsys, monkeypatch)
    assert message in line, line


def test_the_best_checkpoint_may_be_chosen_by_the_held_out_loss(tmp_path, tiny_model):
    """A reward model's evaluations log eval_loss, with an eval section or without."""
    raw = reward_raw(tiny_model, tmp_path)
    raw["training"]["metric_for_best"] = "eval_loss"
    assert recipefile.load(write_recipe(tmp_path / "r.yaml", raw)).training.metric_for_best == "eval_loss"


@pytest.mark.parametrize("metric", ["eval_accuracy", "eval_margin"])
def test_the_best_checkpoint_may_be_chosen_by_held_out_pair_accuracy_or_margin(tmp_path, tiny_model, metric):
    """What a reward model's evaluations log beside eval_loss, greater being better."""
    raw = reward_raw(tiny_model, tmp_path)
    raw["training"]["metric_for_best"] = metric
    training = recipefile.load(write_recipe(tmp_path / "r.yaml", raw)).training
    assert training.metric_for_best == metric and training.best_is_greater


@pytest.mark.parametrize("method, metric, message", [
    ("sft", "eval_accuracy", "eval_accuracy is a reward model's held-out pair measure, logged by training.method: "
                             "reward, not sft, whose evaluations log eval_loss"),
    ("dpo", "eval_margin", "eval_margin is a reward model's held-out pair measure"),
    ("reward", "eval_bleu", "eval_bleu is not logged at evaluations of training.method: reward, which generate "
                            "nothing; logged: eval_loss, eval_accuracy, eval_margin"),
])
def test_a_measure_the_evaluations_do_not_log_is_refused_in_one_line(tmp_path, tiny_model, method, metric, message):
    raw = reward_raw(tiny_model, tmp_path)
    raw["training"].update(method=method, metric_for_best=metric)
    raw["eval"]["metrics"] = ["bleu"]
    if method == "sft":
        raw["data"] = {**raw["data"], "format": "prompt_completion", "train": str(write_jsonl(
            tmp_path / "sft.jsonl", [{"prompt": w, "completion": w[::-1]} for w in WORDS])), "eval": None}
        raw["data"]["eval_fraction"] = 0.25
    with pytest.raises(TunekitError, match="training.metric_for_best") as e:
        recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_the_best_checkpoint_by_margin_is_the_one_kept(tiny_model, tmp_path):
    """eval_margin reaches the evaluation's metrics counted over the pairs: the run keeps the checkpoint with the
    greatest one."""
    raw = reward_raw(tiny_model, tmp_path, metric_for_best="eval_margin", max_steps=8, eval_steps=4)
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    runner.run(recipe)
    margins = {h["step"]: h["eval_margin"] for h in history(tmp_path / "run", "eval_margin")}
    best = RunRecord.load(tmp_path / "run").best
    assert len(margins) == 2 and best["value"] == pytest.approx(max(margins.values())), (margins, best)


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_a_merged_reward_model_reloads_with_its_score_head_and_gives_the_runs_scores(trained, tmp_path, caplog):
    """The merge checks parity on the [batch, 1] scores (not logits per token); the merged directory loads with
    plain AutoModelForSequenceClassification, reads the score where training did, and gives the scores the adapter
    run's `tunekit eval` wrote."""
    recipe, run_dir, _ = trained
    with caplog.at_level("INFO", logger="tunekit"):
        out = merge.merge(run_dir, tmp_path / "merged", dtype="fp32")
    assert "parity: max |score diff|" in caplog.text and "pair order agreement 100.00%" in caplog.text
    parity = json.loads((out / "tunekit.json").read_text())["parity"]
    assert parity["measure"] == "scores" and parity["max_abs_diff"] < 1e-4 and parity["top1_agreement"] == 1.0
    assert "AutoModelForSequenceClassification.from_pretrained" in (out / "README.md").read_text()
    model = AutoModelForSequenceClassification.from_pretrained(out)  # plain transformers, no peft
    tok = AutoTokenizer.from_pretrained(out)
    assert model.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    written = [json.loads(line) for line in (run_dir / "eval" / "predictions.jsonl").read_text().splitlines()]
    chosen = [r["chosen"] for r in written]
    rows = rewardmodel.scored_pairs(model, tok, recipe, evaluator.held_out_records(recipe), None, 4)
    assert [r["chosen"] for r in rows] == chosen
    for row, old in zip(rows, written):
        assert row["chosen_score"] == pytest.approx(old["chosen_score"], abs=1e-4)
        assert row["rejected_score"] == pytest.approx(old["rejected_score"], abs=1e-4)


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_gguf_export_of_a_reward_model_is_refused_in_one_line(trained, tmp_path, capsys, monkeypatch):
    _, run_dir, _ = trained
    line = refused_in_process(["export", str(run_dir), "--quant", "q8_0"], tmp_path, capsys, monkeypatch)
    assert "a reward model ends in a score head" in line and "GGUF does not apply" in line, line


def test_a_reward_plan_counts_a_score_head_not_vocabulary_logits(tmp_path, tiny_model):
    """The score head gives one number per position (hidden x 1), the language-model head one per vocabulary entry:
    a DPO plan of the same pairs and an SFT plan of the same model keep their vocabulary-sized logits."""
    raw = reward_raw(tiny_model, tmp_path)
    reward = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    raw["training"]["method"] = "dpo"
    dpo = recipefile.load(write_recipe(tmp_path / "d.yaml", raw))  # the same pairs, a language-model head
    plans = {}
    for name, recipe in (("reward", reward), ("dpo", dpo)):
        cfg, model = estimate.meta_model(recipe)
        s = estimate.Settings(micro_batch=2, sequences=2, seq_len=64, precision="fp32")
        plans[name] = (cfg, model, estimate.make(recipe, s, cfg, model), s)
    cfg, model, plan, s = plans["reward"]
    tokens = s.micro_batch * s.sequences * s.seq_len
    assert plan.parts["logits and loss"] < tokens * 16  # a few bytes per position, no vocabulary
    assert plan.parts["logits and loss"] < plans["dpo"][2].parts["logits and loss"] / cfg.vocab_size * 2
    assert model.get_output_embeddings() is None and [n for n, _ in model.named_parameters() if "score" in n]
    assert plans["dpo"][2].parts["logits and loss"] == tokens * cfg.vocab_size * (4 + 6)  # fp32 logits, log-softmax
    # with a memory bandwidth, the elementwise bytes: fp32 outputs written and read, 1 per position (score head)
    import dataclasses

    bw = dataclasses.replace(s, memory_bandwidth=1e9)
    p = estimate.make(reward, bw, cfg, model)
    layers = 4 * cfg.num_hidden_layers * tokens * activations.layer_bytes_per_token(cfg, bw, reward)
    assert p.time.elementwise_bytes == pytest.approx(layers + 4 * tokens * 1 * 4 + p.counts.trainable * 28)
    sft = recipefile.load(write_recipe(tmp_path / "s.yaml", tiny_recipe(
        tiny_model, write_jsonl(tmp_path / "sft.jsonl", reverse_rows(8)), tmp_path / "sft",
        training={"chunked_loss": False})))
    s = estimate.Settings(micro_batch=2, seq_len=64, precision="fp32")
    sft_plan = estimate.make(sft, s, *estimate.meta_model(sft))
    assert sft_plan.parts["logits and loss"] == 2 * 64 * cfg.vocab_size * (4 + 6)


def fake_run(run_dir, method: str, status: str = "completed"):
    """A run directory holding only run.json (and an empty adapter/)."""
    (run_dir / "adapter").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({
        "status": status, "started": "", "command": [], "versions": {}, "precision": {}, "adapter": "lora",
        "base_model": "x", "parameters": {}, "world_size": 1, "effective_batch": 1, "data": {},
        "training_method": method}))
    return run_dir


def test_a_run_of_another_method_is_not_a_reward_model(tmp_path):
    with pytest.raises(TunekitError, match="is a training.method: sft run, not a reward model"):
        rewardmodel.reward_run(str(fake_run(tmp_path / "sft", "sft")))
    assert methods.get("reward").trainer_class() is RewardModelTrainer


@pytest.mark.slow  # seconds: make test-fast leaves it out
@pytest.mark.parametrize("adapter", [
    {"adapter": "none", "lora": None},
    {"quantization": {"bits": 4}},
], ids=["full", "qlora"])
def test_full_and_qlora_reward_models_learn_and_reload(tmp_path, tiny_model, adapter):
    """Full fine-tuning saves model/ with its score head, QLoRA an adapter over the re-quantized base: both learn
    the preference, and `tunekit eval` reloads each to the accuracy the last evaluation of training logged."""
    raw = {**reward_raw(tiny_model, tmp_path), **adapter}
    raw = {k: v for k, v in raw.items() if v is not None}
    raw["training"]["learning_rate"] = 1e-3 if "quantization" not in raw else 5e-3
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    runner.run(recipe)
    result = evaluator.end_of_training(recipe, tmp_path / "run")
    assert logged(tmp_path / "run", "eval_accuracy")[-1] == result["scores"]["reward_accuracy"]
    assert result["scores"]["reward_accuracy"] >= 0.75, result["scores"]
    saved = tmp_path / "run" / ("model" if "quantization" not in raw else "adapter")
    assert loader.saved_with_score_head(saved)
    # QLoRA: merged into the re-quantized base with its score head; full: saved as it is, score head kept
    from tunekit.export.exporting import export

    out = export(str(tmp_path / "run"), out=tmp_path / "merged", format="safetensors", dtype="fp32")
    if "quantization" in raw:
        parity = json.loads((out / "tunekit.json").read_text())["parity"]
        assert parity["measure"] == "scores" and parity["max_abs_diff"] < 1e-3, parity
    model = AutoModelForSequenceClassification.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    rows = rewardmodel.scored_pairs(model, tok, recipe, evaluator.held_out_records(recipe), None, 4)
    assert rewardmodel.pair_scores(rows)["reward_accuracy"] == result["scores"]["reward_accuracy"]


@pytest.mark.slow
@pytest.mark.full
@NEEDS_SMOLLM2
def test_real_model_reward_run_ranks_held_out_pairs_well_above_chance(tmp_path):
    """recipes/smollm2_reward.yaml as shipped, on the real SmolLM2-135M-Instruct: its end-of-run `tunekit eval` scores
    the chosen answer above the rejected one on 90% or more of the 40 held-out pairs (chance: 50%; docs/methods.md:
    100%, mean margin 1.16), and the last evaluation during training logged that accuracy too."""
    run = tmp_path / "run"
    res = run_cli("train", "recipes/smollm2_reward.yaml", "--set", f"output_dir={run}", timeout=3600)
    assert res.returncode == 0, res.stderr[-3000:]
    scores = json.loads((run / "eval" / "metrics.json").read_text())["scores"]
    assert scores["examples"] == 40 and scores["reward_accuracy"] >= 0.9 and scores["reward_margin"] > 0.5, scores
    accuracies = [(h["step"], h["eval_accuracy"]) for h in history(run, "eval_accuracy")]
    assert [s for s, _ in accuracies] == [4, 8] and accuracies[-1][1] >= 0.9, accuracies
