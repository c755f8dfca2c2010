"""`tunekit data RECIPE` (issue 29, point 4): what training will see, before any model weight loads. The
trained segments it shows are exactly the tokens whose labels are targets, its counts are data
preparation's, it reads the training records only, loads the tokenizer and no model, prints no escape
codes into a pipe, and its JSON lines parse; a run writes its first examples for the report page."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

from conftest import reverse_rows, run_cli, run_watching_imports, tiny_recipe, write_jsonl, write_recipe
from tunekit.config.schema import DataConfig
from tunekit.data import preview, split
from tunekit.data.tokenizing import IGNORE, build_examples, tokenize_batch
from tunekit.reporting import dataview

NOT_LOADED = ("peft", "deepspeed", "bitsandbytes", "trl", "datasets")
SETTINGS = [  # (template, mask_prompt, max_length)
    ("chat", True, 64), ("alpaca", True, 64), ("alpaca", False, 64), ("chat", True, 34), ("raw", True, 40)]


def tunekit(*args: str):
    """(exit code, stdout less its last line, stderr, the modules of NOT_LOADED imported), in a fresh interpreter."""
    return run_watching_imports(NOT_LOADED, *args)


def flags_of(segments: list[dict]) -> list[bool]:
    """One trained flag per token, from the segments."""
    return [s["trained"] for s in segments for _ in range(s["tokens"])]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", reverse_rows(12))


@pytest.mark.parametrize("template,mask_prompt,max_length", SETTINGS)
def test_trained_segments_are_the_target_labels_and_counts_are_preparations(tiny_tokenizer, data_file, template,
                                                                            mask_prompt, max_length):
    cfg = DataConfig(train=str(data_file), format="alpaca", template=template, mask_prompt=mask_prompt,
                     max_length=max_length)
    renderer = preview.renderer_for(cfg, tiny_tokenizer)
    records = list(split.train_source(cfg))
    renders = list(preview.rendered(renderer, records))
    p = preview.preview(records, renderer, cfg, show=len(renders))
    assert vars(p.stats) == vars(build_examples(renders, tiny_tokenizer, cfg)[1])
    labelled = tokenize_batch(renders, tiny_tokenizer, cfg.max_length, cfg.mask_prompt)
    assert len(p.shown) == len(renders)
    for shown, r, (ex, truncated) in zip(p.shown, renders, labelled):
        assert flags_of(shown.segments) == [j > 0 and label != IGNORE for j, label in enumerate(ex.labels)]
        assert shown.tokens == len(ex.input_ids) and shown.truncated == truncated
        text = "".join(s["text"] for s in shown.segments)
        assert r.text.startswith(text) and (truncated or text == r.text)  # the tiny tokenizer adds no BOS
    assert sum(n["trained"] for n in p.roles.values()) == p.stats.trained_tokens
    assert sum(n["trained"] + n["untrained"] for n in p.roles.values()) == p.stats.tokens
    assert sum(b["examples"] for b in p.lengths) == p.stats.examples and p.lengths[-1]["to"] == max_length
    if template == "chat" and getattr(renders[0], "roles", None) is not None:
        assert {s["role"] for ex in p.shown for s in ex.segments if s["trained"]} == {"assistant"}


def test_an_example_with_no_trained_token_is_counted_dropped_and_shown_so(tiny_tokenizer, tmp_path):
    rows = [{"instruction": "Reverse the word. " * 20, "input": "", "output": "x"}] + reverse_rows(2)
    cfg = DataConfig(train=str(write_jsonl(tmp_path / "d.jsonl", rows)), format="alpaca", template="alpaca",
                     max_length=16)
    renderer = preview.renderer_for(cfg, tiny_tokenizer)
    records = list(split.train_source(cfg))
    p = preview.preview(records, renderer, cfg, show=1)
    assert vars(p.stats) == vars(build_examples(list(preview.rendered(renderer, records)), tiny_tokenizer, cfg)[1])
    assert p.stats.dropped_no_target >= 1 and p.shown[0].dropped and not any(flags_of(p.shown[0].segments))
    assert "dropped: no trained token" in dataview.text(p, split.summary(cfg, 3, 3, []), {}, colour=False)


def test_terminal_colour_and_plain_markers(tiny_tokenizer, data_file):
    cfg = DataConfig(train=str(data_file), format="alpaca", max_length=64)
    renderer = preview.renderer_for(cfg, tiny_tokenizer)
    p = preview.preview(list(split.train_source(cfg)), renderer, cfg, show=2)
    facts = split.summary(cfg, 12, 12, [])
    plain, coloured = (dataview.text(p, facts, {}, colour=c) for c in (False, True))
    assert "\x1b" not in plain and plain.count(dataview.OPEN) >= 2 and "legend: trained tokens [[like this]]" in plain
    assert dataview.TRAINED in coloured and dataview.OPEN not in coloured
    trained = "".join(s["text"] for s in p.shown[0].segments if s["trained"])
    assert f"{dataview.OPEN}{trained}{dataview.CLOSE}" in plain


@pytest.mark.slow  # two `tunekit data` commands, each loading the tokenizer stack (~15 s)
def test_command_shows_training_records_only_and_loads_no_model(tiny_model, tiny_tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    recipe = tiny_recipe(tiny_model, data, tmp_path / "run", data={"eval_fraction": 0.25})
    recipe_file = write_recipe(tmp_path / "r.yaml", recipe)
    code, out, err, loaded = tunekit("data", str(recipe_file), "--show", "20")
    assert code == 0, err
    assert loaded == [] and "\x1b" not in out and dataview.OPEN in out
    code, out, err, loaded = tunekit("data", str(recipe_file), "--show", "20", "--json")
    assert code == 0 and loaded == [], err
    head, *examples = [json.loads(line) for line in out.splitlines()]
    cfg = DataConfig.model_validate(recipe["data"])
    train, held, _ = split.train_and_held(cfg, recipe["training"]["seed"])
    renders = list(preview.rendered(preview.renderer_for(cfg, tiny_tokenizer), train))
    expected = vars(build_examples(renders, tiny_tokenizer, cfg)[1])
    assert {k: head["summary"][k] for k in expected} == expected and head["split"]["held_out"] == len(held) == 4
    assert [e["where"] for e in examples] == [r.where for r in train]
    assert not {e["where"] for e in examples} & {r.where for r in held}
    for e in examples:
        assert {s["trained"] for s in e["segments"]} == {True, False}
        assert sum(s["tokens"] for s in e["segments"] if s["trained"]) == e["trained_tokens"]


@pytest.mark.parametrize("problem,expected", [
    ({"data": {"train": "/nonexistent/train.jsonl"}}, "data.train: file '/nonexistent/train.jsonl' not found"),
    ({"data": {"max_lenght": 64}}, "unknown key data.max_lenght"),
    ({"training": {"method": "dpo"}, "data": {"format": "preference"}},
     "training.method: dpo trains on (prompt, chosen, rejected) pairs; tunekit data shows"),
])
def test_a_bad_recipe_is_one_line_and_exit_2(tiny_model, tmp_path, problem, expected):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(4))
    recipe = tiny_recipe(tiny_model, data, tmp_path / "run", **problem)
    if "preference" in json.dumps(problem):
        write_jsonl(data, [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 4)
    code, out, err, loaded = tunekit("data", str(write_recipe(tmp_path / "r.yaml", recipe)))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("tunekit: error: ") and expected in lines[0], err
    assert out == "" and loaded == []


def test_run_examples_and_the_report_page(tiny_tokenizer, data_file, tmp_path):
    import datasets

    from tunekit.reporting import report
    from tunekit.runs.layout import RunRecord

    cfg = DataConfig(train=str(data_file), format="alpaca", max_length=64)
    renders = list(preview.rendered(preview.renderer_for(cfg, tiny_tokenizer), split.train_source(cfg)))
    examples, _ = build_examples(renders, tiny_tokenizer, cfg)
    train_set = datasets.Dataset.from_list([vars(e) for e in examples])
    rows = preview.run_examples(train_set, tiny_tokenizer)
    assert len(rows) == preview.RUN_EXAMPLES
    for row, ex in zip(rows, examples):
        assert flags_of(row["segments"]) == [j > 0 and label != IGNORE for j, label in enumerate(ex.labels)]
        assert "".join(s["text"] for s in row["segments"]) == tiny_tokenizer.decode(ex.input_ids)
    run = tmp_path / "run"
    run.mkdir()
    RunRecord(status="completed", started="2026-11-24T10:00:00+0000", command=["tunekit", "train"], versions={},
              precision={"name": "fp32", "reason": "test"}, adapter="lora", base_model="m",
              parameters={"total": 1, "trainable": 1}, world_size=1, effective_batch=8, data={}).save(run)
    preview.write_examples(run / preview.EXAMPLES_FILE, rows)
    page = report.write([run]).read_text(encoding="utf-8")
    trained = "".join(s["text"] for s in rows[0]["segments"] if s["trained"])
    assert "Training examples: run (first 3)" in page and f"<mark>{html.escape(trained)}</mark>" in page


@pytest.mark.slow  # a `tunekit train` run (~15 s)
def test_a_training_run_writes_its_first_examples(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    recipe = tiny_recipe(tiny_model, data, tmp_path / "run", training={"max_steps": 1})
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", recipe)), env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / preview.EXAMPLES_FILE).read_text().splitlines()]
    assert len(rows) == preview.RUN_EXAMPLES and all(any(s["trained"] for s in r["segments"]) for r in rows)
    assert "Training examples: run" in (tmp_path / "run" / "report.html").read_text(encoding="utf-8")
