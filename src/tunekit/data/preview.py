"""What training will see of a recipe's data, before any model weight loads: the counts data preparation
makes (examples, tokens, trained tokens, truncated, dropped with no trained token), tokens per role
(trained and not), a length histogram, and examples as segments of trained and untrained tokens.
How labels, token texts and roles are found: docs/data.md, "What `tunekit data` shows"."""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data import mixture, split
from tunekit.data.formats import Record
from tunekit.data.rendering import Rendered
from tunekit.data.tokenizing import IGNORE, DataStats, tokenize_batch

EXAMPLES_FILE = "data-examples.jsonl"  # a run's first training examples as segments, for the report
RUN_EXAMPLES = 3  # examples a run writes there
BATCH = 1000  # examples tokenized per call
BUCKETS = 8  # length histogram buckets at most
DECODE_CONTEXT = 8  # tokens decoded before each one when its text comes from ids alone


@dataclass
class Shown:
    """One example as training sees it."""

    index: int  # 1-based, among the examples of the training records
    where: str | None
    tokens: int
    trained_tokens: int
    truncated: bool
    dropped: bool  # no trained token left: preparation leaves it out
    segments: list[dict]  # {"text", "trained", "role", "tokens"}

    def to_json(self) -> dict:
        return {"example": self.index, "where": self.where, "tokens": self.tokens,
                "trained_tokens": self.trained_tokens, "truncated": self.truncated, "dropped": self.dropped,
                "segments": self.segments}


@dataclass
class Preview:
    max_length: int
    mask_prompt: bool
    stats: DataStats = field(default_factory=DataStats)
    roles: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> {"trained": n, "untrained": n}
    lengths: list[dict] = field(default_factory=list)  # {"from", "to", "examples"}: kept examples' lengths
    shown: list[Shown] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def trained_share(self) -> float:
        return self.stats.trained_tokens / self.stats.tokens if self.stats.tokens else 0.0

    def summary(self) -> dict:
        return {**vars(self.stats), "trained_share": round(self.trained_share, 4), "max_length": self.max_length,
                "mask_prompt": self.mask_prompt, "roles": self.roles, "lengths": self.lengths, "notes": self.notes}


