"""`tunekit` commands for the tests, each in a process of its own, forked from a server that has imported the heavy
libraries once.

A `tunekit train` process on the 2-core CI machine spent 4.6-7 s importing torch, transformers, peft, TRL and
tunekit before its first line of work, and the suite starts a few hundred of them. Here one server per pytest
worker imports them once; each command is a fork of it (a new process: its own pid, exit code, stdout, stderr,
working directory and environment, as `python -m tunekit` gives), so a test still sees what a user's command does.

What a fork cannot give, a fresh interpreter does (`Command(..., fresh=True)`, or automatically): an environment that
differs from the server's in anything but TUNEKIT_* and PYTEST_* variables (libraries read theirs once, at import),
and output printed while the libraries import (the server's, not the command's: tests of what tunekit hides at import
use fresh interpreters)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# imported once by the server: the libraries every training, merge, eval and export command imports, and tunekit's
# modules for them (none reads the environment at import; tunekit reads its own variables when a command runs)
PRELOAD = ("torch", "transformers", "transformers.trainer", "peft", "trl", "accelerate", "datasets",
           "tunekit.cli.main", "tunekit.training.runner")

_SERVER = r"""
import gc, importlib, json, os, runpy, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
gc.collect()
gc.freeze()  # the imported objects stay out of the children's collections: fewer pages copied on write
requests, replies = sys.stdin, sys.stdout
print("ready", file=replies, flush=True)
for line in requests:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.argv = ["tunekit", *req["args"]]
        sys.path[0] = req["cwd"]  # as `python -m` puts its working directory first
        # the command's SystemExit (or exception) ends this interpreter as `python -m tunekit` ends: threads joined,
        # atexit's functions run, modules torn down and open files flushed, the exit code or a traceback
        runpy.run_module("tunekit", run_name="__main__", alter_sys=True)
        sys.exit(0)
    print(pid, file=replies, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), file=replies, flush=True)
"""


class _Server:
    def __init__(self, env: dict):
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps(PRELOAD)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     bufsize=0, cwd=Path(__file__).resolve().parents[1])
        self.ready, self.buffer = False, b""

    def _line(self, timeout: float | None) -> str | None:
        """The server's next reply line, or None after `timeout` seconds (read unbuffered, for select to hold)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            if timeout is not None and not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError("the tunekit test server ended")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode().strip()

    def start(self, argv: list[str], cwd: Path, env: dict, out: Path, err: Path) -> int:
        if not self.ready:
            assert self._line(600) == "ready", "the tunekit test server did not start"
            self.ready = True
        req = {"args": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        return int(self._line(60))


_server: _Server | None = None
_busy = threading.Lock()


# variables no library reads at import: a command's own may differ from the server's (pytest names the running test)
OWN = ("TUNEKIT_", "PYTEST_")


def _forkable(env: dict) -> bool:
    """Whether `env` differs in OWN variables only from the server's (or, before it starts, from this process's with
    the warnings off that every command here runs with)."""
    base = _server.env if _server else {**os.environ, "PYTHONWARNINGS": "ignore"}
    keys = set(env) | set(base)
    return all(k.startswith(OWN) or env.get(k) == base.get(k) for k in keys)


class Command:
    """A running `python -m tunekit *argv` (forked by the server, else a new interpreter), as much of
    subprocess.Popen as the tests use: pid, poll, wait, send_signal, communicate."""

    def __init__(self, argv: list[str], cwd: Path, env: dict, fresh: bool = False):
        global _server
        self.argv, self.returncode, self._server = ["tunekit", *argv], None, None
        self._tmp = tempfile.TemporaryDirectory()
        self._out, self._err = Path(self._tmp.name, "stdout"), Path(self._tmp.name, "stderr")
        if not (fresh or os.environ.get("TUNEKIT_TEST_FRESH")) and _forkable(env) and _busy.acquire(blocking=False):
            try:
                if _server is None or _server.proc.poll() is not None:
                    _server = _Server({k: v for k, v in env.items() if not k.startswith(OWN)})
                self.pid, self._server = _server.start(argv, cwd, env, self._out, self._err), _server
                return
            except BaseException:
                _busy.release()
                raise
        with self._out.open("w") as out, self._err.open("w") as err:
            self._proc = subprocess.Popen([sys.executable, "-m", "tunekit", *argv], cwd=cwd, env=env, stdout=out,
                                          stderr=err, stdin=subprocess.DEVNULL)
        self.pid = self._proc.pid

    def _ended(self, code: int) -> int:
        if self._server is not None:
            self._server = None
            _busy.release()
        self.returncode = code
        return code

    def poll(self) -> int | None:
        return self._wait(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return code

    def _wait(self, timeout: float | None) -> int | None:
        """The exit code; None if the command still runs after `timeout` seconds."""
        if self.returncode is not None:
            return self.returncode
        if self._server is None:
            try:
                return self._ended(self._proc.wait(timeout))
            except subprocess.TimeoutExpired:
                return None
        code = self._server._line(timeout)
        return None if code is None else self._ended(int(code))

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def output(self) -> tuple[str, str]:
        return self._out.read_text(errors="replace"), self._err.read_text(errors="replace")

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once the command ends; after `timeout` seconds it is killed (its process group too, when
        forked) and subprocess.TimeoutExpired raised, as subprocess.run does."""
        if self._wait(timeout) is None:
            with contextlib.suppress(ProcessLookupError):
                if self._server is not None:
                    os.killpg(self.pid, signal.SIGKILL)  # and whatever it started
                else:
                    os.kill(self.pid, signal.SIGKILL)
            self.wait()
            raise subprocess.TimeoutExpired(self.argv, timeout, *self.output())
        return self.output()

