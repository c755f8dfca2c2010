"""The expert load counted at evaluations (training.routerbalance.ExpertLoad): every real token's top-k picks, padding
left out, per router; the imbalance of a known spread."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tunekit.training.routerbalance import ExpertLoad


def test_each_real_token_is_counted_top_k_times_per_layer():
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=8,
                               num_experts_per_tok=2, vocab_size=50)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    load = ExpertLoad(model)
    assert load and sorted(load.routers) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    ids = torch.randint(0, 50, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with torch.no_grad(), load.counting():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    for name, layer in zip(sorted(load.tokens), out.router_logits):
        assert load.tokens[name].sum() == 10 * 2  # 10 real tokens, 2 experts each
        picked = layer.topk(2, dim=-1).indices[mask.reshape(-1).bool()]
        assert load.tokens[name].tolist() == torch.bincount(picked.reshape(-1), minlength=8).tolist()
    with torch.no_grad():
        model(input_ids=ids)  # outside `counting` nothing is counted
    assert all(t.sum() == 20 for t in load.tokens.values())
    line = json.loads(load.line(7))
    assert line["step"] == 7 and line["top_k"] == 2 and len(line["layers"]) == 2


def test_the_imbalance_is_the_busiest_expert_over_the_mean_in_the_worst_layer():
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4,
                               num_experts_per_tok=1, vocab_size=50)
    load = ExpertLoad(AutoModelForCausalLM.from_config(cfg))
    load.tokens = {"a": torch.tensor([5, 5, 5, 5]), "b": torch.tensor([20, 0, 0, 0])}
    assert load.imbalance() == 4.0  # every token to one of 4 experts
    load.tokens = {"a": torch.tensor([5, 5, 5, 5])}
    assert load.imbalance() == 1.0
