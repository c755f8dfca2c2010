"""Agent data (tools, tool calls, tool results, reasoning) under the chat templates real model families ship
(tests/chat_templates.py says where each comes from). Per template: the trained tokens decode to exactly the
trained assistant messages plus their end-of-turn marker (the strings below are written out from reading each
template); system, user and tool-result text and the generation-prompt header carry no loss; an empty
reasoning block a template writes carries none; data.train_reasoning, data.train_on and a message's
`train: false` are honoured; templates without tools or reasoning get the default rendering and a note.
Mistral's template is also checked against mistral-common's own encoder."""

from __future__ import annotations

import copy

import pytest

import chat_templates as ct
from tunekit.config.schema import DataConfig
from tunekit.data.chattemplate import DEFAULTS
from tunekit.data.formats import Record

FAMILIES = ["llama3_1", "llama3_2", "qwen2_5", "qwen3", "mistral", "gemma", "gemma3", "smollm2"]
NO_TOOLS = {"gemma", "gemma3", "smollm2"}  # templates that render no tools: the default rendering is used

SYSTEM = "You answer briefly."
QUESTION = "What is the weather in Paris?"
RESULT = "18 C, light rain"
FINAL = "It is 18 C with light rain in Paris."
ARGS = {"city": "Paris", "days": 2, "metric": True}
ARGS_TEXT = '{"city": "Paris", "days": 2, "metric": true}'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}}, "required": ["city"]}}}]
THINK_CALL = "I need the weather tool."
THINK_FINAL = "The tool says 18 C and rain."
PRIME_Q, PRIME_THINK, PRIME_A = "Is 17 a prime number?", "17 has no divisor from 2 to 4.", "Yes, 17 is prime."
PROMPT_TEXT = [SYSTEM, QUESTION, RESULT, "Current weather for a city.", "Say hi.", "Now say bye.", PRIME_Q]

# What each template writes for a trained assistant message, from the generation prompt on (the header
# `<|start_header_id|>assistant<|end_header_id|>\n\n`, `<|im_start|>assistant\n`, `<start_of_turn>model\n`,
# nothing after Mistral's `[/INST]`/`[/TOOL_RESULTS]`) through its end-of-turn marker; the newline ChatML and
# Gemma write after the marker is not trained (the model stops at the marker and never generates it).
_LLAMA = {
    "call": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2, "metric": true}}<|eot_id|>',
    "final": "It is 18 C with light rain in Paris.<|eot_id|>",
    "prime": "<think>\n17 has no divisor from 2 to 4.\n</think>\n\nYes, 17 is prime.<|eot_id|>",  # default rendering
    "prime_plain": "Yes, 17 is prime.<|eot_id|>",
    "hi": "Hi!<|eot_id|>", "bye": "Bye!<|eot_id|>",
}
_QWEN = {
    "call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "metric": true}}\n'
            "</tool_call><|im_end|>",
    "final": "It is 18 C with light rain in Paris.<|im_end|>",
    "prime": "<think>\n17 has no divisor from 2 to 4.\n</think>\n\nYes, 17 is prime.<|im_end|>",
    "prime_plain": "Yes, 17 is prime.<|im_end|>",
    "hi": "Hi!<|im_end|>", "bye": "Bye!<|im_end|>",
}
_GEMMA = {  # no tools, no reasoning in the template: the default rendering
    "call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "metric": true}}\n'
            "</tool_call><end_of_turn>",
    "final": "It is 18 C with light rain in Paris.<end_of_turn>",
    "prime": "<think>\n17 has no divisor from 2 to 4.\n</think>\n\nYes, 17 is prime.<end_of_turn>",
    "prime_plain": "Yes, 17 is prime.<end_of_turn>",
    "hi": "Hi!<end_of_turn>", "bye": "Bye!<end_of_turn>",
}
EXPECTED = {
    "llama3_1": _LLAMA,
    "llama3_2": _LLAMA,
    "qwen2_5": _QWEN,  # reasoning: the default rendering, the same text as Qwen3's own
    "qwen3": {
        **_QWEN,
        "call_thought": '<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                        '"arguments": {"city": "Paris", "days": 2, "metric": true}}\n</tool_call><|im_end|>',
        "final_thought": "<think>\nThe tool says 18 C and rain.\n</think>\n\nIt is 18 C with light rain in "
                         "Paris.<|im_end|>",
    },
    "mistral": {
        "call": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "metric": true}, '
                '"id": "call00001"}]</s>',
        "final": "It is 18 C with light rain in Paris.</s>",
        "prime": "<think>\n17 has no divisor from 2 to 4.\n</think>\n\nYes, 17 is prime.</s>",  # default rendering
        "prime_plain": "Yes, 17 is prime.</s>",
        "hi": "Hi!</s>", "bye": "Bye!</s>",
    },
    "gemma": _GEMMA,
    "gemma3": _GEMMA,
    "smollm2": _QWEN,  # ChatML; no tools, no reasoning in the template: the default rendering
}
# The generation-prompt header of each template: never trained.
HEADER = {"llama3_1": "<|start_header_id|>assistant", "llama3_2": "<|start_header_id|>assistant",
          "qwen2_5": "<|im_start|>assistant", "qwen3": "<|im_start|>assistant", "smollm2": "<|im_start|>assistant",
          "gemma": "<start_of_turn>model", "gemma3": "<start_of_turn>model", "mistral": "[/INST]"}


