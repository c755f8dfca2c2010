"""The registry of the training methods' implementations and the Method base class (tunekit.training.methods
re-exports them; see there). What the recipe must know of a method is declared in tunekit.config.methods."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from tunekit.config.methods import DECLARED, MethodSpec
from tunekit.core.errors import TunekitError


@dataclass
class TrainerInputs:
    """What the training runner (tunekit.training.runner) has built when a method makes its trainer."""

    recipe: Any  # config.schema.Recipe
    model: Any
    args: Any  # the method's config (Method.trainer_config)
    data: Any  # what Method.build_data returned: .train, .eval, .train_stats, .eval_stats, .template, .split,
    # .contamination
    tokenizer: Any
    precision: Any  # core.hardware.Precision
    packed: bool  # batches packed (Method.packs and the model supports it)
    attention: str  # the model's attention implementation
    start_adapter: Any = None  # model.adapter_from's adapter directory, when the run continues one
    callbacks: list = field(default_factory=list)
    generation_eval: Any = None  # evaluation.evaluator.DuringTraining, or None


class Method:
    """One training method's implementation. Declare the method in tunekit.config.methods, subclass this in a
    module of this package with the same `name`, override the stages that differ, and `register` an instance
    (docs/adding-a-method.md). The declared facts (summary, settings, data_formats, has_reference, ...) read
    as attributes of the method."""

    name: ClassVar[str]

    @property
    def spec(self) -> MethodSpec:
        """The method's declaration (config.methods)."""
        return DECLARED[self.name]

    def __getattr__(self, attr: str) -> Any:
        """The declared facts (config.methods.MethodSpec), read as the method's own."""
        if attr.startswith("_") or attr in ("name", "spec"):
            raise AttributeError(attr)
        return getattr(self.spec, attr)

    def check(self, recipe, model: str) -> None:
        """What the method checks before any weight loads, beyond the recipe rules (`model`: what the verb asks of
        the models, as data.precheck.check takes it)."""

    # ------------------------------------------------------------ training stages

    def build_data(self, recipe, tokenizer):
        """The tokenized train/eval data sets (with .train, .eval, .train_stats, .eval_stats, .template, and
        .split and .contamination: the held-out split's and the contamination report's facts for run.json,
        from tunekit.data.split and tunekit.data.contamination)."""
        raise NotImplementedError

    def trainer_class(self) -> type:
        """The method's trainer, a top-level class of training.trainers (imported here: it imports torch and TRL)."""
        raise NotImplementedError

    def trainer_config(self, args, recipe):
        """The Trainer's arguments as this method's trainer takes them (a TRL config, say)."""
        return args

    def reference(self, recipe, precision, start_adapter) -> tuple[dict, str]:
        """The trainer's reference-model arguments and how the run output names the reference."""
        return {}, "none (the loss has no reference model)"

    def make_trainer(self, inputs: TrainerInputs):
        """(trainer, counting collator) for the run."""
        raise NotImplementedError

    # ------------------------------------------------------------ evaluation

    def measures(self, model, tokenizer, recipe, records: list, limit: int | None, batch_size: int) -> dict:
        """Scores beside the generation metrics in `tunekit eval` (preference accuracy, implicit rewards), as
        evaluation computes them for the method (evaluation.preference.method_measures)."""
        from tunekit.evaluation.preference import method_measures

        return method_measures(model, tokenizer, recipe, records, limit, batch_size)

    def scores(self, recipe, tokenizer, records: list, rendered: list,
               predictions: list[str]) -> tuple[dict, list[dict]]:
        """Scores of held-out generations beside the metrics (GRPO's rewards: evaluation.rewards.held_out)."""
        from tunekit.evaluation.rewards import held_out

        return held_out(recipe, tokenizer, records, rendered, predictions)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a declared method's implementation to the registry (its module calls this at import)."""
    if method.name not in DECLARED:
        raise ValueError(f"training method {method.name!r} is not declared in tunekit.config.methods")
    if method.name in METHODS:
        raise ValueError(f"training method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def names() -> str:
    return ", ".join(METHODS)


def get(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise TunekitError(f"training.method: unknown method {name!r}; registered: {names()}") from None


def of(recipe) -> Method:
    """The recipe's training method."""
    return get(recipe.training.method)
