"""The training methods' recipe sections (dpo:, kto:, orpo:, grpo:), each named after its method and declared
with it in tunekit.config.methods; the methods' trainers (tunekit.training.methods) read them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tunekit.config import rewardkinds
from tunekit.config.section import Section

DEFAULT_BETA = 0.1  # TRL's default beta: the implicit reward's scale when the recipe sets none


class MethodSettings(Section):
    """A training method's recipe section."""

    def step_shape(self, recipe) -> dict:
        """What the method's training step adds to its declared shape for `tunekit plan` (fields of
        plan.estimate.Settings); nothing unless a setting changes it."""
        return {}

# ---------------------------------------------------------------- dpo

# DPO losses TRL's DPOTrainer implements (trl 1.16, DPOConfig.loss_type)
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft")
SMOOTHED = ("robust", "exo_pair", "aot", "aot_unpaired")  # the losses that read label_smoothing (trl 1.16)


class DpoSettings(MethodSettings):
    beta: float = Field(DEFAULT_BETA, gt=0, description="DPO: how far the policy may move from the reference "
                        "(higher: closer to it). For loss_type ipo, the regularization strength.")
    loss_type: Literal[DPO_LOSSES] = Field(  # type: ignore[valid-type]
        "sigmoid", description="DPO loss, as TRL names them: " + ", ".join(DPO_LOSSES) + ".")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="DPO: assumed probability that a pair's "
                                   "preference is flipped; TRL reads it in the losses " + ", ".join(SMOOTHED) + ".")

    @model_validator(mode="after")
    def _smoothing_where_read(self):
        if self.label_smoothing and self.loss_type not in SMOOTHED:
            raise ValueError(f"dpo.label_smoothing applies to loss_type {', '.join(SMOOTHED)}; TRL's "
                             f"{self.loss_type} loss takes none: set one of those or remove label_smoothing")
        return self


# ---------------------------------------------------------------- kto

KTO_LOSSES = ("kto", "apo_zero_unpaired")
KL_LOSSES = ("kto",)  # the losses that estimate a KL term from the other examples of a micro-batch


class KtoSettings(MethodSettings):
    beta: float = Field(DEFAULT_BETA, gt=0, description="KTO: how far the policy may move from the reference "
                        "(higher: closer).")
    loss_type: Literal[KTO_LOSSES] = Field(  # type: ignore[valid-type]
        "kto", description="KTO loss, as TRL names them: kto (with the KL estimate from mismatched completions in "
        "each micro-batch, which needs micro_batch_size >= 2) or apo_zero_unpaired.")
    desirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the desirable examples' loss (to balance "
                                    "unequal numbers of desirable and undesirable examples).")
    undesirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the undesirable examples' loss.")


# ---------------------------------------------------------------- orpo

class OrpoSettings(MethodSettings):
    beta: float = Field(DEFAULT_BETA, gt=0, description="ORPO: weight of the odds-ratio term added to the chosen "
                        "answers' SFT loss (lambda in the paper; TRL's beta). There is no reference model.")


# ---------------------------------------------------------------- reward

class RewardSettings(MethodSettings):
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="Reward model: weight of a penalty on the squared mean of each pair's two scores, "
        "which keeps the scores centred on 0 (TRL's RewardConfig; 0.01 is its recommendation); null: none.")


# ---------------------------------------------------------------- grpo

# GRPOConfig.loss_type values of trl 1.16 that need no further settings
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo")


class RewardSpec(Section):
    reward: str = Field(description="The reward's kind: " + rewardkinds.names() + " (docs/methods.md, GRPO).")
    weight: float = Field(1.0, description="Its weight in the sum GRPO trains on.")
    name: str | None = Field(None, description="The name it is logged under (rewards/<name>/mean); default its kind.")
    pattern: str | None = Field(None, description="regex: the pattern the whole completion must match.")
    target: int | None = Field(None, ge=0, description="length: completion tokens allowed before the penalty starts "
                               "(default 0).")
    field: str | None = Field(None, description="task_success: the record field holding the expected answer "
                              "(default: the reference answer).")
    function: str | None = Field(None, description="function: `module:function`, importable from the working "
                                 "directory (needs grpo.trust_local_code: true).")
    run: str | None = Field(None, description="model: the run directory of a finished reward model run "
                            "(training.method: reward) whose score the completion earns.")


