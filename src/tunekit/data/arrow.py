"""Training data prepared as Arrow tables and cached under TUNEKIT_CACHE/data/<fingerprint>: records streamed,
rendered and tokenized by `datasets.map` in batches, the tables memory-mapped. How, and why not
`datasets.load_dataset("json")` alone: docs/data.md, "Arrow tables"."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunekit.config.schema import DataConfig
from tunekit.core import console
from tunekit.core.errors import TunekitError
from tunekit.core.outputs import cache_root
from tunekit.data import chattemplate, imagetokens, mixture, split
from tunekit.data.rendering import Rendered
from tunekit.data.tokenizing import DataStats, tokenize_batch, trained_count

log = logging.getLogger("tunekit")

DONE = "prepared.json"
TRAIN_SET, EVAL_SET, EVAL_RECORDS = "train-set", "eval-set", "eval-records.jsonl"
BATCH = 1000  # rows per map batch and per Arrow record batch
PARALLEL_FROM = 20_000  # rows; below this, worker start-up costs more than it saves
_CODE = sorted(Path(__file__).parent.glob("*.py"))  # the data package: parsing, rendering, spans, split, mix


@dataclass
class DataBundle:
    """The prepared data sets a method trains on (Method.build_data), with their counts and the held-out
    records' renderings."""

    train: Any  # datasets.Dataset
    eval: Any | None
    train_stats: DataStats
    eval_stats: DataStats | None
    eval_rendered: list[Rendered] = field(default_factory=list)
    template: str = "raw"
    split: dict = field(default_factory=dict)  # tunekit.data.split.summary
    contamination: dict = field(default_factory=dict)  # tunekit.data.contamination.report


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(cfg: DataConfig, tokenizer, seed: int) -> str | None:
    """Cache key, or None when a source is not a local file (a hub data set can change under its name). It
    covers every source's file (each of a mixture's) and settings."""
    from datasets.fingerprint import Hasher

    h = hashlib.sha256(f"{cfg.model_dump_json()}|{seed}".encode())
    for source in mixture.sources(cfg):
        if not Path(source.spec).is_file():
            return None
        h.update(_file_digest(Path(source.spec)).encode())
    h.update(Hasher.hash(tokenizer).encode())
    for path in _CODE:
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


