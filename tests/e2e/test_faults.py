"""Faults: resume after SIGKILL (in training, in the end-of-training eval, in merge), no half-written
outputs, one run per output directory, a full disk, NaN stops, pre-flight checks, safe defaults.
Bad input is in test_bad_input.py."""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    ROOT,
    assert_no_pickles,
    cut_after_checkpoint,
    in_full,
    logged,
    reverse_rows,
    run_cli,
    start_cli,
    tiny_recipe,
    write_jsonl,
    write_recipe,
)
from tunekit.config import recipefile, schema
from tunekit.core import checkpointfile
from tunekit.core.errors import TunekitError
from tunekit.models import loader
from tunekit.runs import checkpoints
from tunekit.runs.layout import RunRecord
from tunekit.training import diskspace, runner

pytestmark = pytest.mark.slow  # every test here trains, merges or evaluates a model

shutil_usage = namedtuple("usage", "total used free")  # what shutil.disk_usage returns
RESUME_ARGS = ["--set", "training.max_steps=8", "--set", "training.save_steps=2",
               "--set", "training.save_total_limit=10",
               "--set", "lora.dropout=0.1"]  # dropout: the RNG state must be restored too


@pytest.fixture(scope="module")
def resume_recipe(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("resume")
    data = write_jsonl(root / "train.jsonl", reverse_rows(32))
    return write_recipe(root / "r.yaml", tiny_recipe(tiny_model, data, root / "unused"))


@pytest.fixture(scope="module")
def uninterrupted(resume_recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *RESUME_ARGS)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def start_and_kill(recipe_file, out, wait_for: Path):
    proc = start_cli("train", str(recipe_file), "--set", f"output_dir={out}", *RESUME_ARGS)
    deadline = time.time() + 300
    while not wait_for.exists():
        assert proc.poll() is None, "training ended before the kill point"
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigterm_ends_training_as_an_error_does(resume_recipe, tmp_path):
    """A scheduler's stop (SIGTERM) is recorded: run.json says failed with the signal, never "running"."""
    out = tmp_path / "run"
    proc = start_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *RESUME_ARGS)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "checkpoint-2" / "tunekit-complete").exists():
        assert proc.poll() is None and time.time() < deadline, "training ended before the stop"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    record = RunRecord.load(out)
    assert record.status == "failed" and record.error == "stopped by signal SIGTERM", record
    assert record.failed_at_step >= 2


# make test kills after the first checkpoint and while the last one is written; the kill points between are `full`
@pytest.mark.parametrize("kill_point", ["checkpoint-2/tunekit-complete",
                                        in_full("checkpoint-4/tunekit-complete"),
                                        in_full("checkpoint-6/tunekit-complete"),
                                        "checkpoint-6"])
def test_resume_after_sigkill_matches_an_uninterrupted_run(resume_recipe, uninterrupted, tmp_path, kill_point):
    """The last point kills as soon as checkpoint-6 appears, while its files are being written."""
    out = tmp_path / "run"
    start_and_kill(resume_recipe, out, out / "checkpoints" / kill_point)
    assert RunRecord.load(out).status == "running"
    assert not (out / "adapter").exists()
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *RESUME_ARGS, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.search(r"resuming from checkpoint-[246]\b", res.stderr)
    info = RunRecord.load(out)
    assert info.status == "completed" and info.global_step == 8
    # exactly the same: data order, optimizer, scheduler and RNG state all restored
    assert logged(out, "loss") == logged(uninterrupted, "loss")
    a = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(uninterrupted / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_refuses_a_checkpoint_without_readable_optimizer_state(tmp_path):
    ckpt = tmp_path / "checkpoints" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoints.MARKER).write_text("{}")
    (ckpt / "optimizer.pt").write_bytes(b"PK\x03\x04")  # torch.save format, which tunekit never loads
    with pytest.raises(TunekitError, match="no optimizer state tunekit can read"):
        checkpoints.resume_point(tmp_path / "checkpoints")


