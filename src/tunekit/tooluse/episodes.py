"""Episodes that act: the model answers, calls tools, gets their results back as tool messages and goes on, up to
max_turns. GRPO and RLOO sample them (training.methods.rollouts), `tunekit eval` runs them greedily on held-out
prompts; both through `run`, with their own token picker. A failing call is an error result the model sees, never
a crash; tool-result tokens carry no loss (`mask`). Tools, calls and the text between turns: docs/methods.md, "GRPO
with tools: episodes that act"."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from tunekit.core.errors import TunekitError, first_line
from tunekit.tooluse.textcalls import tool_calls_in

RESERVED = ("reset", "get_reward", "reward")  # an environment's methods that are not tools


def _import(module: str, where: str):
    if os.getcwd() not in sys.path:  # the module may sit beside the recipe, as a user runs it
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module)
    except Exception as e:  # a user's module may raise anything on import
        raise TunekitError(f"{where}: cannot import {module!r} ({type(e).__name__}: {first_line(e)}); give a module "
                           "importable from the working directory or the Python path") from None


def schema(fn: Callable, where: str) -> dict:
    """The tool's JSON schema as chat templates take it, from its type hints and docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises its own DocstringParsingException / TypeHintParsingException
        raise TunekitError(f"{where}: {fn.__name__} cannot be offered as a tool ({first_line(e)}); give it type hints "
                           "on every argument and a docstring with an Args: section") from None


def load_functions(specs: list[str], section: str = "grpo") -> list[Callable]:
    """The functions grpo.tools names (`module:function`, or `module` for every public function it defines)."""
    out: list[Callable] = []
    for i, spec in enumerate(specs):
        where = f"{section}.tools[{i}]"
        module_name, _, name = spec.partition(":")
        module = _import(module_name, where)
        if name:
            fn = getattr(module, name, None)
            if not callable(fn):
                raise TunekitError(f"{where}: {module_name} has no function {name!r}")
            found = [fn]
        else:
            found = [f for n, f in inspect.getmembers(module, inspect.isfunction)
                     if f.__module__ == module.__name__ and not n.startswith("_")]
            if not found:
                raise TunekitError(f"{where}: {module_name} defines no public function to offer as a tool")
        for fn in found:
            schema(fn, where)
        out += [f for f in found if f not in out]
    return out


def load_environment(spec: str, section: str = "grpo") -> type:
    """The class grpo.environment names; it has a reset method and every public method is a valid tool."""
    where = f"{section}.environment"
    module_name, _, name = spec.partition(":")
    cls = getattr(_import(module_name, where), name, None)
    if not inspect.isclass(cls):
        raise TunekitError(f"{where}: {module_name} has no class {name!r}")
    if not callable(getattr(cls, "reset", None)):
        raise TunekitError(f"{where}: {name} has no reset(**record) method; an environment is reset from each "
                           "record before its episode (TRL's environment_factory)")
    for method in methods_of(cls):
        schema(method, f"{where} {name}.{method.__name__}")
    return cls


def methods_of(obj) -> list[Callable]:
    """An environment's (class or instance) public methods that are tools."""
    return [getattr(obj, n) for n, m in inspect.getmembers(obj, callable)
            if not n.startswith("_") and n not in RESERVED and not inspect.isclass(m)]


