"""Tokenizing with masks: a rendered record as token ids and labels, a token trained (its label its id)
when its first character lies in a trained span, every other label IGNORE; truncation to data.max_length,
and the counts of what a set of examples holds (DataStats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tunekit.config.schema import DataConfig
from tunekit.data.rendering import Rendered

IGNORE = -100  # the label of a position the loss skips


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


@dataclass
class DataStats:
    examples: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    notes: list[str] = field(default_factory=list)  # default renderings the chat template needed (data.chat)

    def line(self, name: str, max_length: int) -> str:
        return (
            f"{name}: {self.examples} examples, {self.tokens} tokens ({self.trained_tokens} trained); "
            f"{self.truncated} truncated to {max_length} tokens; {self.dropped_no_target} dropped with no trained token"
        )


def trained_count(labels: list[int]) -> int:
    """Trained positions of an example; labels are shifted inside the model, so position 0 is never a target."""
    return sum(1 for label in labels[1:] if label != IGNORE)


def tokenize(rendered: Rendered, tokenizer, max_length: int, mask_prompt: bool) -> tuple[Example, bool]:
    """Token ids and labels; a token is trained when its first character lies in a trained span.
    Returns the example and whether it was truncated."""
    enc = tokenizer(rendered.text, add_special_tokens=rendered.add_special_tokens, return_offsets_mapping=True)
    return _labelled(enc["input_ids"], enc["offset_mapping"], rendered.spans, max_length, mask_prompt)


def _labelled(ids: list[int], offsets, spans, max_length: int, mask_prompt: bool) -> tuple[Example, bool]:
    if mask_prompt:
        labels = [IGNORE] * len(ids)
        for j, (start, end) in enumerate(offsets):
            if end > start and any(s <= start < e for s, e in spans):
                labels[j] = ids[j]
    else:
        labels = list(ids)
    truncated = len(ids) > max_length
    return Example(ids[:max_length], labels[:max_length]), truncated


def tokenize_batch(renders: list[Rendered], tokenizer, max_length: int,
                   mask_prompt: bool) -> list[tuple[Example, bool]]:
    """`tokenize` for many: one tokenizer call per special-token setting (fast tokenizers batch in Rust)."""
    out: list[tuple[Example, bool] | None] = [None] * len(renders)
    for flag in {r.add_special_tokens for r in renders}:
        idx = [i for i, r in enumerate(renders) if r.add_special_tokens == flag]
        enc = tokenizer([renders[i].text for i in idx], add_special_tokens=flag, return_offsets_mapping=True)
        for k, i in enumerate(idx):
            out[i] = _labelled(enc["input_ids"][k], enc["offset_mapping"][k], renders[i].spans, max_length, mask_prompt)
    return out  # type: ignore[return-value]


def build_examples(renders: list[Rendered], tokenizer, cfg: DataConfig) -> tuple[list[Example], DataStats]:
    """The examples with a trained token left after truncation, and their counts."""
    stats = DataStats()
    out = []
    for ex, truncated in tokenize_batch(renders, tokenizer, cfg.max_length, cfg.mask_prompt):
        stats.truncated += truncated
        trained = trained_count(ex.labels)
        if trained == 0:
            stats.dropped_no_target += 1
            continue
        stats.examples += 1
        stats.tokens += len(ex.input_ids)
        stats.trained_tokens += trained
        out.append(ex)
    return out, stats
