"""A run directory whose JSON files are damaged (cut short by an interrupted copy or a full disk, overwritten,
edited) or a path that is not there: `tunekit report`, `tunekit export` and `tunekit runs` name the file
and the fix in one line, with no traceback (issue 28, point 3). Runs are written by hand: no training."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli, write_recipe
from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import read_jsonl
from tunekit.runs.layout import MERGED_MARKER, RunRecord


def make_run(root, name="run", history=None):
    run = root / name
    run.mkdir(parents=True)
    RunRecord(status="completed", started="2026-11-22T10:00:00+0000", command=["tunekit", "train"], versions={},
              precision={"name": "fp32", "reason": "test"}, adapter="lora", base_model="m",
              parameters={"total": 1, "trainable": 1}, world_size=1, effective_batch=8, data={},
              finished="2026-11-22T10:12:30+0000", global_step=40, output="adapter").save(run)
    if history is not None:
        (run / "loss_history.jsonl").write_text(history, encoding="utf-8")
    return run


def one_line_error(res, *expected: str) -> str:
    """The command failed with exactly one stderr line holding every `expected` text, and no traceback."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0, res.stdout
    assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    assert lines[0].startswith("tunekit: error: "), lines[0]
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def cut(text: str) -> str:
    return text[: len(text) // 2]


DAMAGE = {  # what a damaged run.json holds -> what the line says is wrong with it
    "truncated mid-way": (cut, "cut short"),
    "not JSON at all": (lambda text: "<html>502 Bad Gateway</html>\n", "not valid JSON"),
    "empty": (lambda text: "", "empty"),
    "a JSON list": (lambda text: "[1, 2]\n", "holds a JSON list, not an object"),
    "an object lacking fields": (lambda text: '{"status": "completed"}\n', "lacks started"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_report_names_a_damaged_run_json_in_one_line(tmp_path, case):
    damage, problem = DAMAGE[case]
    run = make_run(tmp_path)
    (run / "run.json").write_text(damage((run / "run.json").read_text()))
    line = one_line_error(run_cli("report", str(run)), f"{run / 'run.json'}: {problem}", "restore it")
    assert not (run / "report.html").exists(), line


def test_report_and_export_name_a_missing_path_as_missing(tmp_path):
    one_line_error(run_cli("report", str(tmp_path / "nope")), f"{tmp_path / 'nope'} does not exist")
    one_line_error(run_cli("report", str(tmp_path / "nope"), "--baseline", str(tmp_path)), "does not exist")
    run = make_run(tmp_path)
    one_line_error(run_cli("report", str(run), "--baseline", str(tmp_path / "gone")),
                   f"--baseline {tmp_path / 'gone'}: does not exist")
    one_line_error(run_cli("export", str(tmp_path / "nope")), f"export target {tmp_path / 'nope'}: does not exist")
    one_line_error(run_cli("export", "./nope/run", cwd=tmp_path), "export target ./nope/run: does not exist")


def test_export_names_a_damaged_run_json(tmp_path):
    run = make_run(tmp_path)
    (run / "run.json").write_text(cut((run / "run.json").read_text()))
    (run / "recipe.yaml").write_text("")  # never read: run.json is
    one_line_error(run_cli("export", str(run)), f"{run / 'run.json'}: cut short")


def test_export_names_a_damaged_merge_marker(tmp_path):
    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    merged = tmp_path / "merged"
    merged.mkdir()
    write_recipe(merged / "recipe.yaml", {"model": {"name_or_path": str(model)}, "data": {"train": str(data)},
                                          "output_dir": str(tmp_path / "out")})
    (merged / MERGED_MARKER).write_text('{"source_run": "/somewhere/ru')
    one_line_error(run_cli("export", str(merged)), f"{merged / MERGED_MARKER}: cut short", "tunekit merge")


def test_report_names_damaged_metrics_and_prediction_files(tmp_path):
    run = make_run(tmp_path)
    (run / "eval").mkdir()
    (run / "eval" / "metrics.json").write_text('{"scores": {"bleu": 12.5, "chrf"')
    one_line_error(run_cli("report", str(run)), f"{run / 'eval' / 'metrics.json'}: cut short", "--resume")
    (run / "eval" / "metrics.json").write_text('{"scores": {"bleu": 12.5}}')
    (run / "eval" / "predictions.jsonl").write_text('{"prompt": "p", "reference": "r", "prediction": "q"}\n'
                                                      'garbage\n' + '{"prompt": "p"}\n' * 3)
    one_line_error(run_cli("report", str(run)), f"{run / 'eval' / 'predictions.jsonl'}: line 2: not valid JSON")


ROW = '{"step": %d, "loss": 2.0, "time": %d.0}\n'


def test_a_cut_last_history_line_is_skipped_and_a_damaged_middle_one_named(tmp_path):
    killed = make_run(tmp_path, "killed", history=ROW % (1, 1) + ROW % (2, 2) + '{"step": 3, "lo')
    assert [r["step"] for r in read_jsonl(killed / "loss_history.jsonl", "fix")] == [1, 2]
    res = run_cli("report", str(killed))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    page = (killed / "report.html").read_text()
    assert '"loss": [[1, 2.0], [2, 2.0]]' in page
    damaged = make_run(tmp_path, "damaged", history=ROW % (1, 1) + '{"step": 2, "lo\n' + ROW % (3, 3))
    one_line_error(run_cli("report", str(damaged)), f"{damaged / 'loss_history.jsonl'}: line 2: cut short",
                   "delete that line")


def test_runs_lists_a_damaged_run_as_unreadable_and_the_others_as_they_are(tmp_path):
    make_run(tmp_path, "good")
    bad = make_run(tmp_path, "bad")
    (bad / "run.json").write_text(cut((bad / "run.json").read_text()))
    scores = make_run(tmp_path, "scores")
    (scores / "eval").mkdir()
    (scores / "eval" / "metrics.json").write_text("not json\n")
    res = run_cli("runs", str(tmp_path))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    rows = {line.split()[0]: line for line in res.stdout.splitlines()[2:]}
    assert rows["good"].split()[1:3] == ["completed", "40"]
    assert rows["bad"].split()[1] == "unreadable" and "run.json: cut short" in rows["bad"]
    assert rows["scores"].split()[1] == "unreadable" and "eval/metrics.json: not valid JSON" in rows["scores"]
    warnings = res.stderr.strip().splitlines()  # one line each, with the fix
    assert len(warnings) == 2 and all("restore it" in w or "--resume" in w for w in warnings), warnings


def test_resume_cuts_the_history_back_past_a_line_a_kill_left_half_written(tmp_path):
    from tunekit.runs.checkpoints import truncate_history

    history = tmp_path / "loss_history.jsonl"
    history.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    truncate_history(history, 2)
    assert [json.loads(x) for x in history.read_text().splitlines()] == [{"step": 1, "loss": 2.0},
                                                                         {"step": 2, "loss": 1.5}]
    history.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(TunekitError, match=r"loss_history.jsonl: line 2: cut short"):
        truncate_history(history, 3)


@pytest.mark.parametrize("gone", ["adapter_model.safetensors", "adapter_config.json"])
def test_export_merge_and_push_name_an_adapter_whose_files_were_deleted(tmp_path, gone):
    """The same line from every command that reads a LoRA run's adapter, before any weight or the Hub is touched."""
    run = make_run(tmp_path)
    write_recipe(run / "recipe.yaml", {"model": {"name_or_path": str(tmp_path / "base")},
                                       "data": {"train": str(tmp_path / "d.jsonl")}})
    (run / "adapter").mkdir()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        if name != gone:
            (run / "adapter" / name).write_text("{}")
    before = sorted(p.name for p in run.iterdir())
    lacks = "no .safetensors file in adapter/" if gone.endswith("safetensors") else f"no {gone} in adapter/"
    expected = f"{run}: a tunekit run whose weights are gone ({lacks}); train it again or point at another run"
    for argv in (["export", str(run)], ["merge", str(run)], ["push", str(run), "--repo", "me/model"]):
        res = run_cli(*argv)
        assert res.returncode == 2
        one_line_error(res, expected)
        assert sorted(p.name for p in run.iterdir()) == before
