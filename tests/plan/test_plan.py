"""tunekit plan: exact parameter counts, ZeRO arithmetic, 4-bit bytes, suggestions that help; FSDP2's
sharded and gathered terms (checked against torch's FSDPMemTracker) and the verdict of FSDP2 against ZeRO-3."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch

from conftest import run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.core.hardware import Precision
from tunekit.models import loader
from tunekit.plan import activations, estimate, fixes, modelstate, report, sizes


@pytest.fixture()
def make_recipe(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])

    def _make(*overrides):
        raw = tiny_recipe(tiny_model, data, tmp_path / "run")
        return recipefile.load(write_recipe(tmp_path / "r.yaml", raw), list(overrides))
    return _make


@pytest.mark.parametrize("overrides", [[], ["adapter=qlora"], ["adapter=none", "lora=null"],
                                       ["lora.target_modules=[q_proj, v_proj]", "lora.r=4"]])
def test_parameter_counts_match_the_built_model(make_recipe, overrides):
    recipe = make_recipe(*overrides)
    _, meta = estimate.meta_model(recipe)
    assert {p.device.type for p in meta.parameters()} == {"meta"}  # planned without any weights
    counts = estimate.count(recipe, meta)
    built = loader.load_for_training(recipe, Precision("fp32", "test"))
    total, trainable = loader.count_parameters(built)
    assert (counts.total, counts.trainable) == (total, trainable)
    if recipe.quantization is not None:
        quantized = sum(m.weight.numel() * 2 for m in built.modules() if isinstance(m, bnb.nn.Linear4bit))
        assert counts.quantized == quantized


@pytest.mark.parametrize("overrides", [[], ["adapter=qlora"], ["adapter=none", "lora=null"]])
def test_a_vision_language_model_is_planned_as_it_loads(tmp_path, tiny_vision_model, overrides):
    """Built as training builds it (AutoModelForImageTextToText, LoRA on the language model, the projector trained
    in full): the same parameters, trainable ones and 4-bit ones (the tower and projector stay unquantized); the
    activations planned from the language model's config; the report names the tower and projector."""
    from conftest import colour_rows

    data = write_jsonl(tmp_path / "d.jsonl", colour_rows(tmp_path / "img", 2))
    raw = tiny_recipe(tiny_vision_model, data, tmp_path / "run", data={"format": "chat"},
                      vision={"train_projector": True})
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw), overrides)
    cfg, meta = estimate.meta_model(recipe)
    assert cfg.model_type == "llama" and {p.device.type for p in meta.parameters()} == {"meta"}
    counts = estimate.count(recipe, meta)
    built = loader.load_for_training(recipe, Precision("fp32", "test"))
    assert (counts.total, counts.trainable) == loader.count_parameters(built)
    quantized = sum(m.weight.numel() * 2 for m in built.modules() if isinstance(m, bnb.nn.Linear4bit))
    assert counts.quantized == quantized and (quantized > 0) == (recipe.quantization is not None)
    plan = estimate.make(recipe, estimate.settings_from(recipe, 1, "fp32"), cfg, meta)
    assert plan.vision.startswith("vision: tower ") and "projector" in plan.vision
    assert plan.vision in report.text(recipe, plan, None, [])


def test_the_vision_tower_runs_on_patches_not_on_text_tokens(tmp_path, tiny_vision_model, monkeypatch):
    """The tower's and projector's FLOPs: 2 per weight and patch forward (one image per example, patches from
    the tower's image size), 4 more for those that train; none of their weights counted on the text's tokens."""
    from conftest import colour_rows
    from tunekit.models import vision

    data = write_jsonl(tmp_path / "d.jsonl", colour_rows(tmp_path / "img", 2))
    raw = tiny_recipe(tiny_vision_model, data, tmp_path / "run", data={"format": "chat"},
                      vision={"train_projector": True})
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    cfg, meta = estimate.meta_model(recipe)
    work = vision.image_work(meta)
    found = vision.parts(meta)
    base = meta.get_base_model()
    tower = sum(p.numel() for n, p in base.named_parameters() if found.under(n, found.tower))
    projector = sum(p.numel() for n, p in base.named_parameters()
                    if found.under(n, *found.projector) and p.requires_grad)
    assert work.parameters == tower + projector and tower > 0 and projector > 0 and not work.assumed
    assert work.trained == projector and (work.side, work.patches) == (32, 16)  # the model's 16 tokens an image
    s = estimate.settings_from(recipe, 1, "fp32")
    with_images = estimate.make(recipe, s, cfg, meta).flops_per_step
    monkeypatch.setattr(vision, "image_work", lambda model: vision.ImageWork(work.parameters, work.trained, 32, 0,
                                                                            False))
    no_patches = estimate.make(recipe, s, cfg, meta).flops_per_step
    patches = s.micro_batch * 16 * s.accumulation
    assert with_images - no_patches == pytest.approx((2 * work.parameters + 4 * work.trained) * patches)


