"""Episodes with tools (tooluse.episodes): tools loaded with their schemas or refused in one line, calls run with
a timeout and an output cap, every failure an error result the model sees, results rendered by the chat template
and masked, turns bounded; played with a scripted model so every path is known."""

from __future__ import annotations

import json

import pytest

from conftest import importable
from tunekit.config.methodsettings import GrpoSettings
from tunekit.core.errors import TunekitError
from tunekit.data.chattemplate import Chat
from tunekit.evaluation import rewards
from tunekit.evaluation.rewards import Sample
from tunekit.tooluse import episodes

TOOLS = '''
import time

TABLE = {"oslo": 7, "lima": 19}


def lookup(city: str) -> int:
    """The temperature in a city.

    Args:
        city: the city, lower case
    """
    return TABLE[city]


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: first
        b: second
    """
    return a + b


def slow(x: int) -> int:
    """Takes its time.

    Args:
        x: anything
    """
    time.sleep(5)
    return x


def long(n: int) -> str:
    """A long text.

    Args:
        n: its length
    """
    return "x" * n


def untyped(x):
    """No hints.

    Args:
        x: anything
    """
    return x


class Counter:
    def reset(self, start: int = 0, **record):
        self.n = start
        return f" (the counter starts at {start})" if start else None

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much
        """
        self.n += by
        return self.n

    def get_reward(self) -> float:
        return float(self.n)


class NoReset:
    def bump(self, by: int) -> int:
        """Add.

        Args:
            by: how much
        """
        return by
'''


@pytest.fixture
def tools_module(tmp_path, monkeypatch):
    yield from importable(tmp_path, monkeypatch, "mytools", TOOLS)


def settings(**kw) -> GrpoSettings:
    return GrpoSettings(rewards=[{"reward": "task_success"}], trust_local_code=True, **kw)


@pytest.mark.parametrize("kw, message", [
    ({"tools": ["nosuchmodule:f"]}, r"grpo.tools\[0\]: cannot import 'nosuchmodule' \(ModuleNotFoundError"),
    ({"tools": ["mytools:nothere"]}, r"grpo.tools\[0\]: mytools has no function 'nothere'"),
    ({"tools": ["mytools:untyped"]}, r"grpo.tools\[0\]: untyped cannot be offered as a tool \(.*\); give it type "
                                     r"hints"),
    ({"environment": "mytools:NoReset"}, r"grpo.environment: NoReset has no reset\(\*\*record\) method"),
    ({"environment": "mytools:Missing"}, r"grpo.environment: mytools has no class 'Missing'"),
])
def test_bad_tools_are_refused_in_one_line(tools_module, kw, message):
    with pytest.raises(TunekitError, match=message) as e:
        episodes.Toolkit.of(settings(**kw))
    assert "\n" not in str(e.value)


def test_a_module_offers_its_public_functions_with_their_schemas(tools_module):
    kit = episodes.Toolkit.of(settings(tools=["mytools:lookup", "mytools:add"], environment="mytools:Counter"))
    names = [s["function"]["name"] for s in kit.schemas()]
    assert names == ["lookup", "add", "bump"]
    lookup = kit.schemas()[0]["function"]
    assert lookup["parameters"]["properties"]["city"] == {"type": "string", "description": "the city, lower case"}
    assert episodes.Toolkit.of(settings(max_turns=2)) is None  # no tools, no environment: plain completions


def test_every_failure_is_an_error_result_never_a_crash(tools_module):
    kit = episodes.Toolkit.of(settings(tools=["mytools:lookup", "mytools:add", "mytools:slow", "mytools:long"],
                                       tool_timeout=0.2, tool_output_chars=20))
    ep = kit.start({})
    ok = ep.call("lookup", {"city": "oslo"})
    assert (ok.result, ok.ok) == ("7", True)
    cases = {
        ("lookup", json.dumps({"city": "paris"})): "lookup raised KeyError: 'paris'",
        ("nope", "{}"): "no tool named 'nope'; the tools are lookup, add, slow, long",
        ("add", json.dumps({"a": 1})): "add(a: int, b: int) -> int: missing a required argument: 'b'",
        ("add", json.dumps([1, 2])): "the arguments of add must be a JSON object",
        ("slow", json.dumps({"x": 1})): "slow took longer than 0.2 s",
    }
    for (name, args), error in cases.items():
        call = ep.call(name, json.loads(args))
        assert not call.ok and json.loads(call.result) == {"error": error}
    assert ep.call("long", {"n": 50}).result == "x" * 20 + "... [cut: 50 characters, 20 shown]"
    assert ep.failures == 0  # calls count once the episode records them (episodes.run)


def test_an_environment_is_reset_from_its_record_per_episode(tools_module):
    kit = episodes.Toolkit.of(settings(environment="mytools:Counter"))
    a, b = kit.start({"start": 5, "question": "q"}), kit.start({"question": "q"})
    assert a.observation == " (the counter starts at 5)" and b.observation is None
    a.call("bump", {"by": 2})
    assert (a.reward(), b.reward()) == (7.0, 0.0)  # one instance per episode


