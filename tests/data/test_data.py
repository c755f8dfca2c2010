"""Rendering and masking for every data format: labels are -100 exactly on prompt tokens."""

from __future__ import annotations

import pytest

from conftest import write_jsonl
from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data import arrow, split
from tunekit.data.collating import collator
from tunekit.data.formats import Record
from tunekit.data.rendering import Renderer
from tunekit.data.tokenizing import IGNORE, tokenize


def cfg(**kw) -> DataConfig:
    return DataConfig(train="unused.jsonl", **kw)


def check_prompt_masked(tok, rendered, example, prompt_text: str, add_special: bool):
    """Independent check: tokenize the prompt alone; exactly those positions are masked and the
    rest are trained with their own ids, but for whitespace a chat template writes after the
    end-of-turn marker (never generated, so never trained)."""
    k = len(tok(prompt_text, add_special_tokens=add_special)["input_ids"])
    assert example.input_ids[:k] == tok(prompt_text, add_special_tokens=add_special)["input_ids"]
    assert all(label == IGNORE for label in example.labels[:k])
    n = len(example.labels)
    while n > k and not tok.decode(example.input_ids[n - 1:n]).strip():
        n -= 1
    assert example.labels[k:n] == example.input_ids[k:n]
    assert all(label == IGNORE for label in example.labels[n:])
    assert n > k


def test_alpaca_with_chat_template(tiny_tokenizer):
    r = Renderer(cfg(format="alpaca"), tiny_tokenizer)
    assert r.template == "chat"
    rec = Record({"instruction": "Reverse the word.", "input": "cat", "output": "tac"}, "t line 1")
    rendered = r.render(rec)
    assert rendered.text == ("<|im_start|>user\nReverse the word.\n\ncat<|im_end|>\n"
                             "<|im_start|>assistant\ntac<|im_end|>\n")
    assert rendered.prompt == "<|im_start|>user\nReverse the word.\n\ncat<|im_end|>\n<|im_start|>assistant\n"
    assert rendered.reference == "tac"
    ex, truncated = tokenize(rendered, tiny_tokenizer, 512, mask_prompt=True)
    assert not truncated
    check_prompt_masked(tiny_tokenizer, rendered, ex, rendered.prompt, False)
    trained = [i for i, label in zip(ex.input_ids, ex.labels) if label != IGNORE]
    assert tiny_tokenizer.decode(trained) == "tac<|im_end|>"


def test_alpaca_plain_template_and_system_prompt(tiny_tokenizer):
    r = Renderer(cfg(format="alpaca", template="alpaca"), tiny_tokenizer)
    rendered = r.render(Record({"instruction": "Say hi.", "output": "hi"}, "t line 1"))
    assert rendered.prompt.startswith("Below is an instruction") and "### Input" not in rendered.prompt
    assert rendered.text == rendered.prompt + "hi<|im_end|>"
    ex, _ = tokenize(rendered, tiny_tokenizer, 512, mask_prompt=True)
    check_prompt_masked(tiny_tokenizer, rendered, ex, rendered.prompt, True)

    r = Renderer(cfg(format="alpaca", system_prompt="Be brief."), tiny_tokenizer)
    rendered = r.render(Record({"instruction": "Say hi.", "output": "hi"}, "t line 1"))
    assert rendered.text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hi.")


def test_chat_multi_turn_trains_every_assistant_turn_only(tiny_tokenizer):
    r = Renderer(cfg(format="chat"), tiny_tokenizer)
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "one"},
                {"role": "assistant", "content": "uno"}, {"role": "user", "content": "two"},
                {"role": "assistant", "content": "dos"}]
    [rendered] = r.examples(Record({"messages": messages}, "t line 1"))
    ex, _ = tokenize(rendered, tiny_tokenizer, 512, mask_prompt=True)
    pieces, current = [], []
    for i, label in zip(ex.input_ids, ex.labels):
        if label != IGNORE:
            current.append(i)
        elif current:
            pieces.append(tiny_tokenizer.decode(current))
            current = []
    if current:
        pieces.append(tiny_tokenizer.decode(current))
    assert pieces == ["uno<|im_end|>", "dos<|im_end|>"]
    rendered = r.render(Record({"messages": messages}, "t line 1"))
    assert rendered.prompt.endswith("two<|im_end|>\n<|im_start|>assistant\n") and rendered.reference == "dos"


