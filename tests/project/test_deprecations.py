"""No deprecation that tunekit itself causes (issue 27): every command runs in-process under a recorder
that catches each DeprecationWarning / FutureWarning (Python warnings) and each "deprecated" message a
library logs (transformers says "`torch_dtype` is deprecated" through its logger), with the Python stack
at the moment it is raised, and decides who made the deprecated call.

A deprecation is tunekit's when tunekit made the deprecated call: the name the message says is deprecated
(`torch_dtype`) is spelled in the tunekit statement that called into the library, or the library's
`stacklevel` points at a tunekit line, or the API tunekit called raised it itself (at most
MAX_LIBRARY_FRAMES library frames below tunekit's). A deprecation raised deep inside a library's own
machinery (peft's PeftModel reading transformers' renamed `is_gradient_checkpointing` property while
tunekit calls `get_peft_model`) is the library's doing: it is listed, not failed on; tunekit cannot change
that call.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import linecache
import logging
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import tunekit
from conftest import reverse_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit.cli import main

TUNEKIT = str(Path(tunekit.__file__).parent)
HERE = str(Path(__file__).resolve())
DEPRECATED = re.compile(r"deprecat", re.IGNORECASE)
# library frames allowed between tunekit's call and the one that raises: the deprecated API itself and one
# helper of it (a property, a decorator, an argument check); the emitting helpers (warning_once) not counted
MAX_LIBRARY_FRAMES = 2
STDLIB_EMITTERS = (str(Path(logging.__file__).parent), warnings.__file__)
LIBRARY_LOGGERS = ("", "transformers", "peft", "trl", "accelerate", "datasets", "torch", "DeepSpeed", "bitsandbytes",
                   "huggingface_hub")


def _is_ours(filename: str, callers: tuple[str, ...]) -> bool:
    return any(filename.startswith(c) for c in callers)


def deprecated_names(message: str) -> set[str]:
    """The identifiers a deprecation message says are deprecated (named before "deprecated", not the advised
    replacement): `torch_dtype`, `torch.cuda.amp.GradScaler(args...)` -> GradScaler, "X is deprecated" -> X."""
    found = DEPRECATED.search(message)
    message = message[:found.start()] if found else message
    spelled = re.findall(r"`([^`]+)`", message) + re.findall(r"([\w.]+)(?:\(\S*\))? (?:is|are) $", message)
    return {m.group(1) for s in spelled if (m := re.search(r"(\w+)\W*$", s.split("(")[0] or s))}


@functools.lru_cache(maxsize=None)
def _statements(path: str) -> list[tuple[int, int]]:
    """(first line, last line) of each statement in `path`; a compound statement only up to its body."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            last = (body[0].lineno - 1 if isinstance(body, list) and body and hasattr(body[0], "lineno")
                    else node.end_lineno)
            spans.append((node.lineno, max(node.lineno, last)))
    return spans


def statement_at(path: str, line: int) -> str:
    """The source of the innermost statement of `path` that holds `line`."""
    spans = [s for s in _statements(path) if s[0] <= line <= s[1]]
    if not spans:
        return linecache.getline(path, line)
    first, last = max(spans)
    return "".join(linecache.getline(path, n) for n in range(first, last + 1))


@dataclass
class Deprecation:
    message: str
    where: str  # the innermost caller frame (tunekit's, or the test's in the self-check): file:line
    library_frames: list[str]  # from the caller's callee to the frame that raised, outermost first
    blamed_on_caller: bool

    def __str__(self) -> str:
        chain = " -> ".join(self.library_frames[-6:])
        return f"{self.where}: {self.message[:160]!r} (via {chain})"


