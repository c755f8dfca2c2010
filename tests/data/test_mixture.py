"""Mixtures: data.train as a list of sources, each with its own format and fields, mixed by weight or count;
deterministic for a seed, held-out records never trained, the realised mix in the log and run.json, the
cache keyed on every source, and training (packed, and in two processes) on a mixture."""

from __future__ import annotations

import json
import logging

import pytest

from conftest import launch, refused_in_process, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data import arrow, mixture, split
from tunekit.runs.layout import RunRecord


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path / "cache"))


def alpaca_rows(n: int, tag: str = "a") -> list[dict]:
    return [{"instruction": "Reverse the word.", "input": f"{tag}word{i:04d}", "output": f"{i:04d}drow{tag}"}
            for i in range(n)]


def chat_rows(n: int) -> list[dict]:
    """Chat records under their own column and key names (conv, from, value)."""
    return [{"conv": [{"from": "user", "value": f"Spell chat{i:04d}."}, {"from": "assistant", "value": f"c-{i:04d}"}]}
            for i in range(n)]


CHAT = {"format": "chat", "fields": {"messages": "conv", "role": "from", "content": "value"}}


@pytest.fixture
def files(tmp_path):
    return {"a": write_jsonl(tmp_path / "a.jsonl", alpaca_rows(40)), "b": write_jsonl(tmp_path / "b.jsonl",
                                                                                    alpaca_rows(10, "b")),
            "chat": write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))}


def source_counts(records, cfg) -> list[int]:
    counts = [0] * len(mixture.train_sources(cfg))
    for r in records:
        counts[r.source] += 1
    return counts


def test_weights_and_counts_give_the_realised_counts(files):
    cfg = DataConfig(train=[{"path": str(files["a"]), "weight": 1}, {"path": str(files["b"]), "weight": 1}])
    train, _, facts, _ = split.training(cfg, seed=0)
    assert source_counts(train, cfg) == [25, 25]  # an epoch of 50 (the records together), half each
    assert [f["used"] for f in facts["mix"]] == [25, 25] and [f["share"] for f in facts["mix"]] == [0.5, 0.5]
    assert facts["mix"][1]["distinct"] == 10  # b's 10 records, repeated to 25: every one at least twice
    cfg = DataConfig(train=[{"path": str(files["a"]), "count": 7}, {"path": str(files["b"])},
                            {"path": str(files["chat"]), **CHAT, "weight": 0.5}])
    train, _, facts, _ = split.training(cfg, seed=0)
    assert source_counts(train, cfg) == [7, 10, 17]  # 17 fixed examples are the other half of the epoch
    assert len({r.where for r in train if r.source == 0}) == 7
    assert "data mix: 34 training examples per epoch" in mixture.line(facts["mix"])


def test_the_draw_is_seeded(files):
    cfg = DataConfig(train=[{"path": str(files["a"]), "count": 10}, {"path": str(files["b"]), "count": 15}])
    first = [r.where for r in split.training(cfg, seed=1)[0]]
    assert first == [r.where for r in split.training(cfg, seed=1)[0]]
    assert first != [r.where for r in split.training(cfg, seed=2)[0]]


def test_held_out_records_never_train(files):
    cfg = DataConfig(train=[{"path": str(files["a"]), "weight": 3}, {"path": str(files["b"]), "weight": 1}],
                     eval_fraction=0.2, max_examples=30)
    train, held, facts, _ = split.training(cfg, seed=5)
    assert len(held) == 6 + 2  # a fifth of each source's first 30 (b has 10)
    assert not {r.where for r in train} & {r.where for r in held}
    assert [r.where for r in split.held_out(cfg, seed=5)] == [r.where for r in held]
    assert facts["train_records_read"] == 40 and source_counts(train, cfg) == [24, 8]
    assert all(int(r.where.rsplit(" ", 1)[1]) <= 30 for r in train + held)


def test_eval_sources_are_held_out_whole(files):
    cfg = DataConfig(train=str(files["a"]), eval=[{"path": str(files["b"])}, {"path": str(files["chat"]), **CHAT}])
    held = split.held_out(cfg, seed=0)
    assert len(held) == 22 and [r.source for r in held] == [1] * 10 + [2] * 12


