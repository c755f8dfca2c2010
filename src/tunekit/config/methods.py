"""The training methods a recipe may name (training.method), declared: what the schema and the recipe rules
must know of each (its summary, its recipe section, the data formats it trains on or owns, which settings
apply to it). The trainers live in tunekit.training.methods and register against these names;
docs/adding-a-method.md shows both halves."""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.config import dataformats
from tunekit.config.methodsettings import (
    DistillSettings,
    DpoSettings,
    GrpoSettings,
    KtoSettings,
    MethodSettings,
    OrpoSettings,
    RewardSettings,
    RlooSettings,
    SampledSettings,
)

PAIRS = "(prompt, chosen, rejected) pairs"
PAIR_FORMATS = ("preference",)  # the data formats holding such pairs


@dataclass(frozen=True)
class MethodSpec:
    name: str
    summary: str  # one sentence for the recipe reference's training.method
    settings: type[MethodSettings] | None = None  # its recipe section, named `name` (None: no section)
    old_sections: tuple[str, ...] = ()  # earlier names of that section, still read with a note
    data_formats: tuple[str, ...] | None = None  # data.format values it trains on; None: any format no other
    #                                              method owns
    data_description: str = ""  # what those formats hold, for error messages
    owned_formats: tuple[str, ...] = ()  # formats of its data_formats no other method trains on
    has_reference: bool = False  # the loss compares the policy with a reference model
    reference_switch: str | None = None  # the section's setting whose 0 leaves the reference out (grpo.beta)
    chunked_loss: bool = False  # training.chunked_loss applies (tunekit's own loss path)
    packs: bool = False  # data.packing applies (examples packed padding-free)
    groups_by_length: bool = False  # training.group_by_length applies (the Trainer's length sampler)
    prompt_loss_optional: bool = False  # data.mask_prompt: false applies (else answers only, always)
    # evaluations during training log eval_loss beside an eval section's generation metrics (metric_for_best)
    eval_loss_beside_generation: bool = True
    # training.learning_rate: auto applies: the training loss falls as the model learns (not so for a policy
    # gradient's loss), so a range test over it finds a rate
    loss_tracks_learning: bool = True
    # `tunekit eval` on preference pairs adds the implicit reward's measures (beta x log-ratio to the base: the
    # section's beta, else TRL's default) beside preference accuracy (evaluation.preference)
    implicit_reward: bool = False
    # the training step, for `tunekit plan`: sequences per example (chosen and rejected in one batch) and
    # no-grad forwards over the batch (a reference model, a KL batch)
    sequences: int = 1
    no_grad_forwards: int = 0
    # the model ends in a one-number score head (AutoModelForSequenceClassification, num_labels 1) instead of the
    # language-model head: it scores sequences and generates nothing (a reward model)
    score_head: bool = False
    # what its evaluations during training log beside eval_loss, generating nothing (a score head's held-out pair
    # accuracy and mean margin, chosen minus rejected score; greater is better)
    eval_measures: tuple[str, ...] = ()
    # trains a vision-language model on records with images (data.images; models.vision)
    images: bool = False
    # training.parallelism applies: tunekit's own loss sums over sequence shards and split layers
    splits_work: bool = False
    # what its loss learns from the difference between a pair's chosen and rejected answers: a pair whose two answers
    # are the same is refused, naming its line (it carries no signal); empty where the loss has more to it
    learns_from_difference: str = ""

    @property
    def section(self) -> str | None:
        """The recipe section holding the method's settings."""
        return self.name if self.settings is not None else None

    def settings_of(self, recipe) -> MethodSettings | None:
        return getattr(recipe, self.section) if self.section else None

    def plan_settings(self, recipe) -> dict:
        """The training step's shape for `tunekit plan` (fields of plan.estimate.Settings)."""
        shape = {"sequences": self.sequences, "extra_forwards": self.no_grad_forwards}
        settings = self.settings_of(recipe)
        return {**shape, **(settings.step_shape(recipe) if settings is not None else {})}

    def trains_on(self, data_format: str) -> bool:
        return self.data_formats is None or data_format in self.data_formats


DECLARED: dict[str, MethodSpec] = {}
DEFAULT = "sft"  # training.method when a recipe names none


def declare(spec: MethodSpec) -> MethodSpec:
    """Add a method to the declarations (before the recipe schema is built: tunekit.config.trainingschema and
    tunekit.config.schema)."""
    if spec.name in DECLARED:
        raise ValueError(f"training method {spec.name!r} is declared twice")
    unknown = [f for f in (*(spec.data_formats or ()), *spec.owned_formats) if f not in dataformats.DECLARED]
    if unknown:
        raise ValueError(f"training method {spec.name!r} names data format {unknown[0]!r}, which is not declared "
                         "in tunekit.config.dataformats")
    for other in DECLARED.values():
        if other.section is not None and other.section in (spec.section, *spec.old_sections):
            raise ValueError(f"recipe section {other.section!r} of {spec.name!r} belongs to {other.name!r}")
    DECLARED[spec.name] = spec
    return spec


