"""tunekit plan: exact parameter counts, ZeRO arithmetic, 4-bit bytes, suggestions that help."""

from __future__ import annotations

import dataclasses

import bitsandbytes as bnb
import pytest
import torch

from conftest import run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.models import loading as models
from tunekit.plan import estimate as plan
from tunekit.config import loading as recipe_mod
from tunekit.core.hardware import Precision


@pytest.fixture()
def make_recipe(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])

    def _make(*overrides):
        raw = tiny_recipe(tiny_model, data, tmp_path / "run")
        return recipe_mod.load(write_recipe(tmp_path / "r.yaml", raw), list(overrides))
    return _make


@pytest.mark.parametrize("overrides", [[], ["adapter=qlora"], ["adapter=none", "lora=null"],
                                       ["lora.target_modules=[q_proj, v_proj]", "lora.r=4"]])
def test_parameter_counts_match_the_built_model(make_recipe, overrides):
    recipe = make_recipe(*overrides)
    _, meta = plan.meta_model(recipe)
    assert {p.device.type for p in meta.parameters()} == {"meta"}  # planned without any weights
    counts = plan.count(recipe, meta)
    built = models.load_for_training(recipe, Precision("fp32", "test"))
    total, trainable = models.count_parameters(built)
    assert (counts.total, counts.trainable) == (total, trainable)
    if recipe.quantization is not None:
        quantized = sum(m.weight.numel() * 2 for m in built.modules() if isinstance(m, bnb.nn.Linear4bit))
        assert counts.quantized == quantized


def test_four_bit_bytes_by_hand_and_against_bitsandbytes(make_recipe):
    n = 64 * 256 * 4
    assert plan.quantized_bytes(n, 4, double_quant=False) == n / 2 + (n / 64) * 4
    assert plan.quantized_bytes(n, 4, double_quant=True) == n / 2 + (n / 64) * (1 + 4 / 256)
    recipe = make_recipe("adapter=qlora", "quantization.double_quant=false")
    built = models.load_for_training(recipe, Precision("fp32", "test"))
    actual = 0
    for m in built.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            actual += m.weight.numel() * m.weight.element_size() + m.weight.quant_state.absmax.numel() * 4
    counts = plan.count(recipe, plan.meta_model(recipe)[1])
    assert plan.quantized_bytes(counts.quantized, 4, False) == pytest.approx(actual, rel=1e-6)