# ---------------------------------------------------------------- conversations (OpenAI layout)


def _system(family) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}] if family.system else []


def tool_chat(family, arguments=ARGS_TEXT, thoughts: bool = False) -> dict:
    """A tool list, a tool call with typed JSON arguments, its result, a final answer."""
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    final = {"role": "assistant", "content": FINAL}
    if thoughts:
        call["reasoning_content"], final["reasoning_content"] = THINK_CALL, THINK_FINAL
    result = {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": RESULT}
    return {"tools": TOOLS, "messages": _system(family) + [{"role": "user", "content": QUESTION}, call, result, final]}


def reasoning_chat() -> dict:
    return {"messages": [{"role": "user", "content": PRIME_Q},
                         {"role": "assistant", "reasoning_content": PRIME_THINK, "content": PRIME_A}]}


def two_turns(family, first_trained: bool = True, tools: bool = True) -> dict:
    """Two user turns; with the tool list, which some templates move or rewrite as the conversation grows."""
    hi = {"role": "assistant", "content": "Hi!"}
    if not first_trained:
        hi["train"] = False
    messages = _system(family) + [{"role": "user", "content": "Say hi."}, hi,
                                  {"role": "user", "content": "Now say bye."}, {"role": "assistant", "content": "Bye!"}]
    return {"tools": TOOLS, "messages": messages} if tools else {"messages": messages}


# ---------------------------------------------------------------- rendering through tunekit


@pytest.fixture(scope="module")
def families():
    return ct.families()


@pytest.fixture(scope="module")
def tokenizers(families):
    return {name: ct.tokenizer_for(fam) for name, fam in families.items()}


def runs(labels, ids, tokenizer) -> list[str]:
    """The trained tokens, one decoded string per run of consecutive trained positions."""
    from tunekit.data.tokenizing import IGNORE

    out, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE:
            assert label == token
            current.append(token)
        elif current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in out]


def trained(tokenizer, record: dict, **data) -> tuple[list[str], list[str], set]:
    """(trained runs over all the record's examples, each example's text, the renderer's notes)."""
    from tunekit.data.rendering import Renderer
    from tunekit.data.tokenizing import tokenize

    cfg = DataConfig(train="x.jsonl", format="chat", max_length=4096, **data)
    renderer = Renderer(cfg, tokenizer)
    found, texts = [], []
    for rendered in renderer.examples(Record(copy.deepcopy(record), "x.jsonl line 1")):
        example, truncated = tokenize(rendered, tokenizer, 4096, mask_prompt=True)
        assert not truncated and example.labels[0] == -100  # the first token is the template's opening marker
        found += runs(example.labels, example.input_ids, tokenizer)
        texts.append(rendered.text)
    return found, texts, set(renderer.notes)


def assert_untrained_prompts(name: str, found: list[str]):
    for run in found:
        assert not any(p in run for p in PROMPT_TEXT), (name, run)
        assert HEADER[name] not in run, (name, run)


# ---------------------------------------------------------------- the templates themselves (no tunekit rendering)


