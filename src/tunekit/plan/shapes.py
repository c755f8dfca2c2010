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