def test_resume_restores_8bit_optimizer_state(resume_recipe, tmp_path):
    # Full fine-tuning, so the larger matrices get bitsandbytes' uint8 moments with their scales.
    args = ["--set", "training.optimizer=paged_adamw_8bit", "--set", "adapter=none", "--set", "lora=null",
            "--set", "training.learning_rate=1e-3", "--set", "training.max_steps=6", "--set", "training.save_steps=2",
            "--set", "training.save_total_limit=10"]
    full = tmp_path / "full"
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={full}", *args)
    assert res.returncode == 0, res.stderr[-2000:]
    state = checkpointfile.load(full / "checkpoints" / "checkpoint-2" / "optimizer.safetensors")
    assert any(t.dtype == torch.uint8 for s in state["state"].values()
               for t in s.get("__bnb_optimizer_quant_state__", {}).values())
    cut = cut_after_checkpoint(full, tmp_path / "cut", 2)
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={cut}", *args, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert logged(cut, "loss") == logged(full, "loss")
    a, b = load_file(str(full / "model" / "model.safetensors")), load_file(str(cut / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_ignores_a_half_written_checkpoint(resume_recipe, uninterrupted, tmp_path):
    """The on-disk state of a kill in the middle of writing checkpoint-6 and the final adapter."""
    out = tmp_path / "run"
    start_and_kill(resume_recipe, out, out / "checkpoints" / "checkpoint-4" / checkpoints.MARKER)
    half = out / "checkpoints" / "checkpoint-6"
    half.mkdir()
    (half / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    (out / ".adapter.partial").mkdir()
    assert checkpoints.newest_complete(out / "checkpoints").name == "checkpoint-4"
    # nothing treats the interrupted run as finished
    assert run_cli("merge", str(out)).returncode == 2
    assert run_cli("eval", str(out)).returncode == 2
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *RESUME_ARGS, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "removed incomplete checkpoint checkpoint-6" in res.stderr and "resuming from checkpoint-4" in res.stderr
    assert logged(out, "loss") == logged(uninterrupted, "loss")
    assert not (out / ".adapter.partial").exists()


def test_resume_refuses_other_recipe_or_missing_run(resume_recipe, uninterrupted, tmp_path):
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={tmp_path / 'none'}", "--resume")
    assert res.returncode == 2 and f"--resume: output_dir {tmp_path / 'none'}: no such directory" in res.stderr
    (tmp_path / "empty").mkdir()
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={tmp_path / 'empty'}", "--resume")
    assert res.returncode == 2 and "not a tunekit run directory" in res.stderr
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={uninterrupted}", *RESUME_ARGS, "--resume")
    assert res.returncode == 2 and "already completed" in res.stderr


def test_a_run_writes_only_safetensors_and_text(uninterrupted):
    ckpts = sorted((uninterrupted / "checkpoints").glob("checkpoint-*"))
    assert ckpts and all((c / checkpoints.MARKER).is_file() for c in ckpts)
    names = {p.name for p in assert_no_pickles(uninterrupted)}
    assert {"adapter_model.safetensors", "optimizer.safetensors", "scheduler.safetensors",
            "rng_state.safetensors"} <= names


def test_non_finite_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(tmp_path, tiny_model, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(32))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"max_steps": 10, "save_steps": 2})
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    real = loader.load_for_training
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        model = real(*args, **kwargs)

        def hook(module, inputs, output):  # on the output head: logits, or the chunked path's loss sum
            calls["n"] += 1
            if calls["n"] >= 5:  # the 5th training forward pass, i.e. step 5
                return output * float("nan")
            return output
        model.get_output_embeddings().register_forward_hook(hook)
        return model

    monkeypatch.setattr(loader, "load_for_training", poisoned)
    with pytest.raises(TunekitError, match=r"at step 5"):
        runner.run(recipe)
    run_dir = tmp_path / "run"
    info = RunRecord.load(run_dir)
    assert info.status == "failed" and "step 5" in info.error
    assert checkpoints.newest_complete(run_dir / "checkpoints").name == "checkpoint-4"
    good = load_file(str(run_dir / "checkpoints" / "checkpoint-4" / "adapter_model.safetensors"))
    assert all(v.isfinite().all() for v in good.values())
    assert not (run_dir / "adapter").exists()


# ---------------------------------------------------------------- kills after training, locks, full disk


def wait_until(proc, ready, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"the process ended before {what}: " + proc.output()[1][-2000:]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _eval_pending(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "run.json").read_text()).get("eval") == "pending"
    except (OSError, ValueError):
        return False


def test_kill_during_end_of_training_eval_then_resume_finishes_only_the_eval(resume_recipe, tmp_path):
    out = tmp_path / "run"
    # an eval long enough to be killed in
    EVAL_ARGS = ["--set", "training.max_steps=4", "--set", "training.save_steps=2", "--set", "eval.limit=16",
                 "--set", "eval.batch_size=1", "--set", "eval.max_new_tokens=200",
                 "--set", f"eval.data={resume_recipe.parent / 'train.jsonl'}"]
    proc = start_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *EVAL_ARGS)
    wait_until(proc, lambda: _eval_pending(out), "the end-of-training eval")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "eval").exists()  # nothing that looks like a finished eval
    trained = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    history_before = (out / "loss_history.jsonl").read_text()

    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *EVAL_ARGS, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "completed before; only its end-of-training eval is left" in res.stderr
    assert RunRecord.load(out).eval == "completed"
    assert json.loads((out / "eval" / "metrics.json").read_text())["scores"]["examples"] == 16
    # the training was not run again
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == trained
    assert (out / "loss_history.jsonl").read_text() == history_before
    assert not list(out.glob(".eval.partial-*"))
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *EVAL_ARGS, "--resume")
    assert res.returncode == 2 and "already completed; nothing to resume" in res.stderr