def test_templates_come_from_packages(families, tokenizers):
    assert sorted(families) == sorted(FAMILIES)
    for name, fam in families.items():
        assert "==" in fam.source and fam.template.strip(), name
        tok = tokenizers[name]
        for marker in fam.specials + fam.markers:  # one token each, as in the real tokenizers
            assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1, (name, marker)
    assert "training" not in " ".join(f.source for f in families.values())  # TRL's modified copies are not used


def _render(tokenizer, record: dict) -> str:
    messages = [{k: v for k, v in m.items() if k != "train"} for m in record["messages"]]
    return tokenizer.apply_chat_template(messages, tools=record.get("tools"), tokenize=False)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in NO_TOOLS])
def test_expected_strings_are_what_the_template_writes(name, families, tokenizers):
    """The strings the tests below expect trained are the template's own rendering of those messages."""
    fam, tok, want = families[name], tokenizers[name], EXPECTED[name]
    text = _render(tok, tool_chat(fam, arguments=ARGS))
    assert HEADER[name] in text and want["call"] in text and want["final"] in text
    text = _render(tok, two_turns(fam))
    assert want["hi"] in text and want["bye"] in text
    if fam.reasoning:
        assert want["prime"] in _render(tok, reasoning_chat())
        text = _render(tok, tool_chat(fam, arguments=ARGS, thoughts=True))
        assert want["call_thought"] in text and want["final_thought"] in text


# ---------------------------------------------------------------- trained tokens, per template


@pytest.mark.parametrize("arguments", [ARGS_TEXT, ARGS], ids=["arguments-text", "arguments-object"])
@pytest.mark.parametrize("name", FAMILIES)
def test_tool_call_and_result(name, arguments, families, tokenizers):
    fam, want = families[name], EXPECTED[name]
    found, texts, notes = trained(tokenizers[name], tool_chat(fam, arguments))
    assert found == [want["call"], want["final"]]
    assert_untrained_prompts(name, found)
    assert RESULT in texts[-1] and QUESTION in texts[-1]
    assert all("\n" not in n for n in notes)
    if name in NO_TOOLS:  # the template renders no tools: tunekit's default rendering, said in a note
        assert {DEFAULTS["tools"], DEFAULTS["tool_calls"]} <= notes
        assert (DEFAULTS["tool_role"] in notes) == (name != "smollm2")  # SmolLM2's writes any role, `tool` too
    else:
        assert not notes & {DEFAULTS["tools"], DEFAULTS["tool_calls"], DEFAULTS["tool_role"], DEFAULTS["reasoning"]}



@pytest.mark.parametrize("name", FAMILIES)
def test_generation_prompt_and_reference(name, families, tokenizers):
    """render(): the conversation through its last answer, the prompt generation starts from, that answer."""
    from tunekit.data.rendering import Renderer

    renderer = Renderer(DataConfig(train="x.jsonl", format="chat"), tokenizers[name])
    rendered = renderer.render(Record(tool_chat(families[name]), "x.jsonl line 1"))
    assert rendered.reference == FINAL and rendered.text.startswith(rendered.prompt)
    assert RESULT in rendered.prompt and FINAL not in rendered.prompt
    empty_block = "<think>\n\n</think>\n\n" if name == "qwen3" else ""  # Qwen3's on a last answer without reasoning
    assert rendered.text[len(rendered.prompt):].startswith(empty_block + FINAL)

@pytest.mark.parametrize("name", FAMILIES)
def test_reasoning_trains_only_when_asked(name, families, tokenizers):
    fam, want, tok = families[name], EXPECTED[name], tokenizers[name]
    found, texts, notes = trained(tok, reasoning_chat())
    assert found == [want["prime"]] and PRIME_THINK in texts[-1]
    assert (DEFAULTS["reasoning"] in notes) == (not fam.reasoning)
    found, _, _ = trained(tok, reasoning_chat(), train_reasoning=False)
    assert found == [want["prime_plain"]]
    assert_untrained_prompts(name, found)