def length_buckets(max_length: int) -> list[tuple[int, int]]:
    """(from, to) token counts, each bucket twice as wide as the one before, the last ending at max_length."""
    edges = [max_length]
    while len(edges) < BUCKETS and edges[-1] // 2 >= 8:
        edges.append(edges[-1] // 2)
    edges.reverse()
    return [(1 if i == 0 else edges[i - 1] + 1, edge) for i, edge in enumerate(edges)]


def renderer_for(cfg: DataConfig, tokenizer, image_tokens=None) -> mixture.Renderers:
    """The renderers training uses (one per source), filling Rendered.roles (chat-rendered examples)."""
    return mixture.Renderers(cfg, tokenizer, roles=True, image_tokens=image_tokens)


def rendered(renderer: mixture.Renderers, records: Iterable[Record]) -> Iterator[Rendered]:
    """The examples training renders from the records, in order."""
    for record in records:
        yield from renderer.examples(record)


def trained_flags(labels: list[int]) -> list[bool]:
    """Whether each position is a target of the loss (tokenizing.trained_count counts the same)."""
    return [j > 0 and label != IGNORE for j, label in enumerate(labels)]


def _pieces(r: Rendered, ids: list[int], offsets, truncated: bool, tokenizer) -> list[str]:
    """Each token's text: the rendered text from the previous token's end to its own."""
    special = set(tokenizer.all_special_ids)
    pieces, cursor = [], 0
    for tid, (start, end) in zip(ids, offsets):
        if end > start:
            pieces.append(r.text[cursor:end] if end > cursor else "")
            cursor = max(cursor, end)
        else:
            pieces.append(tokenizer.convert_ids_to_tokens(tid) if tid in special else "")
    if pieces and not truncated and cursor < len(r.text):
        pieces[-1] += r.text[cursor:]
    return pieces


def _roles(r: Rendered, offsets) -> list[str]:
    """Each token's role, by its first character."""
    ranges = r.roles
    if ranges is None:  # not chat-rendered: the trained spans and the rest
        return ["answer" if end > start and any(s <= start < e for s, e in r.spans) else "prompt"
                for start, end in offsets]
    ranges = sorted(ranges)
    starts = [s for s, _, _ in ranges]
    out = []
    for start, end in offsets:
        i = bisect.bisect_right(starts, start) - 1
        inside = end > start and i >= 0 and ranges[i][0] <= start < ranges[i][1]
        out.append(ranges[i][2] if inside else "template")
    return out


def merge(pieces: list[str], trained: list[bool], roles: list[str | None]) -> list[dict]:
    """Runs of tokens alike in trained and role, as segments."""
    segments = []
    for (flag, role), run in itertools.groupby(zip(pieces, trained, roles), key=lambda t: (t[1], t[2])):
        run = list(run)
        segments.append({"text": "".join(p for p, _, _ in run), "trained": flag, "role": role, "tokens": len(run)})
    return segments


def _encoded(renders: list[Rendered], tokenizer) -> list[tuple[list[int], list]]:
    """(ids, offsets) of each example, tokenized as tokenizing.tokenize_batch tokenizes it."""
    out: list = [None] * len(renders)
    for flag in {r.add_special_tokens for r in renders}:
        idx = [i for i, r in enumerate(renders) if r.add_special_tokens == flag]
        enc = tokenizer([renders[i].text for i in idx], add_special_tokens=flag, return_offsets_mapping=True)
        for k, i in enumerate(idx):
            out[i] = (enc["input_ids"][k], enc["offset_mapping"][k])
    return out


def _with_images(r: Rendered, ids: list[int], pieces: list[str], roles: list[str], image_tokens
                 ) -> tuple[list[str], list[str]]:
    """Pieces and roles of the text's tokens with each image's marker turned into its image tokens, as
    tokenizing does: role "image", the first one's piece naming the image and its token count."""
    _, out_pieces, _ = image_tokens.expand(
        ids, pieces, r.images, r.where,
        image_label=lambda k, size: [f"[image {k + 1}: {size} tokens]"] + [""] * (size - 1))
    _, out_roles, _ = image_tokens.expand(ids, roles, r.images, r.where, image_label=lambda k, size: ["image"] * size)
    return out_pieces, out_roles


def _add(p: Preview, renders: list[Rendered], tokenizer, show: int, histogram: list[int], image_tokens=None) -> None:
    """Count one batch of examples into `p`, and keep those still to be shown."""
    buckets = length_buckets(p.max_length)
    labelled = tokenize_batch(renders, tokenizer, p.max_length, p.mask_prompt, image_tokens)
    for r, (ex, truncated), (ids, offsets) in zip(renders, labelled, _encoded(renders, tokenizer)):
        n = len(ex.input_ids)
        trained = trained_flags(ex.labels)
        count, index = sum(trained), p.stats.examples + p.stats.dropped_no_target + 1
        p.stats.truncated += truncated
        keep = len(p.shown) < show
        if count == 0:
            p.stats.dropped_no_target += 1
        else:
            p.stats.examples += 1
            p.stats.tokens += n
            p.stats.trained_tokens += count
            histogram[next(i for i, (_, hi) in enumerate(buckets) if n <= hi)] += 1
        if count == 0 and not keep:
            continue
        if r.images:
            pieces, roles = _with_images(r, ids, _pieces(r, ids, offsets, False, tokenizer), _roles(r, offsets),
                                         image_tokens)
            pieces, roles = pieces[:n], roles[:n]
        else:
            roles = _roles(r, offsets[:n])
        for role, flag in zip(roles, trained) if count else ():
            tally = p.roles.setdefault(role, {"trained": 0, "untrained": 0})
            tally["trained" if flag else "untrained"] += 1
        if keep:
            if not r.images:
                pieces = _pieces(r, ex.input_ids, offsets[:n], truncated, tokenizer)
            segments = merge(pieces, trained, roles)
            p.shown.append(Shown(index, r.where, n, count, truncated, count == 0, segments))


def preview(records: Iterable[Record], renderer: mixture.Renderers, cfg: DataConfig, show: int) -> Preview:
    """Counts over every example of `records` (the training records, as data.split gives them) and the
    first `show` examples as segments."""
    p = Preview(cfg.max_length, cfg.mask_prompt)
    histogram = [0] * len(length_buckets(cfg.max_length))
    stream = rendered(renderer, records)
    while batch := list(itertools.islice(stream, BATCH)):
        _add(p, batch, renderer.tok, show, histogram, renderer.image_tokens)
    p.lengths = [{"from": lo, "to": hi, "examples": n}
                 for (lo, hi), n in zip(length_buckets(cfg.max_length), histogram)]
    p.notes = sorted(renderer.notes)
    return p


# ---------------------------------------------------------------- a run's examples, from its prepared set


def decoded_pieces(ids: list[int], tokenizer) -> list[str]:
    """Each token's text from the ids alone: what decoding it adds to the few tokens before it."""
    pieces = []
    for j in range(len(ids)):
        lo = max(0, j - DECODE_CONTEXT)
        before = tokenizer.decode(ids[lo:j], clean_up_tokenization_spaces=False)
        through = tokenizer.decode(ids[lo:j + 1], clean_up_tokenization_spaces=False)
        same = len(before) if through.startswith(before) else len(_common_prefix(before, through))
        pieces.append(through[same:])
    return pieces


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def run_examples(train_set, tokenizer, n: int = RUN_EXAMPLES) -> list[dict]:
    """The first `n` rows of a prepared training set (input_ids, labels) as segments (no roles)."""
    if not {"input_ids", "labels"} <= set(getattr(train_set, "column_names", ())):
        return []
    rows = []
    for i in range(min(n, len(train_set))):
        row = train_set[i]
        ids, trained = list(row["input_ids"]), trained_flags(list(row["labels"]))
        segments = merge(decoded_pieces(ids, tokenizer), trained, [None] * len(ids))
        rows.append({"example": i + 1, "tokens": len(ids), "trained_tokens": sum(trained), "segments": segments})
    return rows


def write_examples(path: Path, rows: list[dict]) -> None:
    """One JSON object per line (no file when there are none)."""
    if rows:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def training_records(cfg: DataConfig, seed: int) -> tuple[list[Record], dict, dict]:
    """(the records training prepares examples from, the split's facts, the contamination report): the
    training side of data.split, less what data.dedup / data.decontaminate drop. Held-out records are read
    only to screen against; none is returned."""
    train, _, facts, found = split.training(cfg, seed)
    if not train:
        raise TunekitError("data.train: no training record is left: the data holds none, or data.dedup / "
                           "data.decontaminate dropped every one (set them to false to see the data)")
    return train, facts, found
