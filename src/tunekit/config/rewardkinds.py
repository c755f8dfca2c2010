"""The reward kinds a GRPO recipe may name (grpo.rewards), declared: names, the spec keys each needs, whether it
scores against the reference answer, a summary; and the rules on one grpo.rewards entry. The scoring lives in
tunekit.evaluation.rewards, which registers against these names."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tunekit.config import metrickinds


@dataclass(frozen=True)
class RewardKind:
    name: str
    summary: str
    needs: tuple[str, ...] = ()  # spec keys it requires
    reference: bool = False  # scores against the reference answer
    optional: tuple[str, ...] = ()  # spec keys it reads when given
    episode: bool = False  # scores an episode with tools (grpo.tools / grpo.environment)

    @property
    def reads(self) -> tuple[str, ...]:
        return self.needs + self.optional


def _metric_kinds() -> list[RewardKind]:
    """Every score key of the text metrics but tool_calls (its own kind below), divided by 100."""
    return [RewardKind(key, f"{label} of the completion against the reference answer, / 100", reference=True)
            for m in metrickinds.DECLARED.values() if m.scored and m.name != "tool_calls" for key, label in m.rows]


DECLARED: dict[str, RewardKind] = {k.name: k for k in (
    *_metric_kinds(),
    RewardKind("tool_calls", "the tool_calls metric on one completion: when the reference calls tools, the mean of "
               "parsed, right functions and right arguments (1/3 each); when it calls none, 1 unless the completion "
               "calls one", reference=True),
    RewardKind("regex", "1 when the whole completion (stripped) matches `pattern` (Python re), else 0",
               needs=("pattern",)),
    RewardKind("json", "1 when the completion (stripped, a ``` fence removed) is one JSON value, else 0"),
    RewardKind("length", "a length penalty: 0 up to `target` completion tokens, then falling linearly to -1 at "
               "grpo.max_completion_length", optional=("target",)),
    RewardKind("function", "your Python function `module:function` (grpo.trust_local_code: true), called with "
               "keywords prompt, completion, reference, record, tokens; returns a number", needs=("function",)),
    RewardKind("task_success", "episodes with tools: 1 when the final answer holds the expected answer (the record's "
               "`field`, default the reference answer; case, spacing and thousands separators ignored, a number found "
               "only whole: 6 is not in -6 or 16), else 0", optional=("field",),
               episode=True),
    RewardKind("tool_success", "episodes with tools: the share of the episode's tool calls that returned a result "
               "rather than an error; 0 when it called none", episode=True),
    RewardKind("turns", "episodes with tools: the model turns the episode took / max_turns (0..1; give it a negative "
               "weight to prefer short episodes)", episode=True),
    RewardKind("environment", "episodes with an environment: its get_reward() at the episode's end", episode=True),
    RewardKind("model", "the score a reward model (a finished run of training.method: reward, `run`) gives the "
               "prompt and completion", needs=("run",)),
)}


def declare(spec: RewardKind) -> RewardKind:
    """Declare one more reward kind (a plugin's declare(): tunekit.config.plugins)."""
    if spec.name in DECLARED:
        raise ValueError(f"reward kind {spec.name!r} is declared twice")
    DECLARED[spec.name] = spec
    return spec


SETTINGS = ("pattern", "target", "function", "run", "field")  # the spec keys only some kinds read


def names() -> str:
    return ", ".join(DECLARED)


def needing_reference(specs, section: str = "grpo") -> list[str]:
    """`grpo.rewards[i] (kind)` of each reward that scores against the reference answer."""
    return [f"{section}.rewards[{i}] ({s.reward})" for i, s in enumerate(specs) if DECLARED[s.reward].reference]


def check(spec, index: int, section: str = "grpo") -> None:
    """One grpo.rewards (or rloo.rewards) entry; raises ValueError with a one-line message."""
    where = f"{section}.rewards[{index}]"
    if spec.reward not in DECLARED:
        raise ValueError(f"{where}.reward: unknown reward {spec.reward!r}; choose from {names()}")
    for key in DECLARED[spec.reward].needs:
        if getattr(spec, key) is None:
            raise ValueError(f"{where}.{key}: reward {spec.reward} needs it")
    for key in SETTINGS:
        if getattr(spec, key) is not None and key not in DECLARED[spec.reward].reads:
            raise ValueError(f"{where}.{key}: reward {spec.reward} does not read it; remove it (or choose the reward "
                             "that does)")
    if spec.pattern is not None:
        try:
            re.compile(spec.pattern)
        except re.error as e:
            raise ValueError(f"{where}.pattern: not a regular expression ({e})") from None
    if spec.function is not None and not re.fullmatch(r"[\w.]+:\w+", spec.function):
        raise ValueError(f"{where}.function: {spec.function!r} is not module:function")


def label(spec, index: int, specs) -> str:
    """The name a reward is logged under: its `name`, else its kind or its function's name (with its position
    when that repeats)."""
    if spec.name:
        return spec.name
    kind = spec.function.partition(":")[2] if spec.reward == "function" else spec.reward
    repeats = sum(label(s, 0, ()) == kind for s in specs if not s.name) > 1
    return f"{kind}_{index}" if repeats else kind