def test_qwen3_thinking_with_tools(families, tokenizers):
    """Qwen3 writes reasoning before a tool call and before the answer; both train, or neither."""
    fam, want, tok = families["qwen3"], EXPECTED["qwen3"], tokenizers["qwen3"]
    found, texts, notes = trained(tok, tool_chat(fam, thoughts=True))
    assert found == [want["call_thought"], want["final_thought"]] and DEFAULTS["reasoning"] not in notes
    found, texts, _ = trained(tok, tool_chat(fam, thoughts=True), train_reasoning=False)
    assert found == [want["call"], want["final"]]
    assert THINK_CALL in "".join(texts) and THINK_FINAL in texts[-1]


@pytest.mark.parametrize("name", ["qwen3"])
def test_empty_reasoning_block_carries_no_loss(name, families, tokenizers):
    """Qwen3 writes `<think>\n\n</think>\n\n` on the last assistant message when it has no reasoning."""
    fam, want, tok = families[name], EXPECTED[name], tokenizers[name]
    for record, expected in [(tool_chat(fam), [want["call"], want["final"]]),
                             (two_turns(fam), [want["hi"], want["bye"]])]:
        found, texts, _ = trained(tok, record)
        assert found == expected
        assert any("<think>\n\n</think>\n\n" in t for t in texts)
        assert not any("<think>" in run for run in found)


@pytest.mark.parametrize("name", FAMILIES)
def test_two_user_turns(name, families, tokenizers):
    """Every assistant message trains once, also where a template moves the tool list or drops earlier
    reasoning as the conversation grows (Mistral, Qwen3): tunekit then splits the conversation."""
    fam, want = families[name], EXPECTED[name]
    for record in (two_turns(fam), two_turns(fam, tools=False)):
        found, _, _ = trained(tokenizers[name], record)
        assert found == [want["hi"], want["bye"]]
        assert_untrained_prompts(name, found)


@pytest.mark.parametrize("name", FAMILIES)
def test_train_false_and_last_assistant(name, families, tokenizers):
    fam, want, tok = families[name], EXPECTED[name], tokenizers[name]
    found, texts, _ = trained(tok, two_turns(fam, first_trained=False))
    assert found == [want["bye"]] and "Hi!" in texts[-1]
    found, _, _ = trained(tok, tool_chat(fam), train_on="last_assistant")
    assert found == [want["final"]]
    found, _, _ = trained(tok, two_turns(fam), train_on="last_assistant")
    assert found == [want["bye"]]


# ---------------------------------------------------------------- Mistral: against mistral-common's encoder


@pytest.fixture(scope="module")
def mistral_reference():
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(ct.mistral_data() / ct.MISTRAL_TOKENIZER_FILE),
                                      mode=ValidationMode.finetuning)


def _reference(mt, record: dict) -> tuple[str, list[str]]:
    """mistral-common's encoding of a conversation: its whole text, and each assistant message's text."""
    from mistral_common.protocol.instruct.messages import AssistantMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

    messages = [{k: v for k, v in m.items() if k != "train"} for m in record["messages"]]
    request = ChatCompletionRequest.from_openai(messages, record.get("tools"))
    whole = mt.decode(mt.encode_chat_completion(request).tokens, special_token_policy=SpecialTokenPolicy.KEEP)
    turns = [mt.decode(mt.instruct_tokenizer.encode_assistant_message(m, False),
                       special_token_policy=SpecialTokenPolicy.KEEP)
             for m in request.messages if isinstance(m, AssistantMessage)]
    return whole, turns


def _mistral_records(fam) -> list[dict]:
    return [tool_chat(fam), tool_chat(fam, arguments=ARGS), two_turns(fam), two_turns(fam, tools=False)]


def test_mistral_template_is_mistral_commons_encoding(families, tokenizers, mistral_reference):
    fam, tok = families["mistral"], tokenizers["mistral"]
    for record in _mistral_records(fam):
        whole, turns = _reference(mistral_reference, record)
        assert _render(tok, record) == whole
        assert all(t in whole for t in turns)


def test_mistral_trained_tokens_are_mistral_commons_assistant_turns(families, tokenizers, mistral_reference):
    fam, tok = families["mistral"], tokenizers["mistral"]
    for record in _mistral_records(fam):
        whole, turns = _reference(mistral_reference, record)
        found, texts, _ = trained(tok, record)
        assert found == turns and texts[-1] == whole