def test_prompt_completion_raw_and_chat(tiny_tokenizer):
    rec = Record({"prompt": "2+2=", "completion": "4"}, "t line 1")
    rendered = Renderer(cfg(format="prompt_completion", template="raw"), tiny_tokenizer).render(rec)
    assert rendered.text == "2+2=4<|im_end|>"
    ex, _ = tokenize(rendered, tiny_tokenizer, 512, mask_prompt=True)
    check_prompt_masked(tiny_tokenizer, rendered, ex, "2+2=", True)
    rendered = Renderer(cfg(format="prompt_completion"), tiny_tokenizer).render(rec)
    ex, _ = tokenize(rendered, tiny_tokenizer, 512, mask_prompt=True)
    check_prompt_masked(tiny_tokenizer, rendered, ex, rendered.prompt, False)


def test_text_format_and_unmasked_prompt_train_everything(tiny_tokenizer):
    rendered = Renderer(cfg(format="text"), tiny_tokenizer).render(Record({"text": "the quick fox"}, "t line 1"))
    ex, _ = tokenize(rendered, tiny_tokenizer, 512, mask_prompt=True)
    assert ex.labels == ex.input_ids
    rec = Record({"instruction": "Reverse.", "output": "tac"}, "t line 1")
    rendered = Renderer(cfg(format="alpaca"), tiny_tokenizer).render(rec)
    ex, _ = tokenize(rendered, tiny_tokenizer, 512, mask_prompt=False)
    assert ex.labels == ex.input_ids


def test_field_mapping(tiny_tokenizer):
    c = cfg(format="alpaca", fields={"instruction": "q", "output": "a"})
    rendered = Renderer(c, tiny_tokenizer).render(Record({"q": "Reverse.", "a": "tac"}, "t line 1"))
    assert rendered.reference == "tac" and "Reverse." in rendered.prompt


def test_missing_field_lists_present_fields(tiny_tokenizer):
    r = Renderer(cfg(format="alpaca"), tiny_tokenizer)
    with pytest.raises(TunekitError, match=r"f.jsonl line 3: missing field 'output' "
                                           r"\(fields present: instruction, answer\)"):
        r.render(Record({"instruction": "x", "answer": "y"}, "f.jsonl line 3"))
    with pytest.raises(TunekitError, match="field 'output' must be text, got int"):
        r.render(Record({"instruction": "x", "output": 3}, "f.jsonl line 3"))


