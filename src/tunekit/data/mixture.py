"""Mixtures: data.train (or data.eval) given as a list of sources, each with its own format and fields, and
for training a weight (a share of each epoch's examples) or a count (a fixed number of examples).
`train_sources` lists them (a plain data.train is one), `Renderers` renders a record with its own source's
format and fields, and `draw` draws the epoch's examples. How the targets are set and drawn: docs/data.md,
"The split and the mix"."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tunekit.config.schema import MAX_EPOCH_EXAMPLES, DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data import contamination
from tunekit.data.formats import FORMATS, Record
from tunekit.data.rendering import Renderer


@dataclass(frozen=True)
class Sourced(Record):
    """A record and the source it came from: its position in `sources(cfg)` (train sources, then eval)."""

    source: int = 0


@dataclass(frozen=True)
class Source:
    key: str  # data.train, data.train[1], data.eval[0], ...
    spec: str  # file or hub name
    split: str  # hub split
    cfg: DataConfig  # the data settings with this source's format and fields
    weight: float | None = None
    count: int | None = None


def _view(cfg: DataConfig, source) -> DataConfig:
    fields = cfg.fields
    if source.fields is not None:
        fields = fields.model_copy(update={k: getattr(source.fields, k) for k in source.fields.model_fields_set})
    return cfg.model_copy(update={"format": source.format or cfg.format, "fields": fields})


def _of(cfg: DataConfig, which: str, default_split: str) -> list[Source]:
    value = getattr(cfg, which)
    if value is None:
        return []
    if isinstance(value, str):
        return [Source(f"data.{which}", value, default_split, cfg)]
    return [Source(key, s.path, s.split or default_split, _view(cfg, s), s.weight, s.count)
            for key, s in cfg.sources(which)]


def train_sources(cfg: DataConfig) -> list[Source]:
    return _of(cfg, "train", cfg.train_split)


def eval_sources(cfg: DataConfig) -> list[Source]:
    return _of(cfg, "eval", cfg.eval_split)


def sources(cfg: DataConfig) -> list[Source]:
    """Every source, train first: a Sourced record's `source` indexes this list."""
    return train_sources(cfg) + eval_sources(cfg)


def is_mixture(cfg: DataConfig) -> bool:
    return isinstance(cfg.train, list)


def source_of(record: Record) -> int | None:
    return getattr(record, "source", None)


class Renderers:
    """A Renderer per source; a record is rendered by its own source's (a record read elsewhere, --data say,
    by data.format's)."""

    def __init__(self, cfg: DataConfig, tokenizer, roles: bool = False, tools: list[dict] | None = None,
                 image_tokens=None):
        self.base = Renderer(cfg, tokenizer, roles=roles, tools=tools, image_tokens=image_tokens)
        made: dict[str, Renderer] = {cfg.model_dump_json(): self.base}
        self.each = []
        for source in sources(cfg):
            key = source.cfg.model_dump_json()
            if key not in made:
                made[key] = Renderer(source.cfg, tokenizer, roles=roles, tools=tools, image_tokens=image_tokens)
            self.each.append(made[key])
        self.tok = tokenizer
        self.image_tokens = image_tokens
        self.cfg = cfg
        self.template = "+".join(dict.fromkeys(r.template for r in [self.base, *self.each]))

    def of(self, record: Record) -> Renderer:
        source = source_of(record)
        return self.base if source is None else self.each[source]

    def render(self, record: Record, observation: str | None = None):
        return self.of(record).render(record, observation)

    def examples(self, record: Record):
        return self.of(record).examples(record)

    @property
    def notes(self) -> set[str]:
        return set().union(*(r.notes for r in [self.base, *self.each]))


def parse(record: Record, views: Sequence[Source], cfg: DataConfig):
    """The record parsed under its source's format and fields."""
    source = source_of(record)
    view = cfg if source is None else views[source].cfg
    return FORMATS[view.format].parse(record, view.fields)