class SampledSettings(MethodSettings):
    """What GRPO and RLOO share: completions sampled per prompt, scored by the recipe's rewards
    (tunekit.evaluation.rewards), a KL term toward the base with beta > 0."""

    rewards: list[RewardSpec] = Field(default_factory=list, description="What a completion earns: a list of "
                                      "{reward, weight, ...} (docs/methods.md, GRPO has the table); at least one.")
    completions: int = Field(4, ge=2, description="Completions sampled per prompt (a group). training."
                             "micro_batch_size x gradient_accumulation_steps counts completions and must be a "
                             "multiple of it.")
    max_completion_length: int = Field(128, ge=1, description="Most tokens a sampled completion may have.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens holding this "
                         "much probability.")
    beta: float = Field(0.0, ge=0, description="KL coefficient toward the reference (the base model); 0 (TRL's "
                        "default) computes no reference at all.")
    epsilon: float = Field(0.2, gt=0, description="Clipping of the probability ratio (lower bound 1 - epsilon).")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clipping bound 1 + epsilon_high (DAPO: 0.28); "
                                       "null: epsilon.")
    iterations: int = Field(1, ge=1, description="Optimizer steps on each batch of completions (TRL's mu).")
    trust_local_code: bool = Field(False, description="Allow Python code of yours: rewards of kind function, tools, "
                                   "an environment.")
    tools: list[str] = Field(default_factory=list, description="Functions the model may call while it answers: "
                             "`module:function`, or `module` for every public function the module defines (needs "
                             "trust_local_code: true). Each needs type hints and a docstring: its JSON schema, shown "
                             "to the model, is made from them. docs/methods.md, GRPO with tools.")
    environment: str | None = Field(None, description="`module:Class`: one instance per sampled answer, reset from "
                                    "its record (the record's fields as keywords; a returned text is added to the "
                                    "prompt), its public methods the tools, its optional get_reward() a reward (TRL's "
                                    "environment_factory). Needs trust_local_code: true.")
    max_turns: int = Field(4, ge=1, description="With tools: most model turns of one episode (each turn that calls "
                           "a tool gets the results back as tool messages and goes on).")
    tool_timeout: float = Field(10.0, gt=0, description="With tools: seconds one call may take; past it the model "
                                "gets an error result.")
    tool_output_chars: int = Field(2000, ge=16, description="With tools: characters of one result the model sees; "
                                   "the rest is cut, with a note saying so.")
    vllm: bool = Field(False, description="Sample with vLLM (colocated on the training GPU; pip install "
                       "'tunekit[vllm]').")

    @property
    def acts(self) -> bool:
        """Episodes call tools (grpo.tools or grpo.environment)."""
        return bool(self.tools or self.environment)

    def step_shape(self, recipe) -> dict:
        """Sequences are prompt + completion (with tools, the episode: every turn and tool result counts in
        max_completion_length, as TRL counts them); every completion of the optimizer step is sampled at once before
        it (TRL's generation batch: micro-batch x accumulation per process); a reference forward with beta > 0
        (the old policy's forward that iterations > 1 adds is not counted)."""
        t = recipe.training
        return {"seq_len": recipe.data.max_length + self.max_completion_length, "extra_forwards": int(self.beta > 0),
                "sampled": t.micro_batch_size * t.gradient_accumulation_steps,
                "sample_turns": self.max_turns if self.acts else 1}


class GrpoSettings(SampledSettings):
    loss_type: Literal[GRPO_LOSSES] = Field(  # type: ignore[valid-type]
        "dapo", description="GRPO loss, as TRL names them: " + ", ".join(GRPO_LOSSES) + ".")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantages divided by the rewards' spread in each group, the batch, or not at all.")

    @model_validator(mode="after")
    def _clipping_where_read(self):
        """TRL's cispo caps the ratio at epsilon_high itself (recommended 5.0; with the null default it would take
        epsilon, 0.2, and scale every update down about five times); cispo and sapo do not read epsilon."""
        if self.loss_type == "cispo" and self.epsilon_high is None:
            raise ValueError("grpo.epsilon_high: loss_type cispo caps the probability ratio at epsilon_high (not "
                             "1 + epsilon_high); set it, e.g. 5.0 (TRL's recommendation)")
        if self.loss_type in ("cispo", "sapo") and self.epsilon != GrpoSettings.model_fields["epsilon"].default:
            raise ValueError(f"grpo.epsilon: loss_type {self.loss_type} does not clip by it; remove it")
        if self.loss_type == "sapo" and self.epsilon_high is not None:
            raise ValueError("grpo.epsilon_high: loss_type sapo does not clip by it; remove it")
        return self


# ---------------------------------------------------------------- rloo

