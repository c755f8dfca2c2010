"""The model architectures `tunekit export --format gguf` writes, in one registry (ARCHITECTURES: transformers
model_type -> Architecture). Each entry says what llama.cpp's converter (convert_hf_to_gguf.py and its
conversion/ modules: llama.py, qwen.py, gemma.py, phi.py) does differently for that family: the GGUF
architecture name, q/k rows reordered for llama.cpp's rotary layout, norm weights stored shifted by one
(Gemma's RMSNorm scales by 1 + w), and the settings only that family has (soft-capping, sliding window,
partial rotary). What every family shares (sizes, heads, norm epsilon, RoPE base and scaling) is written by
`common_settings`. transformers' GGUF reader undoes each of these on read-back, which the export's read-back check
relies on. Adding a family is one entry here plus its tiny-model test."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tunekit.core.errors import TunekitError


def _rope(cfg) -> dict:
    """The RoPE parameters of the full-attention layers (transformers 5 keeps one dict per layer type where
    they differ, as Gemma 3 does)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    params = params.get("full_attention", params)
    if "rope_theta" not in params and getattr(cfg, "rope_theta", None):
        params = {**params, "rope_theta": cfg.rope_theta}
    return params


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rope_scaling(writer, cfg, where: str) -> None:
    import gguf

    rope = _rope(cfg)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind not in ("default", "llama3"):  # llama3's frequencies travel as the rope_freqs tensor (rope_tensors)
        raise TunekitError(f"{where}: export --format gguf writes default, linear, yarn and llama3 RoPE; this model's "
                           f"rope_type is {kind}")