def test_merge_killed_mid_way_is_rerun_cleanly(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    proc = start_cli("merge", str(run_dir))
    wait_until(proc, lambda: (run_dir / ".merged.lock").exists(), "merge started")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # what a kill while writing leaves: a partial directory and the dead process's lock file
    (run_dir / ".merged.partial-x1y2").mkdir()
    (run_dir / ".merged.partial-x1y2" / "model.safetensors").write_bytes(b"\0" * 64)
    (run_dir / ".merged.lock").write_text("pid 999999: tunekit merge")
    assert not (run_dir / "merged").exists()

    res = run_cli("merge", str(run_dir))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "took over a stale lock" in res.stderr and "pid 999999" in res.stderr
    assert not list(run_dir.glob(".merged.partial-*")) and not (run_dir / ".merged.lock").exists()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "merged") is not None
    assert json.loads((run_dir / "merged" / "tunekit.json").read_text())["parity"]["max_abs_diff"] < 1e-4


def test_a_second_run_on_the_same_output_dir_is_refused_naming_the_first(resume_recipe, tmp_path, capsys):
    from tunekit.cli.main import main

    out = tmp_path / "run"
    args = ["--set", f"output_dir={out}", "--set", "training.max_steps=100000", "--set", "training.save_steps=1000"]
    first = start_cli("train", str(resume_recipe), *args)
    try:
        wait_until(first, lambda: (out / "run.json").is_file(), "the first run started")
        for extra in ([], ["--force"], ["--resume"]):  # --force must not wipe a run in progress either
            capsys.readouterr()  # in this process: another process than the first's, as a second command is
            code = main(["train", str(resume_recipe), *args, *extra])
            err = capsys.readouterr().err
            assert code == 2, (extra, err[-2000:])
            assert f"output_dir {out} is in use by another tunekit process (pid {first.pid}:" in err, extra
        assert first.poll() is None and (out / "run.json").is_file()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # the killed run's lock is stale: the next run takes it over and says so
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", "--set", "training.max_steps=2", "--force")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"took over a stale lock on {out} (pid {first.pid}:" in res.stderr
    assert not (tmp_path / ".run.lock").exists()


def test_full_disk_while_checkpointing_ends_clearly_and_resumes(resume_recipe, uninterrupted, tmp_path):
    """The file-size limit (what a full disk looks like to a writer) drops below a checkpoint's size
    once checkpoint-2 is complete: the next checkpoint cannot be written."""
    import resource

    out = tmp_path / "run"
    proc = start_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *RESUME_ARGS)
    wait_until(proc, lambda: (out / "checkpoints" / "checkpoint-2" / checkpoints.MARKER).exists(), "checkpoint-2")
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))  # the adapter alone is larger
    stderr = proc.communicate(timeout=300)[1]
    assert proc.returncode == 2, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert re.match(r"tunekit: error: out of disk space in \S+ at step \d+ \(File too large\); free space, then add "
                    r"--resume to continue from checkpoint-\d+$", last), last
    assert "Traceback" not in stderr
    info = RunRecord.load(out)
    assert info.status == "failed" and not (out / "adapter").exists()
    kept = checkpoints.newest_complete(out / "checkpoints")
    assert kept.name == last.rsplit(" ", 1)[1]
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *RESUME_ARGS, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resuming from {kept.name}" in res.stderr
    assert logged(out, "loss") == logged(uninterrupted, "loss")


# ---------------------------------------------------------------- pre-flight and safety


def test_preflight_warns_when_disk_looks_too_small(tmp_path, tiny_model, monkeypatch, caplog):
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(4))
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, data, tmp_path / "run")),
                          ["adapter=none", "lora=null"])
    monkeypatch.setattr(diskspace.shutil, "disk_usage",
                        lambda p: shutil_usage(total=10**6, used=10**6 - 1000, free=1000))
    with caplog.at_level(logging.WARNING, logger="tunekit"):
        diskspace.warn_if_disk_short(recipe, tmp_path / "run")
    assert "free disk" in caplog.text and "lower training.save_total_limit" in caplog.text
    caplog.clear()
    monkeypatch.setattr(diskspace.shutil, "disk_usage", lambda p: shutil_usage(total=10**12, used=0, free=10**12))
    with caplog.at_level(logging.WARNING, logger="tunekit"):
        diskspace.warn_if_disk_short(recipe, tmp_path / "run")
    assert "free disk" not in caplog.text


def test_trust_remote_code_is_off_by_default_and_logged_when_on(tiny_model, caplog, tmp_path):
    cfg = schema.ModelConfig(name_or_path=str(tiny_model))
    assert cfg.trust_remote_code is False
    with caplog.at_level(logging.WARNING, logger="tunekit"):
        loader.load_base(cfg.model_copy(update={"trust_remote_code": True}), torch.float32)
    assert "trust_remote_code is ON" in caplog.text


def test_the_source_never_pickles_and_loads_weights_only():
    for path in (ROOT / "src" / "tunekit").rglob("*.py"):
        code = re.sub(r'""".*?"""|#[^\n]*', "", path.read_text(), flags=re.S)  # docstrings and comments
        assert not re.search(r"torch\.save\(|import pickle|pickle\.dump", code), path
        for call in re.findall(r"torch\.load\([^)]*\)", code):
            assert "weights_only=True" in call, f"{path}: {call}"
