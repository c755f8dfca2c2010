"""`tunekit runs` and `tunekit report` read files only: they (and everything they import) load no torch,
transformers or peft, so that listing runs or writing a report page is instant and works where the
training stack is not installed. Each check runs in a fresh interpreter (this one has torch loaded)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "peft", "trl", "tunekit.models.loader", "tunekit.runs.trained")

PROGRAM = """
import json, sys
from pathlib import Path
{body}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def heavy_modules_after(body: str) -> list[str]:
    code = PROGRAM.format(body=body, heavy=HEAVY)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_runs_and_report_modules_import_no_torch():
    assert heavy_modules_after("import tunekit.reporting.listing, tunekit.reporting.report, tunekit.runs.layout, "
                               "tunekit.evaluation.table") == []


def test_the_runs_and_report_commands_load_no_torch(tmp_path):
    root = tmp_path / "runs"
    run = root / "a"
    run.mkdir(parents=True)
    (run / "eval").mkdir()
    (run / "eval" / "metrics.json").write_text(json.dumps({"scores": {"chrf": 40.0, "examples": 4}}))
    (run / "loss_history.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5, "time": 1.0}) + "\n")
    body = f"""
from tunekit.cli import main
from tunekit.runs.layout import RunRecord
run = Path({str(run)!r})
RunRecord(status="completed", started="2026-11-22T10:00:00+0000", command=["tunekit", "train"], versions={{}},
          precision={{"name": "fp32", "reason": "test"}}, adapter="lora", base_model="m",
          parameters={{"total": 1, "trainable": 1}}, world_size=1, effective_batch=8, data={{}},
          finished="2026-11-22T10:01:00+0000", global_step=1, output="adapter").save(run)
assert main.main(["runs", {str(root)!r}]) == 0
assert main.main(["report", str(run), "--out", {str(tmp_path / "r.html")!r}]) == 0
"""
    assert heavy_modules_after(body) == []
    assert (tmp_path / "r.html").is_file()


def test_the_command_line_parser_with_every_export_format_loads_no_torch():
    """`tunekit --help` stays instant: the export formats' flags come from a registry that loads no model code."""
    assert heavy_modules_after("from tunekit.cli import main; main.build_parser()") == []


def test_the_python_api_imports_no_torch_until_a_function_needs_it():
    """`import tunekit` and its functions (tunekit.api) are light: torch comes with the first function that needs
    it (train, evaluate, merge, export, a plan), not with the import."""
    assert heavy_modules_after("import tunekit, tunekit.api; tunekit.train, tunekit.make_plan, tunekit.preview_data; "
                               "from tunekit.api import checks, pipeline, previews, artifacts") == []
