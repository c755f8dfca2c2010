"""torch's varlen flash kernel for packed batches (models.attention): the wiring, checked on CPU with a reference
kernel in the CUDA kernel's place (per-sequence SDPA), against SDPA with transformers' block-causal mask; where it
is chosen and where the run keeps today's attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, masking_utils

from tunekit.core.errors import TunekitError
from tunekit.data.collating import collator
from tunekit.models import attention


def reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """varlen_attn's contract computed by SDPA one sequence at a time: (tokens, heads, dim) in and out, causal."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        a, b = int(cu_q[i]), int(cu_q[i + 1])
        c, d = int(cu_k[i]), int(cu_k[i + 1])
        assert b - a <= max_q and d - c <= max_k
        piece = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=k.shape[1] != q.shape[1])
        out[a:b] = piece.transpose(0, 1)
    return out


@pytest.fixture(params=["reference", "shipped"])
def varlen_on_cpu(request, monkeypatch):
    """`varlen` registered, its kernel the per-sequence SDPA reference above or the one this machine runs."""
    attention.register()
    if request.param == "reference":
        monkeypatch.setattr(attention, "_kernel", reference_kernel)


def tiny(path, name="sdpa"):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    model.config.use_cache = False
    if name != "sdpa":
        model.set_attn_implementation(name)
    return model


def packed_batch(tokenizer, lengths=(5, 17, 9, 30)):
    features = [{"input_ids": [3 + (i * 7 + j) % 300 for j in range(n)], "labels": [3 + (i + j) % 300 for j in
                                                                                  range(n)]}
                for i, n in enumerate(lengths)]
    return collator(tokenizer, packing=True, boundaries=True)(features)


