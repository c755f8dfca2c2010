"""The registry of training methods and the Method base class (tunekit.training.methods re-exports them; see there)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel

from tunekit.core.errors import TunekitError


@dataclass
class TrainerInputs:
    """What `train.prepare` has built when a method makes its trainer."""

    recipe: Any  # recipe.Recipe
    model: Any
    args: Any  # the method's config (Method.trainer_config)
    data: Any  # what Method.build_data returned: .train, .eval, .train_stats, .eval_stats, .template, .split,
    # .contamination
    tokenizer: Any
    precision: Any  # hardware.Precision
    packed: bool  # batches packed (Method.packs and the model supports it)
    attention: str  # the model's attention implementation
    start_adapter: Any = None  # model.adapter_from's adapter directory, when the run continues one
    callbacks: list = field(default_factory=list)
    generation_eval: Any = None  # evaluation.DuringTraining, or None


class Method:
    """One training method. Subclass it in a module of this package, set the facts below, override the
    stages that differ, and `register` an instance (docs/adding-a-method.md)."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one sentence for the recipe reference's training.method
    settings: ClassVar[type[BaseModel] | None] = None  # its recipe section, named `name` (None: no section)
    old_sections: ClassVar[tuple[str, ...]] = ()  # earlier names of that section, still read with a note
    data_formats: ClassVar[tuple[str, ...] | None] = None  # data.format values it trains on; None: any format
    #                                                        no other method owns
    data_description: ClassVar[str] = ""  # what those formats hold, for error messages
    owned_formats: ClassVar[tuple[str, ...]] = ()  # formats of its data_formats no other method trains on
    has_reference: ClassVar[bool] = False  # the loss compares the policy with a reference model
    # the training step, for `tunekit plan`: sequences per example (chosen and rejected in one batch) and
    # no-grad forwards over the batch (a reference model, a KL batch)
    sequences: ClassVar[int] = 1
    no_grad_forwards: ClassVar[int] = 0
    chunked_loss: ClassVar[bool] = False  # training.chunked_loss applies (tunekit's own loss path)
    packs: ClassVar[bool] = False  # data.packing applies (examples packed padding-free)
    groups_by_length: ClassVar[bool] = False  # training.group_by_length applies (the Trainer's length sampler)
    prompt_loss_optional: ClassVar[bool] = False  # data.mask_prompt: false applies (else answers only, always)
    # evaluations during training log eval_loss beside an eval section's generation metrics (metric_for_best)
    eval_loss_beside_generation: ClassVar[bool] = True
    # training.learning_rate: auto applies: the training loss falls as the model learns (not so for a policy
    # gradient's loss), so a range test over it finds a rate
    loss_tracks_learning: ClassVar[bool] = True

    @property
    def section(self) -> str | None:
        """The recipe section holding the method's settings."""
        return self.name if self.settings is not None else None

    def settings_of(self, recipe) -> BaseModel | None:
        return getattr(recipe, self.section) if self.section else None

    def trains_on(self, data_format: str) -> bool:
        return self.data_formats is None or data_format in self.data_formats

    # ------------------------------------------------------------ recipe checks

    def check(self, recipe) -> None:
        """Rules of this method on a validated recipe; raise ValueError with a one-line message."""
        self.check_common(recipe)
        if self.has_reference and recipe.lora is not None and recipe.lora.init != "default":
            raise ValueError(f"training.method: {self.name} takes the base model as its reference, which lora.init="
                             f"{recipe.lora.init} rewrites; use lora.init: default")

    def check_common(self, recipe) -> None:
        """The rules every method keeps, whatever else its `check` replaces."""
        self.check_formats(recipe)
        self.check_learning_rate(recipe)
        self.check_settings_apply(recipe)

    def check_settings_apply(self, recipe) -> None:
        """A setting this method's trainer would not use is refused, not ignored (training.chunked_loss, on by
        default and written into every run's recipe.yaml, is documented as SFT's instead)."""
        t, d = recipe.training, recipe.data
        unused = [
            (t.group_by_length and not self.groups_by_length, "training.group_by_length", "samples in its own order"),
            (d.packing is True and not self.packs, "data.packing: true", "pads its batches"),
            (not d.mask_prompt and not self.prompt_loss_optional, "data.mask_prompt: false", "trains the answers only"),
        ]
        for hit, key, why in unused:
            if hit:
                raise ValueError(f"{key} does not apply to training.method: {self.name}, which {why}; remove it")

    def check_learning_rate(self, recipe) -> None:
        if recipe.training.learning_rate == "auto" and not self.loss_tracks_learning:
            raise ValueError(f"training.learning_rate: auto runs a range test on the training loss, which "
                             f"training.method: {self.name} does not lower as it learns; set a rate, e.g. 1e-5")

    def check_formats(self, recipe) -> None:
        """Every data source's format is one this method trains on."""
        wrong = [f for f in recipe.data.formats() if self.data_formats is not None and f not in self.data_formats]
        if wrong:
            raise ValueError(f"training.method: {self.name} trains on {self.data_description}; set data.format "
                             f"(and each source's format): {' or '.join(self.data_formats)} (got {wrong[0]})")

    def plan_settings(self, recipe) -> dict:
        """The training step's shape for `tunekit plan` (fields of plan.estimate.Settings)."""
        return {"sequences": self.sequences, "extra_forwards": self.no_grad_forwards}

    # ------------------------------------------------------------ training stages

    def build_data(self, recipe, tokenizer):
        """The tokenized train/eval data sets (with .train, .eval, .train_stats, .eval_stats, .template, and
        .split and .contamination: the held-out split's and the contamination report's facts for run.json,
        from tunekit.data.split and tunekit.data.contamination)."""
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
        """Scores beside the generation metrics in `tunekit eval` (preference accuracy, rewards, ...)."""
        return {}

    def scores(self, recipe, tokenizer, records: list, rendered: list, predictions: list[str]) -> tuple[dict, list[dict]]:
        """Scores of held-out generations beside the metrics (GRPO's rewards), and what each prediction adds to its
        row in predictions.jsonl; `rendered` (data.Rendered) are the records' renderings the predictions answer."""
        return {}, [{} for _ in predictions]