def test_truncation_counted_and_targetless_examples_dropped(tmp_path, tiny_tokenizer):
    rows = [{"instruction": "Reverse the word.", "input": "cat", "output": "tac"},
            {"instruction": "Reverse the word. " * 30, "input": "dog", "output": "god"},
            {"instruction": "x", "output": "y " * 40}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    bundle = arrow.build(DataConfig(train=str(path), max_length=40), tiny_tokenizer, seed=0)
    stats = bundle.train_stats
    assert stats.truncated == 2  # the long prompt and the long answer
    assert stats.dropped_no_target == 1  # the long prompt leaves no answer token within 40
    assert stats.examples == 2 and len(bundle.train) == 2
    assert all(len(ids) <= 40 for ids in bundle.train["input_ids"])


def test_seeded_eval_fraction_is_deterministic_and_disjoint(tmp_path, tiny_tokenizer):
    rows = [{"instruction": f"Reverse {i}.", "output": str(i)[::-1]} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    c = DataConfig(train=str(path), eval_fraction=0.25)
    a = arrow.build(c, tiny_tokenizer, seed=3)
    b = arrow.build(c, tiny_tokenizer, seed=3)
    assert len(a.train) == 15 and len(a.eval) == 5
    assert [r.reference for r in a.eval_rendered] == [r.reference for r in b.eval_rendered]
    eval_refs = {r.reference for r in a.eval_rendered}
    train_text = [tiny_tokenizer.decode(ids) for ids in a.train["input_ids"]]
    assert not any(f"assistant\n{ref}<" in t for t in train_text for ref in eval_refs)
    held = split.held_out(c, seed=3)
    assert [r.values["output"] for r in held] == [r.reference for r in a.eval_rendered]


def test_csv_and_parquet_files(tmp_path, tiny_tokenizer):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": "2+2=", "completion": "4"}, {"prompt": "3+3=", "completion": "6"}])
    ds.to_csv(tmp_path / "d.csv")
    ds.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        bundle = arrow.build(DataConfig(train=str(tmp_path / name), format="prompt_completion"), tiny_tokenizer, 0)
        assert bundle.train_stats.examples == 2


def test_the_pre_check_and_preparation_read_a_file_with_the_same_reader(tmp_path, tiny_tokenizer):
    """One reader per file type (data.reading): a row the pre-check refuses, preparation refuses in the same
    words, and the two see the same records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tunekit.data import precheck
    from tunekit.data.reading import file_records, iter_records

    csv = tmp_path / "d.csv"
    csv.write_text("instruction,output\nReverse cat,tac\n\nReverse dog\n", encoding="utf-8")
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"instruction": ["a", "b"], "output": ["x", None]}), parquet)
    for path in (csv, parquet):
        cfg = DataConfig(train=str(path), format="alpaca")
        with pytest.raises(TunekitError) as checked:
            precheck.check_data(str(path), "train", "data.train", cfg)
        with pytest.raises(TunekitError) as prepared:
            arrow.build(cfg, tiny_tokenizer, 0)
        assert str(checked.value) == str(prepared.value)
        assert str(checked.value).startswith(f"{path} row 2: missing field 'output'")
        assert ([(r.values, r.where) for r in iter_records(str(path), "train", "data.train")]
                == [(r.values, r.where) for r in file_records(str(path), "data.train")])
    wide = tmp_path / "wide.csv"
    wide.write_text("instruction,output\na,b,c\n", encoding="utf-8")
    with pytest.raises(TunekitError, match=r"^data\.train: .*wide\.csv line 2: more cells than the header's 2 "):
        arrow.build(DataConfig(train=str(wide), format="alpaca"), tiny_tokenizer, 0)


def test_the_data_suffixes_are_named_once():
    """config.schema.DATA_SUFFIXES is the one list of data file suffixes (no other tuple, list or set in tunekit
    holds them all); the readers and their messages use it."""
    import ast
    from pathlib import Path

    import tunekit
    from tunekit.config.schema import DATA_SUFFIXES
    from tunekit.data import reading

    assert DATA_SUFFIXES == (".jsonl", ".json", ".csv", ".parquet")
    package = Path(tunekit.__file__).parent
    lists = [path.relative_to(package).as_posix() for path in sorted(package.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, (ast.Tuple, ast.List, ast.Set))
             and set(DATA_SUFFIXES) <= {e.value for e in node.elts if isinstance(e, ast.Constant)}]
    assert lists == ["config/schema.py"]
    with pytest.raises(TunekitError, match=r"^k: 'x\.txt' is not a \.jsonl, \.json, \.csv or \.parquet file$"):
        reading.file_records("x.txt", "k")


def test_collator_pads_labels_with_ignore(tiny_tokenizer):
    collate = collator(tiny_tokenizer)
    batch = collate([{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [IGNORE, 6, 7]},
                     {"input_ids": [5], "attention_mask": [1], "labels": [5]}])
    assert batch["input_ids"].shape == (2, 8)
    assert batch["labels"][1, 1:].tolist() == [IGNORE] * 7
    assert batch["attention_mask"][1].tolist() == [1] + [0] * 7


def test_the_format_registry_drives_the_recipe_schema():
    import typing

    from tunekit.data.formats import FORMATS

    assert list(typing.get_args(DataConfig.model_fields["format"].annotation)) == list(FORMATS)
    for name, fmt in FORMATS.items():  # every registered format renders through the one Renderer
        assert fmt.name == name and callable(fmt.parse)
