"""Reward-model data (training.method: reward): a pair whose chosen and rejected answers are the same carries no
signal (the loss reads only the difference between their scores) and is refused in one line naming its file and
line, before weights load; methods whose loss has more to it (SFT and ORPO train on the chosen answer) take it."""

from __future__ import annotations

import pytest

from conftest import refused_in_process, tiny_recipe, write_jsonl, write_recipe
from tunekit.data import precheck

GOOD = [{"prompt": f"Say {w}.", "chosen": w, "rejected": w[::-1] + "x"} for w in ("cat", "dog", "owl", "elk")]
SAME = "the chosen and the rejected answer are the same text, and training.method: reward learns from the " \
       "difference between their scores, so the pair carries no signal; give it a different rejected answer or " \
       "remove it"


def pairs(tmp_path, name: str, rows: list[dict]) -> str:
    return str(write_jsonl(tmp_path / name, rows))


def _train_file(tmp_path, rows, **data):
    return {"train": pairs(tmp_path, "p.jsonl", rows), **data}


# name -> (the data section from tmp_path, expected line)
REFUSED = {
    "identical pair": (lambda t: _train_file(t, GOOD[:2] + [{"prompt": "Say yes.", "chosen": "yes",
                                                             "rejected": "yes"}] + GOOD),
                       "p.jsonl line 3: " + SAME),
    "identical pair after chat messages": (
        lambda t: _train_file(t, GOOD + [{"messages": [{"role": "user", "content": "Hi"}], "chosen": "Hello.",
                                          "rejected": "Hello."}]),
        "p.jsonl line 5: " + SAME),
    "identical pair under renamed fields": (
        lambda t: _train_file(t, [{"q": "Say a.", "good": "a", "bad": "b"}, {"q": "Say b.", "good": "b", "bad": "b"}],
                              fields={"prompt": "q", "chosen": "good", "rejected": "bad"}),
        "p.jsonl line 2: " + SAME),
    "identical pair in the held-out file": (
        lambda t: _train_file(t, GOOD, eval=pairs(t, "held.jsonl", GOOD[:1] + [{"prompt": "Say no.", "chosen": "no",
                                                                               "rejected": "no"}])),
        "held.jsonl line 2: " + SAME),
}


def reward_recipe(model, tmp_path, data: dict, method: str = "reward") -> dict:
    raw = tiny_recipe(model, tmp_path / "unused.jsonl", tmp_path / "run", training={"method": method, "max_steps": 1})
    raw["data"] = {**raw["data"], "format": "preference", **data}
    return raw


@pytest.mark.parametrize("verb", ["validate", "train"])
@pytest.mark.parametrize("case", REFUSED)
def test_a_pair_without_a_difference_is_refused_with_its_line(case, verb, tmp_path, tiny_model, capsys, monkeypatch):
    make, expected = REFUSED[case]
    recipe = write_recipe(tmp_path / "r.yaml", reward_recipe(tiny_model, tmp_path, make(tmp_path)))
    line = refused_in_process([verb, str(recipe)], tmp_path, capsys, monkeypatch)
    assert line.startswith("tunekit: error: ") and line.endswith(expected), line


@pytest.mark.parametrize("method", ["sft", "orpo"])
def test_a_method_that_trains_on_the_chosen_answer_takes_the_same_pair(method, tmp_path, tiny_model):
    from tunekit import api

    rows = GOOD + [{"prompt": "Say yes.", "chosen": "yes", "rejected": "yes"}]
    raw = reward_recipe(tiny_model, tmp_path, _train_file(tmp_path, rows), method)
    assert api.validate(raw).recipe.training.method == method


def test_a_pair_past_the_checked_lines_is_refused_as_the_data_is_prepared(tmp_path, tiny_model, capsys, monkeypatch):
    """The first lines alone are checked before the data is read whole (data.precheck.CHECKED); a later pair that
    renders to the same tokens is refused when the data is prepared, before the model loads or anything is
    written."""
    import logging

    from tunekit.cli.main import main

    monkeypatch.setattr(precheck, "CHECKED", 2)
    rows = GOOD[:2] + [{"prompt": "Say yes.", "chosen": "yes", "rejected": "yes"}]
    recipe = write_recipe(tmp_path / "r.yaml", reward_recipe(tiny_model, tmp_path, _train_file(tmp_path, rows)))
    monkeypatch.setattr(logging.getLogger("tunekit"), "handlers", [])  # its log lines on this test's stderr
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    code = main(["train", str(recipe)])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("tunekit: error: ")]
    expected = SAME.replace("same text,", "same text once rendered,")
    assert code == 2 and errors == err[-1:] and errors[0].endswith("p.jsonl line 3: " + expected), err[-10:]
    assert not any("Traceback" in line for line in err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "wrote something"
