"""LoRA's fused forward (models.lorafused): the same outputs and gradients as peft's own forward, on plain and 4-bit
bases, in fp32 and under bf16 autocast; peft's forward wherever the fused one does not apply."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from tunekit.models import lorafused
from tunekit.models.loader import keep_4bit_trainable_on_cpu

IDS = torch.tensor([[5, 17, 42, 8, 99, 3, 250, 61, 7, 12]])


def lora_model(path, dtype=torch.float32, four_bit=False, **lora):
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.bfloat16) if four_bit else None
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant)
    if four_bit:
        keep_4bit_trainable_on_cpu(base)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora))
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            if "lora_B" in name:  # B starts at zero: make the adapter's product count
                torch.nn.init.normal_(p, std=0.2)
    return model


def run(model, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=IDS).logits.float()
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def unfuse(model):
    for m in model.modules():
        m.__dict__.pop("forward", None) if getattr(m.__dict__.get("forward"), "__func__", None) \
            is lorafused.fused_forward else None


def fused_run(model, autocast, monkeypatch):
    """`run` with the fused forward installed, checking that every adapted linear took it."""
    assert lorafused.fuse(model) == 14  # 7 linear layers in each of the 2 decoder layers
    products = []
    addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: products.append(1) or addmm(*a, **k))
    out = run(model, autocast)
    monkeypatch.setattr(torch, "addmm", addmm)
    assert len(products) == 14
    unfuse(model)
    return out


def gap(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_fused_equals_peft_in_fp32(tiny_model, monkeypatch):
    model = lora_model(tiny_model)
    stock, fused = run(model), fused_run(model, False, monkeypatch)
    torch.testing.assert_close(fused[0], stock[0], rtol=1e-5, atol=1e-5)
    assert fused[1].keys() == stock[1].keys() and len(stock[1]) == 28  # every A and B has its gradient
    for name in stock[1]:
        torch.testing.assert_close(fused[1][name], stock[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_fused_under_bf16_autocast_is_as_close_to_fp32_as_peft(tiny_model, monkeypatch):
    """peft rounds the adapter's product to bf16 three times (product, scaled, added), the fused path once: against
    the same weights in fp32, its logits and gradients are no further off than peft's."""
    model = lora_model(tiny_model, torch.bfloat16)
    stock, fused = run(model, autocast=True), fused_run(model, True, monkeypatch)
    reference = run(model.float())
    assert gap(fused[0], reference[0]) <= 1.1 * gap(stock[0], reference[0]) < 0.05
    ours = [gap(fused[1][n], reference[1][n]) for n in reference[1]]
    peft = [gap(stock[1][n], reference[1][n]) for n in reference[1]]
    assert len(ours) == 28 and sum(ours) <= 1.1 * sum(peft) and max(ours) < 0.1


def test_fused_equals_peft_on_a_4_bit_base(tiny_model, monkeypatch):
    model = lora_model(tiny_model, four_bit=True)
    stock, fused = run(model, autocast=True), fused_run(model, True, monkeypatch)
    assert gap(fused[0], stock[0]) < 0.03
    assert fused[1].keys() == stock[1].keys() and len(stock[1]) == 28
    assert max(gap(fused[1][n], stock[1][n]) for n in stock[1]) < 0.1


def test_peft_s_forward_where_the_fused_one_does_not_apply(tiny_model, monkeypatch):
    model = lora_model(tiny_model)
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=IDS).logits
    lorafused.fuse(model)
    products = []
    addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: products.append(1) or addmm(*a, **k))
    with torch.no_grad():
        fused = model(input_ids=IDS).logits
        assert len(products) == 14 and (fused - base).abs().max() > 1e-3
        products.clear()
        with model.disable_adapter():  # a reference model through the disabled adapter (DPO, KTO)
            torch.testing.assert_close(model(input_ids=IDS).logits, base, rtol=0, atol=0)
        assert products == []
        # weights ZeRO-3 partitions are gathered by hooks on the submodule calls the fused path skips
        layer = next(m for m in model.modules() if "forward" in m.__dict__)
        monkeypatch.setattr(layer.lora_A["default"].weight, "ds_id", 0, raising=False)
        torch.testing.assert_close(model(input_ids=IDS).logits, fused, rtol=1e-5, atol=1e-5)
        assert len(products) == 13
        # 16-bit activations into fp32 adapters without autocast (generation): peft casts them
        products.clear()
        model.get_base_model().to(torch.bfloat16)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
        assert model(input_ids=IDS).logits.dtype == torch.bfloat16
        assert products == []


def test_dora_keeps_peft_s_forward(tiny_model):
    model = lora_model(tiny_model, use_dora=True)
    with torch.no_grad():
        stock = model(input_ids=IDS).logits
        lorafused.fuse(model)
        torch.testing.assert_close(model(input_ids=IDS).logits, stock, rtol=0, atol=0)
