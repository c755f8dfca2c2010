"""The plan's activation bytes per token and layer equal what autograd keeps in a decoder layer loaded as
`tunekit train` loads it: saved-tensor hooks on one layer count every per-position tensor it saves (the rotary
tables, saved by every layer, once for the model, are left out), for LoRA, QLoRA and full fine-tuning, at fp32 and
bf16, with and without LoRA dropout, on a Llama whose query width (heads x head_dim) is not its hidden size, as
Qwen3's and Gemma's are not."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import write_jsonl
from savedtensors import kept_in_layer
from tunekit.config.recipefile import from_dict
from tunekit.core.hardware import Precision
from tunekit.models import loader
from tunekit.models.tiny import build_tokenizer, llama_config
from tunekit.plan import activations, estimate, shapes

pytestmark = pytest.mark.slow  # loads a model per case
SEQ = 200  # no dimension of the model: only per-position tensors have it


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide")
    tok = build_tokenizer(path)
    cfg = llama_config(tok, 512)
    cfg.update({"hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 64})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def saved_per_token(model, layer: int, autocast: bool) -> float:
    """Bytes per position of the tensors autograd saves in decoder layer `layer` and not in the layer before it."""
    return sum(kept_in_layer(model, layer, SEQ, autocast, keep=lambda t: SEQ in t.shape).values()) / SEQ


@pytest.mark.parametrize(("adapter", "precision", "dropout"), [
    ("lora", "fp32", 0.0), ("lora", "fp32", 0.05), ("lora", "bf16", 0.0), ("lora", "bf16", 0.05),
    ("qlora", "fp32", 0.0), ("qlora", "bf16", 0.0), ("qlora", "bf16", 0.05), ("none", "fp32", None),
    ("none", "bf16", None)])
def test_planned_activations_are_what_autograd_keeps(wide_heads, tmp_path, adapter, precision, dropout):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])
    raw = {"model": {"name_or_path": str(wide_heads)}, "adapter": adapter,
           "data": {"train": str(data), "max_length": SEQ}, "training": {"precision": precision}}
    if dropout is not None:
        raw["lora"] = {"dropout": dropout, "r": 16}
    recipe = from_dict(raw)
    model = loader.load_for_training(recipe, Precision(precision, "test"))
    model.train()
    cfg = model.config
    assert shapes.q_width(cfg) == 256 != cfg.hidden_size
    planned = activations.layer_bytes_per_token(cfg, estimate.settings_from(recipe, 1, precision), recipe)
    assert planned == saved_per_token(model, 1, autocast=precision == "bf16")
