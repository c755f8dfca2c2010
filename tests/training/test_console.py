"""What `tunekit train` shows (issue 28, point 5): tunekit's lines, one progress display per phase (data,
training with loss, learning rate, tokens/s and time left, each evaluation's loss pass and generation) and
the Trainer's logs as aligned text. On a terminal the phases are bars; without one (CI, `| tee`) there are
no carriage returns, only lines. transformers' "Loading weights" and "Writing model shards" bars show only
with --verbose. The slow tests read the output of real tiny runs in each mode."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading

import pytest

from conftest import ROOT, history, reverse_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit.core import console, quiet
from tunekit.training.progress import log_line

LIBRARY_BARS = ("Loading weights", "Writing model shards")


# ---------------------------------------------------------------- formatting and modes
def test_log_lines_are_aligned_text_not_dicts():
    first = log_line({"loss": 5.96891, "grad_norm": 0.72, "learning_rate": 5e-3, "epoch": 0.25}, 1, 40,
                     [("tokens/s", "1,631"), ("left", "0:00:16")])
    later = log_line({"loss": 12.5, "grad_norm": 10.25, "learning_rate": 2.5e-4, "epoch": 1.0}, 40, 40,
                     [("tokens/s", "93"), ("left", "0:00:00")])
    assert first == ("step  1/40  loss 5.9689    grad norm 0.7200    lr 5.00e-03  epoch 0.25      "
                     "tokens/s 1,631     left 0:00:16")
    for name in ("loss", "grad norm", "lr", "epoch", "tokens/s", "left"):  # every column starts at the same place
        assert first.index(f"  {name} ") == later.index(f"  {name} ")
    evaluation = log_line({"eval_loss": 5.75, "eval_bleu": 12.34, "eval_runtime": 2.14,
                           "eval_samples_per_second": 3.7, "eval_steps_per_second": 0.46, "epoch": 0.5}, 20, 40)
    assert evaluation == "eval 20/40  loss 5.7500    bleu 12.3400   time 2.1s      epoch 0.50"
    done = log_line({"train_runtime": 7.476, "train_samples_per_second": 4.28, "train_steps_per_second": 0.535,
                     "total_flos": 1234.0, "train_loss": 5.832, "epoch": 1.0}, 40, 40)
    assert done == "done 40/40  time 7.5s      train loss 5.8320    epoch 1.00"
    odd = log_line({"rewards/chosen": 1e-6, "loss": float("nan"), "note": "x" * 60}, 3, 9)
    assert odd == f"step 3/9  rewards/chosen 1.000e-06  loss nan       note {'x' * 40}"


def test_time_left_counts_the_evaluations_still_to_come():
    from types import SimpleNamespace

    from tunekit.training.progress import evaluations_left

    state = SimpleNamespace(max_steps=100, global_step=30, epoch=0.6, num_train_epochs=2)
    assert evaluations_left(SimpleNamespace(eval_strategy="steps", eval_steps=25), state) == 3  # 50, 75, 100
    assert evaluations_left(SimpleNamespace(eval_strategy="steps", eval_steps=0.5), state) == 2
    assert evaluations_left(SimpleNamespace(eval_strategy="epoch", eval_steps=None), state) == 2
    assert evaluations_left(SimpleNamespace(eval_strategy="no", eval_steps=None), state) == 0


def test_the_mode_follows_the_terminal_unless_the_variable_says(monkeypatch):
    monkeypatch.delenv(console.MODE_VAR, raising=False)
    for tty, expected in ((True, "bars"), (False, "lines")):
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=tty: tty, raising=False)
        assert console.mode() == expected
        for forced in console.MODES:
            monkeypatch.setenv(console.MODE_VAR, forced.upper())
            assert console.mode() == forced
        monkeypatch.setenv(console.MODE_VAR, "sometimes")  # anything else: the terminal decides
        assert console.mode() == expected
        monkeypatch.delenv(console.MODE_VAR)


def test_progress_as_lines_every_quarter_and_nothing_where_the_log_is_quieter(monkeypatch, caplog):
    monkeypatch.setenv(console.MODE_VAR, "lines")
    log = logging.getLogger("tunekit")
    monkeypatch.setattr(log, "level", logging.INFO)
    with caplog.at_level(logging.INFO, logger="tunekit"), console.Progress("eval: generating", 10, "answers") as bar:
        for _ in range(10):
            bar.update()
    assert [r.getMessage() for r in caplog.records] == [f"eval: generating {n}/10 answers" for n in (2, 4, 6, 8, 10)]
    caplog.clear()
    monkeypatch.setattr(log, "level", logging.WARNING)  # a process other than the main one
    monkeypatch.setenv(console.MODE_VAR, "bars")
    with console.Progress("training", 4) as bar:
        bar.update(4)
        assert bar.bar is None
    assert not caplog.records


# ---------------------------------------------------------------- the libraries' bars
def test_the_hidden_bars_are_titled_so_in_transformers_and_say_why():
    import inspect

    from transformers import core_model_loading, modeling_utils

    source = inspect.getsource(core_model_loading) + inspect.getsource(modeling_utils)
    for bar in quiet.HIDDEN_BARS:
        assert f'desc="{bar.title}"' in source, f"transformers no longer titles a bar {bar.title!r}"
        assert len(bar.reason) > 40


def test_only_the_listed_transformers_bars_are_hidden(monkeypatch):
    from transformers.utils import logging as hf_logging

    previous, enabled = hf_logging.set_tqdm_hook(None), hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # an install in lines mode earlier in this process turned all off
    monkeypatch.setenv(console.MODE_VAR, "bars")
    try:
        quiet.install(verbose=False)
        hidden = hf_logging.tqdm(range(2), desc="Loading weights", disable=False)
        shown = hf_logging.tqdm(range(2), desc="Downloading model", disable=True)
        assert isinstance(hidden, hf_logging.EmptyTqdm) and not isinstance(shown, hf_logging.EmptyTqdm)
    finally:
        hf_logging.set_tqdm_hook(previous)
        if not enabled:
            hf_logging.disable_progress_bar()


def test_after_import_waits_for_the_real_import(tmp_path, monkeypatch):
    """A library's availability check (importlib.util.find_spec) is not its import."""
    import importlib.util

    (tmp_path / "tk_console_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    quiet.after_import("tk_console_probe", lambda module: seen.append(module.VALUE))
    assert importlib.util.find_spec("tk_console_probe") is not None and seen == []
    import tk_console_probe  # noqa: F401

    assert seen == [1]
    quiet.after_import("tk_console_probe", lambda module: seen.append(2))  # already imported: at once
    assert seen == [1, 2]
    monkeypatch.delitem(sys.modules, "tk_console_probe")


# ---------------------------------------------------------------- real runs
def train_recipe(tmp_path, tiny_model, **sections):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    held = write_jsonl(tmp_path / "eval.jsonl", reverse_rows(8))
    sections = {"data": {"eval": str(held)}, "training": {"max_steps": 4, "eval_steps": 2, "logging_steps": 1},
                "eval": {"limit": 4, "max_new_tokens": 4, "metrics": ["exact_match"]}, **sections}
    recipe = tiny_recipe(tiny_model, data, tmp_path / "run", **sections)
    return write_recipe(tmp_path / "recipe.yaml", recipe)


def environment(tmp_path, mode: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != console.MODE_VAR and "PROGRESS_BARS" not in k}
    env.update({"PYTHONWARNINGS": "ignore", "TUNEKIT_CACHE": str(tmp_path / "cache")})  # data prepared afresh
    return env | ({console.MODE_VAR: mode} if mode else {})


def on_a_terminal(args: list[str], env: dict, timeout: int = 600) -> tuple[int, str]:
    """`tunekit ARGS` with stderr on a pseudo-terminal (stdout a pipe): exit code, everything printed."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # 40 rows of 200 columns
    proc = subprocess.Popen([sys.executable, "-m", "tunekit", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks: list[bytes] = []

    def read():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    out, _ = proc.communicate(timeout=timeout)
    reader.join(timeout=30)
    os.close(master)
    return proc.returncode, b"".join(chunks).decode("utf-8", "replace") + out.decode()


def run_piped(args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    """`tunekit ARGS` with stdout and stderr pipes, read as bytes: text mode would turn each \r into \n."""
    res = subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=ROOT, env=env, capture_output=True,
                         timeout=timeout)
    res.stdout, res.stderr = res.stdout.decode(), res.stderr.decode()
    return res


def screen_lines(text: str) -> list[str]:
    """What stays on a terminal: each line's text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in text.replace("\r\n", "\n").split("\n")]


@pytest.mark.slow
def test_without_a_terminal_only_lines_with_the_same_facts(tmp_path, tiny_model):
    res = run_piped(["train", str(train_recipe(tmp_path, tiny_model))], environment(tmp_path, None))
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout + res.stderr
    assert "\r" not in text and "\x1b[" not in text
    assert "{'" not in text and not any(bar in text for bar in LIBRARY_BARS)
    lines = res.stderr.splitlines()
    assert "tunekit: tokenizing train: 32 examples" in lines and "tunekit: tokenizing eval: 8 examples" in lines
    steps = [line for line in lines if line.startswith("tunekit: step ")]
    assert len(steps) == 4, lines
    pattern = (r"tunekit: step (\d)/4  loss \d\.\d{4}    grad norm \d\.\d{4}    lr 5\.00e-03  epoch \d\.\d\d      "
               r"tokens/s [\d,]+ +left \d:\d\d:\d\d")
    assert all(re.fullmatch(pattern, line) for line in steps), steps
    assert len({line.index("left") for line in steps}) == 1  # aligned
    evals = [line for line in lines if line.startswith("tunekit: eval ") and "/4 " in line]
    assert [line.split()[2] for line in evals] == ["2/4", "4/4"]
    assert all(re.search(r"  loss \d\.\d{4} +exact_match \d+\.\d{4} +time [\d.]+s", line) for line in evals)
    # generation at each evaluation during training, and in the end-of-training eval
    assert lines.count("tunekit: eval: generating 4/4 answers") == 3
    assert any(re.fullmatch(r"tunekit: done 4/4  time [\d.]+s +train loss \d\.\d{4} +epoch 1\.00", line)
               for line in lines)
    rows = history(tmp_path / "run")
    # as the Trainer logs, with when and how many real tokens had been collated
    assert set(rows[0]) == {"step", "epoch", "time", "tokens_collated", "loss", "grad_norm", "learning_rate"}
    tokens = [r["tokens_collated"] for r in rows if "loss" in r]
    assert 0 < tokens[0] < tokens[-1] and all(a <= b for a, b in zip(tokens, tokens[1:])), tokens


@pytest.mark.slow
def test_on_a_terminal_a_bar_per_phase(tmp_path, tiny_model):
    code, text = on_a_terminal(["train", str(train_recipe(tmp_path, tiny_model))], environment(tmp_path, None))
    assert code == 0, text[-3000:]
    assert not any(bar in text for bar in LIBRARY_BARS) and "{'" not in text
    frames = text.split("\r")
    assert any(re.match(r"tokenizing train: +100%\|", f) for f in frames)  # the data phase
    training = [f for f in frames if re.match(r"training +\d+%\|", f)]
    assert any(re.search(r"\| 4/4 \[[\d:]+, loss \d\.\d{4}  lr 5\.00e-03  tokens/s [\d,]+  left \d:\d\d:\d\d\]", f)
               for f in training), training[-3:]
    assert any(re.match(r"eval loss +\d+%\|.*batches/s", f) for f in frames)
    assert any(re.match(r"eval: generating +\d+%\|.*/4 .*answers/s", f) for f in frames)
    # the log lines stay on screen above the bars, whole
    shown = screen_lines(text)
    assert sum(bool(re.fullmatch(r"tunekit: step \d/4  loss .* left \d:\d\d:\d\d\s*", line)) for line in shown) == 4
    assert sum(line.startswith("tunekit: eval ") and " loss " in line for line in shown) == 2


@pytest.mark.slow
def test_verbose_brings_the_libraries_bars_back(tmp_path, tiny_model):
    """Full fine-tuning saves a whole model, which transformers writes in shards."""
    recipe = train_recipe(tmp_path, tiny_model, adapter="none", lora=None, eval=None,
                          data={"train": str(tmp_path / "train.jsonl")}, training={"max_steps": 1})
    res = run_piped(["train", str(recipe), "--verbose"], environment(tmp_path, "bars"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert all(bar in res.stderr for bar in LIBRARY_BARS)
    assert re.search(r"\rtraining 100%\|", res.stderr)  # TUNEKIT_PROGRESS=bars: bars without a terminal
