"""The agent parts of a chat record, checked and normalised: assistant tool calls (OpenAI layout), tool
results linked to the call they answer, reasoning, a message's own `train` switch, and the tool schemas.

Normalised so that every chat template reads them the way Hugging Face templates expect: a tool call is
{"id"?, "type": "function", "function": {"name", "arguments": <object>}} (OpenAI data carries the arguments
as JSON text; templates write them with `tojson`, which would quote that text twice); a tool schema is
{"type": "function", "function": {...}}. Keys are only present when a message has them (Llama 3.1's
template branches on `'tool_calls' in message`)."""

from __future__ import annotations

import json

from tunekit.core.errors import TunekitError


def extras(m: dict, f, role: str, where: str, earlier: list[dict]) -> dict:
    """The keys beyond role/content of message `m` (its field names mapped by data.fields `f`)."""
    out: dict = {}
    train = m.get(f.train)
    if train is not None:
        if not isinstance(train, bool):
            raise TunekitError(f"{where}: {f.train!r} must be true or false, got {train!r}")
        if train and role != "assistant":
            raise TunekitError(f"{where}: {f.train!r} is true on a {role} message; only assistant messages train")
        if role == "assistant":
            out["train"] = train
    calls = m.get(f.tool_calls)
    calls = [] if calls is None else [_call(c, f"{where} tool call {k}")
                                      for k, c in _listed(calls, f"{where} {f.tool_calls!r}")]
    if calls:  # the key only where there are calls: Llama 3.1's template branches on its presence
        ids = [c["id"] for c in calls if "id" in c]
        shared = next((i for i in ids if ids.count(i) > 1), None)
        if shared is not None:  # each result would be linked to the first of them
            raise TunekitError(f"{where}: two tool calls share the id {shared!r}; give each call of a message its "
                               "own id (tool results name the call they answer by it)")
        if role != "assistant":
            raise TunekitError(f"{where}: a {role} message carries {f.tool_calls!r}; "
                               "only assistant messages call tools")
        out["tool_calls"] = calls
    reasoning = _reasoning(m, f, where)
    if reasoning:
        if role != "assistant":
            raise TunekitError(f"{where}: a {role} message carries reasoning; only assistant messages reason")
        out["reasoning_content"] = reasoning
    if role == "tool":
        out.update(_result_link(m, where, earlier))
    return out


def _listed(value, where: str):
    if isinstance(value, str):
        value = _json(value, where)
    if not isinstance(value, list):
        raise TunekitError(f"{where} must be a list, got {type(value).__name__}")
    return enumerate(value)


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TunekitError(f"{where} is not JSON ({e.msg} at column {e.colno}): {text[:60]!r}") from None


def _call(c, where: str) -> dict:
    if not isinstance(c, dict):
        raise TunekitError(f"{where} must be an object with a function name and arguments")
    fn = c.get("function", c)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise TunekitError(f"{where} has no function name "
                           f"(expected {{\"function\": {{\"name\": ..., \"arguments\": ...}}}})")
    args = fn.get("arguments", fn.get("parameters"))
    if args is None or (isinstance(args, str) and not args.strip()):  # a function called without arguments
        args = {}
    if isinstance(args, str):
        args = _json(args, f"{where}: the arguments of {name!r}")
    if not isinstance(args, dict):
        raise TunekitError(f"{where}: the arguments of {name!r} must be a JSON object, got {type(args).__name__}")
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    if c.get("id") is not None:
        call = {"id": str(c["id"]), **call}
    return call


def _reasoning(m: dict, f, where: str) -> str:
    keys = [f.reasoning] + (["thinking"] if f.reasoning == "reasoning_content" else [])
    for key in keys:
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise TunekitError(f"{where}: {key!r} must be text, got {type(value).__name__}")
            return value
    return ""


def _result_link(m: dict, where: str, earlier: list[dict]) -> dict:
    """A tool result answers a call of the assistant message just before it (other results between allowed)."""
    k = len(earlier) - 1
    while k >= 0 and earlier[k]["role"] == "tool":
        k -= 1
    calls = earlier[k].get("tool_calls") if k >= 0 and earlier[k]["role"] == "assistant" else None
    if not calls:
        raise TunekitError(f"{where}: a tool result without a call: the assistant message before it calls no tool")
    out = {}
    call_id, name = m.get("tool_call_id"), m.get("name")
    ids = [c["id"] for c in calls if "id" in c]
    if call_id is not None:
        if ids and str(call_id) not in ids:
            raise TunekitError(f"{where}: tool_call_id {call_id!r} matches no call of the assistant message before "
                               f"it (ids: {', '.join(ids)})")
        out["tool_call_id"] = str(call_id)
    names = [c["function"]["name"] for c in calls]
    if name is not None and call_id is not None and str(call_id) in ids:
        called = calls[ids.index(str(call_id))]["function"]["name"]
        if name != called:
            raise TunekitError(f"{where}: tool_call_id {call_id!r} is the call of {called!r}, but the result's name "
                               f"is {name!r}; make the two agree")
    if name is not None:
        if name not in names:
            raise TunekitError(f"{where}: tool result for {name!r}, but the assistant message before it calls "
                               f"{', '.join(names)}")
        out["name"] = name
    elif call_id is not None and str(call_id) in ids:
        out["name"] = calls[ids.index(str(call_id))]["function"]["name"]
    elif len(set(names)) == 1:
        out["name"] = names[0]
    return out


def check_offered(messages: list[dict], schemas: list[dict] | None, where: str) -> None:
    """A call of a function the example's `tools` does not offer is refused: trained on, it teaches the model to
    call functions that do not exist. Examples without `tools` are not checked (nothing says what is offered)."""
    if not schemas:
        return
    offered = {t["function"]["name"] for t in schemas}
    for i, m in enumerate(messages):
        for c in m.get("tool_calls", []):
            if c["function"]["name"] not in offered:
                raise TunekitError(f"{where}: message {i} calls {c['function']['name']!r}, which the example's tools "
                                   f"do not offer ({', '.join(sorted(offered))}); add its schema to tools or fix "
                                   "the call")


def call_json(call: dict, sort_keys: bool = False) -> str:
    """A normalised tool call as {"name": ..., "arguments": {...}} JSON: the default rendering writes it so, and
    the contamination check compares calls by it (sort_keys: the same arguments in any order)."""
    fn = call["function"]
    return json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False, sort_keys=sort_keys)


def tools(value, where: str) -> list[dict]:
    """The tool schemas of an example: a list (or JSON text of one) of function schemas."""
    out = []
    for k, t in _listed(value, where):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TunekitError(f"{where} item {k} must be a function schema with a name "
                               "({\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}})")
        out.append({"type": "function", "function": fn})
    return out