METHODS: dict[str, Method] = {}
DEFAULT = "sft"  # training.method when a recipe names none


def register(method: Method) -> Method:
    """Add a method to the registry (its module calls this at import)."""
    if method.name in METHODS:
        raise ValueError(f"training method {method.name!r} is registered twice")
    for other in METHODS.values():
        if other.section is not None and other.section in (method.section, *method.old_sections):
            raise ValueError(f"recipe section {other.section!r} of {method.name!r} belongs to {other.name!r}")
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


def check_others(recipe) -> None:
    """No section or data format that belongs to another method than the recipe's. Raises ValueError."""
    chosen = recipe.training.method
    for other in METHODS.values():
        if other.name == chosen:
            continue
        if other.section is not None and getattr(recipe, other.section) is not None:
            raise ValueError(f"{other.section}: these settings belong to training.method {other.name}; set "
                             f"training.method: {other.name} or remove the {other.section} section")
        for fmt in recipe.data.formats():
            if fmt in other.owned_formats:
                raise ValueError(f"data.format: {fmt} is training data for training.method {other.name}; "
                                 f"set training.method: {other.name} or use another format")


def check(recipe) -> None:
    """The recipe's method's own rules; its section takes its defaults when left out. Raises ValueError."""
    method = get(recipe.training.method)
    if method.section is not None and getattr(recipe, method.section) is None:
        object.__setattr__(recipe, method.section, method.settings())  # the recipe is frozen
    method.check(recipe)


def renamed_sections(raw: dict) -> list[tuple[str, str]]:
    """(old, new) for each method section the raw recipe spells by an earlier name."""
    return [(old, m.section) for m in METHODS.values() for old in m.old_sections if old in raw]