def test_packed_logits_loss_and_gradients_equal_sdpa_with_the_block_mask(tiny_model, tiny_tokenizer, varlen_on_cpu):
    batch = packed_batch(tiny_tokenizer)
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 22, 31, 61] and batch["max_length_q"] == 30
    plain = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    results = []
    for name, inputs in (("sdpa", plain), (attention.NAME, batch)):
        model = tiny(tiny_model, name)
        out = model(**inputs)
        out.loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((out.logits.detach(), out.loss.detach(), grads))
    (sdpa_logits, sdpa_loss, sdpa_grads), (varlen_logits, varlen_loss, varlen_grads) = results
    torch.testing.assert_close(varlen_logits, sdpa_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(varlen_loss, sdpa_loss, rtol=0, atol=1e-6)
    assert len(varlen_grads) == len(sdpa_grads) > 0
    for a, b in zip(varlen_grads, sdpa_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # and the block mask mattered: without it (one causal row) the logits differ
    with torch.no_grad():
        whole = tiny(tiny_model)(input_ids=batch["input_ids"]).logits
    assert (whole - sdpa_logits).abs().max() > 1e-3


def test_no_forward_infers_the_sequences_from_position_ids(tiny_model, tiny_tokenizer, varlen_on_cpu, monkeypatch):
    calls = []
    original = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: calls.append(1) or original(p))
    batch = packed_batch(tiny_tokenizer)
    with torch.no_grad():
        tiny(tiny_model, attention.NAME)(**batch)
    assert calls == []
    with torch.no_grad():  # SDPA does, on every forward: what varlen leaves out
        tiny(tiny_model)(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    assert calls == [1]


def test_a_packed_row_without_boundaries_is_still_kept_apart(tiny_model, tiny_tokenizer, varlen_on_cpu):
    batch = packed_batch(tiny_tokenizer)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    with torch.no_grad():
        torch.testing.assert_close(tiny(tiny_model, attention.NAME)(**inputs).logits,
                                   tiny(tiny_model)(**inputs).logits, rtol=0, atol=1e-5)


def test_padded_batches_and_generation_are_sdpa_s(tiny_model, tiny_tokenizer, varlen_on_cpu):
    tiny_tokenizer.padding_side = "left"
    enc = tiny_tokenizer(["The quick brown fox", "cat"], return_tensors="pt", padding=True)
    assert not enc["attention_mask"].all()
    sdpa, varlen = tiny(tiny_model), tiny(tiny_model, attention.NAME)
    with torch.no_grad():
        torch.testing.assert_close(varlen(**enc).logits, sdpa(**enc).logits, rtol=0, atol=1e-5)
        for m in (sdpa, varlen):
            m.config.use_cache = True
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tiny_tokenizer.pad_token_id)
        assert varlen.generate(**enc, **kw).tolist() == sdpa.generate(**enc, **kw).tolist()


def test_where_it_is_chosen(tiny_model, monkeypatch):
    model = tiny(tiny_model)
    assert attention.choose(model, "eager", "bf16", True, 512).reason == "model.attn_implementation: eager"
    choice = attention.choose(model, None, "bf16", False, 512)
    assert choice.name == "sdpa" and choice.reason == "sdpa (varlen not used: batches are not packed)"
    with pytest.raises(TunekitError, match="model.attn_implementation: varlen cannot run here: batches are not "
                                           "packed; set it to sdpa or remove it"):
        attention.choose(model, "varlen", "bf16", False, 512)
    cfg = model.config
    for cuda in (False, True):  # on either device: packed, no window, no attention dropout
        assert "loaded with eager" in attention.unfit_reason(cfg, "bf16", True, 512, "eager", cuda)
        monkeypatch.setattr(cfg, "sliding_window", 256, raising=False)
        assert "window" in attention.unfit_reason(cfg, "bf16", True, 512, "sdpa", cuda)
        monkeypatch.setattr(cfg, "sliding_window", None)
        monkeypatch.setattr(cfg, "attention_dropout", 0.1)
        assert "attention dropout" in attention.unfit_reason(cfg, "bf16", True, 512, "sdpa", cuda)
        monkeypatch.setattr(cfg, "attention_dropout", 0.0)
    # a CPU runs it in any precision
    assert attention.unfit_reason(cfg, "fp32", True, 512, "sdpa", cuda=False) is None
    # a CUDA GPU as the flash kernel needs it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert attention.unfit_reason(cfg, "bf16", True, 512, "sdpa", cuda=True) is None
    assert "training.precision is fp32" in attention.unfit_reason(cfg, "fp32", True, 512, "sdpa", cuda=True)
    monkeypatch.setattr(cfg, "head_dim", 12)
    assert "head size 12" in attention.unfit_reason(cfg, "bf16", True, 512, "sdpa", cuda=True)
    monkeypatch.setattr(cfg, "head_dim", 8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert "compute capability 8.0" in attention.unfit_reason(cfg, "bf16", True, 512, "sdpa", cuda=True)
    # this machine: chosen, and said so in the run log
    choice = attention.choose(model, None, "fp32", True, 512)
    assert choice.name == attention.NAME and model.config._attn_implementation == attention.NAME
    assert choice.reason.startswith("varlen: ") and ("flash kernel" if torch.cuda.is_available() else
                                                     "each sequence alone") in choice.reason


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_cpu_kernel_equals_sdpa_over_the_block_mask(dtype, tol):
    """per_sequence: short sequences in its own kernel, long ones (past SHORT) on SDPA's flash kernel; GQA."""
    torch.manual_seed(0)
    lengths = [3, 40, attention.SHORT + 60, 17, 1]
    total, heads, kv, dim = sum(lengths), 4, 2, 16
    q, k, v = (torch.randn(total, h, dim, dtype=dtype, requires_grad=True) for h in (heads, kv, kv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = attention.per_sequence(q, k, v, cu, cu, max(lengths), max(lengths), dim ** -0.5)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (seq[:, None] == seq[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None].repeat_interleave(2, 1),
        v.transpose(0, 1)[None].repeat_interleave(2, 1), attn_mask=mask)[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    grads = [torch.autograd.grad((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum(), (q, k, v))
             for o in (out, ref)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_the_collator_carries_boundaries_only_for_a_kernel_that_reads_them(tiny_tokenizer):
    assert attention.reads_boundaries(attention.NAME) and attention.reads_boundaries("flash_attention_2")
    assert not attention.reads_boundaries("sdpa")
    plain = collator(tiny_tokenizer, packing=True, boundaries=False)([{"input_ids": [3, 4], "labels": [3, 4]}])
    assert "cu_seq_lens_q" not in plain


def test_boundaries_from_positions():
    cu, longest = attention.boundaries_from_positions(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
