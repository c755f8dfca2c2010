"""GGUF export of each model family besides Llama (export.architectures): a tiny random model of the family
with its real tokenizer (tunekit.models.families: the files the model makers ship, from package registries),
written as llama.cpp's converter writes that family, then read back by transformers: logits and top-1 equal the
source model's, token ids identical on the probe texts, the chat template and special tokens carried over,
and the family's own settings in the file. `make export-check` runs llama.cpp itself on the same files."""

from __future__ import annotations

import pytest

from conftest import in_full
from tunekit.export import gguf, readback
from tunekit.export.source import Facts
from tunekit.models.families import FAMILIES, build_family_model

# the keys only that family has, with the config attribute each must equal (llama.cpp reads them)
OWN_KEYS = {
    "gemma2": {"gemma2.attn_logit_softcapping": "attn_logit_softcapping",
               "gemma2.final_logit_softcapping": "final_logit_softcapping", "gemma2.attention.sliding_window":
               "sliding_window", "gemma2.attention.key_length": "head_dim"},
    "gemma3": {"gemma3.attention.sliding_window": "sliding_window", "gemma3.attention.key_length": "head_dim"},
    "qwen3": {"qwen3.attention.key_length": "head_dim"},
    "mistral": {"llama.attention.key_length": "head_dim"},
    "phi3": {"phi3.rope.dimension_count": None},  # hidden / heads: Phi-3 rotates whole heads
    "qwen2": {},
}
# SentencePiece-style vocabularies: whether llama.cpp puts a space before the first word (Gemma: no)
SPACE_PREFIX = {"gemma2": False, "gemma3": False, "phi3": True}
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "mistral": "llama",
             "phi3": "phi3"}


# make test keeps Qwen3 (Qwen's byte-level BPE), Gemma 3 (Gemma's SentencePiece) and Phi-3 (its own keys and
# rotary width); Qwen2, Gemma 2 and Mistral (the llama architecture test_export.py covers, with a byte-level BPE
# vocabulary) run in make test-full (last run: tests/export-families-full-last-run.json) and in make
# export-check's llama.cpp run
IN_FULL = {"qwen2", "gemma2", "mistral"}


