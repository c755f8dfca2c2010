"""Reading records: the rows of a data file or a hub data set, in order, each with where it came from
(file and line or row), before any format, template or tokenizer is applied. One reader per file type
(config.schema.DATA_SUFFIXES), shared by the pre-check (data.precheck) and data preparation, none importing
`datasets`: docs/data.md, "Reading records and the first check"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from tunekit.config.schema import DATA_SUFFIXES
from tunekit.core.errors import TunekitError, first_line
from tunekit.data.formats import Record
from tunekit.models import hub

# ".jsonl, .json, .csv or .parquet" and ".jsonl/.json/.csv/.parquet", as messages name them
_LISTED = ", ".join(DATA_SUFFIXES[:-1]) + " or " + DATA_SUFFIXES[-1]
_SLASHED = "/".join(DATA_SUFFIXES)


def read_records(spec: str, split: str, key: str) -> list[Record]:
    return list(iter_records(spec, split, key))


def iter_records(spec: str, split: str, key: str) -> Iterator[Record]:
    """The records of a data file or hub data set, in order, each with where it came from."""
    if Path(spec).exists():
        yield from file_records(spec, key)
    else:
        yield from _hub_records(spec, split, key)


def file_records(spec: str, key: str) -> Iterator[Record]:
    """The records of a data file, read by its type's reader; a path that is not a data file is refused."""
    path = Path(spec)
    if not path.is_file() or path.suffix not in DATA_SUFFIXES:
        raise TunekitError(f"{key}: {spec!r} is not a {_LISTED} file")
    if path.suffix == ".csv":
        return _csv_records(path, key)
    if path.suffix == ".parquet":
        return _parquet_records(path, key)
    return _json_records(path, key)


def _hub_records(spec: str, split: str, key: str) -> Iterator[Record]:
    import datasets

    try:
        hub.probe_dataset(spec)
        ds = datasets.load_dataset(spec, split=split)
    except TunekitError:
        raise
    except Exception as e:  # datasets raises many types for unreachable hub names
        first = first_line(e)
        if hub.offline():
            raise TunekitError(f"{key}: data set {spec!r} is not in the local datasets cache and the Hub cannot be "
                               f"used here ({first[:120]}); load it once where the Hub is reachable and copy the "
                               f"cache (HF_HOME), or set {key} to a local {_SLASHED} file") from None
        raise TunekitError(f"{key}: cannot load {spec!r} ({first[:200]})") from None
    for i, row in enumerate(ds):
        yield Record(row, f"{spec}[{split}] row {i + 1}")


def _bad_utf8(path: Path, key: str, offset: int, byte: int) -> TunekitError:
    line = path.read_bytes()[:offset].count(b"\n") + 1
    return TunekitError(f"{key}: {path} line {line}: not UTF-8 text (byte 0x{byte:02x}); re-save the file as UTF-8")


def _record(value: Any, key: str, where: str) -> Record:
    if not isinstance(value, dict):
        raise TunekitError(f"{key}: {where}: expected a JSON object, got {type(value).__name__}")
    return Record(value, where)


def _json_records(path: Path, key: str) -> Iterator[Record]:
    """JSON lines (.jsonl, or a .json that does not start with a list), else a JSON list of objects."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if path.suffix == ".jsonl" or (path.suffix == ".json" and not head.startswith(b"[")):
        yield from _json_lines(path, key)
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


def _json_lines(path: Path, key: str) -> Iterator[Record]:
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
                raise TunekitError(f"{key}: {path} line {n}: malformed JSON "
                                   f"({e.msg} at column {e.colno})") from None
            yield _record(value, key, f"{path} line {n}")


def _csv_records(path: Path, key: str) -> Iterator[Record]:
    """Rows by the header's columns: every cell text, blank lines skipped, "row N"."""
    import csv

    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            n = 0
            for row in reader:
                if all(v is None or not v.strip() for v in row.values()):  # a blank line
                    continue
                n += 1
                if None in row:
                    raise TunekitError(f"{key}: {path} line {reader.line_num}: more cells than the header's "
                                       f"{len(reader.fieldnames or [])} columns")
                yield Record(row, f"{path} row {n}")
    except UnicodeDecodeError as e:
        raise TunekitError(f"{key}: {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x}); re-save the file "
                           "as UTF-8") from None
    except csv.Error as e:
        raise TunekitError(f"{key}: {path}: malformed CSV ({e})") from None


def _parquet_records(path: Path, key: str) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1000):
            for row in batch.to_pylist():
                n += 1
                yield Record(row, f"{path} row {n}")
    except (pa.ArrowException, OSError) as e:
        raise TunekitError(f"{key}: {path}: not a readable Parquet file ({first_line(e)[:200]})") from None
