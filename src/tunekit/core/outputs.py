"""Output directories: refuse to overwrite without --force, hold them while writing, write finished
outputs atomically, and record what produced them; where caches live. Knows nothing of what goes inside."""

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

from tunekit.core.errors import TunekitError


def cache_root() -> Path:
    """tunekit's caches (converted GGUF models, prepared data sets): $TUNEKIT_CACHE or ~/.cache/tunekit."""
    return Path(os.environ.get("TUNEKIT_CACHE", Path.home() / ".cache" / "tunekit"))


LIBRARIES = ("tunekit", "torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "deepspeed",
             "safetensors", "sacrebleu", "rouge-score")


def require_dir(path: Path, what: str) -> Path:
    """`path` must be an existing directory; say which of the two it is not."""
    if not path.exists():
        raise TunekitError(f"{what} {path}: no such directory")
    if not path.is_dir():
        raise TunekitError(f"{what} {path}: is a file, not a directory")
    return path


def _occupied(path: Path, keep: tuple[str, ...] = ()) -> bool:
    return path.exists() and (path.is_file() or any(p.name not in keep for p in path.iterdir()))


def check_free(path: Path, force: bool, what: str = "output directory", keep: tuple[str, ...] = ()) -> None:
    """Fail if `path` cannot be written or holds anything (but the names in `keep`) and --force was not given;
    touch nothing."""
    check_writable(path, what)
    if _occupied(path, keep) and not force:
        raise TunekitError(f"{what} {path} already exists; pass --force to overwrite it or choose another path")


def check_writable(path: Path, what: str = "output directory") -> None:
    """Fail if `path` could not be created or written: its nearest existing ancestor must be a writable directory."""
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        raise TunekitError(f"{what} {path}: {existing} is a file, not a directory; choose another path")
    try:  # access() says yes to root even on read-only file systems: try for real
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise TunekitError(f"{what} {path}: {existing} is not writable ({e.strerror}); choose another path") from None


def claim(path: Path, force: bool, what: str = "output directory", keep: tuple[str, ...] = ()) -> None:
    """Fail if `path` holds anything (but the names in `keep`), unless --force was given (then it is cleared of
    all but those)."""
    check_free(path, force, what, keep)
    if not _occupied(path, keep):
        return
    if path.is_file() or not keep:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        return
    for child in path.iterdir():
        if child.name not in keep:
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; rename it into place only on success. Holding
    `target`'s lock, it first removes partial directories that killed writers left behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(target, "output"):
        for stale in target.parent.glob(f".{target.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        try:
            yield tmp
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


_held: dict[Path, int] = {}  # lock file -> open descriptor, for the locks this process holds


def lock_path(output_dir: Path) -> Path:
    """Beside the directory, not in it: --force clears the directory while the lock must stay put."""
    return output_dir.parent / f".{output_dir.name}.lock"


@contextlib.contextmanager
def exclusive(output_dir: Path, what: str = "output_dir") -> Iterator[None]:
    """Hold `output_dir` for this process: a second tunekit process on it is refused at once, naming
    the holder's pid. The kernel drops an flock when its holder dies, so a lock file left by a killed
    run is stale by construction and is taken over (and said so). Re-entrant within one process."""
    path = lock_path(Path(output_dir).absolute())
    if path in _held:
        yield
        return
    made = [p for p in [path.parent, *path.parent.parents] if not p.exists()]  # removed again if left empty
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, stale = _acquire(path, output_dir, what)
    except OSError as e:
        raise TunekitError(f"{what} {output_dir}: cannot create its lock file {path} ({e.strerror}); "
                           "choose another path") from None
    if stale:
        import logging

        logging.getLogger("tunekit").info("took over a stale lock on %s (%s, no longer running)", output_dir, stale)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}: {' '.join(command_line())}".encode(), 0)
    _held[path] = fd
    try:
        yield
    finally:
        del _held[path]
        path.unlink(missing_ok=True)  # before unlocking: a process that opened it meanwhile retries
        os.close(fd)
        for folder in made:  # a refused run leaves no folder it created only for its lock
            with contextlib.suppress(OSError):
                folder.rmdir()


def _acquire(path: Path, output_dir: Path, what: str) -> tuple[int, str]:
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "pid unknown"
            os.close(fd)
            raise TunekitError(f"{what} {output_dir} is in use by another tunekit process ({holder}); wait for it "
                               "to finish or stop it, or choose another output_dir") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the holder unlinked it between our open and our lock: try the new file
            return fd, os.pread(fd, 300, 0).decode(errors="replace").strip()
        os.close(fd)


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