@dataclass(frozen=True)
class Toolkit:
    """What an episode may call, loaded once per run: the functions, the environment class, the limits."""

    functions: tuple[Callable, ...] = ()
    environment: type | None = None
    max_turns: int = 1
    timeout: float = 10.0
    output_chars: int = 2000
    section: str = "grpo"  # the recipe section its errors name

    @classmethod
    def of(cls, settings, section: str = "grpo") -> Toolkit | None:
        """The toolkit of a grpo/rloo section with tools or an environment; None without."""
        if settings is None or not settings.acts:
            return None
        env = load_environment(settings.environment, section) if settings.environment else None
        return cls(tuple(load_functions(settings.tools, section)), env, settings.max_turns, settings.tool_timeout,
                   settings.tool_output_chars, section)

    def probe(self) -> None:
        """One environment made and dropped (before weights load), so that a constructor that raises is found
        before a run starts rather than at its first sampled batch."""
        if self.environment is not None:
            self.make_environment()

    def make_environment(self):
        """A new environment; its constructor raising is one line naming the recipe key, the class and why."""
        name = self.environment.__name__
        try:
            return self.environment()
        except Exception as e:  # a user's class may raise anything
            raise TunekitError(f"{self.section}.environment: {name}() raised {type(e).__name__}: {first_line(e)}; "
                               f"an environment is made with no arguments, once per episode: fix {name}.__init__"
                               ) from None

    def schemas(self) -> list[dict]:
        """The tools' JSON schemas, as the prompt offers them."""
        tools = [*self.functions, *(methods_of(self.environment) if self.environment else [])]
        return [schema(fn, "tools") for fn in tools]

    def start(self, record: dict, where: str = "a record") -> Episode:
        """A new episode on `record` (read at `where`, "file line N"): its environment made and reset from the
        record's fields."""
        env, observation = None, None
        if self.environment is not None:
            env = self.make_environment()
            name = self.environment.__name__
            try:
                observation = env.reset(**record)
            except Exception as e:  # a user's class may raise anything
                raise TunekitError(f"{self.section}.environment: {name}.reset raised {type(e).__name__}: "
                                   f"{first_line(e)} on {where}; it takes the record's fields as keyword arguments"
                                   ) from None
            if observation is not None and not isinstance(observation, str):
                raise TunekitError(f"{self.section}.environment: {name}.reset returned {type(observation).__name__} "
                                   f"on {where}; it returns None or a text added to the prompt")
        tools = {fn.__name__: fn for fn in self.functions}
        if env is not None:
            tools.update({m.__name__: m for m in methods_of(env)})
        return Episode(tools, env, observation, self)


@dataclass
class Call:
    name: str
    arguments: object
    result: str
    ok: bool


@dataclass
class Episode:
    """One episode: the completion's tokens (model turns and tool results), the calls, the final answer."""

    tools: dict[str, Callable]
    env: object | None
    observation: str | None
    kit: Toolkit
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: a token the model sampled, 0: a tool result's token
    calls: list[Call] = field(default_factory=list)
    turns: int = 0
    answer: str = ""

    @property
    def failures(self) -> int:
        return sum(not c.ok for c in self.calls)

    def call(self, name: str, arguments) -> Call:
        """Run one call; whatever goes wrong becomes the error result the model sees."""
        fn = self.tools.get(name)
        if fn is None:
            return Call(name, arguments, _error(f"no tool named {name!r}; the tools are {', '.join(self.tools)}"),
                        False)
        if not isinstance(arguments, dict):
            return Call(name, arguments, _error(f"the arguments of {name} must be a JSON object"), False)
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return Call(name, arguments, _error(f"{name}{inspect.signature(fn)}: {e}"), False)
        box: dict = {}

        def target():
            try:
                box["value"] = fn(**arguments)
            except BaseException as e:  # a tool may raise anything; the model gets it as an error result
                box["error"] = e

        worker = threading.Thread(target=target, daemon=True)  # a call past its timeout is left to finish alone
        worker.start()
        worker.join(self.kit.timeout)
        if worker.is_alive():
            return Call(name, arguments, _error(f"{name} took longer than {self.kit.timeout:g} s"), False)
        if "error" in box:
            e = box["error"]
            return Call(name, arguments, _error(f"{name} raised {type(e).__name__}: {first_line(e)}"), False)
        return Call(name, arguments, self._cut(_text(box["value"])), True)

    def _cut(self, text: str) -> str:
        cap = self.kit.output_chars
        return text if len(text) <= cap else f"{text[:cap]}... [cut: {len(text)} characters, {cap} shown]"

    def reward(self) -> float:
        """The environment's own reward (get_reward(), or reward()) at the episode's end."""
        fn = getattr(self.env, "get_reward", None) or getattr(self.env, "reward", None)
        if not callable(fn):
            raise TunekitError(f"{type(self.env).__name__} has no get_reward() method for the environment reward")
        return fn()

    def transcript(self) -> dict:
        """What predictions.jsonl and the rewards see of the episode."""
        return {"turns": self.turns, "answer": self.answer, "tool_failures": self.failures,
                "calls": [{"name": c.name, "arguments": c.arguments, "result": c.result, "ok": c.ok}
                          for c in self.calls]}


def _error(text: str) -> str:
    return json.dumps({"error": text}, ensure_ascii=False)


