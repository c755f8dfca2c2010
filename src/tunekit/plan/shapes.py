"""A decoder layer's attention widths per token, from the model's config. The head dimension is the config's
head_dim where it names one: Qwen3's and Gemma's query heads x head dimension differ from hidden_size (Qwen3-0.6B:
16 x 128 = 2,048 for a hidden size of 1,024)."""

from __future__ import annotations


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def q_width(cfg) -> int:
    """Query (and attention output) width: query heads x head dimension."""
    return cfg.num_attention_heads * head_dim(cfg)


def kv_width(cfg) -> int:
    """Key (or value) width: key-value heads x head dimension."""
    return (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim(cfg)


def latent_attention(cfg) -> bool:
    """Whether the attention is DeepSeek's multi-head latent attention (keys and values through a low-rank latent,
    kv_lora_rank in the config: DeepSeek-V2/V3, Kimi K2), which the plan counts as plain attention."""
    return bool(getattr(cfg.get_text_config(), "kv_lora_rank", None))


def qk_norm_groups(model, cfg) -> int:
    """RMS values per token of the attention's query and key norms (Qwen3's, OLMoE's and Gemma 3's q_norm and
    k_norm; per head or over the whole width, as each norm's weight says), 0 for a model without them."""
    for module in model.modules():
        q, k = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        if getattr(q, "weight", None) is not None and getattr(k, "weight", None) is not None:
            return q_width(cfg) // q.weight.numel() + kv_width(cfg) // k.weight.numel()
    return 0


def attention(cfg, recipe) -> str | None:
    """The attention that runs: the recipe's model.attn_implementation, else the one the model chose when it was
    built (its config's; gpt-oss and Gemma 2 choose eager)."""
    return recipe.model.attn_implementation or getattr(cfg, "_attn_implementation", None)
