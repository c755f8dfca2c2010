"""training.method: distill from prompts alone (data.format: prompt, the documented way to distil without answers):
recipes/smollm2_distill.yaml as shipped, its data switched to prompt records (alone, or beside records with answers
in a mixture), its model and teacher swapped for tiny ones, trains on-policy."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import load_file

from conftest import ROOT, history, refused_in_process, training_rows, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.data import precheck
from tunekit.runs.layout import RunRecord
from tunekit.training import runner
from tunekit.training.methods import distill


@pytest.fixture(scope="module")
def other_teacher(tiny_model, tmp_path_factory):
    """The tiny model's architecture and tokenizer with other random weights: a teacher the student differs from."""
    from transformers import AutoTokenizer

    from tunekit.models.tiny import build_model

    path = tmp_path_factory.mktemp("teacher")
    build_model(path, AutoTokenizer.from_pretrained(tiny_model), seed=1)
    return path


def prompt_records(path, source: str, first: int, n: int):
    """The shipped extraction data's records as prompt records (the instruction and input its prompt, the output its
    reference answer)."""
    lines = (ROOT / source).read_text().splitlines()[first:first + n]
    rows = [json.loads(line) for line in lines]
    return write_jsonl(path, [{"prompt": f"{r['instruction']}\n{r['input']}", "answer": r["output"]} for r in rows])


def shipped_from_prompts(tmp_path, tiny_model, teacher, mixture: bool) -> dict:
    """recipes/smollm2_distill.yaml with prompt records in data.train and data.eval; everything else as shipped but
    the model, the teacher, the run's length and what the tiny byte-level tokenizer needs (more tokens a sentence)."""
    raw = yaml.safe_load((ROOT / "recipes" / "smollm2_distill.yaml").read_text())
    train = prompt_records(tmp_path / "train.jsonl", "recipes/data/extract_train.jsonl", 0, 16)
    raw["data"].update(format="prompt", max_length=192, train=str(train),
                       eval=str(prompt_records(tmp_path / "eval.jsonl", "recipes/data/extract_eval.jsonl", 0, 4)))
    if mixture:  # prompt records beside records with answers (never read on-policy)
        answered = [json.loads(line) for line in
                    (ROOT / "recipes/data/extract_train.jsonl").read_text().splitlines()[16:24]]
        raw["data"]["train"] = [{"path": str(train)},
                                {"path": str(write_jsonl(tmp_path / "answered.jsonl", answered)), "format": "alpaca"}]
    raw["model"]["name_or_path"] = str(tiny_model)
    raw["distill"].update(teacher=str(teacher), max_completion_length=8)
    raw["training"].update(max_steps=3, micro_batch_size=4, precision="fp32", logging_steps=1, save_steps=1000)
    raw["eval"].update(max_new_tokens=8)
    raw["output_dir"] = str(tmp_path / "run")
    return raw


@pytest.mark.parametrize("mixture", [False, True], ids=["prompts", "prompts-beside-answers"])
def test_on_policy_distillation_trains_from_prompt_records(tmp_path, tiny_model, other_teacher, mixture):
    """The prompts' ids become the examples (the records' other columns dropped): the student samples its answers,
    the divergence to the teacher is taken on them and moves the adapter; the step-0 and last evaluations score the
    held-out prompts."""
    raw = shipped_from_prompts(tmp_path, tiny_model, other_teacher, mixture)
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    assert recipe.distill.mode == "on_policy" and "prompt" in recipe.data.formats()
    runner.run(recipe)
    out = tmp_path / "run"
    assert RunRecord.load(out).status == "completed"
    rows, trained = history(out), training_rows(out)
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(r["distill/on_policy"] == 1.0 and r["distill/divergence"] > 0 for r in trained), trained
    assert [r["step"] for r in rows if "eval_exact_match" in r] == [0, 3]
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)


def test_prompt_examples_are_their_ids_and_place(tmp_path, tiny_model, tiny_tokenizer, other_teacher):
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", shipped_from_prompts(tmp_path, tiny_model, other_teacher,
                                                                                 mixture=False)))
    bundle = distill.Distill().build_data(recipe, tiny_tokenizer)
    assert bundle.train.column_names == ["prompt_ids", "index"] and len(bundle.train) == 16
    assert bundle.train["index"] == list(range(16)) and len(bundle.eval) == 4
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])["prompt"]
    assert tiny_tokenizer.decode(bundle.train[0]["prompt_ids"]).count(first) == 1


@pytest.mark.parametrize("mode", ["on_policy", "mixed"])
@pytest.mark.parametrize("command", ["validate", "train"])
def test_sampled_answers_past_the_context_window_are_refused_as_grpo_refuses_them(mode, command, tmp_path,
                                                                                  tiny_model, other_teacher, capsys,
                                                                                  monkeypatch):
    """The tiny model's window is 512 tokens: prompts of up to 192 and answers of up to 400 do not fit."""
    raw = shipped_from_prompts(tmp_path, tiny_model, other_teacher, mixture=False)
    if mode == "mixed":  # mixed trains on answers too
        raw["data"].update(format="alpaca", train=str(ROOT / "recipes/data/extract_train.jsonl"),
                           eval=str(ROOT / "recipes/data/extract_eval.jsonl"))
    raw["distill"].update(mode=mode, max_completion_length=400)
    line = refused_in_process([command, str(write_recipe(tmp_path / "r.yaml", raw))], tmp_path, capsys, monkeypatch)
    assert ("distill.max_completion_length=400: with prompts of up to data.max_length=192 tokens, sequences pass "
            "the model's context window of 512 tokens") in line, line


def test_off_policy_distillation_samples_nothing_and_is_not_bounded_by_the_completion_length(tmp_path, tiny_model,
                                                                                              other_teacher):
    raw = shipped_from_prompts(tmp_path, tiny_model, other_teacher, mixture=False)
    raw["data"].update(format="alpaca", train=str(ROOT / "recipes/data/extract_train.jsonl"),
                       eval=str(ROOT / "recipes/data/extract_eval.jsonl"))
    raw["distill"].update(mode="off_policy", max_completion_length=400)
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    assert precheck.check(recipe, data_needed=True, model="needed") is not None
