"""Data side: read records, render prompts, tokenize with exact label masking, split, collate."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError, first_line
from tunekit.data.chat import Chat
from tunekit.data.formats import FORMATS, Record
from tunekit.models import hub

log = logging.getLogger("tunekit")

IGNORE = -100
@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # character spans whose tokens are trained
    add_special_tokens: bool  # False when a chat template already wrote BOS etc.
    prompt: str | None = None  # what generation starts from (everything before the last answer)
    reference: str | None = None  # the last answer
    desirable: bool | None = None  # unpaired preference data: whether that answer is wanted
    where: str | None = None  # the record it came from (file and line)
    roles: list[tuple[int, int, str]] | None = None  # character ranges by message role (Renderer(roles=True))


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


@dataclass
class DataBundle:
    train: Any  # datasets.Dataset
    eval: Any | None
    train_stats: DataStats
    eval_stats: DataStats | None
    eval_rendered: list[Rendered] = field(default_factory=list)
    template: str = "raw"
    split: dict = field(default_factory=dict)  # tunekit.data.split.summary
    contamination: dict = field(default_factory=dict)  # tunekit.data.contamination.report


# ---------------------------------------------------------------- reading


def _bad_utf8(path: Path, key: str, offset: int, byte: int) -> TunekitError:
    line = path.read_bytes()[:offset].count(b"\n") + 1
    return TunekitError(f"{key}: {path} line {line}: not UTF-8 text (byte 0x{byte:02x}); re-save the file as UTF-8")


def _record(value: Any, key: str, where: str) -> Record:
    if not isinstance(value, dict):
        raise TunekitError(f"{key}: {where}: expected a JSON object, got {type(value).__name__}")
    return Record(value, where)


def trained_count(labels: list[int]) -> int:
    """Trained positions of an example; labels are shifted inside the model, so position 0 is never a target."""
    return sum(1 for label in labels[1:] if label != IGNORE)


def _iter_json_file(path: Path, key: str) -> Iterator[Record]:
    # Parsed here rather than by `datasets`: its Arrow errors name neither the line nor the field.
    # JSON lines are streamed (memory does not grow with the file); a JSON list is read whole.
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if path.suffix == ".jsonl" or (path.suffix == ".json" and not head.startswith(b"[")):
        offset = 0
        with path.open("rb") as f:
            for n, line in enumerate(f, start=1):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _bad_utf8(path, key, offset + e.start, e.object[e.start]) from None
                offset += len(line)
                if not text.strip():
                    continue
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    raise TunekitError(f"{key}: {path} line {n}: malformed JSON ({e.msg} at column {e.colno})") from None
                yield _record(value, key, f"{path} line {n}")
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _bad_utf8(path, key, e.start, e.object[e.start]) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise TunekitError(f"{key}: {path} line {e.lineno}: malformed JSON ({e.msg})") from None
    if not isinstance(value, list):
        raise TunekitError(f"{key}: {path}: expected a JSON list of objects or JSON lines")
    for i, item in enumerate(value):
        yield _record(item, key, f"{path} item {i}")


def _csv_as_text(path: Path) -> dict:
    import csv

    import datasets

    with path.open(newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return {"features": datasets.Features({c: datasets.Value("string") for c in header}), "keep_default_na": False}


def read_records(spec: str, split: str, key: str) -> list[Record]:
    return list(iter_records(spec, split, key))


def iter_records(spec: str, split: str, key: str) -> Iterator[Record]:
    """The records of a data file or hub data set, in order, each with where it came from."""
    path = Path(spec)
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        yield from _iter_json_file(path, key)
        return
    import datasets

    try:
        if path.is_file() and path.suffix in (".csv", ".parquet"):
            # CSV cells are text: keep "4" as "4" instead of letting pandas infer numbers
            extra = _csv_as_text(path) if path.suffix == ".csv" else {}
            ds = datasets.load_dataset(path.suffix[1:], data_files=str(path), split="train", **extra)
            label = f"{path} row"
        elif path.exists():
            raise TunekitError(f"{key}: {spec!r} is not a .jsonl, .json, .csv or .parquet file")
        else:
            hub.probe_dataset(spec)
            ds = datasets.load_dataset(spec, split=split)
            label = f"{spec}[{split}] row"
    except TunekitError:
        raise
    except Exception as e:  # datasets raises many types for unreachable hub names and bad files
        first = first_line(e)
        if hub.offline() and not path.exists():
            raise TunekitError(f"{key}: data set {spec!r} is not in the local datasets cache and the Hub cannot be "
                               f"used here ({first[:120]}); load it once where the Hub is reachable and copy the "
                               f"cache (HF_HOME), or set {key} to a local .jsonl/.json/.csv/.parquet file") from None
        raise TunekitError(f"{key}: cannot load {spec!r} ({first[:200]})") from None
    for i, row in enumerate(ds):
        yield Record(row, f"{label} {i + 1}")


# ---------------------------------------------------------------- rendering


class Renderer:
    """Turns one record into text plus the character spans that are trained: `examples` for training (one per
    record, more where a chat template rewrites earlier turns), `render` for generation and scoring (the
    conversation through its last assistant message, with that message's prompt and reference)."""

    def __init__(self, cfg: DataConfig, tokenizer, roles: bool = False):
        self.cfg = cfg
        self.tok = tokenizer
        self.format = FORMATS[cfg.format]
        self.with_roles = roles
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        template = cfg.template
        if template == "auto":
            template = "chat" if has_chat or self.format.needs_chat else ("alpaca" if self.format.alpaca else "raw")
        if template == "chat" and not has_chat:
            raise TunekitError("data.template: the tokenizer has no chat template; use template: alpaca or raw")
        if template == "alpaca" and not self.format.alpaca:
            raise TunekitError(f"data.template=alpaca only renders format alpaca, not {cfg.format}; use chat or raw")
        self.template = template
        self.chat = Chat(tokenizer, cfg.train_on, cfg.train_reasoning) if template == "chat" else None

    @property
    def notes(self) -> set[str]:
        """One line per default rendering used so far (templates without tool or reasoning support)."""
        return self.chat.notes if self.chat else set()

    def _conversation(self, parsed, where: str) -> tuple[list[dict], list | None, list[dict]]:
        messages = parsed.messages
        if self.cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.cfg.system_prompt}] + messages
        return self.chat.adapt(messages, parsed.tools, where)

    def examples(self, record: Record) -> list[Rendered]:
        parsed = self.format.parse(record, self.cfg.fields)
        if self.chat is None or parsed.text is not None:
            return [self._finish(self._plain(parsed), parsed, record.where)]
        messages, tools, meta = self._conversation(parsed, record.where)
        out = []
        for piece in self.chat.pieces(messages, tools, meta, record.where):
            rendered = Rendered(piece.text, piece.spans, False)
            if self.with_roles:
                rendered.roles = self.chat.roles(messages, tools, piece.text, record.where)
            out.append(self._finish(rendered, parsed, record.where))
        return out

    def render(self, record: Record) -> Rendered:
        parsed = self.format.parse(record, self.cfg.fields)
        if self.chat is None or parsed.text is not None:
            return self._finish(self._plain(parsed), parsed, record.where)
        messages, tools, meta = self._conversation(parsed, record.where)
        last = max(i for i, info in enumerate(meta) if info["role"] == "assistant")
        turn = self.chat.turn(messages, tools, last, record.where)
        spans = self.chat.spans(messages, tools, turn, meta[last], record.where) if meta[last]["train"] else []
        rendered = Rendered(turn.through, spans, False, prompt=turn.before,
                            reference=self.chat.reference(messages, tools, turn, meta[last], record.where))
        return self._finish(rendered, parsed, record.where)

    @staticmethod
    def _finish(rendered: Rendered, parsed, where: str) -> Rendered:
        rendered.desirable, rendered.where = parsed.desirable, where
        return rendered

    def _plain(self, parsed) -> Rendered:
        eos = self.tok.eos_token or ""
        if parsed.text is not None:
            return Rendered(parsed.text + eos, [(0, len(parsed.text) + len(eos))], True)
        # one turn without a chat template: the Alpaca prompt or the bare prompt, then the answer
        user, answer = parsed.messages[0]["content"], parsed.messages[-1]["content"]
        plain = parsed.alpaca_prompt if self.template == "alpaca" else user
        completion = answer + eos
        return Rendered(plain + completion, [(len(plain), len(plain) + len(completion))], True, prompt=plain,
                        reference=answer)


