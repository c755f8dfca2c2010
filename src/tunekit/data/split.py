"""The held-out split, decided here and nowhere else: which records train and which are held out.

`data.max_examples` takes the first N records of `data.train`; `data.eval_fraction` then holds out a
seeded fraction of those N. A `data.eval` source is held out as it stands (max_examples caps training
only). Every path that trains or scores takes its records from here: the prepared train/eval sets (SFT),
the preference pairs, generation metrics during training, the end-of-training eval, `tunekit eval RUN`
and merge's parity prompts; every rank of a multi-process run computes the same split from the seed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from dataclasses import dataclass
from typing import Iterator

from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data.formats import Record
from tunekit.data.records import iter_records, read_records


@dataclass(frozen=True)
class Split:
    """Positions among the records read from data.train (the first max_examples of them), each in file order."""

    train: list[int]
    held: list[int]  # empty when data.eval is the held-out source


def indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held) positions of n records, each in file order: a seeded `fraction` of them held out."""
    n_eval = round(n * fraction)
    if n_eval < 1 or n_eval >= n:
        raise TunekitError(
            f"data.eval_fraction={fraction} of {n} examples leaves {n_eval} for eval and "
            f"{n - n_eval} for training; each needs at least one"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    return [i for i in range(n) if i not in held], sorted(held)


def positions(n: int, cfg: DataConfig, seed: int) -> Split:
    """The split of the n records read from data.train (n already capped by max_examples)."""
    if cfg.eval is None and cfg.eval_fraction > 0:
        return Split(*indices(n, cfg.eval_fraction, seed))
    return Split(list(range(n)), [])


def train_source(cfg: DataConfig) -> Iterator[Record]:
    """The records of data.train that take part at all: the first data.max_examples when set."""
    return itertools.islice(iter_records(cfg.train, cfg.train_split, "data.train"), cfg.max_examples)


def eval_source(cfg: DataConfig) -> list[Record]:
    records = read_records(cfg.eval, cfg.eval_split, "data.eval")
    if not records:
        raise TunekitError(f"data.eval: {cfg.eval} holds no examples")
    return records


def train_and_held(cfg: DataConfig, seed: int) -> tuple[list[Record], list[Record], dict]:
    """(training records, held-out records, the split's summary) as every path sees them."""
    records = list(train_source(cfg))
    parts = positions(len(records), cfg, seed)
    held = eval_source(cfg) if cfg.eval else [records[i] for i in parts.held]
    return [records[i] for i in parts.train], held, summary(cfg, len(records), len(parts.train), of(held))


def held_out(cfg: DataConfig, seed: int) -> list[Record]:
    """The held-out records exactly as training splits them (none without data.eval / data.eval_fraction)."""
    if cfg.eval:
        return eval_source(cfg)
    if cfg.eval_fraction > 0:
        return train_and_held(cfg, seed)[1]
    return []


def summary(cfg: DataConfig, read: int, train: int, held: list[tuple[str, str]]) -> dict:
    """The split's facts for run.json and the run output; `held`: the held-out records' (location, raw JSON)."""
    source = "data.eval" if cfg.eval else ("data.eval_fraction" if cfg.eval_fraction > 0 else None)
    return {"train_records_read": read, "max_examples": cfg.max_examples, "train": train,
            "held_out": len(held), "held_out_from": source, "held_out_fingerprint": fingerprint(held)}


def line(facts: dict) -> str:
    capped = f" (the first {facts['max_examples']}, data.max_examples)" if facts["max_examples"] else ""
    held = {None: "none held out",
            "data.eval": f"{facts['held_out']} held out in data.eval",
            "data.eval_fraction": f"{facts['held_out']} held out by data.eval_fraction"}[facts["held_out_from"]]
    return f"data split: {facts['train_records_read']} records of data.train{capped}: {facts['train']} train; {held}"


def raw(record: Record) -> str:
    """A record's values as one JSON text (how the prepared sets store it)."""
    return json.dumps(record.values, ensure_ascii=False, default=str)


def fingerprint(held: list[tuple[str, str]]) -> str:
    """A short digest of which records these are, by location and content: the same on every rank for the
    same split, and the same when `tunekit eval RUN` reads the held-out records again from unchanged files."""
    h = hashlib.sha256()
    for where, text in held:
        h.update(where.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def of(records: list[Record]) -> list[tuple[str, str]]:
    return [(r.where, raw(r)) for r in records]