def spec_of(recipe) -> MethodSpec:
    """The recipe's training method, as declared (its implementation: tunekit.training.methods.of)."""
    return DECLARED[recipe.training.method]


def renamed_sections(raw: dict) -> list[tuple[str, str]]:
    """(old, new) for each method section the raw recipe spells by an earlier name."""
    return [(old, m.section) for m in DECLARED.values() for old in m.old_sections if old in raw]


# The built-in methods, in the order the recipe reference lists them.
declare(MethodSpec(
    "sft", "supervised fine-tuning on answers",
    chunked_loss=True, packs=True, groups_by_length=True, prompt_loss_optional=True, implicit_reward=True,
    images=True, splits_work=True))
declare(MethodSpec(
    "dpo", "direct preference optimization on (prompt, chosen, rejected) pairs (data.format: preference) "
    "with TRL's DPOTrainer",
    settings=DpoSettings, old_sections=("preference",), data_formats=PAIR_FORMATS, data_description=PAIRS,
    has_reference=True, implicit_reward=True,
    sequences=2, no_grad_forwards=1))  # chosen and rejected in one batch; the reference
declare(MethodSpec(
    "kto", "Kahneman-Tversky optimization on completions labelled desirable or not (data.format: "
    "unpaired_preference), TRL's KTOTrainer",
    settings=KtoSettings, data_formats=("unpaired_preference",),
    data_description="(prompt, completion, desirable or not) examples", owned_formats=("unpaired_preference",),
    has_reference=True, no_grad_forwards=3))  # its KL batch, the reference and the reference's KL
declare(MethodSpec(
    "orpo", "odds-ratio preference optimization on the same pairs as dpo, SFT and preference in one loss "
    "without a reference model, TRL's ORPOTrainer",
    settings=OrpoSettings, data_formats=PAIR_FORMATS, data_description=PAIRS, sequences=2))
declare(MethodSpec(
    "reward", "a reward model: the base with a one-number score head, trained on (prompt, chosen, rejected) pairs "
    "(data.format: preference) to score the chosen answer above the rejected one, TRL's RewardTrainer; "
    "grpo.rewards scores completions with it ({reward: model, run: RUN})",
    settings=RewardSettings, data_formats=PAIR_FORMATS, data_description=PAIRS, score_head=True,
    eval_measures=("accuracy", "margin"), learns_from_difference="the difference between their scores",
    sequences=2))  # chosen and rejected in one batch
declare(MethodSpec(
    "grpo", "group relative policy optimization: sampled completions scored by rewards a program checks "
    "(exact match, BLEU, chrF, ROUGE, a format pattern, JSON, tool calls, length, your function), "
    "TRL's GRPOTrainer",
    settings=GrpoSettings, data_formats=("prompt", "prompt_completion", "alpaca", "chat"),
    data_description="prompts (data.format: prompt, or the prompts of prompt_completion, alpaca or chat records)",
    owned_formats=("prompt",), has_reference=True, reference_switch="beta", loss_tracks_learning=False,
    eval_loss_beside_generation=False, no_grad_forwards=1))  # the reference, with grpo.beta > 0 (step_shape)
declare(MethodSpec(
    "rloo", "REINFORCE leave-one-out: grpo's sampled completions and rewards, each completion's advantage its reward "
    "minus the mean of the others in its group, TRL's RLOOTrainer",
    settings=RlooSettings, data_formats=("prompt", "prompt_completion", "alpaca", "chat"),
    data_description="prompts (data.format: prompt, or the prompts of prompt_completion, alpaca or chat records)",
    has_reference=True, reference_switch="beta", loss_tracks_learning=False,
    eval_loss_beside_generation=False, no_grad_forwards=1))  # the reference, with rloo.beta > 0 (step_shape)
declare(MethodSpec(
    "distill", "distillation: the student trained to match a teacher's next-token distributions (distill.teacher) on "
    "the data's answers, on its own sampled answers, or both, with a divergence beside an optional SFT loss",
    settings=DistillSettings, data_formats=("prompt", "prompt_completion", "alpaca", "chat"),
    data_description="prompts with or without answers (data.format: prompt for on-policy distillation, else "
    "prompt_completion, alpaca or chat)",
    loss_tracks_learning=False))  # the teacher's forward is counted from the teacher's size (plan.estimate)


def sampled(recipe) -> tuple[str, SampledSettings] | tuple[None, None]:
    """(section name, settings) of a recipe whose method samples completions scored by rewards (grpo, rloo);
    (None, None) for any other."""
    for name, spec in DECLARED.items():
        settings = getattr(recipe, spec.section, None) if spec.section else None
        if isinstance(settings, SampledSettings) and name == recipe.training.method:
            return spec.section, settings
    return None, None

