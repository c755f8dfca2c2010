"""Tool calls read from a model's text whatever the chat template's markup, and nothing read where there is none."""

from __future__ import annotations

import json

from tunekit.tooluse.textcalls import tool_calls_in

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'


def test_tool_calls_are_found_whatever_the_markup():
    weather = ("get_weather", {"city": "Oslo", "unit": "celsius"})
    assert tool_calls_in(CALL) == [weather]
    # Mistral's list after [TOOL_CALLS], Llama 3.1's "parameters", bare JSON after prose, OpenAI's layout
    # with arguments as JSON text, a code fence
    assert tool_calls_in('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", '
                         '"unit": "celsius"}}, {"name": "f", "arguments": {}}]') == [weather, ("f", {})]
    assert tool_calls_in('Sure. {"name": "get_weather", "parameters": {"unit": "celsius", "city": "Oslo"}}') \
        == [("get_weather", {"unit": "celsius", "city": "Oslo"})]
    openai = {"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
    assert tool_calls_in(json.dumps([openai])) == [weather]
    assert tool_calls_in('```json\n{"name": "f", "arguments": {"x": [1, 2]}}\n```') == [("f", {"x": [1, 2]})]
    # no call: broken JSON, an object without arguments, plain text, a reasoning block
    assert tool_calls_in('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"\n'
                         '</tool_call>') == []
    assert tool_calls_in('{"name": "Oslo"} and [1, 2]') == []
    assert tool_calls_in("<think>\nThe user wants {weather}.\n</think>\n\nIt is sunny.") == []
