"""First answers come before heavy imports (issue 28, point 4): `tunekit validate` of a valid recipe imports
none of torch, transformers, peft, TRL, DeepSpeed, datasets or bitsandbytes, and every verb that takes a
recipe or a model reports a bad key, a bad data line, a missing file or model, or a model the Hub cannot
give here, in one line, before importing any of them. Each command runs in a fresh interpreter (this one
has torch loaded) that prints, after tunekit's main returns, which heavy modules were imported."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from conftest import run_watching_imports, write_jsonl
from tunekit.core.errors import TunekitError

HEAVY = ("torch", "transformers", "peft", "trl", "deepspeed", "datasets", "bitsandbytes")


GOOD = {"instruction": "Reverse the word.", "input": "cat", "output": "tac"}


def tunekit(tmp: Path, *args: str):
    """(exit code, stdout without its last line, stderr, heavy modules imported) of one command."""
    return run_watching_imports(HEAVY, *args, env={"HF_HOME": str(tmp / "hf")}, timeout=120)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A model directory holding only its config.json (nothing here loads weights), data files good and
    bad, and a recipe for each case."""
    tmp = tmp_path_factory.mktemp("first")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 512,
                                                   "hidden_size": 64}))
    good = write_jsonl(tmp / "good.jsonl", [GOOD] * 4)
    bad = tmp / "bad.jsonl"
    bad.write_text("".join(json.dumps(GOOD) + "\n" for _ in range(2)) + '{"instruction": "a" "output": "b"}\n')
    lacking = write_jsonl(tmp / "lacking.jsonl", [GOOD, {"instruction": "a", "answer": "b"}])
    found = {"tmp": tmp, "model": model, "good": good, "bad": bad, "lacking": lacking}
    for name, (model_spec, data, extra) in RECIPES.items():
        recipe = {"model": {"name_or_path": str(model) if model_spec is None else model_spec},
                  "data": {"train": str(found.get(data, tmp / data)), "max_length": 64},
                  "output_dir": str(tmp / "runs" / name), **extra}
        found[name] = tmp / f"{name}.yaml"
        found[name].write_text(yaml.safe_dump(recipe))
    return found


# name -> (model (None: the local one), data file, other recipe keys)
RECIPES = {
    "valid": (None, "good", {}),
    "bad key": (None, "good", {"training": {"learnig_rate": 1e-4}}),
    "malformed line": (None, "bad", {}),
    "missing data file": (None, "nope.jsonl", {}),
    "missing model dir": ("/nonexistent/model", "good", {}),
    "hub model offline": ("org/not-here", "good", {}),
    "record lacking a field": (None, "lacking", {}),
}

# case -> what the error line says
EXPECTED = {
    "bad key": "unknown key training.learnig_rate; did you mean training.learning_rate?",
    "malformed line": "data.train: {bad} line 3: malformed JSON",
    "missing data file": "data.train: file '{tmp}/nope.jsonl' not found",
    "missing model dir": "model.name_or_path: no such model directory '/nonexistent/model'",
    "hub model offline": "model.name_or_path: 'org/not-here' is not in the local Hugging Face cache and "
                         "HF_HUB_OFFLINE=1 forbids downloading it",
    "record lacking a field": "{lacking} line 2: missing field 'output' (fields present: instruction, answer)",
}

# `tunekit eval` takes a model and a data file: each case in its terms
EVAL = {
    "bad key": (["{model}", "--recipe", "{bad key}"], EXPECTED["bad key"]),
    "malformed line": (["{model}", "--data", "{bad}"], "--data: {bad} line 3: malformed JSON"),
    "missing data file": (["{model}", "--data", "{tmp}/nope.jsonl"], "--data {tmp}/nope.jsonl: file not found"),
    "missing model dir": (["/nonexistent/model", "--data", "{good}"], "eval target: no such model directory"),
    "hub model offline": (["org/not-here", "--data", "{good}"], EXPECTED["hub model offline"]),
    "record lacking a field": (["{model}", "--data", "{lacking}"], EXPECTED["record lacking a field"]),
}


def assert_one_line_before_heavy(result, expected: str) -> None:
    code, _, err, heavy = result
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("tunekit: error: ") and expected in lines[0], err[-2000:]
    assert heavy == [], f"imported {heavy} before the error"


def test_validate_of_a_valid_recipe_imports_nothing_heavy(files):
    code, out, err, heavy = tunekit(files["tmp"], "validate", str(files["valid"]))
    assert code == 0, err
    assert yaml.safe_load(out)["data"]["train"] == str(files["good"])
    # nothing on stderr but the measured defaults the recipe takes (config.defaults), one line each
    assert all(line.startswith(("tunekit: training.learning_rate: ", "tunekit: lora.use_rslora: "))
               for line in err.splitlines()), err
    assert heavy == []