@contextlib.contextmanager
def _locked(path: Path):
    """Blocking exclusive lock: the first process prepares, the others wait for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_raw(records, path: Path, sources: int) -> list[int]:
    """Stream records into an Arrow file of (raw JSON, where, source) rows; returns the rows of each source."""
    import pyarrow as pa

    schema = pa.schema([("raw", pa.string()), ("where", pa.string()), ("source", pa.int32())])
    sizes = [0] * sources
    raw, where, source = [], [], []
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for record in records:
            raw.append(split.raw(record))
            where.append(record.where)
            source.append(mixture.source_of(record) or 0)
            sizes[source[-1]] += 1
            if len(raw) == BATCH:
                writer.write_batch(pa.record_batch([raw, where, source], schema=schema))
                raw, where, source = [], [], []
        if raw:
            writer.write_batch(pa.record_batch([raw, where, source], schema=schema))
    return sizes


def _records(rows) -> list[mixture.Sourced]:
    """Rows of raw JSON (a batch's columns, or a list of row dicts) as records with their sources."""
    if isinstance(rows, list):
        return [mixture.Sourced(json.loads(r["raw"]), r["where"], r.get("source") or 0) for r in rows]
    return [mixture.Sourced(json.loads(r), w, s) for r, w, s in zip(rows["raw"], rows["where"], rows["source"])]


def _encode(batch, renderer: mixture.Renderers, cfg: DataConfig):
    renders = [r for record in _records(batch) for r in renderer.examples(record)]
    examples = tokenize_batch(renders, renderer.tok, cfg.max_length, cfg.mask_prompt, renderer.image_tokens)
    notes = [""] * len(examples)  # the default renderings used (Renderer.notes), on a batch's first row
    if notes:
        notes[0] = "\n".join(sorted(renderer.notes))
    columns = {
        "input_ids": [ex.input_ids for ex, _ in examples],
        "labels": [ex.labels for ex, _ in examples],
        "truncated": [t for _, t in examples],
        "trained": [trained_count(ex.labels) for ex, _ in examples],
        "notes": notes,
    }
    if renderer.image_tokens is not None:  # the images each example's tokens stand for, read again when batched
        columns["images"] = [imagetokens.stored(ex.images) for ex, _ in examples]
    return columns


def _save(ds, path: Path) -> None:
    """save_to_disk without its progress bar: writing a prepared set takes a fraction of the
    tokenizing time, whose bar is shown."""
    import datasets

    was_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        ds.save_to_disk(str(path))
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _tokenized(raw, renderer: mixture.Renderers, cfg: DataConfig, work: Path, name: str, num_proc: int | None):
    """(dataset of input_ids/labels, stats) for the raw rows; rows without a trained token dropped."""
    import datasets
    import pyarrow.compute as pc

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "labels": datasets.Sequence(datasets.Value("int32")),
                                  "truncated": datasets.Value("bool"), "trained": datasets.Value("int32"),
                                  "notes": datasets.Value("string"),
                                  **({"images": datasets.Sequence(datasets.Value("string"))}
                                     if renderer.image_tokens is not None else {})})
    procs = num_proc if num_proc is not None else (min(os.cpu_count() or 1, 8) if len(raw) >= PARALLEL_FROM else None)
    if console.mode() == "lines":  # datasets' bar (the data phase's) is drawn on a terminal only
        log.info("tokenizing %s: %d examples", name, len(raw))
    ds = raw.map(_encode, batched=True, batch_size=BATCH, num_proc=procs, remove_columns=raw.column_names,
                 features=features, fn_kwargs={"renderer": renderer, "cfg": cfg},
                 cache_file_name=str(work / f"{name}-tokenized.arrow"), new_fingerprint=f"{name}-tokenized",
                 desc=f"tokenizing {name}")
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    trained = table.column("trained")
    keep = pc.greater(trained, 0)
    lengths = pc.list_value_length(table.column("input_ids"))
    stats = DataStats(examples=int(pc.sum(keep).as_py() or 0),
                      truncated=int(pc.sum(table.column("truncated")).as_py() or 0),
                      tokens=int(pc.sum(pc.filter(lengths, keep)).as_py() or 0),
                      trained_tokens=int(pc.sum(trained).as_py() or 0))
    stats.dropped_no_target = len(ds) - stats.examples
    stats.notes = sorted({n for text in pc.unique(table.column("notes")).to_pylist() if text for n in text.split("\n")})
    if stats.dropped_no_target:
        ds = ds.filter(lambda t: [x > 0 for x in t], input_columns=["trained"], batched=True, batch_size=BATCH,
                       cache_file_name=str(work / f"{name}-kept.arrow"), new_fingerprint=f"{name}-kept")
    return ds.remove_columns(["truncated", "trained", "notes"]), stats


def _decontaminated(raw, eval_rows: list[dict], cfg: DataConfig):
    """The positions among the training rows that data.dedup / data.decontaminate drop, and the contamination
    report."""
    def records(rows):
        for batch in rows.iter(batch_size=BATCH):
            yield from _records(batch)

    return mixture.screen(records(raw), _records(eval_rows), cfg, raw["where"])


def _split(cfg: DataConfig, seed: int, work: Path):
    """(the rows the epoch trains on, the held-out rows, the split's summary with the mix, the contamination
    report): data.split's decisions and the mixture's draw, on the streamed rows."""
    import datasets

    sizes = _write_raw(split.train_source(cfg), work / "raw.arrow", len(mixture.train_sources(cfg)))
    raw = datasets.Dataset.from_file(str(work / "raw.arrow"))
    parts = split.positions(sizes, cfg, seed)
    if cfg.eval:
        eval_rows = [{"raw": split.raw(r), "where": r.where, "source": mixture.source_of(r)}
                     for r in split.eval_source(cfg)]
    else:
        eval_rows = raw.select(parts.held).to_list() if parts.held else []
    facts = split.summary(cfg, sizes, len(parts.train), [(r["where"], r["raw"]) for r in eval_rows])
    drop, found = _decontaminated(raw.select(parts.train) if parts.held else raw, eval_rows, cfg)
    kept = [p for k, p in enumerate(parts.train) if k not in drop]
    chosen = split.mix(kept, parts, cfg, seed, facts)
    return (raw if chosen == list(range(len(raw))) else raw.select(chosen)), eval_rows, facts, found


