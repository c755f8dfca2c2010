"""The chunked loss on trained positions equals the stock full-logits loss: value and gradients."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import reverse_rows, tiny_recipe, write_jsonl
from tunekit.config.recipefile import from_dict
from tunekit.core.hardware import Precision
from tunekit.data import arrow
from tunekit.data.collating import TRAINED_POSITIONS, collator
from tunekit.models import loader, losspath
from tunekit.training.arguments import training_arguments
from tunekit.training.trainer import SafeStateTrainer

# fp32: the two paths differ only in summation order. bf16: matmuls over a chunk round differently from
# one matmul over all rows (near-cancelling sums most), and the stock path computes the head's weight
# gradient in one bf16 matmul over all rows; the chunked path sums per-chunk products in fp32 first.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_linear_cross_entropy_equals_stock(dtype, bias):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=dtype, requires_grad=True)
    weight = (torch.randn(50, 16) * 0.3).to(dtype).requires_grad_()
    b = torch.randn(50, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, 50, (37,))

    stock = F.cross_entropy(F.linear(hidden, weight, b).float(), targets, reduction="sum")
    stock_grads = torch.autograd.grad(stock * 0.5, [hidden, weight] + ([b] if bias else []))
    ours = losspath.linear_cross_entropy_sum(hidden, weight, b, targets, rows=8)  # 5 chunks, the last short
    our_grads = torch.autograd.grad(ours * 0.5, [hidden, weight] + ([b] if bias else []))

    torch.testing.assert_close(ours, stock, **TOLERANCE[dtype])
    for mine, theirs in zip(our_grads, stock_grads):
        assert mine.dtype == theirs.dtype
        torch.testing.assert_close(mine.float(), theirs.float(), **TOLERANCE[dtype])


def test_no_gradient_work_without_grad():
    weight = torch.randn(50, 16)
    hidden = torch.randn(9, 16, requires_grad=True)
    with torch.no_grad():
        loss = losspath.linear_cross_entropy_sum(hidden, weight, None, torch.zeros(9, dtype=torch.long), rows=4)
    assert not loss.requires_grad


def _trainer(recipe, model, chunked):
    args = training_arguments(recipe, Precision("fp32", "test"), Path(recipe.output_dir), has_eval=False)
    return SafeStateTrainer(model=model, args=args, chunked_loss=chunked)


def _batch(recipe, tokenizer, packing):
    bundle = arrow.build(recipe.data, tokenizer, 0)
    features = [bundle.train[i] for i in range(5)]
    batch = collator(tokenizer, packing)(features)
    return {k: v for k, v in batch.items() if torch.is_tensor(v)}


def _loss_and_grads(trainer, model, batch, bf16=False):
    model.zero_grad(set_to_none=True)
    count = (losspath.shift_targets(batch["labels"]) != losspath.IGNORE).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as the Trainer runs bf16 on fp32 weights
        loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=count)
        loss.backward()
        mean = trainer.compute_loss(model, dict(batch)).detach()  # no token count: the batch mean
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), mean, grads


@pytest.mark.slow
@pytest.mark.parametrize("method,bf16", [("lora", False), ("qlora", False), ("full", False), ("lora", True)],
                         ids=["lora", "qlora", "full", "lora-bf16-autocast"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_trainer_loss_and_gradients_equal_stock(tiny_model, tiny_tokenizer, tmp_path, method, bf16, packing):
    train = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    sections = {"data": {"packing": packing}}
    if method == "full":
        sections.update(adapter="none", lora=None)
    if method == "qlora":
        sections["quantization"] = {"bits": 4}
    recipe = from_dict(tiny_recipe(tiny_model, train, tmp_path / "out", **sections))
    torch.manual_seed(0)
    model = loader.load_for_training(recipe, Precision("fp32", "test"))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; make every adapter weight receive a gradient
            torch.nn.init.normal_(p, std=0.1)
    batch = _batch(recipe, tiny_tokenizer, packing)
    assert (batch["labels"] == losspath.IGNORE).any()  # prompt (and padding) positions are masked

    stock = _loss_and_grads(_trainer(recipe, model, False), model, batch, bf16)
    trainer = _trainer(recipe, model, True)
    assert trainer.loss_head is not None
    ours = _loss_and_grads(trainer, model, batch, bf16)

    assert trainer.loss_head.trained == int((losspath.shift_targets(batch["labels"]) != -100).sum())
    # fp32: summation order only. bf16 autocast: the head's matmuls round per chunk (see TOLERANCE).
    tol = dict(rtol=2e-2, atol=2e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[0], stock[0], **tol)
    torch.testing.assert_close(ours[1], stock[1], **tol)
    assert ours[2].keys() == stock[2].keys() and stock[2]
    for name in stock[2]:
        torch.testing.assert_close(ours[2][name], stock[2][name], **(tol if bf16 else dict(rtol=1e-4, atol=1e-6)),
                                   msg=name)
    if method == "full":
        assert "lm_head.weight" in ours[2]


def test_head_only_sees_trained_positions(tiny_model, tiny_tokenizer, tmp_path):
    """The head's matmul runs on as many rows as there are trained positions, not batch x length."""
    train = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    recipe = from_dict(tiny_recipe(tiny_model, train, tmp_path / "out"))
    model = loader.load_for_training(recipe, Precision("fp32", "test"))
    trainer = _trainer(recipe, model, True)
    batch = _batch(recipe, tiny_tokenizer, False)
    rows = []
    original = losspath.linear_cross_entropy_sum
    try:
        losspath.linear_cross_entropy_sum = lambda h, *a, **k: rows.append(h.shape[0]) or original(h, *a, **k)
        trainer.compute_loss(model, dict(batch))
    finally:
        losspath.linear_cross_entropy_sum = original
    trained = int((losspath.shift_targets(batch["labels"]) != -100).sum())
    assert rows == [trained] and trained < batch["input_ids"].numel() / 2
    with torch.no_grad():  # generation and plain forwards still get logits
        logits = model(input_ids=batch["input_ids"][:1]).logits
    assert logits.shape[-1] == len(tiny_tokenizer)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_trained_positions_found_on_the_host_give_the_same_loss_with_no_sync(tiny_model, tiny_tokenizer, tmp_path,
                                                                             packing, monkeypatch):
    """The collator lists the trained positions as it builds the batch; the head then selects them without the
    device-side nonzero (a host sync a step), and the loss is the same."""
    train = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    recipe = from_dict(tiny_recipe(tiny_model, train, tmp_path / "out", data={"packing": packing}))
    model = loader.load_for_training(recipe, Precision("fp32", "test"))
    trainer = _trainer(recipe, model, True)
    features = [arrow.build(recipe.data, tiny_tokenizer, 0).train[i] for i in range(5)]
    batch = collator(tiny_tokenizer, packing, positions=True)(features)
    shifted = losspath.shift_targets(batch["labels"]).reshape(-1)
    assert batch[TRAINED_POSITIONS].tolist() == (shifted != losspath.IGNORE).nonzero().squeeze(1).tolist()
    plain = {k: v for k, v in batch.items() if k != TRAINED_POSITIONS}
    with torch.no_grad():
        expected = trainer.compute_loss(model, dict(plain))
        nonzero = []
        monkeypatch.setattr(torch.Tensor, "nonzero", lambda t, *a, **k: nonzero.append(1) or torch.nonzero(t))
        got = trainer.compute_loss(model, dict(batch))
    assert nonzero == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                          final_logit_softcapping=30.0))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=2))


@pytest.mark.parametrize("build,reason", [
    (_gemma2, "Gemma2ForCausalLM.forward changes the logits after the head"),
    (_mixtral, "MixtralForCausalLM.forward adds an auxiliary loss"),
])
def test_models_the_chunked_path_cannot_reproduce_keep_the_stock_path(build, reason, caplog):
    with caplog.at_level(logging.WARNING, logger="tunekit"):
        assert losspath.install(build()) is None
    assert caplog.text.count("loss: computed over all positions (the stock path), because " + reason) == 1


def test_a_lora_wrapped_head_keeps_the_stock_path(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert "not a plain Linear" in losspath.unsupported_reason(model)
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=2, target_modules=["q_proj"]))
    assert losspath.unsupported_reason(plain) is None