def test_four_bit_bytes_by_hand_and_against_bitsandbytes(make_recipe):
    n = 64 * 256 * 4
    assert sizes.quantized_bytes(n, 4, double_quant=False) == n / 2 + (n / 64) * 4
    assert sizes.quantized_bytes(n, 4, double_quant=True) == n / 2 + (n / 64) * (1 + 4 / 256)
    recipe = make_recipe("adapter=qlora", "quantization.double_quant=false")
    built = loader.load_for_training(recipe, Precision("fp32", "test"))
    actual = 0
    for m in built.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            actual += m.weight.numel() * m.weight.element_size() + m.weight.quant_state.absmax.numel() * 4
    counts = estimate.count(recipe, estimate.meta_model(recipe)[1])
    assert sizes.quantized_bytes(counts.quantized, 4, False) == pytest.approx(actual, rel=1e-6)


EMBEDDINGS_BF16 = "weights (unquantized embeddings and head, bf16)"
NORMS = "weights (unquantized norms and biases, fp32)"


def test_qlora_keeps_embeddings_and_head_in_the_compute_dtype_as_loaded(make_recipe):
    """models.loader.prepare_quantized keeps the unquantized embeddings and head in the compute dtype and the norms
    in fp32 (peft's prepare_model_for_kbit_training upcasts all three): the plan counts each as the loaded model
    holds it."""
    recipe = make_recipe("adapter=qlora", "training.precision=bf16")
    cfg, model = estimate.meta_model(recipe)
    c = estimate.count(recipe, model)
    assert c.embeddings == 2 * cfg.vocab_size * cfg.hidden_size  # untied: input embeddings and output head
    p = estimate.make(recipe, estimate.Settings(seq_len=64, precision="bf16"), cfg, model)
    assert p.parts[EMBEDDINGS_BF16] == c.embeddings * 2 and p.parts[NORMS] == (c.frozen_plain - c.embeddings) * 4
    built = loader.load_for_training(recipe, Precision("bf16", "test"))
    base = built.get_base_model()
    embedding = {id(q): q for m in (base.get_input_embeddings(), base.get_output_embeddings()) for q in m.parameters()}
    plain = [q for q in built.parameters() if not q.requires_grad and type(q).__name__ != "Params4bit"]
    assert sum(q.numel() * q.element_size() for q in embedding.values()) == p.parts[EMBEDDINGS_BF16]
    assert sum(q.numel() * q.element_size() for q in plain if id(q) not in embedding) == p.parts[NORMS]
    # the report says what the compute dtype saves against peft's upcast, beside the part
    line = next(x for x in report.text(recipe, p, None, []).splitlines() if EMBEDDINGS_BF16 in x)
    assert f"({sizes.size_words(c.embeddings * 2)} less than with peft's prepare_model_for_kbit_training" in line
    fp32 = estimate.make(recipe, estimate.Settings(seq_len=64, precision="fp32"), cfg, model)
    assert fp32.parts["weights (unquantized embeddings and head, fp32)"] == c.embeddings * 4 and not fp32.remarks


def test_qlora_head_is_not_cast_for_the_loss_and_its_layers_keep_more_in_fp32(make_recipe):
    lora, qlora = make_recipe("lora.dropout=0.0"), make_recipe("adapter=qlora", "lora.dropout=0.0")
    full = make_recipe("adapter=none", "lora=null")
    cfg, _ = estimate.meta_model(lora)
    s = estimate.Settings(micro_batch=2, seq_len=64, precision="bf16")
    head = cfg.vocab_size * cfg.hidden_size * 2
    assert activations.loss_path_bytes(cfg, s, qlora, True) == activations.loss_path_bytes(cfg, s, lora, True)
    assert activations.loss_path_bytes(cfg, s, full, True) >= head  # full fine-tuning's fp32 head: cast for the matmul
    # QLoRA's fp32 norms and bitsandbytes' dtype-preserving 4-bit layers keep the MLP's gate, up and SiLU(gate) in
    # fp32, each of q, k, v, gate and up its 16-bit cast of an fp32 input where LoRA on a 16-bit base keeps the
    # attention's and the MLP's inputs once each, and six adapter outputs in fp32 (tests/plan/test_activations.py
    # counts every term)
    extra = activations.layer_bytes_per_token(cfg, s, qlora) - activations.layer_bytes_per_token(cfg, s, lora)
    h, r = cfg.hidden_size, qlora.lora.r
    assert extra == 3 * cfg.intermediate_size * (4 - 2) + (5 * h - 2 * h) * 2 + 6 * r * (4 - 2)


def test_qlora_on_llama_8b_plans_its_embeddings_and_head_in_bf16(make_recipe):
    from tunekit.models.info import shipped_config

    recipe = make_recipe("adapter=qlora", "training.precision=bf16", "data.max_length=2048",
                         "training.micro_batch_size=2", "training.gradient_checkpointing=true")
    cfg = shipped_config("meta-llama/Llama-3.1-8B")
    p = estimate.make(recipe, estimate.settings_from(recipe, 1, "bf16"), *estimate.meta_model(recipe, cfg))
    matrices = 2 * 128256 * 4096  # untied: embeddings and head, 3.9 GiB in fp32
    assert p.parts[EMBEDDINGS_BF16] == matrices * 2 and "1.96 GiB less" in p.remarks[EMBEDDINGS_BF16]
    assert p.parts[NORMS] == (2 * 32 + 1) * 4096 * 4
    assert p.peak < 9 * 1024**3  # 10.8 GiB with the embeddings and head in fp32