def _text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class Continuation:
    """The text the chat template writes between a model turn that called tools and the next model turn: the
    rest of the assistant turn after its end-of-sequence token, the results as tool messages, the generation
    prompt. Found by rendering a conversation with and without the results (data.chattemplate.Chat)."""

    def __init__(self, chat, tokenizer):
        self.chat, self.tok = chat, tokenizer
        self.eos = tokenizer.eos_token or ""

    def text(self, calls: list[Call]) -> str:
        head = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        results = [{"role": "tool", "name": c.name, "content": c.result} for c in calls]
        before, _, _ = self.chat.adapt(head, None, "tool results")
        after, _, _ = self.chat.adapt(head + results, None, "tool results")
        base = self.chat.apply(before, None, "tool results")
        full = self.chat.apply(after, None, "tool results", gen=True)
        if not full.startswith(base):
            raise TunekitError("the chat template rewrites an assistant turn once tool results follow it, so an "
                               "episode cannot go on from what the model generated; use a template that does not")
        # the sampled turn ends at the end-of-sequence token: what the template writes after it comes first
        end = base.rfind(self.eos) + len(self.eos) if self.eos and self.eos in base else len(base)
        return base[end:] + full[len(base):]

    def ids(self, calls: list[Call]) -> list[int]:
        return self.tok(self.text(calls), add_special_tokens=False)["input_ids"]


# Generate: (the episodes' token ids so far, their indices in the batch, the turn, most new tokens) -> new ids
Generate = Callable[[list[list[int]], list[int], int, int], list[list[int]]]


def run(prompt_ids: list[list[int]], episodes: list[Episode], generate: Generate, continuation: Continuation,
        budget: int, eos_ids: set[int]) -> None:
    """Play the episodes to their end: each turn generates for the episodes still going, runs the calls of those
    that called tools and ended their turn, and appends the results (masked). `budget`: most completion tokens of
    an episode, its results included (max_completion_length, as TRL counts it)."""
    live = list(range(len(episodes)))
    turn = 0
    while live:
        lefts = [budget - len(episodes[i].ids) for i in live]
        outs = generate([prompt_ids[i] + episodes[i].ids for i in live], live, turn, max(lefts))
        going = []
        for i, out, left in zip(live, outs, lefts):
            ep, out = episodes[i], outs_cut(out, left)
            ep.ids += out
            ep.mask += [1] * len(out)
            ep.turns += 1
            text = continuation.tok.decode(out, skip_special_tokens=True)
            calls = tool_calls_in(text) if out and out[-1] in eos_ids and ep.turns < ep.kit.max_turns else []
            if not calls:
                ep.answer = _answer(text)
                continue
            done = [ep.call(name, args) for name, args in calls]
            ep.calls += done
            more = continuation.ids(done)
            if len(ep.ids) + len(more) >= budget:  # no room for the results and an answer: the episode ends here
                ep.answer = _answer(text)
                continue
            ep.ids += more
            ep.mask += [0] * len(more)
            going.append(i)
        live = going
        turn += 1


def outs_cut(out: list[int], left: int) -> list[int]:
    return out[:max(left, 0)]


_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def _answer(text: str) -> str:
    """The final answer: the last turn's text without its reasoning block."""
    return _THINK.sub("", text).strip()


def eos_ids(model, tokenizer) -> set[int]:
    """The tokens that end a model turn: the generation config's end-of-sequence ids and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def greedy(model, tokenizer, batch_size: int) -> Generate:
    """`tunekit eval`'s token picker for episodes: greedy continuations in batches, each cut after its first
    end-of-sequence token."""
    import torch

    ends = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(seqs: list[list[int]], rows: list[int], turn: int, max_new: int) -> list[list[int]]:
        out = []
        device = next(model.parameters()).device
        for k in range(0, len(seqs), batch_size):
            chunk = seqs[k:k + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(s)) + s for s in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in chunk], device=device)
            with torch.no_grad():
                new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(max_new, 1),
                                     do_sample=False, pad_token_id=pad, eos_token_id=sorted(ends))
            for row in new[:, width:].tolist():
                cut = next((i for i, t in enumerate(row) if t in ends), None)
                out.append(row[:cut + 1] if cut is not None else row)
        return out
    return generate
