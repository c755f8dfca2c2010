"""QLoRA of a mixture of experts (models.expertquant): the experts' 3-D weights stored in 4 bits beside the 4-bit
linear layers, read back within nf4's tolerance of the 16-bit weights on CPU, their LoRA pairs trained through the
4-bit weights, the adapter loadable onto plain weights and merged with the logit parity check, and the plan counting
the 4-bit experts as the loaded model holds them."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    ROOT,
    refused_in_process,
    reverse_rows,
    run_cli,
    tiny_recipe,
    write_jsonl,
    write_recipe,
)
from tunekit.config.recipefile import from_dict
from tunekit.core.hardware import Precision
from tunekit.models import expertquant, experts, loader

pytestmark = pytest.mark.slow  # loads models


def qlora(model_dir, data, **extra):
    raw = {"model": {"name_or_path": str(model_dir)}, "adapter": "lora", "quantization": {},
           "lora": {"r": 8, "dropout": 0.0}, "data": {"train": str(data)}, "training": {"precision": "bf16"}}
    return from_dict({**raw, **extra})


def held_4bit_bytes(model) -> int:
    """Bytes the model holds for its 4-bit weights: the codes and their scales."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    def constants(state):  # the blocks' scales; not the 1 KiB lookup table each tensor carries, whatever its size
        while state is not None:
            for key, v in vars(state).items():
                if key != "code":
                    add(v)
            state = getattr(state, "state2", None)

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(weight).__name__ == "Params4bit":
            add(weight)
            constants(weight.quant_state)
        for name in getattr(module, "parametrizations", {}):
            if expertquant.is_quantized(module, name):
                add(module.parametrizations[name].original)
                constants(module.parametrizations[name][0].quant_state)
    return total


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral"])
def test_the_experts_are_stored_in_4_bits_and_read_back_within_nf4s_tolerance(family_models, tmp_path, family):
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(4))
    reference = AutoModelForCausalLM.from_pretrained(str(family_models(family)), dtype=torch.bfloat16)
    model = loader.load_for_training(qlora(family_models(family), data, moe={"experts": False}),
                                     Precision("bf16", "test"))
    plain = {n.removeprefix("base_model.model."): m for n, m in reference.named_modules()}
    found = [(n.removeprefix("base_model.model."), m) for n, m in model.named_modules() if experts.holds_experts(m)]
    assert len(found) == 2
    for name, module in found:
        for weight in ("gate_up_proj", "down_proj"):
            assert expertquant.is_quantized(module, weight)
            codes, want = module.parametrizations[weight].original, getattr(plain[name], weight)
            assert codes.dtype == torch.uint8 and codes.numel() == want.numel() // 2  # two weights a byte
            got = getattr(module, weight)
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            # nf4: each weight within half the widest gap between its levels (0.139) of its 64-block's absmax,
            # the block's scale itself 8-bit (double quantization) and the read back rounded to bf16
            blocks = want.float().reshape(-1, 64)
            error = (got.float().reshape(-1, 64) - blocks).abs() / blocks.abs().amax(1, keepdim=True)
            assert error.max() <= 0.16
            assert (got.float() - want.float()).norm() / want.float().norm() < 0.1  # nf4 on Gaussian weights: 0.09
        # the sparse block's output through its 4-bit experts, against the 16-bit ones, for the same routing
        count, top_k = plain[name].num_experts, reference.config.num_experts_per_tok
        x = torch.randn(50, reference.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
        picks = torch.stack([torch.randperm(count, generator=torch.Generator().manual_seed(i))[:top_k]
                             for i in range(50)])
        weights = torch.full((50, top_k), 1 / top_k, dtype=torch.bfloat16)
        with torch.no_grad():
            want, got = plain[name](x, picks, weights).float(), module(x, picks, weights).float()
        # three 4-bit products (gate, up, down), each off by nf4's 0.09: about 0.09 x sqrt(3) = 0.16 together
        assert (got - want).norm() / want.norm() < 0.2


def test_qlora_trains_the_experts_through_their_4_bit_weights_and_merges(family_models, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = family_models("qwen3_moe")
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    model = loader.load_for_training(qlora(model_dir, data), Precision("bf16", "test"))
    ids = torch.randint(0, 1000, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and ".experts." in n and "lora_B" in n}
    # both expert weights of both layers: peft nests one wrapper in the other, and each pair gets its gradient
    assert len(grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    chains = [m.parametrizations for m in model.modules() if experts.holds_experts(m)]
    assert all(len(c[w]) == 1 for c in chains for w in c)  # LoRA's proxies removed after the forward

    train = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    run = tmp_path / "run"
    raw = tiny_recipe(model_dir, train, run, quantization={}, training={"max_steps": 6, "precision": "bf16"})
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "quantization: the experts' 3-D weights are stored in 4 bits too (nf4)" in res.stderr
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    trained = [k for k in adapter if ".experts." in k and "lora_B" in k]
    assert len(trained) == 4 and all(adapter[k].abs().sum() > 0 for k in trained)  # B starts at zero
    # the adapter goes onto plain weights as it is (peft alone, a bf16 base)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    PeftModel.from_pretrained(base, str(run / "adapter"))

    merged = tmp_path / "merged"
    res = run_cli("merge", str(run), "--out", str(merged))
    assert res.returncode == 0, res.stderr[-3000:]
    # the merged model's logits against the adapter's on the 4-bit base it trained on (merge refuses beyond 1e-3)
    parity = re.search(r"parity: max \|logit diff\| ([0-9.e+-]+)", res.stderr)
    assert parity and float(parity.group(1)) <= 1e-3
    weights = load_file(str(merged / "model.safetensors"))  # plain weights again, saved per expert as Qwen3-MoE's are
    assert weights["model.layers.0.mlp.experts.15.down_proj.weight"].shape == (64, 32)
    assert not any("parametrizations" in k for k in weights)


def test_the_plan_counts_the_4_bit_experts_as_the_model_holds_them(family_models, tmp_path):
    from tunekit.plan import estimate
    from tunekit.plan.modelstate import QUANTIZED

    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(4))
    recipe = qlora(family_models("qwen3_moe"), data)
    plan = estimate.make(recipe, estimate.settings_from(recipe, 1, "bf16"))
    model = loader.load_for_training(recipe, Precision("bf16", "test"))
    held = held_4bit_bytes(model)
    assert plan.parts[QUANTIZED] == pytest.approx(held, rel=0.02)
    assert not any("frozen experts" in k for k in plan.parts)  # no 16-bit experts left
    # on several devices: no FSDP2-or-ZeRO-3 comparison and no suggestion of either, which shard no 4-bit experts
    from tunekit.plan import fixes

    two = estimate.make(recipe, estimate.settings_from(recipe, 2, "bf16"))
    assert two.versus is None
    labels = [label for label, _ in fixes.suggestions(recipe, two, 1, *estimate.meta_model(recipe))]
    assert not any("fsdp" in label or "zero3" in label for label in labels), labels
    cfg, meta = estimate.meta_model(recipe)
    assert plan.counts.quantized > experts.layout(meta).parameters  # the experts among the 4-bit weights


def test_what_4_bit_experts_cannot_do_is_refused_and_the_recorded_recipe_says_what_trained(family_models, tmp_path,
                                                                                          capsys, monkeypatch):
    from tunekit.api import checks
    from tunekit.config.recipefile import load, to_yaml

    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": r["instruction"], "chosen": r["output"], "rejected": "no"}
                                               for r in reverse_rows(8)])
    model_dir = family_models("qwen3_moe")
    refusals = [({"quantization": {"bits": 8}}, "use bits: 4, whose experts are stored in 4 bits too"),
                ({"quantization": {}, "training": {"deepspeed": str(ROOT / "ds_configs" / "zero3.json")}},
                 "cannot be sharded by ZeRO-3; train QLoRA on one device or under DDP, or remove the quantization "
                 "section"),
                ({"quantization": {}, "training": {"fsdp": {}}}, "cannot be sharded by FSDP2"),
                ({"quantization": {}, "training": {"method": "dpo"},
                  "data": {"format": "preference", "train": str(pairs)}},
                 "training.method: dpo trains against TRL's copy of the adapter as its reference")]
    for sections, said in refusals:
        raw = tiny_recipe(model_dir, data, tmp_path / "run", **sections)
        line = refused_in_process(["validate", str(write_recipe(tmp_path / "r.yaml", raw))], tmp_path, capsys,
                                  monkeypatch)
        assert said in line, line
    # lora.dropout's default, dropped on the experts, is what the run's recipe records: read back, it is not refused
    raw = tiny_recipe(model_dir, data, tmp_path / "run")
    raw["lora"] = {"r": 8}
    settled = checks.before_weights(from_dict(raw), checks.PLAN)
    assert settled.lora.dropout == 0.0
    (tmp_path / "recorded.yaml").write_text(to_yaml(settled))
    assert checks.before_weights(load(tmp_path / "recorded.yaml"), checks.PLAN).lora.dropout == 0.0


@pytest.mark.full  # 40-60 s: a run and a two-process launch
def test_two_processes_under_ddp_train_4_bit_experts_as_one_process(tmp_path, family_models):
    """QLoRA of a mixture of experts under DDP (the frozen 4-bit codes left out of its buckets) equals one process
    accumulating the same micro-batches: loss and the expert adapters."""
    from conftest import launch, logged

    model_dir = family_models("qwen3_moe")
    train = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    steps = {"max_steps": 3, "micro_batch_size": 4}
    one = tmp_path / "one"
    raw = tiny_recipe(model_dir, train, one, quantization={},
                      training={**steps, "gradient_accumulation_steps": 2, "precision": "fp32"})
    res = run_cli("train", str(write_recipe(tmp_path / "one.yaml", raw)))
    assert res.returncode == 0, res.stderr[-3000:]
    raw = tiny_recipe(model_dir, train, tmp_path / "two", quantization={}, training={**steps, "precision": "fp32"})
    launch(write_recipe(tmp_path / "two.yaml", raw), tmp_path / "two", 2)
    assert logged(one, "loss") == pytest.approx(logged(tmp_path / "two", "loss"), rel=1e-4)
    a = load_file(str(one / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)