def _prepare(cfg: DataConfig, renderer: mixture.Renderers, seed: int, out: Path, num_proc: int | None) -> None:
    """Build the prepared data set into `out`: the train and eval sets (Arrow), the eval records, prepared.json."""
    import datasets

    work = out / "work"
    work.mkdir(parents=True)
    raw, eval_rows, facts, found = _split(cfg, seed, work)
    train, train_stats = _tokenized(raw, renderer, cfg, work, "train", num_proc)
    if not train_stats.examples:
        raise TunekitError(
            f"data.train: no example has a trained token left after truncation to {cfg.max_length} tokens; "
            "raise data.max_length"
        )
    _save(train, out / TRAIN_SET)
    summary = {"train": vars(train_stats), "eval": None, "split": facts, "contamination": found}
    if eval_rows:
        evaluation, eval_stats = _tokenized(datasets.Dataset.from_list(eval_rows), renderer, cfg, work, "eval", None)
        if eval_stats.examples:
            _save(evaluation, out / EVAL_SET)
        summary["eval"] = vars(eval_stats)
        with (out / EVAL_RECORDS).open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in eval_rows)
    del raw, train
    shutil.rmtree(work)
    (out / DONE).write_text(json.dumps(summary), encoding="utf-8")


def _load(directory: Path, cfg: DataConfig, renderer: mixture.Renderers) -> DataBundle:
    import datasets

    summary = json.loads((directory / DONE).read_text(encoding="utf-8"))
    train = datasets.load_from_disk(str(directory / TRAIN_SET))
    evaluation = datasets.load_from_disk(str(directory / EVAL_SET)) if (directory / EVAL_SET).is_dir() else None
    eval_rendered = []
    if (directory / EVAL_RECORDS).is_file():
        rows = [json.loads(line) for line in (directory / EVAL_RECORDS).read_text(encoding="utf-8").splitlines()]
        eval_rendered = [renderer.render(record) for record in _records(rows)]
    eval_stats = DataStats(**summary["eval"]) if summary["eval"] else None
    train_stats = DataStats(**summary["train"])
    log.info(split.line(summary["split"]))
    if summary["split"].get("mix"):
        log.info(mixture.line(summary["split"]["mix"]))
    log.info(summary["contamination"]["line"])
    log.info(train_stats.line("train", cfg.max_length))
    chattemplate.say(train_stats.notes)
    if eval_stats:
        log.info(eval_stats.line("eval", cfg.max_length))
    return DataBundle(train, evaluation, train_stats, eval_stats, eval_rendered, renderer.template, summary["split"],
                      summary["contamination"])


_TEMPORARY: list[tempfile.TemporaryDirectory] = []  # uncached builds live as long as the process


def build(cfg: DataConfig, tokenizer, seed: int, num_proc: int | None = None, image_tokens=None) -> DataBundle:
    """The prepared train/eval data sets for `cfg`, from the cache when it holds them (`image_tokens`: a
    vision-language model's, data.imagetokens; such sets are prepared anew each run, as the images they name can
    change under their paths)."""
    renderer = mixture.Renderers(cfg, tokenizer, image_tokens=image_tokens)  # template errors first
    key = None if image_tokens is not None else fingerprint(cfg, tokenizer, seed)
    if key is None:
        holder = tempfile.TemporaryDirectory(prefix="tunekit-data-")
        _TEMPORARY.append(holder)
        _prepare(cfg, renderer, seed, Path(holder.name) / "set", num_proc)
        return _load(Path(holder.name) / "set", cfg, renderer)
    root = cache_root() / "data"
    directory = root / key
    with _locked(root / f".{key}.lock"):
        if (directory / DONE).is_file():
            log.info("data: prepared set read from the cache (%s)", directory)
        else:
            partial = root / f".{key}.partial"
            shutil.rmtree(partial, ignore_errors=True)  # left by a killed run
            try:
                _prepare(cfg, renderer, seed, partial, num_proc)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            shutil.rmtree(directory, ignore_errors=True)
            partial.rename(directory)
            log.info("data: prepared and cached in %s", directory)
    return _load(directory, cfg, renderer)