# ---------------------------------------------------------------- tokenizing


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


def tokenize_batch(renders: list[Rendered], tokenizer, max_length: int, mask_prompt: bool) -> list[tuple[Example, bool]]:
    """`tokenize` for many: one tokenizer call per special-token setting (fast tokenizers batch in Rust)."""
    out: list[tuple[Example, bool] | None] = [None] * len(renders)
    for flag in {r.add_special_tokens for r in renders}:
        idx = [i for i, r in enumerate(renders) if r.add_special_tokens == flag]
        enc = tokenizer([renders[i].text for i in idx], add_special_tokens=flag, return_offsets_mapping=True)
        for k, i in enumerate(idx):
            out[i] = _labelled(enc["input_ids"][k], enc["offset_mapping"][k], renders[i].spans, max_length, mask_prompt)
    return out  # type: ignore[return-value]


def build_examples(renders: list[Rendered], tokenizer, cfg: DataConfig) -> tuple[list[Example], DataStats]:
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


def collator(tokenizer, packing: bool = False, boundaries: bool = False):
    """Padded batches: input_ids padded with the pad token, labels with -100 (DataCollatorForSeq2Seq).
    Packed: DataCollatorWithFlattening concatenates the micro-batch into one row, restarts position
    ids per example and sets each example's first label to -100; attention builds a block-diagonal
    causal mask from the position ids or, with `boundaries`, reads the sequence boundaries
    (flash-attention), so no example sees another."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    if packing:
        return DataCollatorWithFlattening(separator_id=IGNORE, return_flash_attn_kwargs=boundaries)
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE, padding=True, pad_to_multiple_of=8)
