"""Agent data on a ChatML template without tool or reasoning support (the tiny tokenizer's, as SmolLM2's):
what trains, the default renderings and their notes, train_on / train_reasoning / train: false, and a
template that rewrites earlier turns (Qwen3's, as TRL ships it) splitting a conversation in preparation.
The per-family checks on real templates are in test_agent_templates.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import write_jsonl
from tunekit.config.schema import DataConfig
from tunekit.data import arrow, chattemplate
from tunekit.data.chattemplate import DEFAULTS
from tunekit.data.formats import Record
from tunekit.data.rendering import Renderer
from tunekit.data.tokenizing import IGNORE, tokenize

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def conversation(reasoning: str = "", train_first: bool | None = None) -> dict:
    first = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    if reasoning:
        first["reasoning_content"] = reasoning
    if train_first is not None:
        first["train"] = train_first
    return {"tools": TOOLS, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}, first,
        {"role": "tool", "tool_call_id": "call00001", "content": {"temp": 21}},
        {"role": "assistant", "content": "It is 21 C."}]}


def trained_pieces(tok, rendered) -> list[str]:
    ex, _ = tokenize(rendered, tok, 4096, mask_prompt=True)
    pieces, current = [], []
    for i, label in zip(ex.input_ids + [None], ex.labels + [IGNORE]):
        if label != IGNORE:
            current.append(i)
        elif current:
            pieces.append(tok.decode(current))
            current = []
    return pieces


def renderer(tok, **kw) -> Renderer:
    return Renderer(DataConfig(train="unused.jsonl", format="chat", **kw), tok)


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


def test_tool_calls_train_tool_results_and_prompts_do_not(tiny_tokenizer):
    r = renderer(tiny_tokenizer)
    [rendered] = r.examples(Record(conversation(), "t line 1"))
    assert trained_pieces(tiny_tokenizer, rendered) == [CALL_TEXT, "It is 21 C.<|im_end|>"]
    # the template has no tools, tool-call or reasoning support: the default renderings, each noted
    assert DEFAULTS["tools"] in r.notes and DEFAULTS["tool_calls"] in r.notes
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in rendered.text
    assert rendered.text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions")
    assert '<|im_start|>tool\n{"temp": 21}<|im_end|>' in rendered.text  # ChatML writes any role


def test_train_on_last_assistant_and_train_false(tiny_tokenizer):
    [last] = renderer(tiny_tokenizer, train_on="last_assistant").examples(Record(conversation(), "t line 1"))
    assert trained_pieces(tiny_tokenizer, last) == ["It is 21 C.<|im_end|>"]
    [off] = renderer(tiny_tokenizer).examples(Record(conversation(train_first=False), "t line 1"))
    assert trained_pieces(tiny_tokenizer, off) == ["It is 21 C.<|im_end|>"]
    assert off.text == last.text  # the untrained call stays in the text as context


def test_reasoning_trained_or_not_and_never_empty(tiny_tokenizer):
    record = Record(conversation(reasoning="The user wants Paris."), "t line 1")
    r = renderer(tiny_tokenizer)
    [with_reasoning] = r.examples(record)
    assert (trained_pieces(tiny_tokenizer, with_reasoning)[0]
            == "<think>\nThe user wants Paris.\n</think>\n\n" + CALL_TEXT)
    assert DEFAULTS["reasoning"] in r.notes
    [without] = renderer(tiny_tokenizer, train_reasoning=False).examples(record)
    assert without.text == with_reasoning.text
    assert trained_pieces(tiny_tokenizer, without) == [CALL_TEXT, "It is 21 C.<|im_end|>"]
    r = renderer(tiny_tokenizer)
    [empty] = r.examples(Record(conversation(reasoning=""), "t line 1"))
    assert "<think>" not in empty.text.split("<|im_start|>assistant")[1] and DEFAULTS["reasoning"] not in r.notes


def test_reference_of_a_tool_call_is_the_call_as_written(tiny_tokenizer):
    record = conversation()
    record["messages"] = record["messages"][:3]  # ends at the call: what eval scores
    rendered = renderer(tiny_tokenizer).render(Record(record, "t line 1"))
    assert rendered.reference == CALL_TEXT.removesuffix("<|im_end|>")
    assert rendered.prompt.endswith("Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.text == rendered.prompt + CALL_TEXT + "\n"


def test_thinking_key_accepted_and_mapped_field_names(tiny_tokenizer):
    rows = {"conv": [{"who": "user", "text": "hi"}, {"who": "assistant", "text": "yo", "thinking": "greet"}]}
    fields = {"messages": "conv", "role": "who", "content": "text"}
    [rendered] = renderer(tiny_tokenizer, fields=fields).examples(Record(rows, "t line 1"))
    assert trained_pieces(tiny_tokenizer, rendered) == ["<think>\ngreet\n</think>\n\nyo<|im_end|>"]


def qwen3_tokenizer(tiny_tokenizer):
    import trl

    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    return tok


def test_template_rewriting_earlier_turns_splits_in_preparation(tiny_tokenizer, tmp_path, monkeypatch, caplog):
    """Qwen3 writes an empty think block on a conversation's last assistant message only, so the call turn
    rendered for generation is not a prefix of the whole conversation: two examples, each turn as generated."""
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(chattemplate, "_SAID", set())  # said once per process: this test's process may have said it
    tok = qwen3_tokenizer(tiny_tokenizer)
    record = Record(conversation(), "t line 1")
    r = renderer(tok)
    first, second = r.examples(record)
    assert trained_pieces(tok, first) == [CALL_TEXT]
    assert first.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + CALL_TEXT + "\n")
    assert trained_pieces(tok, second) == ["It is 21 C.<|im_end|>"]  # the empty think block untrained
    assert DEFAULTS["split"] in r.notes
    data = write_jsonl(tmp_path / "d.jsonl", [conversation()] * 3)
    cfg = DataConfig(train=str(data), format="chat")
    with caplog.at_level(logging.INFO, logger="tunekit"):
        bundle = arrow.build(cfg, tok, seed=0)
    assert bundle.train_stats.examples == 6 and len(bundle.train) == 6
    assert [m for m in caplog.messages if DEFAULTS["split"] in m] == ["data: " + DEFAULTS["split"]]
    labels = [[x for x in row if x != IGNORE] for row in bundle.train["labels"]]
    assert tok.decode(labels[0]) == CALL_TEXT and tok.decode(labels[1]) == "It is 21 C.<|im_end|>"


@pytest.mark.parametrize("value", [[{"name": "get_weather"}], json.dumps(TOOLS)])
def test_tools_as_json_text_or_bare_functions(tiny_tokenizer, value):
    record = conversation()
    record["tools"] = value
    [rendered] = renderer(tiny_tokenizer).examples(Record(record, "t line 1"))
    assert '{"type": "function", "function": {"name": "get_weather"' in rendered.text


def test_contamination_reads_tool_calls_as_the_answer():
    """An answer that only calls a tool is its call: two calls with other arguments are not one answer."""
    from tunekit.data import contamination

    def ending_at_call(city: str, question: str) -> Record:
        call = dict(CALL, function={"name": "get_weather", "arguments": json.dumps({"city": city})})
        return Record({"messages": [{"role": "user", "content": question},
                                    {"role": "assistant", "content": None, "tool_calls": [call]}]}, f"t {city}")

    cfg = DataConfig(train="unused.jsonl", format="chat")
    train = [ending_at_call("Paris", "Weather in Paris?"), ending_at_call("Oslo", "How warm is Oslo?")]
    found = contamination.of_records(train, [ending_at_call("Lima", "Lima weather please")], cfg)
    assert found.eval_exact == [] and found.overlapping == []
    found = contamination.of_records(train, [ending_at_call("Oslo", "Is Oslo warm now?")], cfg)
    assert found.eval_exact == [0] and found.overlapping == [1]


def template_tokenizer(tiny_tokenizer, name: str):
    import trl

    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()
    return tok


def test_system_text_on_a_template_without_a_system_role(tiny_tokenizer):
    """Gemma 2's template refuses a system message: its text goes to the start of the first user turn, noted;
    with no user turn to hold it, one line names the record."""
    tok = template_tokenizer(tiny_tokenizer, "gemma")
    r = renderer(tok, system_prompt="Be brief.")
    [rendered] = r.examples(Record({"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "yo"}]}, "t line 1"))
    assert "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>" in rendered.text and DEFAULTS["system"] in r.notes
    assert trained_pieces(tok, rendered) == ["yo<end_of_turn>"]
    from tunekit.core.errors import TunekitError

    with pytest.raises(TunekitError, match="t line 2: a conversation without a user message"):
        r.examples(Record({"messages": [{"role": "assistant", "content": "yo"}]}, "t line 2"))


def test_empty_arguments_null_results_and_empty_call_lists(tiny_tokenizer):
    record = conversation()
    record["messages"][2]["tool_calls"] = [dict(CALL, function={"name": "get_weather", "arguments": ""})]
    record["messages"][3]["content"] = None
    record["messages"][4]["tool_calls"] = "[]"
    [rendered] = renderer(tiny_tokenizer).examples(Record(record, "t line 1"))
    assert ('{"name": "get_weather", "arguments": {}}' in rendered.text
            and "<|im_start|>tool\nnull<|im_end|>" in rendered.text)
    assert trained_pieces(tiny_tokenizer, rendered)[1] == "It is 21 C.<|im_end|>"


def test_a_tool_call_reference_is_the_turn_as_written_reasoning_included(tiny_tokenizer):
    record = conversation(reasoning="Paris, so the weather tool.")
    record["messages"] = record["messages"][:3]
    rendered = renderer(tiny_tokenizer).render(Record(record, "t line 1"))
    assert (rendered.reference
            == "<think>\nParis, so the weather tool.\n</think>\n\n" + CALL_TEXT.removesuffix("<|im_end|>"))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
RATE = {"type": "function", "function": {"name": "get_rate", "parameters": {"type": "object"}}}


def _call(name: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": {}}}


BAD_AGENT_RECORDS = {  # a chat record whose links contradict each other -> the cause the one line names
    "two calls sharing one id": (
        {"tools": [WEATHER, RATE], "messages": [
            {"role": "user", "content": "weather and rate?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", "c1"), _call("get_rate", "c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."}]},
        "message 1: two tool calls share the id 'c1'; give each call of a message its own id"),
    "a result whose id and name name different calls": (
        {"tools": [WEATHER, RATE], "messages": [
            {"role": "user", "content": "weather and rate?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", "c1"), _call("get_rate", "c2")]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_rate", "content": "1.1"},
            {"role": "assistant", "content": "1.1"}]},
        "message 2: tool_call_id 'c1' is the call of 'get_weather', but the result's name is 'get_rate'"),
    "nothing trainable": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "train": False}]},
        "nothing to train on: every assistant message has 'train': false"),
    "a call of a function the tools do not offer": (
        {"tools": [WEATHER], "messages": [
            {"role": "user", "content": "rate?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("get_rate", "c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": "1.1"},
            {"role": "assistant", "content": "1.1"}]},
        "message 1 calls 'get_rate', which the example's tools do not offer (get_weather)"),
}


@pytest.mark.parametrize("case", BAD_AGENT_RECORDS)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_contradicting_agent_records_are_refused_before_any_weight_loads(case, command, tmp_path, tiny_model,
                                                                         capsys, monkeypatch):
    """In-process, by validate as by train: exit 2, one line naming the file and line, nothing written."""
    from conftest import refused_in_process, reverse_rows, tiny_recipe, write_recipe
    good = [{"messages": [{"role": "user", "content": r["instruction"]},
                          {"role": "assistant", "content": r["output"]}]} for r in reverse_rows(3)]
    record, expected = BAD_AGENT_RECORDS[case]
    data = write_jsonl(tmp_path / "d.jsonl", [*good, record])
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, data, tmp_path / "run",
                                                           data={"format": "chat"}))
    line = refused_in_process([command, str(recipe)], tmp_path, capsys, monkeypatch)
    assert line.startswith("tunekit: error: ") and f"{data} line 4: " in line and expected in line, line