@pytest.mark.slow  # 30-70 s each: transformers parses a 150k-256k token vocabulary twice on read-back
@pytest.mark.parametrize("family", [in_full(f) if f in IN_FULL else f for f in FAMILIES])
def test_each_family_exports_and_reads_back_with_its_logits_token_ids_and_chat_template(tmp_path, family):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata

    model_dir = tmp_path / family
    tok = build_family_model(model_dir, family)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = tmp_path / f"{family}.gguf"
    gguf.write_gguf(model, tok, out, gguf.QUANTS["f32"], Facts(family, f"tiny-{family}"))

    # transformers' quick header reader: gguf's GGUFReader would spend ~30 s on the vocabulary arrays
    header = GgufHeader.from_file(str(out))
    meta, names = read_gguf_metadata(str(out))
    assert meta["general.architecture"] == GGUF_ARCH[family]
    assert meta["tokenizer.chat_template"] == tok.chat_template and tok.chat_template
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert meta.get("tokenizer.ggml.bos_token_id") == tok.bos_token_id
    assert meta.get("tokenizer.ggml.add_space_prefix") == SPACE_PREFIX.get(family)
    for key, attr in OWN_KEYS[family].items():
        cfg = model.config
        assert meta[key] == pytest.approx(getattr(cfg, attr) if attr
                                          else cfg.hidden_size // cfg.num_attention_heads), key
    assert ("output.weight" in names) == (not model.config.tie_word_embeddings)
    if gguf.architecture(model.config, "test").norm_shift:  # Gemma: llama.cpp stores 1 + w
        norm = next(t for t in header.tensors if t.name == "blk.0.attn_norm.weight")
        stored = np.memmap(out, dtype=np.float32, mode="r", offset=header.data_start + norm.offset, shape=norm.shape)
        expected = model.model.layers[0].input_layernorm.weight.detach().numpy() + 1
        assert abs(stored - expected).max() < 1e-6

    result = readback.check(model, tok, out, readback.prompts(None, tok))
    assert result.parity.top1_agreement == 1.0 and result.parity.max_abs_diff < 1e-4, result.line()
    assert result.token_mismatches == [], result.token_mismatches
    assert result.passes(gguf.QUANTS["f32"])


# the mixture-of-experts families llama.cpp runs: GGUF name, the config attribute of one expert's FFN width
MOE_GGUF = {"qwen3_moe": ("qwen3moe", "moe_intermediate_size"), "olmoe": ("olmoe", "intermediate_size")}


@pytest.mark.slow  # the vocabulary parsed on read-back
@pytest.mark.parametrize("family", list(MOE_GGUF))
def test_a_moe_exports_its_experts_as_llama_cpp_keeps_them_and_reads_back_with_its_logits(tmp_path, family):
    """transformers 5 keeps a sparse block's experts in two 3-D tensors (gate and up rows joined, then down);
    llama.cpp's qwen3moe and olmoe read three (ffn_gate_exps, ffn_up_exps, ffn_down_exps) beside the router
    (ffn_gate_inp) and the expert keys. Read back by transformers (OLMoE registered with its reader for the check
    only), the file gives the model's logits."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata

    tok = build_family_model(tmp_path / "model", family)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32)
    cfg = model.config
    name, width = MOE_GGUF[family]
    out = tmp_path / f"{family}.gguf"
    gguf.write_gguf(model, tok, out, gguf.QUANTS["f32"], Facts(family, f"tiny-{family}"))
    meta, _ = read_gguf_metadata(str(out))
    assert meta["general.architecture"] == name
    assert (meta[f"{name}.expert_count"], meta[f"{name}.expert_used_count"]) == (cfg.num_experts,
                                                                                 cfg.num_experts_per_tok)
    shapes = {t.name: tuple(t.shape) for t in GgufHeader.from_file(str(out)).tensors}
    experts, inter, hidden = cfg.num_experts, getattr(cfg, width), cfg.hidden_size
    assert meta.get(f"{name}.expert_feed_forward_length", meta[f"{name}.feed_forward_length"]) == inter
    assert shapes["blk.1.ffn_gate_exps.weight"] == shapes["blk.1.ffn_up_exps.weight"] == (experts, inter, hidden)
    assert shapes["blk.1.ffn_down_exps.weight"] == (experts, hidden, inter)
    assert shapes["blk.1.ffn_gate_inp.weight"] == (experts, hidden)
    assert shapes["blk.1.attn_k_norm.weight"] == (cfg.head_dim if family == "qwen3_moe" else hidden,)
    supported = list(reader.GGUF_SUPPORTED_ARCHITECTURES)
    result = readback.check(model, tok, out, readback.prompts(None, tok))
    assert result.parity.top1_agreement == 1.0 and result.parity.max_abs_diff < 1e-4, result.line()
    assert result.passes(gguf.QUANTS["f32"])
    assert reader.GGUF_SUPPORTED_ARCHITECTURES == supported and "olmoe" not in reader.TENSOR_PROCESSORS


def test_the_readers_tables_hold_olmoe_only_for_the_check_and_are_left_as_they_were():
    """Nested, or left by an error, the read-back's registration leaves transformers' GGUF reader as it found it."""
    from transformers import modeling_gguf_pytorch_utils as reader

    from tunekit.export.architectures import ARCHITECTURES

    def tables():
        return (dict(reader.GGUF_TO_TRANSFORMERS_MAPPING["config"]), dict(reader.TENSOR_PROCESSORS),
                list(reader.GGUF_SUPPORTED_ARCHITECTURES))

    before = tables()
    assert "olmoe" not in before[2]
    with pytest.raises(RuntimeError, match="inside"):
        with readback.registered(ARCHITECTURES["olmoe"]):
            inside = tables()
            with readback.registered(ARCHITECTURES["olmoe"]):
                assert tables() == inside
            assert tables() == inside and "olmoe" in inside[2]
            assert inside[0]["olmoe"] == before[0]["qwen3_moe"] and inside[1]["olmoe"] is before[1]["qwen3moe"]
            raise RuntimeError("inside")
    assert tables() == before
    with readback.registered(ARCHITECTURES["qwen3_moe"]):  # listed by transformers: read as it is
        assert tables() == before


@pytest.mark.parametrize("family, changes, says", [
    ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob: false"),
    ("olmoe", {"norm_topk_prob": True}, "this model has norm_topk_prob: true"),
    ("olmoe", {"num_key_value_heads": 2, "clip_qkv": 8.0},
     "this model has 2 key/value heads for 4 query heads, clip_qkv: 8.0"),
    ("olmoe", {"hidden_act": "gelu", "attention_bias": True, "tie_word_embeddings": True},
     "this model has hidden_act: gelu, attention_bias: true, tie_word_embeddings: true"),
    ("mixtral", {}, "this one is MixtralForCausalLM")])
def test_a_moe_llama_cpp_would_compute_otherwise_is_refused_in_one_line(tmp_path, family, changes, says):
    """A Qwen3-MoE whose router does not normalise its top-k weights (llama.cpp's qwen3moe always does), an OLMoE
    that does (llama.cpp's olmoe never does), one with grouped key/value heads, clamped q/k/v, another activation,
    attention biases or a tied output (llama.cpp's olmoe has none of these, and would not load the last two), and a
    family with no GGUF entry here: each refused before anything is written."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunekit.core.errors import TunekitError

    tok = build_family_model(tmp_path / family, family)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path / family), **changes))
    out = tmp_path / f"{family}.gguf"
    with pytest.raises(TunekitError, match=says) as caught:
        gguf.write_gguf(model, tok, out, gguf.QUANTS["f32"], Facts(family, f"tiny-{family}"))
    assert "\n" not in str(caught.value) and not out.exists()