class RlooSettings(SampledSettings):
    """RLOO reads GRPO's sampling and reward settings; its advantage is each completion's reward minus the mean of
    the other completions of its group (no loss_type, no scale_rewards)."""

    beta: float = Field(0.05, ge=0, description="KL coefficient toward the reference (the base model), added to the "
                        "reward as RLOO does (TRL's default 0.05); 0 computes no reference at all.")
    normalize_advantages: bool = Field(False, description="Scale the advantages to mean 0 and spread 1 over each "
                                       "batch of completions.")


# ---------------------------------------------------------------- distill

# What the student is trained to match the teacher by, per trained position (GKD's generalized JSD, Agarwal et al.
# 2024, eq. 1): forward_kl = KL(teacher || student), reverse_kl = KL(student || teacher), jsd its mixture form.
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
DISTILL_MODES = ("off_policy", "on_policy", "mixed")


class DistillSettings(MethodSettings):
    teacher: str | None = Field(None, description="The teacher: a hub name, a local model directory, or the "
                                "output_dir of a tunekit run (its adapter on its base, or its full or merged "
                                "weights). It must share the student's vocabulary, checked before weights load.")
    mode: Literal[DISTILL_MODES] = Field(  # type: ignore[valid-type]
        "off_policy", description="off_policy: match the teacher on the data's answers; on_policy: on answers the "
        "student samples itself (the data's answers are never read: prompts suffice, data.format: prompt); mixed: "
        "each example drawn (seeded) on-policy with on_policy_fraction, else off-policy.")
    on_policy_fraction: float = Field(0.5, gt=0, lt=1, description="mixed: the share of examples answered by the "
                                      "student's own samples.")
    temperature: float = Field(1.0, gt=0, description="Softens both distributions before the divergence; on-policy "
                               "answers are sampled at it too.")
    divergence: Literal[DIVERGENCES] = Field(  # type: ignore[valid-type]
        "jsd", description="forward_kl (the teacher's mass everywhere the student has little: mode-covering), "
        "reverse_kl (the student's mass only where the teacher has it: mode-seeking), or jsd, the generalized "
        "Jensen-Shannon divergence between them (GKD's default: bounded, weighted by jsd_beta).")
    jsd_beta: float = Field(0.5, gt=0, lt=1, description="jsd: weight of the teacher in the mixture (toward 0 it "
                            "behaves like forward_kl, toward 1 like reverse_kl).")
    sft_weight: float = Field(0.0, ge=0, description="Weight of the plain SFT loss on the data's answers, added to "
                              "the divergence (off-policy examples only; needs answers in the data).")
    top_k: int | None = Field(None, ge=1, description="Keep the teacher's k most likely tokens at each position and "
                              "compare both distributions renormalised over them (less memory for a large "
                              "vocabulary); null: the whole vocabulary.")
    max_completion_length: int = Field(128, ge=1, description="on_policy / mixed: most tokens of a sampled answer.")
    top_p: float = Field(1.0, gt=0, le=1, description="on_policy / mixed: nucleus sampling of the student's answers.")
    teacher_4bit: bool = Field(False, description="Load the teacher quantized to 4 bits (NF4, as QLoRA loads a base; "
                               "bitsandbytes on a GPU); else in the run's compute dtype.")
    teacher_placement: Literal["sharded", "replicated"] = Field(
        "sharded", description="Under ZeRO-3 or FSDP: shard the teacher across the processes as the student is "
                               "(its memory divided, a gather per forward) or keep a whole copy in each (no "
                               "gathers). Elsewhere every process holds a whole copy.")

    @model_validator(mode="after")
    def _beta_where_read(self):
        """jsd_beta weighs the JSD's mixture; forward_kl and reverse_kl do not read it. Refused when it differs
        from its default (which every run's recipe.yaml writes)."""
        if self.divergence != "jsd" and self.jsd_beta != DistillSettings.model_fields["jsd_beta"].default:
            raise ValueError(f"distill.jsd_beta applies to distill.divergence: jsd; {self.divergence} does not read "
                             "it: set distill.divergence: jsd or remove jsd_beta")
        return self

    @property
    def samples(self) -> bool:
        """Some examples are answered by the student's own samples."""
        return self.mode != "off_policy"

    def step_shape(self, recipe) -> dict:
        """With sampling: sequences are prompt + sampled answer, sampled before the step's forward; the teacher's
        forward is counted by the plan from the teacher's own size (plan.estimate)."""
        if not self.samples:
            return {}
        t = recipe.training
        share = 1.0 if self.mode == "on_policy" else self.on_policy_fraction
        return {"seq_len": recipe.data.max_length + self.max_completion_length,
                "sampled": max(1, round(t.micro_batch_size * t.gradient_accumulation_steps * share))}