def test_zero_stages_divide_the_right_parts(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null")
    cfg, model = estimate.meta_model(recipe)
    # ZeRO-3 releasing each parameter after use (stage3_max_reuse_distance 0): the stages fall in order
    base = estimate.Settings(world_size=4, micro_batch=2, seq_len=64, precision="fp32", zero3_reuse=0)
    p0 = estimate.make(recipe, base, cfg, model)
    opt, grads, weights = "optimizer (adamw_torch)", "gradients (fp32)", "weights (trainable, fp32)"
    p1 = estimate.make(recipe, dataclasses.replace(base, zero_stage=1), cfg, model)
    p2 = estimate.make(recipe, dataclasses.replace(base, zero_stage=2), cfg, model)
    p3 = estimate.make(recipe, dataclasses.replace(base, zero_stage=3), cfg, model)
    assert p0.parts[opt] == p0.counts.trainable * 8 and p0.parts[grads] == p0.counts.trainable * 4
    assert p1.parts[opt] == p0.parts[opt] // 4 and p1.parts[grads] == p0.parts[grads]
    assert p2.parts[grads] == p0.parts[grads] // 4 and p2.parts[weights] == p0.parts[weights]
    assert p3.parts[weights] == p0.parts[weights] // 4
    off = estimate.make(recipe, dataclasses.replace(base, zero_stage=3, offload_optimizer=True, offload_params=True),
                        cfg, model)
    assert opt not in off.parts and weights not in off.parts
    assert off.cpu_bytes == pytest.approx(p3.parts[opt] + p3.parts[weights], abs=2)
    assert p0.peak > p1.peak > p2.peak > p3.peak > off.peak
    # ds_configs/zero3.json's 1e9: a model this small is used again within it, so every parameter over the
    # persistence threshold (10 x hidden) stays gathered from forward to backward, as DeepSpeed does
    shipped = estimate.make(recipe, dataclasses.replace(base, zero_stage=3, zero3_reuse=10**9), cfg, model)
    large = sum(p.numel() for p in model.parameters() if p.numel() >= 10 * cfg.hidden_size)
    assert shipped.parts["ZeRO-3 gathered: head + parameters within max_reuse_distance"] == large * 4
    assert shipped.peak > p3.peak


def test_deepspeed_mixed_precision_keeps_fp32_masters_with_the_optimizer(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null")
    cfg, model = estimate.meta_model(recipe)
    s = estimate.Settings(world_size=2, micro_batch=1, seq_len=32, precision="bf16", zero_stage=2)
    p = estimate.make(recipe, s, cfg, model)
    n = p.counts.trainable
    assert p.parts["weights (trainable, bf16)"] == n * 2
    assert p.parts["master weights (fp32, in the optimizer)"] == n * 4 // 2
    off = estimate.make(recipe, dataclasses.replace(s, offload_optimizer=True), cfg, model)
    assert "master weights (fp32, in the optimizer)" not in off.parts and off.cpu_bytes == n * 4 // 2 + n * 8 // 2


def by_hand(cfg, total: int, sequences: int, seq: int, causal_half: float = 0.5) -> tuple[float, float]:
    """(matmul weights x tokens x 2, attention's forward FLOPs) of a forward pass: the untied input embeddings do
    no matmul; QK^T and PV are 2 x seq x d each per token (d = heads x head_dim), halved under a causal kernel."""
    matmul = 2 * (total - cfg.vocab_size * cfg.hidden_size) * sequences * seq
    d = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    return matmul, cfg.num_hidden_layers * sequences * 4 * seq * seq * d * causal_half


def test_checkpointing_and_flops(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null")
    cfg, model = estimate.meta_model(recipe)
    assert not cfg.tie_word_embeddings
    s = estimate.Settings(micro_batch=4, seq_len=128, precision="fp32")
    p = estimate.make(recipe, s, cfg, model)
    matmul, attention = by_hand(cfg, p.counts.total, 4, 128)
    # forward; backward twice the forward (the inputs' and the weights' gradients; attention's two products)
    assert p.flops_per_step == pytest.approx(3 * (matmul + attention))
    ckpt = estimate.make(recipe, dataclasses.replace(s, gradient_checkpointing=True), cfg, model)
    assert (ckpt.parts["activations (checkpointed: layer inputs)"] + ckpt.parts["activations (one layer recomputed)"]
            < p.parts["activations"])
    assert ckpt.peak < p.peak
    assert ckpt.flops_per_step == pytest.approx(4 * (matmul + attention))  # the forward is run twice


def test_lora_flops_train_only_the_adapter_and_eager_attention_multiplies_the_whole_square(make_recipe):
    lora = make_recipe()
    cfg, model = estimate.meta_model(lora)
    s = estimate.Settings(micro_batch=2, seq_len=64, precision="fp32")
    p = estimate.make(lora, s, cfg, model)
    matmul, attention = by_hand(cfg, p.counts.total, 2, 64)
    # the frozen base gets its inputs' gradients; only the adapter gets weights' gradients
    assert p.flops_per_step == pytest.approx(2 * matmul + 2 * p.counts.trainable * 2 * 64 + 3 * attention)
    eager = make_recipe("model.attn_implementation=eager")
    e = estimate.make(eager, s, *estimate.meta_model(eager))
    assert e.flops_per_step - p.flops_per_step == pytest.approx(3 * attention)
    # a tied head is the input embeddings' matrix: its matmul counts once, as the head's
    tied = estimate.meta_model(lora, cfg.__class__(**{**cfg.to_dict(), "tie_word_embeddings": True}))
    t = estimate.make(lora, s, *tied)
    assert t.counts.total == p.counts.total - cfg.vocab_size * cfg.hidden_size
    assert t.flops_per_step == pytest.approx(p.flops_per_step)


def test_a_memory_bandwidth_adds_the_elementwise_work(make_recipe):
    recipe = make_recipe("lora.dropout=0.05")
    cfg, model = estimate.meta_model(recipe)
    s = estimate.Settings(micro_batch=2, seq_len=64, precision="bf16")
    gpu = estimate.make(recipe, s, cfg, model)  # no bandwidth: a GPU plan, matmuls against the host (test_steptime_fit)
    assert gpu.time.elementwise_seconds == 0
    assert gpu.time.matmul_seconds == pytest.approx(gpu.flops_per_step / (989e12 * 0.4))
    p = estimate.make(recipe, dataclasses.replace(s, memory_bandwidth=2e9), cfg, model)
    assert p.time.host is None
    tokens, per_token = 2 * 64, activations.layer_bytes_per_token(cfg, s, recipe)
    # activations written and read forward, their gradients written and read backward; fp32 logits the same;
    # AdamW reads weight, gradient and two moments and writes weight and moments
    moved = 4 * cfg.num_hidden_layers * tokens * per_token + 4 * tokens * cfg.vocab_size * 4 + p.counts.trainable * 28
    assert p.time.elementwise_bytes == pytest.approx(moved)
    assert p.step_seconds == pytest.approx(gpu.time.matmul_seconds + moved / 2e9)
    ckpt = estimate.make(recipe, dataclasses.replace(s, memory_bandwidth=2e9, gradient_checkpointing=True), cfg, model)
    assert ckpt.time.elementwise_bytes == pytest.approx(moved + 2 * cfg.num_hidden_layers * tokens * per_token)
    text = report.text(recipe, p, None, [])
    assert f"elementwise work {moved / 2e9:.3f} s" in text and "GB at 2 GB/s" in text
    assert json.loads(report.to_json(p))["time"]["elementwise_bytes"] == pytest.approx(moved)


def test_suggestions_each_lower_the_planned_peak(make_recipe):
    recipe = make_recipe("training.micro_batch_size=8", "data.max_length=512")
    cfg, model = estimate.meta_model(recipe)
    p = estimate.make(recipe, estimate.Settings(world_size=2, micro_batch=8, seq_len=512, precision="fp32"), cfg, model)
    found = fixes.suggestions(recipe, p, p.peak // 2, cfg, model)
    labels = [label for label, _ in found]
    assert any("gradient_checkpointing" in x for x in labels) and any("micro_batch_size=4" in x for x in labels)
    assert all(fp.peak < p.peak for _, fp in found)


@pytest.mark.slow
def test_plan_cli_verdict(make_recipe, tmp_path):
    make_recipe()
    res = run_cli("plan", str(tmp_path / "r.yaml"), "--gpu-memory", "1MiB", "--world-size", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "verdict: does NOT fit in 0.0 GiB" in res.stdout and "gradient_checkpointing=true" in res.stdout
    ok = run_cli("plan", str(tmp_path / "r.yaml"), "--gpu-memory", "80GiB")
    assert "verdict: fits" in ok.stdout and "parameters: " in ok.stdout
    assert sizes.parse_size("24GiB") == 24 * 1024**3 and sizes.parse_size("512M") == 512 * 1024**2


def test_gradients_and_activations_are_not_live_together_in_one_process(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null")
    cfg, model = estimate.meta_model(recipe)
    s = estimate.Settings(micro_batch=2, seq_len=64, precision="fp32")
    p = estimate.make(recipe, s, cfg, model)
    forward = p.parts["activations"] + p.parts["logits and loss"]
    backward = p.parts["gradients (fp32)"]
    held = p.parts["weights (trainable, fp32)"] + p.parts["optimizer (adamw_torch)"]
    assert p.peak == held + max(forward, backward)
    # accumulation keeps gradients across micro-batches, and several processes keep them in buckets
    for other in (dataclasses.replace(s, accumulation=2), dataclasses.replace(s, world_size=2)):
        q = estimate.make(recipe, other, cfg, model)
        assert q.peak == held + forward + backward


def test_a_trained_tied_head_counts_its_gradient_accumulation(make_recipe):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    full = make_recipe("adapter=none", "lora=null")
    assert estimate.count(full, model).tied_trainable_head == 500 * 32
    p = estimate.make(full, estimate.Settings(seq_len=16, precision="fp32"), cfg, model)
    assert p.parts["gradient of the tied head, accumulating"] == 2 * 500 * 32 * 4
    lora = make_recipe()
    assert estimate.count(lora, model).tied_trainable_head == 0  # a frozen head gets no gradient


def test_dpo_plans_two_sequences_per_pair_a_reference_forward_and_the_stock_loss(make_recipe):
    sft = make_recipe("data.format=preference")
    dpo = make_recipe("data.format=preference", "training.method=dpo")
    cfg, model = estimate.meta_model(sft)
    settings = [estimate.settings_from(r, 1, "fp32") for r in (sft, dpo)]
    assert (settings[0].sequences, settings[1].sequences) == (1, 2) and settings[1].extra_forwards == 1
    one, two = (estimate.make(r, s, cfg, model) for r, s in zip((sft, dpo), settings))
    assert two.parts["activations"] == pytest.approx(2 * one.parts["activations"])
    stock = activations.loss_path_bytes(cfg, settings[1], dpo, chunked=False)
    assert two.parts["logits and loss"] == pytest.approx(stock)  # TRL computes log-probs from full logits
    # the pair's two sequences, and the reference's forward over them (micro-batch 8, max_length 64)
    assert two.flops_per_step == pytest.approx(2 * one.flops_per_step + sum(by_hand(cfg, one.counts.total, 16, 64)))


# ---------------------------------------------------------------- FSDP2 (training.fsdp) and ZeRO-3 beside it

ROOT = Path(__file__).resolve().parents[2]
LAYER_ONLY = "FSDP2 gathered: a decoder layer + the next (prefetch)"
HEAD_UNIT = "FSDP2 gathered: head unit (final norm, output head)"


def mid_llama(layers: int = 8):
    """A 150M-parameter Llama config (untied head): layers big enough to tell the sharding terms apart."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)


def sharded_state(p) -> int:
    return sum(v for k, v in p.parts.items() if k.startswith(("weights", "gradients (", "optimizer (")))


def test_settings_read_training_fsdp_and_the_zero3_config(make_recipe):
    s = estimate.settings_from(make_recipe("training.fsdp={}"), 2, "bf16")
    assert (s.fsdp, s.fsdp_reshard_after_forward, s.fsdp_offload, s.fsdp_auto_wrap, s.fsdp_reduce_dtype,
            s.gradient_checkpointing, s.zero_stage) == (True, True, False, True, "float32", False, 0)
    s = estimate.settings_from(make_recipe("training.fsdp.reshard_after_forward=false",
                                           "training.fsdp.cpu_offload=true",
                                           "training.fsdp.activation_checkpointing=true",
                                           "training.fsdp.reduce_dtype=param"), 2, "bf16")
    assert (s.fsdp, s.fsdp_reshard_after_forward, s.fsdp_offload, s.fsdp_reduce_dtype,
            s.gradient_checkpointing) == (True, False, True, "param", True)  # the same recomputation
    assert not estimate.settings_from(make_recipe("training.fsdp.auto_wrap=false"), 2, "bf16").fsdp_auto_wrap
    assert not estimate.settings_from(make_recipe(), 2, "bf16").fsdp
    # the ZeRO-3 that FSDP2 is compared with by default is ds_configs/zero3.json, read the way a recipe's is
    zero3 = estimate.settings_from(make_recipe(f"training.deepspeed={ROOT / 'ds_configs' / 'zero3.json'}"), 2, "bf16")
    fields = [f.name for f in dataclasses.fields(estimate.Settings) if f.name.startswith("zero3_")]
    assert zero3.zero_stage == 3 and all(getattr(zero3, f) == getattr(estimate.Settings(), f) for f in fields)
    assert '"fsdp_offload": true' in report.to_json(estimate.make(make_recipe("training.fsdp.cpu_offload=true"),
                                                           estimate.Settings(fsdp=True, fsdp_offload=True)))


def test_fsdp2_shards_every_parameter_one_over_the_world_size(make_recipe):
    recipe = make_recipe("training.fsdp={}")  # LoRA: FSDP2 shards the frozen base too, unlike ZeRO-1/2
    cfg, model = estimate.meta_model(recipe, mid_llama())
    one = estimate.make(recipe, estimate.Settings(world_size=1, precision="bf16", fsdp=True), cfg, model)
    frozen, lora = "weights (frozen base, bf16)", "weights (trainable, fp32)"
    assert one.parts[frozen] == one.counts.frozen_plain * 2 and one.parts[lora] == one.counts.trainable * 4
    for n in (2, 4, 8):
        p = estimate.make(recipe, estimate.Settings(world_size=n, precision="bf16", fsdp=True), cfg, model)
        for key in (frozen, lora, "gradients (fp32)", "optimizer (adamw_torch)"):
            assert p.parts[key] == pytest.approx(one.parts[key] / n, abs=1)
        assert p.parts[HEAD_UNIT] == one.parts[HEAD_UNIT]  # what is gathered whole does not shrink
    zero2 = estimate.make(recipe, estimate.Settings(world_size=8, precision="bf16", zero_stage=2), cfg, model)
    assert zero2.parts[frozen] == one.parts[frozen]


def test_fsdp2_gathers_whole_decoder_layers_and_without_auto_wrap_all_of_them(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null", "training.fsdp={}")
    cfg, model = estimate.meta_model(recipe, mid_llama())
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * 2  # gathered in bf16
    head = sum(p.numel() for p in (*model.lm_head.parameters(), *model.model.norm.parameters())) * 2
    s = estimate.Settings(world_size=4, seq_len=256, precision="bf16", fsdp=True)
    wrapped = estimate.make(recipe, s, cfg, model)
    assert wrapped.parts[LAYER_ONLY] == 2 * layer and wrapped.parts[HEAD_UNIT] == head
    one_unit = estimate.make(recipe, dataclasses.replace(s, fsdp_auto_wrap=False), cfg, model)
    everything = one_unit.parts["FSDP2 gathered: every decoder layer (one unit) + head unit"]
    assert everything == cfg.num_hidden_layers * layer + head
    assert one_unit.peak >= sharded_state(one_unit) + everything and one_unit.peak > wrapped.peak
    assert sharded_state(one_unit) == sharded_state(wrapped)


def test_fsdp2_keeping_layers_gathered_to_backward_costs_more(make_recipe):
    recipe = make_recipe("training.fsdp={}")
    cfg, model = estimate.meta_model(recipe, mid_llama())
    s = estimate.Settings(world_size=4, seq_len=256, precision="bf16", fsdp=True)
    resharded = estimate.make(recipe, s, cfg, model)
    kept = estimate.make(recipe, dataclasses.replace(s, fsdp_reshard_after_forward=False), cfg, model)
    layers_and_embeddings = kept.parts["FSDP2 gathered: every decoder layer + embeddings (kept to backward)"]
    assert layers_and_embeddings > resharded.parts[LAYER_ONLY] and kept.peak > resharded.peak
    assert "layers kept gathered from forward to backward" in report.text(recipe, kept, None, [])


def test_fsdp2_cpu_offload_moves_the_sharded_state_to_cpu(make_recipe):
    recipe = make_recipe("adapter=none", "lora=null", "training.fsdp={}")
    cfg, model = estimate.meta_model(recipe, mid_llama())
    s = estimate.Settings(world_size=4, seq_len=256, precision="bf16", fsdp=True)
    on_device = estimate.make(recipe, s, cfg, model)
    off = estimate.make(recipe, dataclasses.replace(s, fsdp_offload=True), cfg, model)
    assert on_device.cpu_bytes == 0 and off.cpu_bytes == pytest.approx(sharded_state(on_device), abs=4)
    assert sharded_state(off) == 0 and off.parts[LAYER_ONLY] == on_device.parts[LAYER_ONLY]  # gathered on device
    assert off.peak == on_device.peak - sharded_state(on_device)


def test_qlora_4bit_weights_under_fsdp2_and_zero3(make_recipe):
    recipe = make_recipe("adapter=qlora", "quantization.double_quant=false")
    cfg, model = estimate.meta_model(recipe, mid_llama())
    s = estimate.Settings(world_size=4, seq_len=128, precision="bf16")
    c = estimate.count(recipe, model)
    whole, codes = sizes.quantized_bytes(c.quantized, 4, False), c.quantized / 2
    fsdp = estimate.make(recipe, dataclasses.replace(s, fsdp=True), cfg, model)
    zero3 = estimate.make(recipe, dataclasses.replace(s, zero_stage=3), cfg, model)
    # tunekit stores the packed codes in bf16 under both (the same bytes as uint8): both divide them, not the
    # quantization constants
    constants = whole - codes
    assert fsdp.parts[modelstate.QUANTIZED] == zero3.parts[modelstate.QUANTIZED] == int(constants + codes / 4)
    # FSDP2 gathers a decoder layer with its packed codes, and prefetches the next
    layer = model.base_model.model.model.layers[0]
    packed = sum(m.weight.numel() for name, m in layer.named_modules() if name.endswith("base_layer"))
    rest = sum(p.numel() for p in layer.parameters()) - packed
    assert fsdp.parts[LAYER_ONLY] == 2 * (packed / 2 + rest * 2)
    # offload moves the share of the codes to CPU RAM; the constants stay on the device
    fsdp_off = estimate.make(recipe, dataclasses.replace(s, fsdp=True, fsdp_offload=True), cfg, model)
    zero3_off = estimate.make(recipe, dataclasses.replace(s, zero_stage=3, offload_params=True, offload_optimizer=True),
                              cfg, model)
    for on, off in ((fsdp, fsdp_off), (zero3, zero3_off)):
        assert off.parts[modelstate.QUANTIZED] == int(constants)
        assert off.cpu_bytes >= codes / 4 and off.peak < on.peak
    assert fsdp_off.cpu_bytes == pytest.approx(sharded_state(fsdp) - constants, abs=8)


def versus(line: str) -> tuple[float, float, str, float]:
    """(FSDP2's peak, ZeRO-3's peak, the lower one named, the difference) from the report's line, in bytes."""
    unit = {"GiB": 1024**3, "MiB": 1024**2, "KiB": 1024}
    m = re.search(r"devices: ([\d.]+) (\w+) vs ([\d.]+) (\w+) per device.*: (FSDP2|ZeRO-3) needs ([\d.]+) (\w+) less",
                  line)
    assert m, line
    return (float(m[1]) * unit[m[2]], float(m[3]) * unit[m[4]], m[5], float(m[6]) * unit[m[7]])


@pytest.mark.parametrize("overrides, lower, reason", [
    # a 150M model is used again within ZeRO-3's stage3_max_reuse_distance (1e9): it stays gathered
    (["training.fsdp={}"], "FSDP2", "stage3_max_reuse_distance"),
    # with accumulation the Trainer skips FSDP2's reduce-scatter until the last micro-batch
    (["adapter=none", "lora=null", "training.gradient_accumulation_steps=4"], "ZeRO-3", "micro-batches"),
])
def test_the_report_says_whether_fsdp2_or_zero3_needs_less(make_recipe, overrides, lower, reason):
    recipe = make_recipe(*overrides)
    cfg, model = estimate.meta_model(recipe, mid_llama())
    alone = estimate.make(recipe, estimate.settings_from(recipe, 1, "bf16"), cfg, model)
    assert alone.versus is None and "ZeRO-3 (" not in report.text(recipe, alone, None, [])
    p = estimate.make(recipe, estimate.settings_from(recipe, 2, "bf16"), cfg, model)
    line = next(x for x in report.text(recipe, p, None, []).splitlines() if x.startswith("FSDP2 ("))
    assert "ZeRO-3 (ds_configs/zero3.json) on 2 devices" in line and reason in line
    fsdp, zero3 = p.versus["fsdp"][1], p.versus["zero3"][1]
    assert (fsdp is p) == (recipe.training.fsdp is not None)  # the recipe's own plan, where it uses one of them
    f, z, named, diff = versus(line)
    assert named == lower == ("FSDP2" if fsdp.peak < zero3.peak else "ZeRO-3")
    assert f == pytest.approx(fsdp.peak, rel=0.01) and z == pytest.approx(zero3.peak, rel=0.01)
    assert diff == pytest.approx(abs(fsdp.peak - zero3.peak), rel=0.01)
    assert json.loads(report.to_json(p))["versus"]["zero3"]["peak"] == zero3.peak


def test_suggestions_offer_fsdp2_beside_zero_only_where_it_lowers_the_peak(make_recipe):
    recipe = make_recipe("training.micro_batch_size=8", "data.max_length=512")
    cfg, model = estimate.meta_model(recipe)
    s = estimate.settings_from(recipe, 2, "fp32")
    p = estimate.make(recipe, s, cfg, model)
    found = dict(fixes.suggestions(recipe, p, p.peak // 2, cfg, model))
    options = {label: st for label, _, st in fixes.sharding_options(recipe, s)}
    for label in ("training.fsdp: {}", "training.fsdp: {cpu_offload: true}"):
        lowers = estimate.make(recipe, options[label], cfg, model).peak < p.peak
        assert (label in found) == lowers  # listed beside the ZeRO options exactly when it lowers the peak
    assert all(fp.peak < p.peak for fp in found.values()) and any("fsdp" in label for label in found)
    # beside a DeepSpeed config, FSDP2 replaces it; under FSDP2, ZeRO replaces that
    zero2 = fixes.sharding_options(recipe, dataclasses.replace(s, zero_stage=2))
    assert "training.fsdp: {} (in place of training.deepspeed)" in [label for label, _, _ in zero2]
    fsdp = [label for label, _, _ in fixes.sharding_options(recipe, dataclasses.replace(s, fsdp=True))]
    assert "deepspeed: ds_configs/zero3.json (in place of training.fsdp)" in fsdp
    assert "training.fsdp.cpu_offload=true" in fsdp and "training.fsdp: {}" not in fsdp
    assert all(not st.fsdp or (st.zero_stage == 0 and not st.offload_params)
               for _, _, st in fixes.sharding_options(recipe, dataclasses.replace(s, zero_stage=3)))
    alone = [label for label, _, _ in fixes.sharding_options(recipe, dataclasses.replace(s, world_size=1))]
    assert not any("fsdp" in label for label in alone)


# FSDP2 on one process with torch's fake process group of 4 (collectives do nothing, every buffer is allocated):
# the model loaded as tunekit loads it, sharded by accelerate's fsdp2_prepare_model, two steps under torch's
# FSDPMemTracker; prints the live bytes by kind at the peak and at the last decoder layer's backward peak.
TRACKED_STEP = """
import json, sys, torch, torch.distributed as dist
from types import SimpleNamespace
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from tunekit.config import fsdpconfig, recipefile
from tunekit.core.hardware import Precision
from tunekit.models import loader

path, cases = sys.argv[1], json.loads(sys.argv[2])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
cpu, out = torch.device("cpu"), []
for overrides in cases:
    recipe = recipefile.load(path, overrides)
    t, precision = recipe.training, recipe.training.precision
    model = loader.load_for_training(recipe, Precision(precision, "test"))
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=t.fsdp.reshard_after_forward, cpu_ram_efficient_loading=False,
        auto_wrap_policy="transformer_based_wrap" if t.fsdp.auto_wrap else "no_wrap",
        mixed_precision_policy=fsdpconfig.mixed_precision_policy(t.fsdp, precision))
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), is_main_process=True, device=cpu,
                                  torch_device_mesh=None, mixed_precision="no" if precision == "fp32" else precision)
    model = fsdp2_prepare_model(accelerator, model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randint(0, 100, (t.micro_batch_size, recipe.data.max_length))
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((x,))
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    with tracker:
        for step in range(2):
            for micro in range(t.gradient_accumulation_steps):  # as the Trainer: no_sync but for the last
                model.set_requires_gradient_sync(micro == t.gradient_accumulation_steps - 1)
                model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                tracker.reset_mod_stats()
    stats = tracker.memory_tracking.get(layers[-1])
    backward = stats.snapshots[_FSDPModState.PEAK_BW][-1][cpu] if stats is not None else None
    out.append({"peak": tracker.get_tracker_snapshot("peak")[cpu], "layer_backward": backward})
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_fsdp2_terms_match_torchs_memory_tracker(make_recipe, tmp_path):
    full = ["adapter=none", "lora=null"]
    cases = [full + ["training.fsdp={}"], full + ["training.fsdp.reshard_after_forward=false"],
             full + ["training.fsdp.auto_wrap=false"], ["training.fsdp={}", "training.precision=bf16"],
             full + ["training.fsdp={}", "training.gradient_accumulation_steps=2"],
             ["adapter=qlora", "training.fsdp={}", "training.precision=bf16"]]
    make_recipe()
    res = subprocess.run([sys.executable, "-c", TRACKED_STEP, str(tmp_path / "r.yaml"), json.dumps(cases)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    tracked = json.loads(res.stdout.split("RESULT ", 1)[1])
    planned = []
    for overrides in cases:
        recipe = make_recipe(*overrides)
        planned.append(estimate.make(recipe, estimate.settings_from(recipe, 4, recipe.training.precision)))
    for p, t in zip(planned, tracked):
        # 4-bit constants are no parameter (bitsandbytes' quant_state): all but them is sharded
        q = p.counts.quantized
        constants = sizes.quantized_bytes(q, 4, True) - q / 2 if q else 0
        weights = sum(v for k, v in p.parts.items() if k.startswith("weights")) - constants
        assert t["peak"]["Sharded Param"] == pytest.approx(weights, rel=0.01)
        assert t["peak"]["OptState"] == pytest.approx(p.parts["optimizer (adamw_torch)"], rel=0.01)
    plain, kept, one_unit, lora, accumulating, qlora = zip(planned, tracked)
    for p, t in (plain, lora, qlora):  # the head unit at the loss; a layer and the next, prefetched, in its backward
        assert t["peak"]["Unsharded Param"] == p.parts[HEAD_UNIT]
        both = t["layer_backward"]["Unsharded Param"] + t["layer_backward"]["All Gather"]
        assert both == pytest.approx(p.parts[LAYER_ONLY], rel=0.01)
    p, t = kept
    assert t["peak"]["Unsharded Param"] == p.parts["FSDP2 gathered: every decoder layer + embeddings (kept to "
                                                   "backward) + head unit"]
    assert t["layer_backward"]["Unsharded Param"] == p.parts["FSDP2 gathered: every decoder layer + embeddings "
                                                             "(kept to backward)"]
    p, t = one_unit
    assert t["peak"]["Unsharded Param"] == p.parts["FSDP2 gathered: every decoder layer (one unit) + head unit"]
    p, t = accumulating
    assert t["peak"]["Unsharded Grad"] == p.parts["FSDP2: unsharded gradients over micro-batches (no_sync)"]


@pytest.mark.parametrize("changes, expected", [
    ({"num_attention_heads": "x"}, "transformers refuses this llama config: Validation error for field "
                                   "'num_attention_heads': TypeError: Field 'num_attention_heads' expected int"),
    ({"num_attention_heads": 5}, "The hidden size (64) is not a multiple of the number of attention heads (5)"),
])
def test_a_model_config_transformers_refuses_is_one_line(changes, expected, tiny_model, tmp_path, capsys,
                                                        monkeypatch):
    from conftest import refused_in_process, reverse_rows

    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, write_jsonl(tmp_path / "d.jsonl",
                                                                                   reverse_rows(4)), tmp_path / "run"))
    config = json.loads((tiny_model / "config.json").read_text())
    (tmp_path / "c.json").write_text(json.dumps({**config, **changes}))
    line = refused_in_process(["plan", str(recipe), "--model-config", "c.json"], tmp_path, capsys, monkeypatch)
    assert line.startswith("tunekit: error: --model-config c.json: ") and expected in line
