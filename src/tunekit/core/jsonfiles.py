"""Reading the JSON files tunekit writes (run.json, metrics.json, loss_history.jsonl, ...): a file that
cannot be read is one line naming it, what is wrong and what to do (DamagedFile), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from tunekit.core.errors import TunekitError


class DamagedFile(TunekitError):
    """A JSON file in a run (or merged) directory that cannot be read: the CLI's one line names the file,
    what is wrong with it and what to do; `tunekit runs` shows `problem` in the run's row."""

    def __init__(self, path: Path, problem: str, fix: str):
        super().__init__(f"{path}: {problem}; {fix}")
        self.path, self.problem = path, problem


def _text(path: Path, fix: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DamagedFile(path, "does not exist", fix) from None
    except UnicodeDecodeError as e:
        raise DamagedFile(path, f"not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})", fix) from None
    except OSError as e:
        raise DamagedFile(path, f"cannot be read ({e.strerror or e})", fix) from None


def _decode(text: str) -> tuple[object, str | None]:
    """(the parsed JSON object, None), or (None, what is wrong with `text` in a few words)."""
    if not text.strip():
        return None, "empty"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:  # a decoder that ran out of text (or of a string) met a cut file
        if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
            return None, "cut short (truncated JSON)"
        return None, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except RecursionError:
        return None, "not valid JSON (nested too deeply)"
    if not isinstance(value, dict):
        return None, f"holds a JSON {type(value).__name__}, not an object"
    return value, None


def read_json(path: Path, fix: str) -> dict:
    """A JSON object file of a run (run.json, eval/metrics.json, a merged directory's tunekit.json, ...). One
    that cannot be read, is not UTF-8, is cut short, is not JSON or not an object raises DamagedFile naming
    it and `fix`: every reader of a run's files goes through here, never through a bare json.loads."""
    value, problem = _decode(_text(path, fix))
    if problem is not None:
        raise DamagedFile(path, problem, fix)
    return value


def read_jsonl(path: Path, fix: str, limit: int | None = None) -> list[dict]:
    """The JSON object lines of a run's .jsonl file (loss_history.jsonl, eval/predictions.jsonl), the first
    `limit` lines only when given; blank lines are skipped.

    An unparsable LAST line is skipped: each line is appended in one write, so a kill or a full disk during a
    write cuts the last line only, and that is the normal state of a killed run, which a report must take as it
    is. A bad line with lines after it was not cut by a kill (later lines were appended behind it): it was
    damaged after, and skipping it would draw curves with a silent hole, so it is named with its line number."""
    lines = _text(path, fix).splitlines()
    rows = []
    for number, line in enumerate(lines[:limit] if limit else lines, 1):
        if not line.strip():
            continue
        value, problem = _decode(line)
        if problem is None:
            rows.append(value)
        elif number < len(lines):
            raise DamagedFile(path, f"line {number}: {problem}", fix)
    return rows
