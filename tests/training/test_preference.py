"""training.method: dpo: recipe checks, pairs tokenized exactly as SFT renders them, and a DPO run on the
tiny model that learns the preference with the adapter-off base as its reference."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import history, in_full, logged, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.core.errors import TunekitError
from tunekit.data.formats import Record
from tunekit.data.reading import read_records
from tunekit.data.rendering import Renderer
from tunekit.data.tokenizing import IGNORE, tokenize
from tunekit.evaluation import evaluator
from tunekit.models import loader
from tunekit.runs.layout import RunRecord
from tunekit.training import methods, runner
from tunekit.training.methods import pairs as pairs_mod

WORDS = ["catfish", "dogduck", "birddog", "fishbear", "lioncrab", "wolflion", "bearcat", "crabfish"]


def pairs(n_repeat=4):
    return [{"prompt": f"Reverse the word.\n\n{w}", "chosen": w[::-1], "rejected": w} for w in WORDS * n_repeat]


def dpo_raw(tiny_model, data, out, **training):
    raw = tiny_recipe(tiny_model, data, out, training={"method": "dpo", "max_steps": 12, "learning_rate": 5e-3,
                                                         "eval_steps": 6, **training})
    raw["data"]["format"] = "preference"
    return raw


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(dpo={"beta": 0.2}) or r["training"].update(method="sft"),
     "dpo: these settings belong to training.method dpo"),
    (lambda r: r["data"].update(format="alpaca"), "training.method: dpo trains on (prompt, chosen, rejected) pairs"),
    (lambda r: r.update(dpo={"loss_type": "sigmoidd"}), "dpo.loss_type"),
    (lambda r: r["lora"].update(init="pissa"), "lora.init=pissa"),
    (lambda r: r.update(orpo={"beta": 0.2}), "orpo: these settings belong to training.method orpo"),
    (lambda r: r["training"].update(method="orpo") or r.update(orpo={"loss_type": "sigmoid"}), "orpo.loss_type"),
])
def test_recipe_checks_name_the_method(tmp_path, tiny_model, change, message):
    raw = dpo_raw(tiny_model, write_jsonl(tmp_path / "p.jsonl", pairs(1)), tmp_path / "run")
    change(raw)
    with pytest.raises(TunekitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        recipefile.load(write_recipe(tmp_path / "r.yaml", raw))


def test_pairs_are_tokenized_exactly_as_sft_renders_them(tmp_path, tiny_model):
    """The prompt ids are the SFT example's masked prefix, and each answer's ids are exactly the tokens SFT
    trains when that answer is the target: DPO's loss falls on the same tokens as SFT's."""
    data = write_jsonl(tmp_path / "p.jsonl", pairs(1))
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", dpo_raw(tiny_model, data, tmp_path / "run")))
    tok = loader.load_tokenizer(recipe.model)
    renderer = Renderer(recipe.data, tok)
    for record in read_records(str(data), "train", "data.train"):
        pair = pairs_mod.tokenize_pair(record, renderer, tok)
        for answer in ("chosen", "rejected"):
            as_sft = Record({**record.values, "chosen": record.values[answer]}, record.where)
            ex, _ = tokenize(renderer.render(as_sft), tok, 10**6, mask_prompt=True)
            trained = [i for i, label in zip(ex.input_ids, ex.labels) if label != IGNORE]
            n = len(pair["prompt_ids"]) + len(pair[f"{answer}_ids"])
            assert ex.input_ids[:n] == pair["prompt_ids"] + pair[f"{answer}_ids"]
            assert pair[f"{answer}_ids"] == trained and tok.decode(ex.input_ids[n:]).strip() == ""
        assert tok.decode(pair["chosen_ids"]).startswith(record.values["chosen"])


def test_a_malformed_pair_is_named_by_file_and_line(tmp_path, tiny_model):
    rows = pairs(1)
    del rows[2]["rejected"]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", dpo_raw(tiny_model, data, tmp_path / "run")))
    with pytest.raises(TunekitError, match=r"p.jsonl line 3: missing field 'rejected'"):
        runner.run(recipe)


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_dpo_learns_the_preference_against_the_adapter_off_base(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "p.jsonl", pairs())
    raw = dpo_raw(tiny_model, data, tmp_path / "run")
    raw["data"]["eval"] = str(data)
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    result = runner.run(recipe)
    evals = history(tmp_path / "run", "eval_loss")
    assert evals[0]["eval_loss"] < 0.6931  # below log 2: the policy already separates the pair
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[-1]["eval_rewards/accuracies"] == 1.0 and evals[-1]["eval_rewards/margins"] > 0
    record = RunRecord.load(tmp_path / "run")
    assert record.training_method == "dpo" and record.data["train"]["examples"] == len(pairs())
    # the reference is the base: no reference adapter is held or saved, and the base weights did not move
    model = result.trainer.model
    assert list(model.peft_config) == ["default"]
    saved = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    base = load_file(str(tiny_model / "model.safetensors"))
    current = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
               for k, v in model.state_dict().items() if "lora_" not in k}
    for name, weight in base.items():
        assert torch.equal(current[name].to(weight.dtype), weight), name
    assert not list((tmp_path / "run").rglob("*.pt")) and not list((tmp_path / "run").rglob("*.bin"))


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_dpo_run_scores_generations_while_training_and_its_measures_reach_metrics_json(tmp_path, tiny_model):
    """With an eval section, a DPO run logs generation metrics at each evaluation; its end-of-run eval
    (metrics.json) carries reward accuracy and margin, equal to TRL's own on the same held-out pairs and
    weights; the run merges with parity."""
    from tunekit.export import merge

    data = write_jsonl(tmp_path / "p.jsonl", pairs())
    raw = dpo_raw(tiny_model, data, tmp_path / "run", eval_steps=12)
    raw["data"]["eval"] = str(data)
    raw["eval"] = {"batch_size": 8, "max_new_tokens": 8}
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    runner.run(recipe)
    evaluator.end_of_training(recipe, tmp_path / "run")  # as `tunekit train` ends
    last = history(tmp_path / "run", "eval_loss")[-1]
    assert last["step"] == 12 and {"eval_bleu", "eval_chrf", "eval_rougeL", "eval_exact_match"} <= set(last)
    scores = json.loads((tmp_path / "run" / "eval" / "metrics.json").read_text())["scores"]
    assert scores["preference_pairs"] == len(pairs())
    assert scores["reward_accuracy"] == last["eval_rewards/accuracies"] == 1.0
    assert scores["reward_margin"] == pytest.approx(last["eval_rewards/margins"], rel=1e-3)
    merged = merge.merge(tmp_path / "run")
    info = json.loads((merged / "tunekit.json").read_text())
    assert info["parity"]["top1_agreement"] == 1.0


def test_a_base_model_that_prefers_the_rejected_answers_scores_low(tmp_path, tiny_model):
    """Measures without an adapter: only the model's own preference, here checked against summed
    log-probabilities computed by hand."""
    data = write_jsonl(tmp_path / "p.jsonl", pairs(1))
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", dpo_raw(tiny_model, data, tmp_path / "run")))
    tok = loader.load_tokenizer(recipe.model)
    model = loader.load_base(recipe.model, torch.float32)
    records = read_records(str(data), "train", "data.train")
    scores = methods.of(recipe).measures(model, tok, recipe, records, None, 3)
    assert "reward_accuracy" not in scores and scores["preference_pairs"] == len(WORDS)
    renderer = Renderer(recipe.data, tok)
    wins = 0
    for record in records:
        pair = pairs_mod.tokenize_pair(record, renderer, tok)
        sums = []
        for side in ("chosen", "rejected"):
            ids = torch.tensor([pair["prompt_ids"] + pair[f"{side}_ids"]])
            logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            start = len(pair["prompt_ids"])
            sums.append(sum(logps[i - 1, ids[0, i]].item() for i in range(start, ids.shape[1])))
        wins += sums[0] > sums[1]
    assert scores["preference_accuracy"] == wins / len(WORDS)


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_dpo_continues_an_sft_run_against_that_run_as_reference(tmp_path, tiny_model):
    """model.adapter_from: SFT on the chosen answers, then DPO from that adapter. The reference is the SFT model
    (TRL's frozen copy kept), so the first DPO loss is exactly log 2; only the trained adapter is saved, and
    run.json names the run it started from."""
    data = write_jsonl(tmp_path / "p.jsonl", pairs())
    sft = dpo_raw(tiny_model, data, tmp_path / "sft", method="sft", max_steps=6, eval_steps=None)
    runner.run(recipefile.load(write_recipe(tmp_path / "sft.yaml", sft)))
    raw = dpo_raw(tiny_model, data, tmp_path / "dpo", max_steps=3, eval_steps=None)
    raw["model"]["adapter_from"] = str(tmp_path / "sft")
    result = runner.run(recipefile.load(write_recipe(tmp_path / "dpo.yaml", raw)))
    losses = logged(tmp_path / "dpo", "loss")
    assert losses[0] == pytest.approx(0.693147, abs=1e-5)  # policy == reference at the start
    model = result.trainer.model
    assert not [n for n, p in model.named_parameters() if p.requires_grad and ".ref." in n]
    start, end = final_adapter(tmp_path / "sft"), final_adapter(tmp_path / "dpo")
    assert start.keys() == end.keys() and not (tmp_path / "dpo" / "adapter" / "ref").exists()
    assert any(not torch.equal(start[k], end[k]) for k in start)
    record = RunRecord.load(tmp_path / "dpo").adapter_from
    assert record["run"] == str((tmp_path / "sft").resolve()) and record["training_method"] == "sft"
    assert record["global_step"] == 6
    raw.update(output_dir=str(tmp_path / "other"), lora={**raw["lora"], "r": 4})
    with pytest.raises(TunekitError, match=r"lora.r=4 but the adapter in .*sft has r 8; set lora.r: 8"):
        runner.run(recipefile.load(write_recipe(tmp_path / "other.yaml", raw)))
    raw.update(lora={**raw["lora"], "r": 8, "use_rslora": True})  # the saved config would win: refused, not ignored
    with pytest.raises(TunekitError, match=r"lora.use_rslora=True but the adapter in .*sft has use_rslora false; "
                                           r"set lora.use_rslora: false"):
        runner.run(recipefile.load(write_recipe(tmp_path / "other.yaml", raw)))


@pytest.mark.parametrize("change, message", [
    (lambda r, t: r["model"].update(adapter_from=str(t)), "not a tunekit run directory"),
    (lambda r, t: r["model"].update(adapter_from=str(t / "nope")), "model.adapter_from .*nope: no such directory"),
])
def test_adapter_from_must_be_a_finished_lora_run(tmp_path, tiny_model, change, message):
    raw = dpo_raw(tiny_model, write_jsonl(tmp_path / "p.jsonl", pairs(1)), tmp_path / "run")
    change(raw, tmp_path)
    with pytest.raises(TunekitError, match=message):
        runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_full_finetuning_dpo_trains_against_a_frozen_reference_copy(tmp_path, tiny_model):
    """adapter: none: a second, frozen copy of the base is the reference; it stays equal to the base while the
    trained model moves, the preference is learned, and `tunekit plan` counts the copy."""
    data = write_jsonl(tmp_path / "p.jsonl", pairs())
    raw = dpo_raw(tiny_model, data, tmp_path / "run", max_steps=6, eval_steps=6, learning_rate=1e-3)
    raw.update(adapter="none", lora=None)
    raw["data"]["eval"] = str(data)
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    result = runner.run(recipe)
    last = history(tmp_path / "run", "eval_loss")[-1]
    assert last["eval_rewards/accuracies"] == 1.0 and last["eval_loss"] < 0.6931
    base = load_file(str(tiny_model / "model.safetensors"))
    ref = result.trainer.ref_model.state_dict()
    trained = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    assert all(torch.equal(ref[k].to(v.dtype), v) for k, v in base.items())
    assert any(not torch.equal(trained[k], v) for k, v in base.items() if k in trained)
    from tunekit.plan import estimate

    settings = estimate.settings_from(recipe, 1, "fp32")
    cfg, meta = estimate.meta_model(recipe)
    planned = estimate.make(recipe, settings, cfg, meta)
    assert planned.parts["weights (frozen reference copy, fp32)"] == planned.counts.total * 4


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_orpo_learns_the_preference_without_a_reference(tmp_path, tiny_model):
    """training.method: orpo on the DPO pairs: no reference model or adapter copy, the base stays unchanged,
    the chosen answers' likelihood and the odds ratio rise on held-out pairs, and the SFT term of the loss
    covers exactly the chosen answer tokens (equal to the stock SFT loss on those rows)."""
    data = write_jsonl(tmp_path / "p.jsonl", pairs())
    raw = dpo_raw(tiny_model, data, tmp_path / "run", method="orpo")
    raw["data"]["eval"] = str(data)
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    assert recipe.orpo.beta == 0.1 and recipe.dpo is None
    result = runner.run(recipe)
    first, last = (evals := history(tmp_path / "run", "eval_loss"))[0], evals[-1]
    assert last["eval_loss"] < first["eval_loss"] and last["eval_nll_loss"] < first["eval_nll_loss"]
    assert last["eval_log_odds_ratio"] > first["eval_log_odds_ratio"] and last["eval_rewards/accuracies"] == 1.0
    assert RunRecord.load(tmp_path / "run").training_method == "orpo"
    trainer = result.trainer
    assert list(trainer.model.peft_config) == ["default"] and not hasattr(trainer, "ref_model")
    base = load_file(str(tiny_model / "model.safetensors"))
    current = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
               for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(current[k].to(v.dtype), v) for k, v in base.items())

    batch = trainer._prepare_inputs(trainer.data_collator([trainer.eval_dataset[i] for i in (0, 3)]))
    with torch.no_grad():
        nll = trainer.concatenated_forward(trainer.model, batch)[4]
        stock = trainer.model(input_ids=batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"],
                              labels=batch["chosen_labels"]).loss
    torch.testing.assert_close(nll, stock)
    answer = batch["chosen_labels"] != IGNORE
    assert answer.sum() == sum(len(trainer.eval_dataset[i]["chosen_ids"]) for i in (0, 3))


def unpaired_rows(n_repeat=4):
    from tunekit.data.demodata import unpaired

    return unpaired(pairs(n_repeat))


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_kto_learns_desirable_completions_from_unpaired_labels(tmp_path, tiny_model):
    """training.method: kto on (prompt, completion, label) rows: the desirable completions' rewards rise above
    the undesirable ones' on held-out rows, generation metrics score against desirable completions only, and
    the adapter-off base is the reference."""
    data = write_jsonl(tmp_path / "u.jsonl", unpaired_rows())
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"method": "kto", "max_steps": 12,
                                                                      "learning_rate": 5e-3, "eval_steps": 6})
    raw["data"].update(format="unpaired_preference", eval=str(data))
    raw["eval"] = {"batch_size": 8, "max_new_tokens": 8}
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    assert recipe.kto.beta == 0.1 and recipe.dpo is None
    result = runner.run(recipe)
    first, last = (evals := history(tmp_path / "run", "eval_loss"))[0], evals[-1]
    assert last["eval_loss"] < first["eval_loss"]
    assert last["eval_rewards/margins"] > first["eval_rewards/margins"] > 0
    assert last["eval_rewards/chosen"] > 0 > last["eval_rewards/rejected"]
    assert list(result.trainer.model.peft_config) == ["default"]
    assert "eval_chrf" in last
    record = RunRecord.load(tmp_path / "run")
    assert record.training_method == "kto" and record.data["train"]["examples"] == len(unpaired_rows())
    records = read_records(str(data), "train", "data.train")
    rendered = evaluator.rendered_examples(recipe, loader.load_tokenizer(recipe.model), records, recipe.eval)
    assert [r.reference for r in rendered] == [row["completion"] for row in unpaired_rows() if row["label"]]


@pytest.mark.parametrize("change, message", [
    (lambda r: r["training"].update(method="sft"), "data.format: unpaired_preference is training data for "
                                                   "training.method kto"),
    (lambda r: r.update(dpo={"beta": 0.2}), "dpo: these settings belong to training.method dpo"),
    (lambda r: r["training"].update(micro_batch_size=1), "training.micro_batch_size: KTO's loss kto"),
    (lambda r: r.update(kto={"loss_type": "sigmoid"}), "kto.loss_type"),
])
def test_kto_recipe_checks(tmp_path, tiny_model, change, message):
    raw = tiny_recipe(tiny_model, tmp_path / "u.jsonl", tmp_path / "run", training={"method": "kto"})
    raw["data"]["format"] = "unpaired_preference"
    change(raw)
    with pytest.raises(TunekitError, match=message):
        recipefile.load(write_recipe(tmp_path / "r.yaml", raw))


def test_unpaired_rows_need_a_boolean_label(tmp_path, tiny_model):
    rows = unpaired_rows(1)
    rows[3]["label"] = "yes"
    data = write_jsonl(tmp_path / "u.jsonl", rows)
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"method": "kto"})
    raw["data"]["format"] = "unpaired_preference"
    with pytest.raises(TunekitError, match=r"u.jsonl line 4: field 'label' must be true or false"):
        runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))


def final_adapter(run_dir):
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def method_raw(method, tiny_model, tmp_path, out, **training):
    """A 12-step tiny-model recipe for `method` on the word pairs (unpaired for KTO)."""
    if method != "kto":
        return dpo_raw(tiny_model, write_jsonl(tmp_path / "p.jsonl", pairs()), out, method=method, **training)
    raw = dpo_raw(tiny_model, write_jsonl(tmp_path / "u.jsonl", unpaired_rows()), out, method=method, **training)
    raw["data"]["format"] = "unpaired_preference"
    return raw


@pytest.mark.slow
# one trainer path (training/methods/pairs.py): make test resumes DPO; KTO and ORPO are `full`
@pytest.mark.parametrize("method", ["dpo", in_full("kto"), in_full("orpo")])
def test_resume_after_a_kill_ends_where_the_uninterrupted_run_ends(tmp_path, tiny_model, method):
    """A run cut after its step-6 checkpoint and resumed (original deleted) gives the same adapter."""
    import shutil

    from conftest import assert_no_pickles, cut_after_checkpoint, run_cli

    full = tmp_path / "full"
    raw = method_raw(method, tiny_model, tmp_path, full, save_steps=6)
    runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    expected = final_adapter(full)
    cut = cut_after_checkpoint(full, tmp_path / "cut", 6)
    shutil.rmtree(full)
    res = run_cli("train", str(cut / "recipe.yaml"), "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from checkpoint-6" in res.stderr
    got = final_adapter(cut)
    assert got.keys() == expected.keys()
    for k in got:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)
    assert_no_pickles(cut)


@pytest.mark.slow
@pytest.mark.parametrize("method, sharding", [
    # make test: ORPO under DDP with the rate found; DPO, ZeRO-2 and FSDP2 are `full` (one trainer path)
    in_full("dpo", None, id="dpo-ddp"),
    in_full("dpo", {"deepspeed": "ds_configs/zero2.json", "learning_rate": "auto"}, id="dpo-zero2-lr-auto"),
    in_full("dpo", {"fsdp": {}, "learning_rate": "auto"}, id="dpo-fsdp2-lr-auto"),
    pytest.param("orpo", {"learning_rate": "auto"}, id="orpo-ddp-lr-auto"),
    in_full("orpo", {"fsdp": {}}, id="orpo-fsdp2")])
def test_two_processes_train_as_one_does(tmp_path, tiny_model, method, sharding):
    """2-process DDP (and ZeRO-2, FSDP2) with micro-batch 4 against one process with micro-batch 8: the same pairs
    per step, so the same losses and adapter within float tolerance. Under DDP, ZeRO-2 and FSDP2 both find their
    learning rate (training.learning_rate: auto): the ranks' gradients are averaged, and under ZeRO-2 and FSDP2
    each rank updates its own shard at its rate, so a rank at another rate would show in the adapter. (KTO is
    left out: its KL term pairs each example with its micro-batch neighbours, so halving the micro-batch changes
    the loss by design; it runs under FSDP2 in test_kto_trains_under_fsdp2.)"""
    from conftest import launch

    data = write_jsonl(tmp_path / "p.jsonl", pairs())
    single = tmp_path / "single"
    rate = {k: v for k, v in (sharding or {}).items() if k == "learning_rate"}
    raw = dpo_raw(tiny_model, data, single, max_steps=4, eval_steps=None, method=method, **rate)
    runner.run(recipefile.load(write_recipe(tmp_path / "one.yaml", raw)))
    raw = dpo_raw(tiny_model, data, tmp_path / "two", max_steps=4, eval_steps=None, micro_batch_size=4,
                  method=method, **(sharding or {}))
    res = launch(write_recipe(tmp_path / "two.yaml", raw), tmp_path / "two", 2)
    deepspeed = "deepspeed" in (sharding or {})
    assert ("deepspeed: " in res.stderr) == (tmp_path / "two" / "deepspeed.json").is_file() == deepspeed
    assert ("fsdp: FSDP2" in res.stderr) == ("fsdp" in (sharding or {}))
    records = [RunRecord.load(d) for d in (single, tmp_path / "two")]
    assert records[1].world_size == 2
    if (sharding or {}).get("learning_rate") == "auto":  # the range test's losses too are those of one process
        assert records[1].learning_rate["value"] == pytest.approx(records[0].learning_rate["value"], rel=1e-6)
    losses = [logged(d, "loss") for d in (single, tmp_path / "two")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    one, two = final_adapter(single), final_adapter(tmp_path / "two")
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-3, atol=1e-4)


@pytest.mark.slow
@pytest.mark.full
def test_kto_trains_under_fsdp2(tmp_path, tiny_model):
    """KTO under two FSDP2 processes: it trains (the loss falls) and its adapter is saved whole."""
    from conftest import launch

    raw = method_raw("kto", tiny_model, tmp_path, tmp_path / "two", max_steps=6, eval_steps=None, micro_batch_size=4,
                     fsdp={})
    res = launch(write_recipe(tmp_path / "two.yaml", raw), tmp_path / "two", 2)
    assert "fsdp: FSDP2" in res.stderr
    losses = logged(tmp_path / "two", "loss")
    assert losses[-1] < losses[0]
    adapter = final_adapter(tmp_path / "two")
    base = {k: v for k, v in adapter.items() if "lora_A" in k}
    assert base and all(v.shape[0] == 8 for v in base.values())  # rank 8, gathered from both shards


@pytest.mark.slow
@pytest.mark.parametrize("method", ["kto", "orpo"])
def test_kto_and_orpo_find_their_learning_rate_by_the_range_test(tmp_path, tiny_model, method):
    """training.learning_rate: auto through the method's own trainer and loss (DPO's case runs under ZeRO-2 in
    test_two_processes_train_as_one_does): the run trains at the rate the test found and records its curve."""
    raw = method_raw(method, tiny_model, tmp_path, tmp_path / "run", learning_rate="auto", max_steps=2,
                     lr_range_test_steps=8, eval_steps=None)
    result = runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    found = RunRecord.load(result.run_dir).learning_rate
    assert result.trainer.args.learning_rate == pytest.approx(found["value"])
    assert len(found["curve"]) == found["steps"] and found["curve"][0]["lr"] == pytest.approx(1e-5)
    assert all(math.isfinite(p["loss"]) and p["loss"] > 0 for p in found["curve"][:2])  # the method's own loss


@pytest.mark.slow
def test_loraplus_applies_to_the_preference_trainers(tmp_path, tiny_model):
    """lora.lr_ratio (LoRA+) builds the optimizer of every method's trainer (runner.build_trainer sets it on each
    alike), not only SFT's: DPO's with the B matrices at 16 x the rate."""
    raw = method_raw("dpo", tiny_model, tmp_path, tmp_path / "run", max_steps=1, eval_steps=None)
    raw["lora"] = {**(raw.get("lora") or {}), "lr_ratio": 16}
    result = runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    groups = [g for g in result.trainer.optimizer.param_groups if g["params"]]
    rate = result.trainer.args.learning_rate
    assert sorted({g["initial_lr"] for g in groups}) == pytest.approx([rate, 16 * rate])
    names = {id(p): n for n, p in result.trainer.model.named_parameters()}
    fast = [names[id(p)] for g in groups if g["initial_lr"] > rate * 2 for p in g["params"]]
    assert fast and all("lora_B" in n for n in fast)