def test_per_source_format_and_fields_and_the_cache(files, tiny_tokenizer, caplog):
    train = [{"path": str(files["a"]), "count": 8}, {"path": str(files["chat"]), **CHAT, "count": 8}]
    with pytest.raises(ValueError, match=r"cannot render format chat \(data.train\[1\].format\)"):
        DataConfig(train=train, template="raw")
    cfg = DataConfig(train=train, max_length=64)
    with caplog.at_level(logging.INFO, logger="tunekit"):
        bundle = arrow.build(cfg, tiny_tokenizer, seed=0)
        assert "prepared and cached" in caplog.text and "data mix: 16 training examples" in caplog.text
        texts = [tiny_tokenizer.decode(ids) for ids in bundle.train["input_ids"]]
        assert sum("chat0" in t for t in texts) == 8 and sum("aword" in t for t in texts) == 8
        assert [f["used"] for f in bundle.split["mix"]] == [8, 8]
        caplog.clear()
        arrow.build(cfg, tiny_tokenizer, seed=0)
        assert "read from the cache" in caplog.text
        caplog.clear()
        write_jsonl(files["chat"], chat_rows(13))  # one source file changes: a new set
        arrow.build(cfg, tiny_tokenizer, seed=0)
        assert "prepared and cached" in caplog.text


def test_contamination_sees_every_source_and_the_held_out_set(files, tmp_path):
    copy = write_jsonl(tmp_path / "copy.jsonl", alpaca_rows(3, "b"))  # b's first three again
    cfg = DataConfig(train=[{"path": str(files["b"])}, {"path": str(copy)}], eval=str(files["a"]),
                     dedup=True)
    train, _, facts, report = split.training(cfg, seed=0)
    assert report["duplicates"] == 3 and len(train) == 10
    assert report["duplicate_examples"][0]["train"].startswith(str(copy))


@pytest.mark.parametrize("train, message", [
    ([{"path": "A", "weight": 1, "count": 2}], "data.train[0]: weight and count are both set; keep one"),
    ([{"path": "A"}, {"path": "A", "weight": -1}], "data.train[1].weight: Input should be greater than 0"),
    ([{"path": "A"}, {"path": "A", "wieght": 1}], "unknown key data.train[1].wieght; did you mean "
                                                 "data.train[1].weight?"),
    ([{"path": "A"}, {"path": "missing.jsonl"}], "data.train[1].path: file 'missing.jsonl' not found"),
    ([{"path": "A", "count": 3}, {"path": "A", "weight": 1}], "data.train: the weights sum to 1 beside sources"),
    ([{"path": "A", "count": 10**12}], "data.train[0].count: Input should be less than or equal to 100000000"),
])
@pytest.mark.parametrize("command", ["validate", "train"])
def test_bad_mixtures_are_one_line(tmp_path, tiny_model, files, train, message, command, capsys, monkeypatch):
    """In-process, by validate as by train: exit 2, one line, nothing written."""
    train = [{**s, "path": str(files["a"]) if s["path"] == "A" else s["path"]} for s in train]
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, files["a"], tmp_path / "run",
                                                           data={"train": train}))
    line = refused_in_process([command, str(recipe)], tmp_path, capsys, monkeypatch)
    assert message in line, line


def test_a_mixture_asking_for_more_examples_than_memory_holds_is_refused_before_drawing(files):
    """Weights beside a count can ask for any number (3 fixed examples as 1e-9 of the epoch): refused in one line
    before a position is drawn, where it ended in a MemoryError."""
    cfg = DataConfig(train=[{"path": str(files["a"]), "count": 3}, {"path": str(files["b"]), "weight": 1 - 1e-9}])
    with pytest.raises(TunekitError, match=r"data.train: the mixture asks for [\d,]+ examples per epoch "
                                           r"\(data.train\[1\]: [\d,]+\), more than 100,000,000; lower"):
        split.training(cfg, seed=0)


def test_a_source_in_a_format_the_method_does_not_train_on_is_refused(tmp_path, tiny_model, files):
    raw = tiny_recipe(tiny_model, files["a"], tmp_path / "run", data={"format": "preference", "train": [
        {"path": str(files["a"])}, {"path": str(files["chat"]), **CHAT}]}, training={"method": "dpo"})
    res = run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode == 2 and "training.method: dpo trains on" in res.stderr and "(got chat)" in res.stderr


