"""The tool calls a model wrote in its text, read whatever the chat template's markup: JSON objects with a name and
arguments inside <tool_call> tags, after [TOOL_CALLS], in a code fence or bare. Episodes run them (tooluse.episodes)
and the tool_calls metric scores them (evaluation.metrics)."""

from __future__ import annotations

import json

_DECODER = json.JSONDecoder()


def _json_values(text: str) -> list:
    """Every JSON object or array in the text, outermost first, wherever it stands (inside
    <tool_call> tags, after [TOOL_CALLS], in a code fence, bare)."""
    found, pos = [], 0
    while True:
        starts = [i for i in (text.find("{", pos), text.find("[", pos)) if i >= 0]
        if not starts:
            return found
        pos = min(starts)
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            pos += 1
            continue
        if isinstance(value, (dict, list)):
            found.append(value)
        pos = end


def _calls_in(value) -> list[tuple[str, object]]:
    """(name, arguments) of the calls in a JSON value: objects with a string "name" and "arguments"
    (or "parameters", as Llama 3.1 writes), at any depth, so OpenAI's {"function": {...}} and lists
    of calls count; arguments given as JSON text are read."""
    if isinstance(value, list):
        return [call for item in value for call in _calls_in(item)]
    if not isinstance(value, dict):
        return []
    key = "arguments" if "arguments" in value else "parameters" if "parameters" in value else None
    if isinstance(value.get("name"), str) and key:
        args = value[key]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        return [(value["name"], args)]
    return [call for item in value.values() for call in _calls_in(item)]


def tool_calls_in(text: str) -> list[tuple[str, object]]:
    """The tool calls written in a model's answer, in order, whatever the chat template's markup."""
    return [call for value in _json_values(text) for call in _calls_in(value)]
