"""Conversations rendered by the tokenizer's own chat template, and the character spans that train.

The template decides the text; tunekit only decides which characters carry loss. Templates that cannot render
tools, tool calls, tool results or reasoning get one documented default rendering (DEFAULTS). Which characters
train, and how templates that rewrite earlier turns are split: docs/data.md, "Which characters of a chat train"."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from tunekit.core.errors import TunekitError, first_line
from tunekit.tooluse.records import call_json

TOOLS_TEXT = ("You can call these functions, described as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
              "To call one, answer with <tool_call>\n{{\"name\": <function name>, \"arguments\": "
              "<arguments as a JSON object>}}\n</tool_call>")
DEFAULTS = {
    "tools": "the chat template does not render a tools list: it is written into the system message inside "
             "<tools> tags",
    "tool_calls": "the chat template does not render tool calls: they are written into the assistant text as "
                  "<tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call>",
    "tool_role": "the chat template has no tool role: tool results are written as user turns inside "
                 "<tool_response> tags",
    "reasoning": "the chat template does not render reasoning: it is written before the answer as "
                 "<think>\\n...\\n</think>",
    "dropped": "the chat template leaves out the text (and so the reasoning) of some assistant messages, as "
               "Llama 3.1's does for messages that call a tool: only what it writes trains",
    "system": "the chat template has no system role: system text is written at the start of the first user "
              "message",
    "split": "the chat template rewrites earlier turns of a conversation, so such conversations train as "
             "several examples, one for each point where it does (every trained turn as generated)",
}
_SAID: set[str] = set()  # notes already in this process's output
_PROBE_CHAR = "\u00a4"  # a content no template strips, for finding where a message's own text starts


@dataclass(frozen=True)
class Support:
    """What the template renders itself; the rest gets the default rendering."""

    tools: bool
    tool_calls: bool
    tool_role: bool
    reasoning: bool
    system: bool


@dataclass
class Piece:
    """One training example cut from a conversation: text through its last trained turn, trained spans."""

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Turn:
    """Assistant message i rendered for generation: the prompt before it and the text through it."""

    index: int
    before: str
    through: str

    @property
    def own(self) -> str:
        return self.through[len(self.before):]


def probe(apply) -> Support:
    """Render small conversations and look for their markers in the output."""
    user = {"role": "user", "content": "hi"}
    call = {"id": "probezq01", "type": "function", "function": {"name": "probe_fn_zq", "arguments": {"zq": 1}}}
    schema = {"type": "function", "function": {"name": "probe_tool_zq", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}

    def shows(messages, needle, tools=None) -> bool:
        try:
            return needle in apply(messages, tools)
        except Exception:  # a template that raises on a shape does not support it
            return False

    tool_calls = shows([user, {"role": "assistant", "content": "", "tool_calls": [call]}], "probe_fn_zq")
    caller = {"role": "assistant", "content": "", "tool_calls": [call]} if tool_calls else {"role": "assistant",
                                                                                          "content": "x"}
    result = {"role": "tool", "content": "probe_result_zq", "tool_call_id": "probezq01", "name": "probe_fn_zq"}
    return Support(
        tools=shows([user], "probe_tool_zq", [schema]),
        tool_calls=tool_calls,
        tool_role=shows([user, caller, result], "probe_result_zq"),
        reasoning=shows([user, {"role": "assistant", "content": "x", "reasoning_content": "probe_think_zq"}],
                        "probe_think_zq"),
        system=shows([{"role": "system", "content": "probe_sys_zq"}, user], "probe_sys_zq"),
    )


def reads_strings(apply) -> bool:
    """Whether the template renders a message whose content is a string; False only where it renders the same
    text given as a content part instead (a template that iterates parts)."""
    def shows(content) -> bool:
        try:
            return "probe_text_zq" in apply([{"role": "user", "content": content}])
        except Exception:  # noqa: BLE001 -- a template that raises on a shape does not render it
            return False
    return shows("probe_text_zq") or not shows([{"type": "text", "text": "probe_text_zq"}])


def as_parts(content: str, marker: str | None) -> list[dict]:
    """A string content as content parts: its text, each image `marker` in it an image part."""
    pieces = content.split(marker) if marker else [content]
    parts: list[dict] = []
    for k, piece in enumerate(pieces):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts or [{"type": "text", "text": ""}]


def say(notes) -> None:
    """Each note on a default rendering once in the run output (preparation and evaluation both meet them)."""
    for note in sorted(set(notes) - _SAID):
        logging.getLogger("tunekit").info("data: %s", note)
        _SAID.add(note)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def call_text(calls: list[dict]) -> str:
    """The default rendering of tool calls."""
    return "\n".join(f"<tool_call>\n{call_json(c)}\n</tool_call>" for c in calls)


class Chat:
    """Renders parsed conversations with one tokenizer's chat template."""

    def __init__(self, tokenizer, train_on: str, train_reasoning: bool, image_marker: str | None = None):
        self.tok = tokenizer
        self.train_on = train_on
        self.train_reasoning = train_reasoning
        self.image_marker = image_marker  # where an image stands in a string content (data.imagetokens)
        self.strings = reads_strings(lambda messages: self.tok.apply_chat_template(messages, tokenize=False))
        self.support = probe(lambda messages, tools: self._raw(messages, tools))
        self.notes: set[str] = set()

    def _raw(self, messages, tools, gen: bool = False) -> str:
        if not self.strings:
            messages = [dict(m, content=as_parts(m["content"], self.image_marker)) if isinstance(m.get("content"), str)
                        else m for m in messages]
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=gen)

    def apply(self, messages: list[dict], tools, where: str, gen: bool = False) -> str:
        try:
            return self._raw(messages, tools, gen)
        except Exception as e:  # jinja2 raises its own types, and templates raise_exception() with a message
            raise TunekitError(f"{where}: the chat template refused this conversation ({first_line(e)[:200]}); "
                               "fix the record or pick a template that renders it") from None

    # ------------------------------------------------------------ default renderings

    def adapt(self, messages: list[dict], tools: list | None, where: str) -> tuple[list[dict], list | None, list[dict]]:
        """Messages as the template will get them (default renderings applied, `train` keys removed), the
        tools to pass it, and per message what tunekit needs to know: trained, think block text."""
        out, meta = [], []
        for m in messages:
            m, info = self._adapt_message(dict(m))
            if info.get("tool_turn") and meta and meta[-1].get("tool_turn"):
                out[-1] = dict(out[-1], content=out[-1]["content"] + "\n" + m["content"])
                continue
            out.append(m)
            meta.append(info)
        if tools and not self.support.tools:
            self.notes.add(DEFAULTS["tools"])
            out = self._tools_in_text(out, tools, where)
            if len(out) > len(meta):  # a system message was added for them
                meta.insert(0, {"train": False, "role": "system", "calls": False})
            tools = None
        if out[0]["role"] == "system" and not self.support.system:
            self.notes.add(DEFAULTS["system"])
            out, meta = self._first_user(out[1:], out[0]["content"], where), meta[1:]
        return out, tools, meta

    def _adapt_message(self, m: dict) -> tuple[dict, dict]:
        info = {"train": m.pop("train", True), "role": m["role"], "calls": bool(m.get("tool_calls"))}
        if m["role"] == "assistant":
            if m.get("tool_calls") and not self.support.tool_calls:
                self.notes.add(DEFAULTS["tool_calls"])
                calls = call_text(m.pop("tool_calls"))
                m["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
            reasoning = m.pop("reasoning_content", "")
            if reasoning and self.support.reasoning:
                m["reasoning_content"] = reasoning
                info["reasoning"] = True
            elif reasoning:
                self.notes.add(DEFAULTS["reasoning"])
                info["think"] = f"<think>\n{reasoning}\n</think>"
                m["content"] = info["think"] + ("\n\n" + m["content"] if m["content"] else "")
        elif m["role"] == "tool" and not self.support.tool_role:
            self.notes.add(DEFAULTS["tool_role"])
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            info["tool_turn"] = True
        return m, info

    def _tools_in_text(self, messages: list[dict], tools: list, where: str) -> list[dict]:
        block = TOOLS_TEXT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages[0]["role"] == "system":
            return [dict(messages[0], content=f"{messages[0]['content']}\n\n{block}")] + messages[1:]
        if self.support.system:
            return [{"role": "system", "content": block}] + messages
        return self._first_user(messages, block, where)

    @staticmethod
    def _first_user(messages: list[dict], text: str, where: str) -> list[dict]:
        """`text` put before the first user message (a template without a system role)."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise TunekitError(f"{where}: a conversation without a user message, on a chat template without a "
                               "system role: there is no turn to hold the system text or tools; add a user message")
        messages = list(messages)
        messages[first] = dict(messages[first], content=f"{text}\n\n{messages[first]['content']}")
        return messages

    # ------------------------------------------------------------ spans

    def turn(self, messages: list[dict], tools, i: int, where: str) -> Turn:
        before = self.apply(messages[:i], tools, where, gen=True)
        through = self.apply(messages[: i + 1], tools, where)
        if not through.startswith(before):
            raise TunekitError(f"{where}: the chat template does not write assistant message {i} after its own "
                               "generation prompt, so its tokens cannot be located; set data.template: raw or use a "
                               "tokenizer whose template does")
        return Turn(i, before, through)

    def prelude(self, messages: list[dict], tools, turn: Turn, where: str) -> tuple[int, str]:
        """(length of what the template writes before the message's own text, the end-of-turn text after it).
        Found by rendering the message with an empty and with a one-character content: the text all three
        renderings share is the template's, not the message's."""
        m = messages[turn.index]
        own = turn.own
        variants = {}
        for content in ("", _PROBE_CHAR):
            v = {k: val for k, val in m.items() if k != "tool_calls"}
            v["content"] = content
            try:
                text = self._raw(messages[: turn.index] + [v], tools)
            except Exception:  # a template may refuse an assistant message without text or calls (Mistral's)
                continue
            if text.startswith(turn.before):
                variants[content] = text[len(turn.before):]
        if not variants:
            return 0, ""
        start = min(_common_prefix(own, v) for v in variants.values())
        if "" in variants:
            tail = variants[""][start:]
        else:
            probed = variants[_PROBE_CHAR]
            tail = probed[probed.find(_PROBE_CHAR) + 1:] if _PROBE_CHAR in probed[start:] else ""
        return start, tail if own.endswith(tail) else ""

    def spans(self, messages: list[dict], tools, turn: Turn, info: dict, where: str) -> list[tuple[int, int]]:
        own, base = turn.own, len(turn.before)
        m = messages[turn.index]
        fast = m["content"] and own.startswith(m["content"]) and not info.get("reasoning")
        start = 0 if fast else self.prelude(messages, tools, turn, where)[0]
        if info.get("reasoning") and self.train_reasoning:
            start = 0  # the reasoning block is what the template writes before the text: it trains
        end = len(own.rstrip())
        if m["content"].strip() and m["content"].strip() not in own:
            self.notes.add(DEFAULTS["dropped"])
        think = info.get("think")
        at = own.find(think, start) if think and not self.train_reasoning else -1
        if at < 0:
            return [(base + start, base + end)] if end > start else []
        after = at + len(think)
        while after < end and own[after].isspace():
            after += 1
        return [(base + s, base + e) for s, e in ((start, at), (after, end)) if e > s]

    def trained(self, meta: list[dict]) -> list[int]:
        assistants = [i for i, info in enumerate(meta) if info["role"] == "assistant"]
        if self.train_on == "last_assistant":
            assistants = assistants[-1:]
        return [i for i in assistants if meta[i]["train"]]

    def pieces(self, messages: list[dict], tools, meta: list[dict], where: str) -> list[Piece]:
        """The training examples of one conversation: usually one; more where the template rewrites earlier turns."""
        pieces: list[Piece] = []
        for i in self.trained(meta):
            turn = self.turn(messages, tools, i, where)
            spans = self.spans(messages, tools, turn, meta[i], where)
            if pieces and turn.through.startswith(pieces[-1].text):
                pieces[-1].text = turn.through
                pieces[-1].spans.extend(spans)
            else:
                if pieces:
                    self.notes.add(DEFAULTS["split"])
                pieces.append(Piece(turn.through, spans))
        return pieces or [Piece(self.apply(messages, tools, where))]  # nothing trains: counted as dropped

    def reference(self, messages: list[dict], tools, turn: Turn, info: dict, where: str) -> str:
        """What generation should produce for assistant message `turn.index`: its content, or, for a tool call,
        its text as the template writes it (without the end-of-turn marker), so that the call can be scored."""
        content = messages[turn.index]["content"]
        if not info["calls"]:
            return content[len(info["think"]):].lstrip() if info.get("think") else content
        start, tail = self.prelude(messages, tools, turn, where)
        own = turn.own
        return own[start: len(own) - len(tail)].strip()  # reasoning written before the call included

    def roles(self, messages: list[dict], tools, text: str, where: str) -> list[tuple[int, int, str]]:
        """Character ranges of `text` by the message that wrote them ("template" for text no prefix
        rendering attributes to one message)."""
        ranges, start = [], 0
        for j, m in enumerate(messages):
            try:
                through = self._raw(messages[: j + 1], tools)
            except Exception:
                continue
            if not text.startswith(through) or len(through) <= start:
                continue
            ranges.append((start, len(through), m["role"]))
            start = len(through)
        if start < len(text):
            ranges.append((start, len(text), "template"))
        return ranges