def test_zero_stages_divide_the_right_parts(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null")
    cfg, model = plan.meta_model(recipe)
    base = plan.Settings(world_size=4, micro_batch=2, seq_len=64, precision="fp32")
    p0 = plan.make(recipe, base, cfg, model)
    opt, grads, weights = "optimizer (adamw_torch)", "gradients (fp32)", "weights (trainable, fp32)"
    p1 = plan.make(recipe, dataclasses.replace(base, zero_stage=1), cfg, model)
    p2 = plan.make(recipe, dataclasses.replace(base, zero_stage=2), cfg, model)
    p3 = plan.make(recipe, dataclasses.replace(base, zero_stage=3), cfg, model)
    assert p0.parts[opt] == p0.counts.trainable * 8 and p0.parts[grads] == p0.counts.trainable * 4
    assert p1.parts[opt] == p0.parts[opt] // 4 and p1.parts[grads] == p0.parts[grads]
    assert p2.parts[grads] == p0.parts[grads] // 4 and p2.parts[weights] == p0.parts[weights]
    assert p3.parts[weights] == p0.parts[weights] // 4
    off = plan.make(recipe, dataclasses.replace(base, zero_stage=3, offload_optimizer=True, offload_params=True),
                    cfg, model)
    assert opt not in off.parts and weights not in off.parts
    assert off.cpu_bytes == pytest.approx(p3.parts[opt] + p3.parts[weights], abs=2)
    assert p0.peak > p1.peak > p2.peak > p3.peak > off.peak


def test_deepspeed_mixed_precision_keeps_fp32_masters_with_the_optimizer(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null")
    cfg, model = plan.meta_model(recipe)
    s = plan.Settings(world_size=2, micro_batch=1, seq_len=32, precision="bf16", zero_stage=2)
    p = plan.make(recipe, s, cfg, model)
    n = p.counts.trainable
    assert p.parts["weights (trainable, bf16)"] == n * 2
    assert p.parts["master weights (fp32, in the optimizer)"] == n * 4 // 2
    off = plan.make(recipe, dataclasses.replace(s, offload_optimizer=True), cfg, model)
    assert "master weights (fp32, in the optimizer)" not in off.parts and off.cpu_bytes == n * 4 // 2 + n * 8 // 2


def test_checkpointing_and_flops(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null")
    cfg, model = plan.meta_model(recipe)
    s = plan.Settings(micro_batch=4, seq_len=128, precision="fp32")
    p = plan.make(recipe, s, cfg, model)
    assert p.flops_per_step == pytest.approx(6 * p.counts.total * 4 * 128)
    ckpt = plan.make(recipe, dataclasses.replace(s, gradient_checkpointing=True), cfg, model)
    assert (ckpt.parts["activations (checkpointed: layer inputs)"] + ckpt.parts["activations (one layer recomputed)"]
            < p.parts["activations"])
    assert ckpt.peak < p.peak
    assert ckpt.flops_per_step == pytest.approx(8 * p.counts.total * 4 * 128)


def test_suggestions_each_lower_the_planned_peak(make_recipe):
    recipe = make_recipe("training.micro_batch_size=8", "data.max_length=512")
    cfg, model = plan.meta_model(recipe)
    p = plan.make(recipe, plan.Settings(world_size=2, micro_batch=8, seq_len=512, precision="fp32"), cfg, model)
    fixes = plan.suggestions(recipe, p, p.peak // 2, cfg, model)
    labels = [label for label, _ in fixes]
    assert any("gradient_checkpointing" in x for x in labels) and any("micro_batch_size=4" in x for x in labels)
    assert all(fp.peak < p.peak for _, fp in fixes)


@pytest.mark.slow
def test_plan_cli_verdict(make_recipe, tmp_path):
    make_recipe()
    res = run_cli("plan", str(tmp_path / "r.yaml"), "--gpu-memory", "1MiB", "--world-size", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "verdict: does NOT fit in 0.0 GiB" in res.stdout and "gradient_checkpointing=true" in res.stdout
    ok = run_cli("plan", str(tmp_path / "r.yaml"), "--gpu-memory", "80GiB")
    assert "verdict: fits" in ok.stdout and "parameters: " in ok.stdout
    assert plan.parse_size("24GiB") == 24 * 1024**3 and plan.parse_size("512M") == 512 * 1024**2


def test_gradients_and_activations_are_not_live_together_in_one_process(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null")
    cfg, model = plan.meta_model(recipe)
    s = plan.Settings(micro_batch=2, seq_len=64, precision="fp32")
    p = plan.make(recipe, s, cfg, model)
    forward = p.parts["activations"] + p.parts["logits and loss"]
    backward = p.parts["gradients (fp32)"]
    held = p.parts["weights (trainable, fp32)"] + p.parts["optimizer (adamw_torch)"]
    assert p.peak == held + max(forward, backward)
    # accumulation keeps gradients across micro-batches, and several processes keep them in buckets
    for other in (dataclasses.replace(s, accumulation=2), dataclasses.replace(s, world_size=2)):
        q = plan.make(recipe, other, cfg, model)
        assert q.peak == held + forward + backward


def test_a_trained_tied_head_counts_its_gradient_accumulation(make_recipe):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    full = make_recipe("adapter=none", "lora=null")
    assert plan.count(full, model).tied_trainable_head == 500 * 32
    p = plan.make(full, plan.Settings(seq_len=16, precision="fp32"), cfg, model)
    assert p.parts["gradient of the tied head, accumulating"] == 2 * 500 * 32 * 4
    lora = make_recipe()
    assert plan.count(lora, model).tied_trainable_head == 0  # a frozen head gets no gradient


def test_dpo_plans_two_sequences_per_pair_a_reference_forward_and_the_stock_loss(make_recipe):
    sft = make_recipe("data.format=preference")
    dpo = make_recipe("data.format=preference", "training.method=dpo")
    cfg, model = plan.meta_model(sft)
    settings = [plan.settings_from(r, 1, "fp32") for r in (sft, dpo)]
    assert (settings[0].sequences, settings[1].sequences) == (1, 2) and settings[1].extra_forwards == 1
    one, two = (plan.make(r, s, cfg, model) for r, s in zip((sft, dpo), settings))
    assert two.parts["activations"] == pytest.approx(2 * one.parts["activations"])
    stock = plan.loss_path_bytes(cfg, settings[1], dpo, chunked=False)
    assert two.parts["logits and loss"] == pytest.approx(stock)  # TRL computes log-probs from full logits
    pair_tokens = 8 * 2 * 64  # micro-batch 8, max_length 64
    assert two.flops_per_step == pytest.approx(2 * one.flops_per_step + 2 * one.counts.total * pair_tokens)
