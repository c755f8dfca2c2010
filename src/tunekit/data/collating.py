"""Collating: tokenized examples into batches (padded, or packed into one row), and the count of real and
computed tokens the batches hold."""

from __future__ import annotations

from tunekit.data.tokenizing import IGNORE


class CountingCollator:
    """Wraps a collator and counts real (non-padding) and computed tokens, for throughput and padding
    numbers. Counts every batch it builds, eval batches during training included."""

    def __init__(self, inner):
        self.inner = inner
        self.real = 0
        self.computed = 0

    def __call__(self, features):
        batch = self.inner(features)
        real, computed = self.count(batch, features)
        self.real += real
        self.computed += computed
        return batch

    @staticmethod
    def count(batch, features) -> tuple[int, int]:
        """(real, computed) tokens of one batch."""
        mask = batch.get("attention_mask")  # absent in packed batches, which hold no padding
        real = int(mask.sum()) if mask is not None else sum(len(f["input_ids"]) for f in features)
        return real, batch["input_ids"].numel()

    @property
    def padding_fraction(self) -> float:
        return 1 - self.real / self.computed if self.computed else 0.0


def features(examples, images: bool = False) -> list[dict]:
    """Tokenized examples (data.tokenizing.Example) as the collator takes them; `images`: with the images their
    tokens stand for (a vision-language model's batches)."""
    from tunekit.data.imagetokens import stored

    return [{"input_ids": e.input_ids, "attention_mask": [1] * len(e.input_ids), "labels": e.labels,
             **({"images": stored(e.images)} if images else {})} for e in examples]


class WithImages:
    """Padded batches of a vision-language model's examples: the text padded by `inner`, and the pixel inputs of
    each example's images (the `images` column of the prepared set) from the model's processor."""

    def __init__(self, inner, image_tokens):
        self.inner = inner
        self.image_tokens = image_tokens

    def __call__(self, features):
        from tunekit.data.imagetokens import restored

        per_example = [restored(f.get("images") or []) for f in features]
        batch = self.inner([{k: v for k, v in f.items() if k != "images"} for f in features])
        batch.update(self.image_tokens.pixels(per_example, batch["input_ids"]))
        return batch


class InPieces:
    """Batches a sequence-parallel group of `pieces` processes splits along the sequence (DeepSpeed's Ulysses
    loader): position ids in every batch, so each piece keeps its place in the row (packed batches have them,
    restarting per example), and rows padded to a multiple of `pieces` (pad token, no label, positions going on).
    The attention mask is left out: Ulysses attends causally over the gathered row and never reads it, and right
    padding after a causal row changes no real token. `rows`: a smaller batch (an epoch's last) gets rows of
    padding up to it, since Ulysses takes the micro-batch size it was set up with. `length`: every batch padded
    to this many positions, for CPU processes, whose gloo all-gather (the loader's exchange of the batches) needs
    one shape on every process."""

    def __init__(self, inner, pieces: int, pad_id: int, rows: int = 1, length: int | None = None):
        self.inner = inner
        self.pieces = pieces
        self.pad_id = pad_id
        self.rows = rows
        self.length = length

    def __call__(self, features):
        import torch

        batch = dict(self.inner(features))
        batch.pop("attention_mask", None)
        rows, length = batch["input_ids"].shape
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(length).expand(rows, -1).clone()
        extra = max(self.length - length, 0) if self.length else 0
        extra += -(length + extra) % self.pieces
        more = max(self.rows - rows, 0)
        fill = {"input_ids": self.pad_id, "labels": IGNORE}
        for key, value in list(batch.items()):
            if not (torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == length):
                continue
            if key == "position_ids":
                value = torch.cat([value, value[:, -1:] + torch.arange(1, extra + 1)], dim=1)
                batch[key] = torch.cat([value, torch.arange(length + extra).expand(more, -1)])
            else:
                batch[key] = torch.nn.functional.pad(value, (0, extra, 0, more),
                                                     value=fill.get(key, 0))
        return batch


TRAINED_POSITIONS = "trained_positions"  # the batch key WithTrainedPositions adds


class WithTrainedPositions:
    """Adds the flat indices of the positions whose next token carries a label (`trained_positions`), found on
    the host as the batch is built, so that the loss on trained positions (models.losspath) selects them on the
    device without a host sync. The trainer takes the key out before the model sees the batch."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, features):
        import torch

        batch = self.inner(features)
        labels = batch["labels"]
        trained = torch.zeros(labels.shape, dtype=torch.bool)
        trained[..., :-1] = labels[..., 1:] != IGNORE  # position t is trained on labels[t + 1]
        batch[TRAINED_POSITIONS] = trained.reshape(-1).nonzero().squeeze(1)
        return batch


def collator(tokenizer, packing: bool = False, boundaries: bool = False, image_tokens=None, pieces: int = 1,
             rows: int = 1, fixed: int | None = None, positions: bool = False):
    """Padded batches: input_ids padded with the pad token, labels with -100 (DataCollatorForSeq2Seq).
    Packed: DataCollatorWithFlattening concatenates the micro-batch into one row, restarts position
    ids per example and sets each example's first label to -100; attention builds a block-diagonal
    causal mask from the position ids or, with `boundaries`, reads the sequence boundaries
    (flash-attention), so no example sees another. With a vision-language model's `image_tokens`: padded, with
    each batch's pixel inputs (image examples are never packed). `pieces`, `rows`, `fixed`: the sequence-parallel
    size, the micro-batch size and the batch length on CPU processes (InPieces). `positions`: with the trained
    positions found on the host (WithTrainedPositions; one sequence piece per process only)."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    if packing:
        made = DataCollatorWithFlattening(separator_id=IGNORE, return_flash_attn_kwargs=boundaries)
    else:
        padded = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE, padding=True, pad_to_multiple_of=8)
        made = padded if image_tokens is None else WithImages(padded, image_tokens)
    if pieces > 1:
        return InPieces(made, pieces, tokenizer.pad_token_id, rows, fixed)
    return WithTrainedPositions(made) if positions else made
