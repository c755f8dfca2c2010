"""The data formats' parsers, as a registry: each reads one record into a format-neutral `Parsed` (a
conversation, or raw text). A format is declared in tunekit.config.dataformats (the recipe's `data.format`
choices) and its parser registered here under that name; data.rendering.Renderer turns any Parsed into text and trained
spans."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from tunekit.config import plugins
from tunekit.config.dataformats import DECLARED
from tunekit.core.errors import TunekitError
from tunekit.data import images
from tunekit.tooluse import records as tool_records

ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates render

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


@dataclass(frozen=True)
class Record:
    values: dict
    where: str  # "file line N" for error messages


@dataclass(frozen=True)
class Parsed:
    """One record: either a conversation (`messages`, ending in what is trained) or raw `text`
    trained on whole. `alpaca_prompt` is the prompt under the Alpaca template, for formats that have one.
    A preference pair is the conversation ending in the chosen answer, plus the `rejected` answer.
    Messages are {"role", "content"} plus, where present, "tool_calls" (OpenAI layout, arguments as objects),
    "reasoning_content", "train" (bool), and on tool results "tool_call_id" / "name" (tunekit.tooluse.records)."""

    messages: list[dict] | None = None
    text: str | None = None
    alpaca_prompt: str | None = None
    rejected: str | None = None  # preference pairs: the dispreferred answer (messages end with the chosen one)
    desirable: bool | None = None  # unpaired preference (KTO): whether the answer the messages end in is wanted
    tools: list[dict] | None = None  # chat: the tool (function) schemas the conversation may call
    images: tuple = ()  # chat: the record's images (data.images.Image), in the order their placeholders stand


@dataclass(frozen=True)
class Format:
    name: str
    parse: Callable[[Record, Any], Parsed]  # (record, data.fields) -> Parsed
    needs_chat: bool  # whole conversations: only a chat template renders them
    alpaca: bool  # the Alpaca prompt template applies


FORMATS: dict[str, Format] = {}


def register(name: str):
    """Register the parser of a declared format (config.dataformats), with what the declaration says of it."""
    if name not in DECLARED:
        raise ValueError(f"data format {name!r} is not declared in tunekit.config.dataformats")
    if name in FORMATS:
        raise ValueError(f"data format {name!r} is registered twice")

    def add(fn):
        FORMATS[name] = Format(name, fn, DECLARED[name].needs_chat, DECLARED[name].alpaca)
        return fn
    return add


def field(record: Record, name: str, key: str, required: bool = True) -> Any:
    if name not in record.values or record.values[name] is None:
        if not required:
            return ""
        present = ", ".join(record.values) or "none"
        raise TunekitError(
            f"{record.where}: missing field {name!r} (fields present: {present}); "
            f"map it with data.fields.{key} or fix the data"
        )
    return record.values[name]


def text(record: Record, name: str, key: str, required: bool = True) -> str:
    value = field(record, name, key, required)
    if not isinstance(value, str):
        raise TunekitError(f"{record.where}: field {name!r} must be text, got {type(value).__name__}")
    return value


def _turn(user: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


@register("alpaca")
def alpaca(record: Record, f) -> Parsed:
    instruction = text(record, f.instruction, "instruction")
    extra = text(record, f.input, "input", required=False)
    answer = text(record, f.output, "output")
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    prompt = (ALPACA_PROMPT_INPUT if extra.strip() else ALPACA_PROMPT).format(instruction=instruction, input=extra)
    return Parsed(messages=_turn(user, answer), alpaca_prompt=prompt)


@register("prompt_completion")
def prompt_completion(record: Record, f) -> Parsed:
    return Parsed(messages=_turn(text(record, f.prompt, "prompt"), text(record, f.completion, "completion")))


@register("chat")
def chat(record: Record, f) -> Parsed:
    """OpenAI-style messages: roles system/user/assistant/tool, assistant tool_calls and reasoning, tool results
    linked to their call, and a per-example list of tool (function) schemas."""
    messages, found = _messages(record, f)
    if record.values.get(f.images) not in (None, []):
        if found:
            raise TunekitError(f"{record.where}: images both in message parts and in field {f.images!r}; use one")
        found = images.listed(record.values[f.images], messages, record.where, f.images)
    assistant = [m for m in messages if m["role"] == "assistant"]
    if not assistant:
        raise TunekitError(f"{record.where}: conversation has no assistant message to train on")
    if all(m.get("train") is False for m in assistant):
        raise TunekitError(f"{record.where}: nothing to train on: every assistant message has {f.train!r}: false; "
                           "set it true on the answers to learn, or leave the record out")
    tools = _tools(record, f)
    tool_records.check_offered(messages, tools, record.where)
    return Parsed(messages=messages, tools=tools, images=images.checked(found))


def _messages(record: Record, f) -> tuple[list[dict], list]:
    """The messages, each image part replaced by data.images.PLACEHOLDER in its text, and those images."""
    raw = field(record, f.messages, "messages")
    if not isinstance(raw, list) or not raw:
        raise TunekitError(f"{record.where}: field {f.messages!r} must be a non-empty list of messages")
    messages: list[dict] = []
    found: list = []
    for i, m in enumerate(raw):
        where = f"{record.where}: message {i}"
        if not isinstance(m, dict) or not isinstance(m.get(f.role), str):
            raise TunekitError(f"{where} must be an object with a text field {f.role!r} (and {f.content!r})")
        role = m[f.role]
        if role not in ROLES:
            raise TunekitError(f"{where} has role {role!r}; use one of {', '.join(ROLES)} "
                               "(or map the key names with data.fields.role)")
        value = m.get(f.content)
        if isinstance(value, list) and any(map(images.is_image_part, value)):
            images.refuse_in_answer(role, where)
            text, more = images.content(value, where)
            found += more
        else:
            text = _content(m, f, role, where)
        message = {"role": role, "content": text}
        message.update(tool_records.extras(m, f, role, where, messages))
        messages.append(message)
    return messages, found


def _content(m: dict, f, role: str, where: str) -> str:
    """A message's text: a string, or a list of text parts; empty for an assistant message that only calls tools,
    and a tool result may be any JSON value (written as JSON)."""
    value = m.get(f.content)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    if value is None and role == "assistant" and m.get(f.tool_calls):
        return ""
    if role == "tool":  # any JSON value, null included
        return json.dumps(value, ensure_ascii=False)
    raise TunekitError(f"{where} must have a text field {f.content!r}")


def _tools(record: Record, f) -> list[dict] | None:
    value = record.values.get(f.tools)
    return tool_records.tools(value, f"{record.where}: field {f.tools!r}") if value not in (None, "", []) else None


@register("text")
def raw_text(record: Record, f) -> Parsed:
    return Parsed(text=text(record, f.text, "text"))


@register("preference")
def preference(record: Record, f) -> Parsed:
    """A prompt (text, or chat messages ending before the answer), a chosen and a rejected answer. Read
    as a conversation ending in the chosen answer, so SFT on it trains on the chosen answers and
    evaluation scores against them."""
    prompt = _prompt(record, f, "chosen and rejected")
    chosen, rejected = text(record, f.chosen, "chosen"), text(record, f.rejected, "rejected")
    return Parsed(messages=prompt + [{"role": "assistant", "content": chosen}], rejected=rejected)


def identical_pair(where: str, method, what: str = "text") -> TunekitError:
    """The error for a pair whose chosen and rejected answers are the same `what` (text, or tokens once rendered),
    under a `method` (config.methods.MethodSpec) that learns only from their difference."""
    return TunekitError(f"{where}: the chosen and the rejected answer are the same {what}, and training.method: "
                        f"{method.name} learns from {method.learns_from_difference}, so the pair carries no signal; "
                        "give it a different rejected answer or remove it")


@register("unpaired_preference")
def unpaired_preference(record: Record, f) -> Parsed:
    """A prompt (text, or chat messages ending before the answer), one completion and a label saying whether
    it is desirable (true/false or 1/0), as KTO trains on. Evaluation scores against the desirable ones."""
    prompt = _prompt(record, f, "completion")
    label = field(record, f.label, "label")
    if label not in (True, False) or isinstance(label, float):
        raise TunekitError(f"{record.where}: field {f.label!r} must be true or false (or 1 or 0), got {label!r}")
    completion = text(record, f.completion, "completion")
    return Parsed(messages=prompt + [{"role": "assistant", "content": completion}], desirable=bool(label))


@register("prompt")
def prompt_only(record: Record, f) -> Parsed:
    """A prompt to answer (text, or chat messages ending before the answer) and an optional reference answer, as
    GRPO trains on: its rewards score the model's own completions, against the reference where one is given."""
    prompt = _prompt(record, f, "answer")
    return Parsed(messages=prompt + [{"role": "assistant",
                                      "content": text(record, f.answer, "answer", required=False)}])


def _prompt(record: Record, f, answers: str) -> list[dict]:
    """The prompt of a preference record: chat messages ending before the answer, else a prompt text."""
    if f.messages in record.values and record.values[f.messages] is not None:
        prompt, found = _messages(record, f)
        if found:
            raise TunekitError(f"{found[0].where}: images are read in data.format chat only; this record's format "
                               "trains on text")
        if prompt[-1]["role"] == "assistant":
            raise TunekitError(f"{record.where}: field {f.messages!r} must end before the answer (the last message "
                               f"is the assistant's); the answers go in {answers}")
        return prompt
    return [{"role": "user", "content": text(record, f.prompt, "prompt")}]


plugins.run("register_formats")  # installed plugins' implementations (config.plugins)
