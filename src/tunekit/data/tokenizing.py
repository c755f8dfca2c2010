"""Tokenizing with masks: a rendered record as token ids and labels, a token trained (its label its id)
when it overlaps a trained span, every other label IGNORE; truncation to data.max_length,
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
    images: tuple = ()  # data.images.Image values whose tokens the ids hold (vision-language models)


@dataclass
class DataStats:
    examples: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    notes: list[str] = field(default_factory=list)  # default renderings the chat template needed (data.chattemplate)

    def line(self, name: str, max_length: int) -> str:
        return (
            f"{name}: {self.examples} examples, {self.tokens} tokens ({self.trained_tokens} trained); "
            f"{self.truncated} truncated to {max_length} tokens; {self.dropped_no_target} dropped with no trained token"
        )


def trained_count(labels: list[int]) -> int:
    """Trained positions of an example; labels are shifted inside the model, so position 0 is never a target."""
    return sum(1 for label in labels[1:] if label != IGNORE)


def tokenize(rendered: Rendered, tokenizer, max_length: int, mask_prompt: bool,
             image_tokens=None) -> tuple[Example, bool]:
    """Token ids and labels; a token is trained when any of its characters lies in a trained span (a token that
    merges the template's space before an answer with the answer's first word, as " Red" after "Assistant:", is
    what the model writes after its generation prompt, so it trains); each image's
    marker becomes its image tokens, never trained (`image_tokens`: data.imagetokens.ImageTokens).
    Returns the example and whether it was truncated."""
    enc = tokenizer(rendered.text, add_special_tokens=rendered.add_special_tokens, return_offsets_mapping=True)
    return _labelled(enc["input_ids"], enc["offset_mapping"], rendered, max_length, mask_prompt, image_tokens)


def _labelled(ids: list[int], offsets, rendered: Rendered, max_length: int, mask_prompt: bool,
              image_tokens=None) -> tuple[Example, bool]:
    if mask_prompt:
        labels = [IGNORE] * len(ids)
        for j, (start, end) in enumerate(offsets):
            if end > start and any(start < e and end > s for s, e in rendered.spans):
                labels[j] = ids[j]
    else:
        labels = list(ids)
    if not rendered.images:
        return Example(ids[:max_length], labels[:max_length]), len(ids) > max_length
    full, labels, ends = image_tokens.expand(ids, labels, rendered.images, rendered.where)
    sizes = [len(image_tokens.ids(image)) for image in rendered.images]
    kept_ids, kept_labels, kept = cut(full, labels, ends, sizes, max_length)
    return Example(kept_ids, kept_labels, rendered.images[:kept]), len(full) > max_length


def cut(ids: list[int], labels: list[int], ends: list[int], sizes: list[int], max_length: int
        ) -> tuple[list[int], list[int], int]:
    """Truncation to `max_length` that never cuts an image in two: the example ends before the first image that
    does not fit whole. Returns ids, labels and how many images remain."""
    keep, length = len(ends), max_length
    for k, (end, size) in enumerate(zip(ends, sizes)):
        if end > max_length:
            keep, length = k, min(max_length, end - size)
            break
    return ids[:length], labels[:length], keep


def tokenize_batch(renders: list[Rendered], tokenizer, max_length: int,
                   mask_prompt: bool, image_tokens=None) -> list[tuple[Example, bool]]:
    """`tokenize` for many: one tokenizer call per special-token setting (fast tokenizers batch in Rust)."""
    out: list[tuple[Example, bool] | None] = [None] * len(renders)
    for flag in {r.add_special_tokens for r in renders}:
        idx = [i for i, r in enumerate(renders) if r.add_special_tokens == flag]
        enc = tokenizer([renders[i].text for i in idx], add_special_tokens=flag, return_offsets_mapping=True)
        for k, i in enumerate(idx):
            out[i] = _labelled(enc["input_ids"][k], enc["offset_mapping"][k], renders[i], max_length, mask_prompt,
                               image_tokens)
    return out  # type: ignore[return-value]


def build_examples(renders: list[Rendered], tokenizer, cfg: DataConfig,
                   image_tokens=None) -> tuple[list[Example], DataStats]:
    """The examples with a trained token left after truncation, and their counts."""
    stats = DataStats()
    out = []
    for ex, truncated in tokenize_batch(renders, tokenizer, cfg.max_length, cfg.mask_prompt, image_tokens):
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
