"""tunekit plan under training.parallelism: sequence and context parallel divide a device's positions, tensor
parallel its share of the layers' matrices; the bytes each device sends per step, by hand; the layouts line for
the shipped long-context recipe."""

from __future__ import annotations

import dataclasses
import re

import pytest

from conftest import ROOT
from tunekit.plan import estimate, shapes, splitting


def planned(recipe, world, **changes):
    s = dataclasses.replace(estimate.settings_from(recipe, world, "bf16"), **changes)
    return estimate.make(recipe, s, versus=False)


def test_sequence_and_context_parallel_divide_a_devices_positions(plan_recipe):
    recipe = plan_recipe("training.deepspeed=" + str(ROOT / "ds_configs/zero2.json"))
    whole, sp = planned(recipe, 4), planned(recipe, 4, sp=4)
    assert sp.parts["activations"] == pytest.approx(whole.parts["activations"] / 4)
    assert sp.parts["logits and loss"] < whole.parts["logits and loss"]
    assert sp.parts["gradients (fp32)"] == whole.parts["gradients (fp32)"]  # the state is sharded as before
    assert sp.flops_per_step == pytest.approx(whole.flops_per_step / 4)
    cp = planned(recipe, 4, cp=2)
    assert cp.parts["activations"] == pytest.approx(whole.parts["activations"] / 2)


def test_tensor_parallel_splits_the_layers_matrices_and_their_activations(plan_recipe):
    recipe = plan_recipe("adapter=none", "lora=null")
    cfg, model = estimate.meta_model(recipe)
    share = splitting.split_share(model)
    h, inter, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    q, kv = shapes.q_width(cfg), shapes.kv_width(cfg)
    linear = layers * (2 * h * q + 2 * h * kv + 3 * h * inter) + vocab * h
    assert share == pytest.approx(linear / estimate.count(recipe, model).total)
    one, tp = planned(recipe, 2), planned(recipe, 2, tp=2)
    key = "optimizer (adamw_torch)"
    assert tp.parts[key] == pytest.approx(one.parts[key] * (share / 2 + 1 - share), rel=1e-6)
    # full fine-tuning in bf16: the norms (fp32 input, inverse RMS, normalised input) and the projections' 16-bit
    # casts of their whole inputs stay; attention's and the MLP's per-head and per-column tensors split
    whole = 2 * (4 * h + 4) + 2 * 4 * h + 5 * h * 2
    split = (2 * q + 2 * kv) * 2 + 4 * cfg.num_attention_heads + 4 * inter * 2
    assert tp.parts["activations"] / one.parts["activations"] == pytest.approx((whole + split / 2) / (whole + split))


def test_the_bytes_each_device_sends_per_step(plan_recipe):
    recipe = plan_recipe("adapter=none", "lora=null")
    cfg, _ = estimate.meta_model(recipe)
    h, layers, q, kv = cfg.hidden_size, cfg.num_hidden_layers, shapes.q_width(cfg), shapes.kv_width(cfg)
    tokens = 8 * 256  # micro-batch 8 x max_length, one accumulation step
    sent = planned(recipe, 2, tp=2).communication
    assert sent["tensor parallel 2: all-reduces of the row-split layers' outputs"] == pytest.approx(
        4 * layers * tokens * h * 2 * 2 * (2 - 1) / 2)  # 4 all-reduces a layer, bf16, a ring of 2
    sent = planned(plan_recipe(), 4, sp=2, zero_stage=2).communication
    pieces = tokens / 2
    assert sent["sequence parallel 2: all-to-alls around attention"] == pytest.approx(
        2 * layers * (2 * q + 2 * kv) * pieces * 2 * (2 - 1) / 2)
    assert "gradients all-reduced over 4 processes" in sent


