"""The held-out split, decided here and nowhere else: which records train and which are held out.

`data.max_examples` takes the first N records of `data.train`; `data.eval_fraction` then holds out a seeded
fraction of those N; a `data.eval` source is held out as it stands. Who reads it, and how mixtures are split:
docs/data.md, "Held-out data" and "The split and the mix"."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data import mixture
from tunekit.data.formats import Record
from tunekit.data.reading import iter_records


@dataclass(frozen=True)
class Split:
    """Positions among the records read from data.train's sources (the first max_examples of each, the
    sources one after another), each in file order."""

    train: list[int]
    held: list[int]  # empty when data.eval is the held-out source
    sizes: tuple[int, ...] = ()  # records read from each source

    def source_at(self, position: int) -> int:
        """The index of the source a position lies in."""
        return bisect.bisect_right(list(itertools.accumulate(self.sizes)), position)


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


def positions(sizes: int | list[int], cfg: DataConfig, seed: int) -> Split:
    """The split of the records read from data.train (`sizes`: how many each source gave, already capped by
    max_examples; an int for a plain data.train)."""
    sizes = [sizes] if isinstance(sizes, int) else list(sizes)
    train: list[int] = []
    held: list[int] = []
    start = 0
    for i, (source, n) in enumerate(zip(mixture.train_sources(cfg), sizes)):
        if n == 0:
            raise TunekitError(f"{source.key}: {source.spec} holds no examples")
        if cfg.eval is None and cfg.eval_fraction > 0:
            try:
                t, h = indices(n, cfg.eval_fraction, seed + i)
            except TunekitError as e:
                raise TunekitError(f"{source.key}: {e}" if mixture.is_mixture(cfg) else str(e)) from None
        else:
            t, h = list(range(n)), []
        train += [start + x for x in t]
        held += [start + x for x in h]
        start += n
    return Split(train, held, tuple(sizes))


def train_source(cfg: DataConfig) -> Iterator[Record]:
    """The records of data.train that take part at all: the first data.max_examples (of each source) when
    set, each tagged with its source (mixture.Sourced)."""
    for i, source in enumerate(mixture.train_sources(cfg)):
        for record in itertools.islice(iter_records(source.spec, source.split, source.key), cfg.max_examples):
            yield mixture.Sourced(record.values, record.where, i)


def eval_source(cfg: DataConfig) -> list[Record]:
    """The records of data.eval's sources, one after another, each tagged with its source."""
    records: list[Record] = []
    offset = len(mixture.train_sources(cfg))
    for i, source in enumerate(mixture.eval_sources(cfg)):
        found = [mixture.Sourced(r.values, r.where, offset + i) for r in iter_records(source.spec, source.split,
                                                                                      source.key)]
        if not found:
            raise TunekitError(f"{source.key}: {source.spec} holds no examples")
        records += found
    return records


def sizes_of(records: list[Record], cfg: DataConfig) -> list[int]:
    """Records per train source, for records in train_source's order."""
    counts = [0] * len(mixture.train_sources(cfg))
    for record in records:
        counts[mixture.source_of(record) or 0] += 1
    return counts


def _read_and_split(cfg: DataConfig, seed: int) -> tuple[list[Record], Split, list[Record]]:
    records = list(train_source(cfg))
    parts = positions(sizes_of(records, cfg), cfg, seed)
    return records, parts, eval_source(cfg) if cfg.eval else [records[i] for i in parts.held]


def train_and_held(cfg: DataConfig, seed: int) -> tuple[list[Record], list[Record], dict]:
    """(training records, held-out records, the split's summary) as every path sees them; the training records
    are those a mixture's examples are drawn from (`training` draws them)."""
    records, parts, held = _read_and_split(cfg, seed)
    return [records[i] for i in parts.train], held, summary(cfg, parts.sizes, len(parts.train), of(held))


def training(cfg: DataConfig, seed: int) -> tuple[list[Record], list[Record], dict, dict]:
    """(the epoch's training records, the held-out records, the split's summary with the realised mix, the
    contamination report): the training records less those data.dedup/data.decontaminate drop, then the
    mixture's draw (every one of them, in order, for a plain data.train)."""
    records, parts, held = _read_and_split(cfg, seed)
    facts = summary(cfg, parts.sizes, len(parts.train), of(held))
    pool = [records[i] for i in parts.train]
    drop, report = mixture.screen(pool, held, cfg, [r.where for r in pool])
    kept = [p for k, p in enumerate(parts.train) if k not in drop]
    return [records[i] for i in mix(kept, parts, cfg, seed, facts)], held, facts, report


def mix(kept: list[int], parts: Split, cfg: DataConfig, seed: int, facts: dict) -> list[int]:
    """The positions the epoch trains on, drawn from `kept` (the training positions of `parts` left after the
    contamination screen): `kept` itself for a plain data.train; for a mixture, the draw, whose realised mix
    goes into `facts` (the split's summary) as "mix"."""
    if not mixture.is_mixture(cfg):
        return kept
    groups: list[list[int]] = [[] for _ in parts.sizes]
    for position in kept:
        groups[parts.source_at(position)].append(position)
    chosen, facts["mix"] = mixture.draw(groups, parts.sizes, cfg, seed)
    return chosen


def held_out(cfg: DataConfig, seed: int) -> list[Record]:
    """The held-out records exactly as training splits them (none without data.eval / data.eval_fraction)."""
    if cfg.eval:
        return eval_source(cfg)
    if cfg.eval_fraction > 0:
        return train_and_held(cfg, seed)[1]
    return []


def summary(cfg: DataConfig, read: int | Sequence[int], train: int, held: list[tuple[str, str]]) -> dict:
    """The split's facts for run.json and the run output; `read`: records read (from each source), `held`: the
    held-out records' (location, raw JSON). A mixture's realised mix is added under "mix" once drawn."""
    source = "data.eval" if cfg.eval else ("data.eval_fraction" if cfg.eval_fraction > 0 else None)
    total = read if isinstance(read, int) else sum(read)
    return {"train_records_read": total, "max_examples": cfg.max_examples, "train": train,
            "held_out": len(held), "held_out_from": source, "held_out_fingerprint": fingerprint(held)}


def line(facts: dict) -> str:
    mix = facts.get("mix")
    each = " of each source" if mix else ""
    capped = f" (the first {facts['max_examples']}{each}, data.max_examples)" if facts["max_examples"] else ""
    held = {None: "none held out",
            "data.eval": f"{facts['held_out']} held out in data.eval",
            "data.eval_fraction": f"{facts['held_out']} held out by data.eval_fraction"}[facts["held_out_from"]]
    train = f"data.train's {len(mix)} sources" if mix else "data.train"
    return f"data split: {facts['train_records_read']} records of {train}{capped}: {facts['train']} train; {held}"


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
