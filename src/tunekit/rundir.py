"""Output directories: refuse to overwrite without --force, write finished outputs atomically,
and record what produced them."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import TunekitError

LIBRARIES = ("tunekit", "torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "deepspeed",
             "safetensors", "sacrebleu", "rouge-score")


def _occupied(path: Path) -> bool:
    return path.exists() and (path.is_file() or any(path.iterdir()))


def check_free(path: Path, force: bool, what: str = "output directory") -> None:
    """Fail if `path` holds anything and --force was not given; touch nothing."""
    if _occupied(path) and not force:
        raise TunekitError(f"{what} {path} already exists; pass --force to overwrite it or choose another path")
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        raise TunekitError(f"{what} {path}: {existing} is a file, not a directory; choose another path")
    try:  # access() says yes to root even on read-only file systems: try for real
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise TunekitError(f"{what} {path}: {existing} is not writable ({e.strerror}); choose another path") from None


def claim(path: Path, force: bool, what: str = "output directory") -> None:
    """Fail if `path` holds anything, unless --force was given (then it is cleared)."""
    check_free(path, force, what)
    if _occupied(path):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; rename it into place only on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def command_line() -> list[str]:
    program = "python -m tunekit" if sys.argv[0].endswith("__main__.py") else Path(sys.argv[0]).name
    return [program, *sys.argv[1:]]