@dataclass
class Recorder:
    """Deprecations raised while active, each with who called the library. `callers`: path prefixes whose
    frames count as the caller (tunekit's package; the self-check adds a helper of its own)."""

    callers: tuple[str, ...] = (TUNEKIT,)
    found: list[Deprecation] = field(default_factory=list)

    @staticmethod
    def _emitting(path: str, name: str) -> bool:
        """Frames of the warning machinery, not of the API that was called: the logging and warnings modules,
        a library's logging helpers (transformers' warning_once), this recorder."""
        return (path == HERE and name in ("note", "show", "emit")) or path.startswith(STDLIB_EMITTERS) \
            or "/logging" in path or "warn" in name

    def note(self, message: str, filename: str | None = None) -> None:
        """Called from inside the warning or log call: walks the live stack outward to the first caller frame."""
        frames = []
        f = sys._getframe(1)
        while f is not None:
            path, name = f.f_code.co_filename, f.f_code.co_name
            if _is_ours(path, self.callers) and not (path == HERE and name in ("note", "show", "emit")):
                lib = [fr for fr in reversed(frames) if not self._emitting(fr[0], fr[2])]
                statement = statement_at(path, f.f_lineno)
                blamed = (len(lib) <= MAX_LIBRARY_FRAMES
                          or (filename is not None and _is_ours(filename, self.callers))
                          or any(re.search(rf"\b{re.escape(n)}\b", statement) for n in deprecated_names(message)))
                self.found.append(Deprecation(message, f"{Path(path).name}:{f.f_lineno}",
                                              [f"{Path(p).name}:{n}:{fn}" for p, n, fn in lib], blamed))
                return
            frames.append((path, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        if filename is not None and _is_ours(filename, self.callers):  # raised from a C function tunekit called
            self.found.append(Deprecation(message, Path(filename).name, [], True))

    @property
    def tunekit_caused(self) -> list[Deprecation]:
        return [d for d in self.found if d.blamed_on_caller]

    @contextlib.contextmanager
    def active(self):
        recorder = self

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, (DeprecationWarning, FutureWarning)):
                recorder.note(f"{category.__name__}: {message}", filename)

        class Handler(logging.Handler):
            def emit(self, record):
                if getattr(record, "deprecation_noted", False):  # a handler on a logger and on its parent
                    return
                record.deprecation_noted = True
                if record.levelno >= logging.WARNING and DEPRECATED.search(record.getMessage()):
                    recorder.note(f"log {record.name}: {record.getMessage()}")

        handler = Handler()
        loggers = [logging.getLogger(n) for n in LIBRARY_LOGGERS]
        _clear_once_caches()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            old_show, warnings.showwarning = warnings.showwarning, show
            for lg in loggers:
                lg.addHandler(handler)
            try:
                yield self
            finally:
                warnings.showwarning = old_show
                for lg in loggers:
                    lg.removeHandler(handler)


def _clear_once_caches() -> None:
    """transformers says most deprecations once per process (lru_cache'd warning_once): forget which."""
    from transformers.utils import logging as hf_logging

    for name in ("warning_once", "info_once"):
        cache_clear = getattr(getattr(hf_logging, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


# ---------------------------------------------------------------- the recorder can fail
def _from_pretrained_with_torch_dtype(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)


def _compiled_as(path: str, source: str, **namespace):
    """A function whose frames say they run from `path` (its source registered for linecache)."""
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    exec(compile(source, path, "exec"), namespace)
    return namespace


def test_the_recorder_blames_the_caller_of_a_deprecated_argument(tiny_model):
    """This file's helper passes transformers' deprecated torch_dtype: it is blamed (the warning is raised
    six library frames down, in the config's property, so only the named argument can tell)."""
    recorder = Recorder(callers=(HERE,))
    with recorder.active():
        _from_pretrained_with_torch_dtype(tiny_model)
    blamed = recorder.tunekit_caused
    assert blamed and "torch_dtype" in blamed[0].message and blamed[0].where.startswith(Path(HERE).name), recorder.found


def test_the_recorder_tells_a_direct_deprecated_call_from_a_library_internal_one():
    """A fake library: its API raising a deprecation itself is the caller's doing, as is one whose stacklevel
    points at the caller; one raised three calls deep, naming nothing the caller spelled, is the library's."""
    lib = _compiled_as("/nonexistent/site-packages/fakelib.py", (
        "import warnings\n"
        "def old_api():\n    warnings.warn('`old_api` is deprecated', FutureWarning)\n"
        "def pointing():\n    warnings.warn('`something` is deprecated', FutureWarning, stacklevel=2)\n"
        "def work():\n    return step()\n"
        "def step():\n    return inner()\n"
        "def inner():\n    warnings.warn('`internal_name` is deprecated', DeprecationWarning)\n"))
    caller = _compiled_as(f"{TUNEKIT}/_fake_caller.py", (
        "def direct():\n    old_api()\n"
        "def pointed():\n    pointing()\n"
        "def deep():\n    work()\n"), **{k: lib[k] for k in ("old_api", "pointing", "work")})
    for name, blamed in (("direct", True), ("pointed", True), ("deep", False)):
        recorder = Recorder()
        with recorder.active():
            caller[name]()
        assert [d.blamed_on_caller for d in recorder.found] == [blamed], (name, recorder.found)


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_a_deprecated_call_from_tunekit_during_a_command_is_caught(tiny_env, monkeypatch):
    """The whole path: a command run in-process through cli.main, with a tunekit function (compiled as a
    tunekit file) reading the deprecated `config.torch_dtype`, is reported as tunekit's."""
    from tunekit.export import merge

    fake = _compiled_as(f"{TUNEKIT}/_fake_merge.py", (
        "def _default_dtype(recipe):\n"
        "    getattr(model_config(recipe.model), 'torch_dtype', None)\n"
        "    return 'fp32'\n"), model_config=merge.model_config)
    monkeypatch.setattr(merge, "_default_dtype", fake["_default_dtype"])
    recorder = Recorder()
    with recorder.active():
        assert main.main(["merge", str(tiny_env["sft"]), "--out", str(tiny_env["root"] / "fake-merged"),
                          "--verbose"]) == 0
    assert [d.where for d in recorder.tunekit_caused] == ["_fake_merge.py:2"], recorder.found


# ---------------------------------------------------------------- every command
@pytest.fixture(scope="module")
def tiny_env(tiny_model, tmp_path_factory):
    """The tiny model with no dtype in its config.json (as many published configs have none), a 2-step
    run of each training method on it, and their recipes. Runs the trainings under the recorder."""
    import json
    import shutil

    from tunekit.data.demodata import unpaired

    root = tmp_path_factory.mktemp("deprecations")
    model = root / "tiny"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    (model / "config.json").write_text(json.dumps(config))
    pairs = [{"prompt": f"Reverse the word.\n\n{w}", "chosen": w[::-1], "rejected": w} for w in ("cat", "dog", "bird")]
    data = {"sft": ("alpaca", reverse_rows(8)), "dpo": ("preference", pairs), "orpo": ("preference", pairs),
            "kto": ("unpaired_preference", unpaired(pairs))}
    env = {"root": root, "recorders": {}}
    for method, (fmt, rows) in data.items():
        rows_file = write_jsonl(root / f"{method}.jsonl", rows)
        raw = tiny_recipe(model, rows_file, root / method,
                          training={"method": method, "max_steps": 2, "save_steps": 1, "eval_steps": 2,
                                    "micro_batch_size": 4},
                          eval={"limit": 2, "max_new_tokens": 4, "batch_size": 2})
        raw["data"].update(format=fmt, eval=str(rows_file))
        env[f"{method}.yaml"] = write_recipe(root / f"{method}.yaml", raw)
        env[method] = root / method
        env["recorders"][f"train {method}"] = record(["train", str(env[f"{method}.yaml"])])
    return env


def record(argv: list[str]) -> Recorder:
    """`tunekit <argv> --verbose` in this process under a recorder (--verbose: tunekit's quiet list hides
    nothing), which must exit 0."""
    recorder = Recorder()
    with recorder.active():
        assert main.main([*argv, "--verbose"]) == 0, argv
    return recorder


@pytest.mark.slow  # seconds (its fixture trains each method): make test-fast leaves it out
def test_no_command_makes_a_deprecated_call(tiny_env):
    run, recipe, root = str(tiny_env["sft"]), str(tiny_env["sft.yaml"]), tiny_env["root"]
    commands = {
        "validate": ["validate", recipe],
        "plan": ["plan", recipe],
        "merge": ["merge", run, "--out", str(root / "merged")],
        "eval": ["eval", run, "--limit", "2", "--max-new-tokens", "4", "--out", str(root / "eval")],
        "export gguf": ["export", run, "--out", str(root / "m.gguf")],
        "export safetensors": ["export", run, "--format", "safetensors", "--out", str(root / "st")],
        "runs": ["runs", str(root)],
        "report": ["report", run, "--out", str(root / "report.html")],
    }
    recorders = {**tiny_env["recorders"], **{name: record(argv) for name, argv in commands.items()}}
    ours = [f"{name}: {d}" for name, r in recorders.items() for d in r.tunekit_caused]
    assert not ours, "tunekit makes deprecated calls:\n" + "\n".join(ours)


def test_no_tunekit_source_spells_torch_dtype():
    """Paths the commands above do not take (a GGUF base, quantized loading) are held to the same rule:
    `torch_dtype` is neither passed, read nor set anywhere in tunekit's code."""
    found = []
    for path in sorted(Path(TUNEKIT).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            spelled = ((isinstance(node, ast.keyword) and node.arg == "torch_dtype")
                       or (isinstance(node, ast.Attribute) and node.attr == "torch_dtype")
                       or (isinstance(node, ast.Constant) and node.value == "torch_dtype"))
            if spelled:
                found.append(f"{path.name}:{node.lineno}" if hasattr(node, "lineno") else path.name)
    assert not found, found