@pytest.mark.slow  # `tunekit data`, loading the tokenizer stack (~8 s)
def test_tunekit_data_shows_the_mixture_training_draws(tmp_path, tiny_model, files):
    train = [{"path": str(files["a"]), "count": 12}, {"path": str(files["chat"]), **CHAT, "count": 5}]
    raw = tiny_recipe(tiny_model, files["a"], tmp_path / "run", data={"train": train})
    res = run_cli("data", str(write_recipe(tmp_path / "r.yaml", raw)), "--json", "--show", "20")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert lines[0]["summary"]["examples"] == 17
    shown = [line["where"] for line in lines[1:]]
    assert sum("chat.jsonl" in w for w in shown) == 5 and sum("a.jsonl" in w for w in shown) == 12


def test_a_bad_record_in_a_source_names_the_source_and_line(tmp_path, tiny_model, files):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(alpaca_rows(1)[0]) + "\n{not json\n")
    raw = tiny_recipe(tiny_model, files["a"], tmp_path / "run", data={"train": [{"path": str(files["a"])},
                                                                                {"path": str(bad)}]})
    res = run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode == 2 and f"data.train[1]: {bad} line 2: malformed JSON" in res.stderr


def test_the_recipe_resolves_each_source_path(tmp_path, tiny_model, files):
    raw = tiny_recipe(tiny_model, files["a"], tmp_path / "run", data={"train": [{"path": "a.jsonl", "weight": 0.5},
                                                                                {"path": "b.jsonl", **CHAT}]})
    raw["data"]["train"][1]["path"] = "chat.jsonl"
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    assert [s.path for s in recipe.data.train] == [str(files["a"]), str(files["chat"])]
    assert recipefile.from_dict(json.loads(json.dumps(recipe.model_dump(mode="json")))).data == recipe.data


@pytest.mark.slow
def test_training_on_a_packed_mixture_records_the_mix(tmp_path, tiny_model, files):
    train = [{"path": str(files["a"]), "weight": 0.25}, {"path": str(files["b"]), "count": 30}]
    raw = tiny_recipe(tiny_model, files["a"], tmp_path / "run", data={"train": train, "packing": True,
                                                                      "eval_fraction": 0.2},
                      training={"max_steps": 3})
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode == 0, res.stderr[-3000:]
    record = RunRecord.load(tmp_path / "run")
    assert record.data["packed"] is True
    assert [(m["source"], m["used"]) for m in record.data["mix"]] == [("data.train[0]", 10), ("data.train[1]", 30)]
    assert record.data["split"]["held_out"] == 8 + 2 and "mix" not in record.data["split"]
    assert "data mix: 40 training examples per epoch" in res.stderr + res.stdout
    from tunekit.export import source  # what export records of the run's data: the sources, as JSON

    facts = source._finetune(tmp_path / "run", recipefile.load(tmp_path / "run" / "recipe.yaml"))
    assert json.loads(json.dumps(facts))["data"] == [{**s, "split": None, "format": None, "fields": None,
                                                      "weight": s.get("weight"), "count": s.get("count")}
                                                     for s in train]


@pytest.mark.slow
def test_two_processes_draw_the_same_mixture(tmp_path, tiny_model, files):
    train = [{"path": str(files["a"]), "count": 12}, {"path": str(files["chat"]), **CHAT, "weight": 0.5}]
    raw = tiny_recipe(tiny_model, files["a"], tmp_path / "unused", data={"train": train},
                      training={"max_steps": 2, "micro_batch_size": 4})
    res = launch(write_recipe(tmp_path / "r.yaml", raw), tmp_path / "run", 2)
    record = RunRecord.load(tmp_path / "run")
    assert [m["used"] for m in record.data["mix"]] == [12, 12] and record.world_size == 2
    assert "data mix: 24 training examples per epoch" in res.stdout + res.stderr


def test_a_source_keeps_only_its_own_field_names_through_a_saved_recipe(files):
    """A source's `fields` replace only the keys it gives, also when the recipe is written out and read back
    (run.json / recipe.yaml): data.fields' other keys still apply to it."""
    cfg = DataConfig(format="chat", fields={"tools": "functions"},
                     train=[{"path": str(files["a"]), "format": "alpaca"}, {"path": str(files["chat"]), **CHAT}])
    again = DataConfig(**json.loads(json.dumps(cfg.model_dump(mode="json"))))
    for c in (cfg, again):
        chat_source = mixture.train_sources(c)[1].cfg.fields
        assert (chat_source.messages, chat_source.tools) == ("conv", "functions")