def screen(train: Iterable[Record], held: list[Record], cfg: DataConfig,
           train_where: Sequence[str]) -> tuple[set[int], dict]:
    """contamination.screen with each record parsed by its own source's format: the training positions
    data.dedup and data.decontaminate drop, and the report for run.json."""
    views = sources(cfg)

    def items(records):
        return (contamination.texts(parse(r, views, cfg)) for r in records)

    found = contamination.check(items(train), [t[:2] for t in items(held)], dedup=cfg.dedup,
                                decontaminate=cfg.decontaminate)
    return set(found.dropped), contamination.report(found, train_where, [r.where for r in held])


def _rounded(exact: list[float]) -> list[int]:
    """Whole numbers adding up to round(sum(exact)), each within one of its exact value (largest remainder)."""
    out = [math.floor(x) for x in exact]
    left = round(sum(exact)) - sum(out)
    for i in sorted(range(len(exact)), key=lambda i: (out[i] - exact[i], i))[:max(left, 0)]:
        out[i] += 1
    return out


def targets(given: Sequence[Source], available: Sequence[int]) -> list[int]:
    """Examples per epoch from each source (how: docs/data.md, "The split and the mix")."""
    fixed = [s.count if s.count is not None else (n if s.weight is None else 0) for s, n in zip(given, available)]
    weighted = [i for i, s in enumerate(given) if s.weight is not None]
    if not weighted:
        return fixed
    weights = {i: given[i].weight or 0.0 for i in weighted}
    if len(weighted) == len(given):
        total, scale = float(sum(available)), 1 / sum(weights.values())
    else:
        total, scale = sum(fixed) / (1 - sum(weights.values())), 1.0
    shares = _rounded([total * weights[i] * scale for i in weighted])
    for i, n in zip(weighted, shares):
        fixed[i] = n
    return fixed


def pick(positions: list[int], target: int, rng: random.Random) -> list[int]:
    """`target` of `positions`: without repetition while they suffice, then whole passes and a sample."""
    whole, rest = divmod(target, len(positions))
    return positions * whole + sorted(rng.sample(positions, rest))


def draw(available: list[list[int]], read: Sequence[int], cfg: DataConfig, seed: int) -> tuple[list[int], list[dict]]:
    """The epoch's training examples, as positions drawn from each source's `available` ones (its training
    records left after the held-out split and the contamination screen), and the realised mix (`read`:
    the records read from each source)."""
    given = train_sources(cfg)
    wanted = targets(given, [len(a) for a in available])
    if sum(wanted) > MAX_EPOCH_EXAMPLES:  # weights beside counts can ask for any number
        most = max(range(len(given)), key=lambda i: wanted[i])
        raise TunekitError(f"data.train: the mixture asks for {sum(wanted):,} examples per epoch ({given[most].key}: "
                           f"{wanted[most]:,}), more than {MAX_EPOCH_EXAMPLES:,}; lower its counts or weights")
    chosen: list[int] = []
    facts = []
    for i, (source, positions, n) in enumerate(zip(given, available, wanted)):
        if n and not positions:
            raise TunekitError(f"{source.key}: {source.spec} has no training records left (after data.eval_fraction "
                               "and data.dedup/data.decontaminate) for its weight or count")
        used = pick(positions, n, random.Random(f"{seed}:{i}")) if n else []
        chosen += used
        facts.append({"source": source.key, "path": source.spec, "format": source.cfg.format, "weight": source.weight,
                      "count": source.count, "read": read[i], "available": len(positions), "used": len(used),
                      "distinct": len(set(used))})
    for fact in facts:
        fact["share"] = round(fact["used"] / len(chosen), 4) if chosen else 0.0
    if not chosen:
        raise TunekitError("data.train: the mixture draws no training examples; give a source a weight or count")
    return chosen, facts


def line(facts: list[dict]) -> str:
    """The realised mix in one line: per source, records read, examples used, share of the epoch."""
    def one(f: dict) -> str:
        repeated = f" ({f['used'] / f['available']:.2g}x its records)" if f["used"] > f["available"] else ""
        return f"{f['source']} {f['path']}: {f['read']} read, {f['used']} used{repeated}, {100 * f['share']:.1f}%"

    return f"data mix: {sum(f['used'] for f in facts)} training examples per epoch: " + "; ".join(map(one, facts))
