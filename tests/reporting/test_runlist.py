"""`tunekit runs`: status, steps, scores, wall time and output of every run under a directory."""

from __future__ import annotations

import json
import os

from tunekit.cli import main
from tunekit.core import outputs
from tunekit.runs.layout import RunRecord


def make_run(root, name, status="completed", step=40, scores=None, finished="2026-11-22T10:12:30+0000",
             output="adapter", lock_pid=None):
    run = root / name
    run.mkdir(parents=True)
    RunRecord(status=status, started="2026-11-22T10:00:00+0000", command=["tunekit", "train"], versions={},
              precision={"name": "bf16", "reason": "test"}, adapter="lora", base_model="m",
              parameters={"total": 1, "trainable": 1}, world_size=1, effective_batch=8, data={},
              finished=finished if status == "completed" else None, global_step=step if status == "completed" else None,
              failed_at_step=step if status == "failed" else None, eval_loss=scores and scores.get("eval_loss"),
              output=output if status == "completed" else None).save(run)
    if scores:
        (run / "eval").mkdir()
        (run / "eval" / "metrics.json").write_text(json.dumps({"scores": scores}))
    if lock_pid is not None:
        outputs.lock_path(run.absolute()).write_text(f"pid {lock_pid}: tunekit train r.yaml")
    return run


def runs(capsys, *argv):
    code = main.main(["runs", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_lists_every_run_with_status_steps_scores_wall_time_and_output(tmp_path, capsys):
    make_run(tmp_path, "a", scores={"bleu": 12.5, "rougeL": 40.0, "eval_loss": 1.5, "examples": 10})
    make_run(tmp_path, "b", scores={"bleu": 20.25, "rougeL": 35.0, "eval_loss": 1.7})
    make_run(tmp_path, "c", status="failed", step=7)
    make_run(tmp_path, "d", status="running", lock_pid=os.getpid())  # held by a live process
    make_run(tmp_path, "e", status="running", lock_pid=2**22 + 12345)  # its holder is gone
    (tmp_path / "a" / "merged").mkdir()
    (tmp_path / "a" / "merged" / "tunekit.json").write_text("{}")
    (tmp_path / "a" / "checkpoints" / "checkpoint-5").mkdir(parents=True)  # not a run of its own
    code, out, _ = runs(capsys, str(tmp_path))
    assert code == 0
    lines = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert sorted(lines) == ["a", "b", "c", "d", "e"]
    assert lines["a"] == ["a", "completed", "40", "1.5000", "12.50", "40.00", "12m30s", "adapter", "+merged"]
    assert lines["c"][:3] == ["c", "failed", "7"]
    assert lines["d"][1] == "running" and lines["e"][1] == "interrupted"
    assert out.splitlines()[0].split() == ["run", "status", "steps", "eval_loss", "bleu", "rougeL", "wall", "output"]


def test_tool_call_and_grpo_runs_show_their_own_scores(tmp_path, capsys):
    make_run(tmp_path, "tools", scores={"chrf": 80.0, "tool_call_args": 64.29, "tool_call_name": 85.71})
    make_run(tmp_path, "grpo", scores={"chrf": 41.12, "reward": 0.42, "reward/chrf": 0.42})
    code, out, _ = runs(capsys, str(tmp_path), "--sort", "reward")
    assert code == 0
    assert out.splitlines()[0].split() == ["run", "status", "steps", "chrf", "tool_call_args", "reward", "wall",
                                           "output"]
    assert [line.split()[:6] for line in out.splitlines()[2:]] == [
        ["grpo", "completed", "40", "41.12", "-", "0.42"], ["tools", "completed", "40", "80.00", "64.29", "-"]]


def test_sort_puts_the_best_first_in_each_metric_direction(tmp_path, capsys):
    make_run(tmp_path, "a", scores={"bleu": 12.5, "eval_loss": 1.5})
    make_run(tmp_path, "b", scores={"bleu": 20.25, "eval_loss": 1.7})
    make_run(tmp_path, "c", status="failed", step=3)
    order = lambda out: [line.split()[0] for line in out.splitlines()[2:]]  # noqa: E731
    assert order(runs(capsys, str(tmp_path), "--sort", "bleu")[1]) == ["b", "a", "c"]
    assert order(runs(capsys, str(tmp_path), "--sort", "eval_loss")[1]) == ["a", "b", "c"]


def test_unknown_sort_metric_and_missing_directory_are_one_line_errors(tmp_path, capsys):
    make_run(tmp_path, "a", scores={"bleu": 1.0})
    code, out, err = runs(capsys, str(tmp_path), "--sort", "blue")
    assert code != 0 and err.count("\n") == 1 and "--sort blue" in err and "bleu" in err
    code, out, err = runs(capsys, str(tmp_path / "nowhere"))
    assert code != 0 and err.count("\n") == 1 and "nowhere" in err
