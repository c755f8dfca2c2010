"""Rewards a program checks, for GRPO and RLOO, as a registry: each scores one completion. A recipe names them in
grpo.rewards, each with a weight; the run logs each one's mean and spread, and `tunekit eval` scores held-out
generations with them. Each kind is declared in tunekit.config.rewardkinds (its name, the keys it needs, the
recipe checks) and its scoring registered here under that name. No model code. The kinds: docs/methods.md, "GRPO:
rewards a program checks"."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from tunekit.config import methods, plugins
from tunekit.config.rewardkinds import DECLARED, label
from tunekit.core.errors import TunekitError
from tunekit.evaluation import metrics, rewardmodel


@dataclasses.dataclass(frozen=True)
class Sample:
    """One completion as a reward sees it."""

    prompt: str
    completion: str
    reference: str  # the record's reference answer ("" when it has none)
    tokens: int  # completion tokens
    record: dict  # the raw record
    where: str  # "file line N"
    episode: Any = None  # tooluse.episodes.Episode when the completion is an episode with tools


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[Any, int], Callable[[Sample], float]]  # (spec, max_completion_length) -> score of one sample
    reference: bool  # scores against the reference answer (config.rewardkinds)


KINDS: dict[str, Kind] = {}


def register(name: str):
    """Register how a declared reward kind (config.rewardkinds) scores a sample."""
    if name not in DECLARED:
        raise ValueError(f"reward {name!r} is not declared in tunekit.config.rewardkinds")
    if name in KINDS:
        raise ValueError(f"reward {name!r} is registered twice")

    def add(make):
        KINDS[name] = Kind(name, make, DECLARED[name].reference)
        return make
    return add


# ---------------------------------------------------------------- the metrics registry's scores

def _metric_kind(metric: metrics.Metric, key: str) -> None:
    def make(spec, max_len):
        return lambda s: metric.score([s.completion], [s.reference])[key] / 100.0
    register(key)(make)


for _metric in metrics.METRICS.values():
    if _metric.score is not None and _metric.name != "tool_calls":
        for _key, _ in _metric.rows:
            if _key in DECLARED:  # a plugin's metric is a reward kind only where the plugin declares one
                _metric_kind(_metric, _key)


@register("tool_calls")
def _tool_calls(spec, max_len):
    def score(s: Sample) -> float:
        got = metrics.tool_calls([s.completion], [s.reference])
        if got["tool_call_valid_json"] is None:
            return 1.0 - got["tool_call_spurious"] / 100.0
        return (got["tool_call_valid_json"] + got["tool_call_name"] + got["tool_call_args"]) / 300.0
    return score


@register("regex")
def _regex(spec, max_len):
    pattern = re.compile(spec.pattern, re.DOTALL)
    return lambda s: float(pattern.fullmatch(s.completion.strip()) is not None)


_FENCE = re.compile(r"^```[\w-]*\n(.*)\n```$", re.DOTALL)


@register("json")
def _json(spec, max_len):
    def score(s: Sample) -> float:
        text = s.completion.strip()
        fenced = _FENCE.match(text)
        try:
            json.loads(fenced.group(1) if fenced else text)
        except ValueError:
            return 0.0
        return 1.0
    return score


@register("length")
def _length(spec, max_len):
    target = spec.target or 0
    return lambda s: -min(1.0, max(0, s.tokens - target) / max(1, max_len - target))


@register("function")
def _function(spec, max_len):
    module, _, name = spec.function.partition(":")
    if os.getcwd() not in sys.path:  # `module` may sit beside the recipe, as a user runs it
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise TunekitError(f"cannot load {spec.function!r} ({e}); give module:function importable from the "
                           "working directory or the Python path") from None
    params = inspect.signature(fn).parameters
    takes_episode = "episode" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def call(s: Sample):
        more = {"episode": s.episode.transcript() if s.episode is not None else None} if takes_episode else {}
        return fn(prompt=s.prompt, completion=s.completion, reference=s.reference, record=s.record, tokens=s.tokens,
                  **more)
    return call


# ---------------------------------------------------------------- episodes with tools (tooluse.episodes)

def _episode(s: Sample):
    if s.episode is None:
        raise TunekitError(f"{s.where}: no episode to score; this reward scores episodes with tools (grpo.tools or "
                           "grpo.environment)")
    return s.episode


# A number written with thousands separators ("3,345.46") is the same value as without: only well-formed groups
# are joined, so a garbled "1,28.35" stays what it is.
_GROUPED = re.compile(r"(?<![\d,.])\d{1,3}(?:,\d{3})+(?![\d,])")


def _normalized(text: str) -> str:
    return _GROUPED.sub(lambda m: m.group(0).replace(",", ""), " ".join(text.lower().split()))


def _holds(expected: str, answer: str) -> bool:
    """`expected` in `answer`, case, spacing and thousands separators aside; an expected number is found only
    whole: "6°C" not in "-6°C", "86" not in "186" or "86.5"."""
    want = _normalized(expected)
    left = r"(?<![\d\-])(?<!\d[.,])" if want[:1].isdigit() else ""
    right = r"(?!\d)(?![.,]\d)" if want[-1:].isdigit() else ""
    return re.search(left + re.escape(want) + right, _normalized(answer)) is not None


@register("task_success")
def _task_success(spec, max_len):
    def score(s: Sample) -> float:
        _episode(s)
        expected = s.record.get(spec.field) if spec.field else s.reference
        if expected is None or str(expected).strip() == "":
            what = f"field {spec.field!r}" if spec.field else "reference answer"
            raise TunekitError(f"{s.where} has no {what} to check the final answer against")
        return float(_holds(str(expected), s.completion))
    return score


@register("tool_success")
def _tool_success(spec, max_len):
    def score(s: Sample) -> float:
        calls = _episode(s).calls
        return sum(c.ok for c in calls) / len(calls) if calls else 0.0
    return score


@register("turns")
def _turns(spec, max_len):
    return lambda s: _episode(s).turns / _episode(s).kit.max_turns


@register("environment")
def _environment(spec, max_len):
    return lambda s: _episode(s).reward()


_REWARD_MODELS: dict[Path, rewardmodel.ModelReward] = {}  # one loaded copy of each reward model in a process


@register("model")
def _model(spec, max_len):
    run_dir = rewardmodel.reward_run(spec.run).resolve()
    model = _REWARD_MODELS.setdefault(run_dir, rewardmodel.ModelReward(run_dir))
    return lambda s: model(s.prompt, s.completion)


def check_loadable(specs, max_completion_length: int, section: str = "grpo") -> None:
    """Every reward can be made: a `function` reward's module imports and has the function (before any weight
    loads, where a run would otherwise fail at its first sampled batch)."""
    build(specs, max_completion_length, section)


# ---------------------------------------------------------------- scoring

class Reward:
    """One recipe reward as TRL's GRPOTrainer calls it: a batch of completions in, one float each out. A reward
    that raises, or returns anything but a finite number, stops the run in one line naming it and the example."""

    def __init__(self, spec, index: int, specs, max_completion_length: int, section: str = "grpo"):
        self.__name__ = label(spec, index, specs)  # TRL logs rewards/<__name__>/mean and /std
        self.title = f"{section}.rewards[{index}] ({self.__name__})"
        self.kind = KINDS[spec.reward]
        try:
            self.one = self.kind.make(spec, max_completion_length)
        except TunekitError as e:
            raise TunekitError(f"{self.title}: {e}") from None

    def score(self, sample: Sample) -> float:
        if self.kind.reference and not sample.reference:
            raise TunekitError(f"{self.title}: {sample.where} has no reference answer to score against; give one "
                               "(data.fields.answer for data.format: prompt) or use a reward without a reference")
        try:
            value = self.one(sample)
        except TunekitError:
            raise
        except Exception as e:  # a user's function may raise anything
            raise TunekitError(f"{self.title}: raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                               f"on {sample.where}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TunekitError(f"{self.title}: returned {value!r} on {sample.where}; a reward returns a finite number")
        return float(value)

    def __call__(self, prompts, completions, completion_ids=None, reference=None, where=None, record=None,
                 episode=None, **_):
        n = len(completions)
        episode = episode or [None] * n
        return [self.score(Sample(prompts[i], episode[i].answer if episode[i] else completions[i],
                                  (reference or [""] * n)[i], _tokens(completion_ids, episode, i),
                                  json.loads(record[i]) if record else {}, (where or ["?"] * n)[i], episode[i]))
                for i in range(n)]


def _tokens(completion_ids, episodes, i: int) -> int:
    """Completion tokens the model sampled (an episode's tool results left out)."""
    if episodes[i] is not None:
        return sum(episodes[i].mask)
    return len(completion_ids[i]) if completion_ids is not None else 0


def build(specs, max_completion_length: int, section: str = "grpo") -> list[Reward]:
    """The rewards of the recipe section `section` (grpo, rloo), named by it in their errors."""
    return [Reward(spec, i, specs, max_completion_length, section) for i, spec in enumerate(specs)]


def held_out(recipe, tokenizer, records: list, rendered: list, predictions: list[str],
             episodes: list | None = None) -> tuple[dict, list[dict]]:
    """The recipe's rewards (grpo.rewards) on held-out generations, beside the metrics: mean_scores, and what each
    prediction adds to its row in predictions.jsonl; `rendered` (data.rendering.Rendered) are the records'
    renderings the predictions answer. Nothing for a recipe without rewards."""
    section, g = methods.sampled(recipe)
    if g is None:
        return {}, [{} for _ in predictions]
    scorers = build(g.rewards, g.max_completion_length, section)
    raw = {r.where: r.values for r in records}
    episodes = episodes or [None] * len(predictions)
    samples = [Sample(r.prompt, p, r.reference or "", len(tokenizer(p, add_special_tokens=False)["input_ids"]),
                      raw.get(r.where, {}), r.where, e) for r, p, e in zip(rendered, predictions, episodes)]
    return mean_scores(scorers, [s.weight for s in g.rewards], samples)


def mean_scores(rewards: list[Reward], weights: list[float], samples: list[Sample]) -> tuple[dict, list[dict]]:
    """({reward: mean, reward/<name>: mean}, per-sample {name: value}) of held-out completions: the weighted sum
    as GRPO trains on it, and each reward alone."""
    per = [{r.__name__: r.score(s) for r in rewards} for s in samples]
    for row in per:
        row["reward"] = sum(w * row[r.__name__] for r, w in zip(rewards, weights))
    n = max(len(per), 1)
    scores = {"reward": sum(row["reward"] for row in per) / n}
    scores.update({f"reward/{r.__name__}": sum(row[r.__name__] for row in per) / n for r in rewards})
    return scores, per


plugins.run("register_rewards")  # installed plugins' implementations (config.plugins)