@pytest.mark.parametrize("verb", ["train", "validate", "plan"])
@pytest.mark.parametrize("case", list(EXPECTED))
def test_each_error_is_one_line_before_any_heavy_import(files, verb, case):
    expected = EXPECTED[case].format(**{k: str(v) for k, v in files.items()})
    result = tunekit(files["tmp"], verb, str(files[case]))
    if verb == "validate" and case == "hub model offline":  # a recipe is valid offline: what was not checked is said
        code, _, err, heavy = result
        assert code == 0 and heavy == [] and f"data.max_length not checked against the model's context window: " \
            f"{expected}" in err, err
        return
    assert_one_line_before_heavy(result, expected)


@pytest.mark.parametrize("case", list(EVAL))
def test_eval_reports_each_error_before_any_heavy_import(files, case):
    argv, expected = EVAL[case]
    fill = lambda s: s.format(**{k: str(v) for k, v in files.items()})  # noqa: E731
    assert_one_line_before_heavy(tunekit(files["tmp"], "eval", *map(fill, argv)), fill(expected))


def test_export_and_merge_name_an_uncached_hub_model_before_any_heavy_import(files):
    from tunekit.runs.layout import ADAPTER_DIR, RECIPE_FILE, RunRecord

    assert_one_line_before_heavy(tunekit(files["tmp"], "export", "org/not-here"),
                                 "export target: 'org/not-here' is not in the local Hugging Face cache")
    run = files["tmp"] / "runs" / "trained"
    (run / ADAPTER_DIR).mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):  # never read: the base first
        (run / ADAPTER_DIR / name).write_text("{}")
    (run / RECIPE_FILE).write_text(files["hub model offline"].read_text())
    RunRecord(status="completed", started="2026-11-24T10:00:00+0000", command=["tunekit", "train"], versions={},
              precision={"name": "fp32", "reason": "test"}, adapter="lora", base_model="org/not-here",
              parameters={"total": 1, "trainable": 1}, world_size=1, effective_batch=8, data={}).save(run)
    assert_one_line_before_heavy(tunekit(files["tmp"], "merge", str(run)), EXPECTED["hub model offline"])


def test_csv_and_parquet_records_are_checked_without_datasets(files, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    csv = tmp_path / "d.csv"
    csv.write_text("instruction,output\nReverse cat,tac\nReverse dog\n", encoding="utf-8")
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"instruction": ["a", "b"], "output": ["x", None]}), parquet)
    for data, expected in ((csv, f"{csv} row 2: missing field 'output'"),
                           (parquet, f"{parquet} row 2: missing field 'output'")):
        result = tunekit(files["tmp"], "validate", str(files["valid"]), "--set", f"data.train={data}")
        assert_one_line_before_heavy(result, expected)


def test_an_uncached_hub_data_set_is_refused_by_train_and_named_by_validate(files):
    argv = (str(files["valid"]), "--set", "data.train=org/some-data")
    assert_one_line_before_heavy(tunekit(files["tmp"], "train", *argv),
                                 "data.train: data set 'org/some-data' is not in the local datasets cache")
    code, _, err, heavy = tunekit(files["tmp"], "validate", *argv)
    assert code == 0 and heavy == [] and "org/some-data' is not in the local datasets cache" in err, err


def test_a_big_file_is_checked_up_to_its_first_records(tmp_path, monkeypatch, caplog):
    """Records past the first CHECKED are left to data preparation, which reads every one."""
    from tunekit.config.schema import DataConfig
    from tunekit.data import precheck

    monkeypatch.setattr(precheck, "CHECKED", 3)
    monkeypatch.setattr(logging.getLogger("tunekit"), "propagate", True)  # the CLI turns it off
    cfg = DataConfig(train="x")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{oops\n" + (json.dumps(GOOD) + "\n") * 3)
    with pytest.raises(TunekitError, match=r"line 2: malformed JSON"):
        precheck.check_data(str(path), "train", "data.train", cfg)
    path.write_text((json.dumps(GOOD) + "\n") * 3 + "{oops\n")
    with caplog.at_level("INFO", logger="tunekit"):
        precheck.check_data(str(path), "train", "data.train", cfg)
    assert "the first 3 records checked; the rest are checked as data is prepared" in caplog.text
    with pytest.raises(TunekitError, match="holds no examples"):
        path.write_text("\n")
        precheck.check_data(str(path), "train", "data.train", cfg)


def test_plan_needs_no_tokenizer_and_train_names_one_it_cannot_have(files):
    raw = yaml.safe_load(files["valid"].read_text())
    raw["model"]["tokenizer"] = "org/tokenizer-not-here"
    recipe = files["tmp"] / "hub-tokenizer.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    from tunekit.config import recipefile
    from tunekit.data import precheck

    assert precheck.check(recipefile.load(recipe), data_needed=False, model="shipped").model.tokenizer  # no error
    assert_one_line_before_heavy(tunekit(files["tmp"], "train", str(recipe)),
                                 "model.tokenizer: 'org/tokenizer-not-here'")