def script(tokenizer, turns: dict[int, str]):
    """A model that answers turn t with turns[t] (then its end-of-turn token), whatever it is shown."""
    seen = []

    def generate(seqs, rows, turn, max_new):
        seen.append((list(rows), turn, [tokenizer.decode(s) for s in seqs]))
        ids = tokenizer(turns[turn], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return [ids[:max_new] for _ in seqs]
    return generate, seen


CALL = '<tool_call>\n{"name": "lookup", "arguments": {"city": "lima"}}\n</tool_call>'


def test_an_episode_calls_gets_the_result_as_a_tool_turn_and_answers(tools_module, tiny_tokenizer):
    tok = tiny_tokenizer
    kit = episodes.Toolkit.of(settings(tools=["mytools:lookup"], max_turns=3))
    eps = [kit.start({}), kit.start({})]
    prompt = tok.apply_chat_template([{"role": "user", "content": "How warm is Lima?"}], tokenize=False,
                                     add_generation_prompt=True)
    prompt_ids = [tok(prompt, add_special_tokens=False)["input_ids"]] * 2
    generate, seen = script(tok, {0: CALL, 1: "It is 19 degrees."})
    cont = episodes.Continuation(Chat(tok, "all", True), tok)
    episodes.run(prompt_ids, eps, generate, cont, budget=200, eos_ids={tok.eos_token_id})
    for ep in eps:
        assert (ep.turns, ep.answer, [c.result for c in ep.calls]) == (2, "It is 19 degrees.", ["19"])
        text = tok.decode(ep.ids)
        # the template's own rendering of a tool message (this ChatML writes any role), then its generation prompt
        assert text == (CALL + "<|im_end|>\n<|im_start|>tool\n19<|im_end|>\n"
                        "<|im_start|>assistant\nIt is 19 degrees.<|im_end|>")
        model_ids = [t for t, m in zip(ep.ids, ep.mask) if m]
        assert tok.decode(model_ids) == CALL + "<|im_end|>" + "It is 19 degrees.<|im_end|>"
    assert [(rows, turn) for rows, turn, _ in seen] == [([0, 1], 0), ([0, 1], 1)]
    assert seen[1][2][0] == prompt + tok.decode(eps[0].ids[:-len(tok("It is 19 degrees.")["input_ids"]) - 1])


def test_turns_and_budget_bound_an_episode(tools_module, tiny_tokenizer):
    tok = tiny_tokenizer
    kit = episodes.Toolkit.of(settings(tools=["mytools:lookup"], max_turns=2))
    generate, _ = script(tok, {0: CALL, 1: CALL})
    cont = episodes.Continuation(Chat(tok, "all", True), tok)
    ep = kit.start({})
    episodes.run([[1, 2]], [ep], generate, cont, budget=500, eos_ids={tok.eos_token_id})
    assert ep.turns == 2 and len(ep.calls) == 1  # the last turn's call is its answer, not run
    small = kit.start({})
    episodes.run([[1, 2]], [small], generate, cont, budget=len(tok(CALL)["input_ids"]) + 3,
                 eos_ids={tok.eos_token_id})
    assert small.turns == 1 and 0 not in small.mask  # no room for the result: the episode ends at its call


@pytest.mark.parametrize("expected, answer, holds", [
    ("3,345.46", "2633 GBP is 3345.46 USD.", True),     # thousands separators aside
    ("3345.46", "That is 3,345.46 USD", True),
    ("128.35", "151 EUR is about 1,28.35 GBP.", False),  # a garbled group is not joined
    ("6°C", "Krakow: -6°C and foggy.", False),          # a number is found only whole
    ("86°F", "Lisbon: 186°F", False),
    ("1,292.18", "1469 USD is 1292.18000000001 CHF.", False),
    ("128.35", "It comes to 128.35.", True),             # a full stop after it
    ("Paris", "It is PARIS, of course", True),
])
def test_task_success_compares_numbers_whole_and_by_value(tools_module, expected, answer, holds):
    (scorer,) = rewards.build(GrpoSettings(rewards=[{"reward": "task_success"}]).rewards, 64)
    ep = episodes.Toolkit.of(settings(tools=["mytools:lookup"])).start({})
    ep.answer = answer
    assert scorer.score(Sample("p", answer, expected, 5, {}, "f line 1", ep)) == float(holds)


def test_episode_rewards_score_the_transcript(tools_module):
    kit = episodes.Toolkit.of(settings(tools=["mytools:lookup"], environment="mytools:Counter", max_turns=4))
    ep = kit.start({"start": 1})
    ep.calls += [ep.call("lookup", {"city": "oslo"}), ep.call("lookup", {"city": "rome"}), ep.call("bump", {"by": 2})]
    ep.turns, ep.answer = 3, "It is 7  Degrees."
    specs = GrpoSettings(rewards=[{"reward": "task_success"}, {"reward": "task_success", "field": "want",
                                                                 "name": "want"},
                                  {"reward": "tool_success"}, {"reward": "turns"}, {"reward": "environment"}]).rewards
    scorers = rewards.build(specs, 64)
    sample = Sample("p", ep.answer, "7 degrees", 5, {"want": "8"}, "f line 1", ep)
    assert [r.score(sample) for r in scorers] == [1.0, 0.0, pytest.approx(2 / 3), 0.75, 3.0]
    with pytest.raises(TunekitError, match="no episode to score; this reward scores episodes with tools"):
        scorers[2].score(Sample("p", "a", "r", 1, {}, "f line 1"))