def common_settings(writer, cfg, where: str) -> None:
    """The keys llama.cpp reads for every decoder-only family (conversion/base.py TextModel.set_gguf_parameters)."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if (theta := _rope(cfg).get("rope_theta")) is not None:
        writer.add_rope_freq_base(float(theta))
    _rope_scaling(writer, cfg, where)


def rope_tensors(cfg):
    """llama3-type RoPE as llama.cpp takes it: one `rope_freqs` tensor of per-dimension divisors
    (conversion/llama.py LlamaModel.generate_extra_tensors), or nothing for other RoPE types."""
    import math

    import numpy as np

    rope = _rope(cfg)
    if (rope.get("rope_type") or rope.get("type")) != "llama3":
        return
    base, dim = rope.get("rope_theta", 10000.0), head_dim(cfg)
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    yield "rope_freqs.weight", np.array(factors, dtype=np.float32)


def _llama(writer, cfg) -> None:
    writer.add_rope_dimension_count(head_dim(cfg))


def _gemma2(writer, cfg) -> None:
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)


def _gemma3(writer, cfg) -> None:
    if getattr(cfg, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)


def _phi3(writer, cfg) -> None:
    rotary = _rope(cfg).get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None) or 1.0
    writer.add_rope_dimension_count(int(rotary * cfg.hidden_size) // cfg.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(getattr(cfg, "original_max_position_embeddings", None)
                                         or cfg.max_position_embeddings)
    writer.add_sliding_window(getattr(cfg, "sliding_window", None) or 0)  # 0: none (llama.cpp's convention)


def _qwen3_moe(writer, cfg) -> None:
    # llama.cpp's qwen3moe graph (src/models/qwen3moe.cpp) always weighs a token's top-k experts normalised to a
    # sum of 1 (build_moe_ffn's norm_w: true): a model that does not would compute otherwise there
    if not getattr(cfg, "norm_topk_prob", False):
        raise TunekitError("export: llama.cpp's qwen3moe normalises each token's top-k expert weights to a sum of 1; "
                           "this model (norm_topk_prob: false) does not, so a GGUF file of it would compute otherwise")
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _olmoe(writer, cfg) -> None:
    # llama.cpp's olmoe graph (src/models/olmoe.cpp) weighs a token's top-k experts by their softmax probabilities
    # as they are (build_moe_ffn's norm_w: false), normalises k over n_embd values (as wide as q: no grouped
    # heads), clamps nothing, runs SiLU experts, has no attention biases and reads its own output matrix (no tied
    # fallback): a model that differs would compute otherwise there, or not load
    differs = [what for what, differ in (
        ("norm_topk_prob: true", getattr(cfg, "norm_topk_prob", False)),
        (f"{cfg.num_key_value_heads} key/value heads for {cfg.num_attention_heads} query heads",
         cfg.num_key_value_heads != cfg.num_attention_heads),
        (f"clip_qkv: {getattr(cfg, 'clip_qkv', None)}", getattr(cfg, "clip_qkv", None) is not None),
        (f"hidden_act: {cfg.hidden_act}", cfg.hidden_act != "silu"),
        ("attention_bias: true", getattr(cfg, "attention_bias", False)),
        ("tie_word_embeddings: true", getattr(cfg, "tie_word_embeddings", False))) if differ]
    if differs:
        raise TunekitError(f"export: llama.cpp's olmoe takes the top-k expert weights unnormalised, as many "
                           f"key/value heads as query heads, no clip_qkv, SiLU, no attention biases and an output "
                           f"matrix of its own; this model has {', '.join(differs)}, so a GGUF file of it would "
                           "compute otherwise")
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)


def _none(writer, cfg) -> None:
    pass


@dataclass(frozen=True)
class Architecture:
    gguf_arch: str  # gguf.MODEL_ARCH member
    families: str  # for messages
    permute_qk: bool = False  # llama.cpp's llama graph rotates interleaved pairs; transformers rotates halves
    norm_shift: float = 0.0  # added to every *norm.weight (Gemma's RMSNorm multiplies by 1 + w)
    settings: Callable = field(default=_none)  # (writer, config): the family's own keys
    # the transformers model type the read-back check loads the file as, where transformers' GGUF reader may
    # pick another: it reads a llama file named exactly "mistral" as Mistral, then finds no tensor map for it
    read_back_as: str | None = None
    # config attributes transformers' GGUF reader leaves at their defaults, read back from the file's keys (the
    # architecture's own prefix left out) or set to what llama.cpp computes
    read_back_keys: tuple[tuple[str, str], ...] = ()
    read_back_set: tuple[tuple[str, object], ...] = ()
    # a family transformers' GGUF reader does not list, read as the listed one whose keys and tensors it shares
    # (registered with the reader for the read-back only: readback.registered)
    read_back_like: str | None = None

    @property
    def gguf_name(self) -> str:
        """The architecture's name in a GGUF file (general.architecture, the keys' prefix): qwen3moe, olmoe, ..."""
        import gguf

        return gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, self.gguf_arch)]


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LLAMA", "Llama 2/3, SmolLM2", permute_qk=True, settings=_llama),
    "mistral": Architecture("LLAMA", "Mistral", permute_qk=True, settings=_llama, read_back_as="llama"),
    "qwen2": Architecture("QWEN2", "Qwen2/Qwen2.5"),
    "qwen3": Architecture("QWEN3", "Qwen3"),
    "gemma2": Architecture("GEMMA2", "Gemma 2", norm_shift=1.0, settings=_gemma2),
    "gemma3_text": Architecture("GEMMA3", "Gemma 3 (text)", norm_shift=1.0, settings=_gemma3),
    "phi3": Architecture("PHI3", "Phi-3/Phi-3.5", settings=_phi3),
    "qwen3_moe": Architecture("QWEN3MOE", "Qwen3-MoE", settings=_qwen3_moe,
                              read_back_keys=(("expert_feed_forward_length", "moe_intermediate_size"),),
                              read_back_set=(("norm_topk_prob", True),)),
    "olmoe": Architecture("OLMOE", "OLMoE", settings=_olmoe, read_back_like="qwen3_moe"),
}


def architecture(config, where: str) -> Architecture:
    """The registry entry for `config`, or a one-line refusal naming the families that are supported."""
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        found = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        names = "; ".join(f"{a.families} ({t})" for t, a in ARCHITECTURES.items())
        raise TunekitError(f"{where}: export --format gguf supports {names}; this one is {found}")
    return arch