def test_the_long_context_recipe_is_planned_with_each_layout(capsys):
    from tunekit.cli.main import main

    assert main(["plan", str(ROOT / "recipes/llama_long_sp.yaml"), "--world-size", "8", "--gpu-memory",
                 "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "split: sequence parallel 8: a device holds 4096 positions of each row" in out
    line = next(x for x in out.splitlines() if x.startswith("32768 tokens a row on 8 devices:"))
    found = re.findall(r"([\w\- ]+?) needs ([\d.]+) GiB", line.split(": ", 1)[1])
    need = {label.strip(): float(gib) for label, gib in found}
    assert set(need) == {"ZeRO-3 alone", "sp 8", "cp 8"}  # tp: full fine-tuning only
    assert need["sp 8"] < need["ZeRO-3 alone"] / 4
    assert "sent per step per device:" in out and "verdict: fits in 80.0 GiB" in out


# ---------------------------------------------------------------- the world size, as training checks it

ZERO2 = str(ROOT / "ds_configs" / "zero2.json")
SP = {"parallelism": {"sp": 2}, "deepspeed": ZERO2}
FULL = {"adapter": "none", "lora": None}

# case -> (recipe changes, training changes, the command after its recipe, what the one line says)
WORLD_REFUSED = {
    "sp 2 at world size 3": ({}, SP, ["--world-size", "3"],
                             "training.parallelism: tp x sp x cp = 2 does not divide --world-size 3; give --world-size "
                             "a multiple of 2"),
    "sp 4 at world size 1, below its group": ({}, {**SP, "parallelism": {"sp": 4}}, ["--world-size", "1"],
                                              "tp x sp x cp = 4 does not divide --world-size 1 (a parallel group "
                                              "needs 4); give --world-size a multiple of 4"),
    "cp 2 at world size 5": ({}, {"parallelism": {"cp": 2}, "fsdp": {}}, ["--world-size", "5"],
                             "tp x sp x cp = 2 does not divide --world-size 5"),
    "tp 2 x dp_shard 2 at world size 2": (FULL, {"parallelism": {"tp": 2, "dp_shard": 2}}, ["--world-size", "2"],
                                          "dp_replicate 1 x dp_shard 2 x tp 2 x cp 1 = 4 processes, but "
                                          "--world-size is 2; make the product 2"),
    "tp 2 at world size 3": (FULL, {"parallelism": {"tp": 2}}, ["--world-size", "3"],
                             "tp x sp x cp = 2 does not divide --world-size 3"),
    "a given config's heads tp does not divide": (FULL, {"parallelism": {"tp": 2}}, ["--model-config", "odd.json"],
                                                  "training.parallelism.tp 2 must divide --model-config odd.json's 3 "
                                                  "attention heads and 3 key/value heads"),
}


@pytest.fixture()
def parallel_recipe(tmp_path, tiny_model):
    from conftest import reverse_rows, tiny_recipe, write_jsonl, write_recipe

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))

    def make(sections: dict, training: dict) -> str:
        raw = tiny_recipe(tiny_model, data, tmp_path / "run", **sections)
        raw["training"] = {**raw["training"], **training}
        return str(write_recipe(tmp_path / "r.yaml", raw))
    return make


@pytest.mark.parametrize("case", WORLD_REFUSED)
def test_plan_refuses_a_world_size_training_would_refuse(case, parallel_recipe, tiny_model, tmp_path, capsys,
                                                         monkeypatch):
    import json

    from conftest import refused_in_process

    sections, training, rest, expected = WORLD_REFUSED[case]
    recipe = parallel_recipe(sections, training)
    config = json.loads((tiny_model / "config.json").read_text())
    (tmp_path / "odd.json").write_text(json.dumps({**config, "num_attention_heads": 3, "num_key_value_heads": 3,
                                                   "hidden_size": 48}))
    assert expected in refused_in_process(["plan", recipe, *rest], tmp_path, capsys, monkeypatch)
    if "--world-size" in rest:  # validate at the same world size refuses it alike
        assert expected in refused_in_process(["validate", recipe, *rest], tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("sections, training, fewest, described", [
    ({}, {**SP, "parallelism": {"sp": 4}}, 4, "sequence parallel 4 (DeepSpeed Ulysses)"),
    (FULL, {"parallelism": {"tp": 2, "dp_shard": 2}}, 4, "tensor parallel 2 (layers split), FSDP2 over 2"),
])
def test_plan_without_a_world_size_plans_the_fewest_processes_the_sizes_run_on(sections, training, fewest, described,
                                                                                 parallel_recipe, capsys):
    import logging

    from tunekit import api
    from tunekit.cli.main import main

    recipe = parallel_recipe(sections, training)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log, level = logging.getLogger("tunekit"), logging.getLogger("tunekit").level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        assert main(["plan", recipe]) == 0
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert f"per device: world size {fewest}," in capsys.readouterr().out
    said = [r.getMessage() for r in records if "--world-size left out" in r.getMessage()]
    assert len(said) == 1 and f"planned at {fewest}, the fewest processes training.parallelism runs on" in said[0]
    assert described in said[0]
    assert api.plan(recipe).plan.settings.world_size == fewest
    assert api.plan(recipe, world_size=fewest).plan.settings.world_size == fewest
