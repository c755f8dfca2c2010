"""training.method: grpo -- group relative policy optimization from rewards a program checks, with TRL's
GRPOTrainer; the `grpo:` recipe section and its rewards (tunekit.evaluation.rewards).

Each prompt is answered `completions` times by sampling; every completion is scored by the recipe's rewards
(weighted sum), and the policy moves toward the completions that beat their group's mean. Prompts come from
any record with a prompt: data.format prompt (a prompt, an optional reference answer), prompt_completion,
alpaca or chat (the conversation up to its last assistant turn, which becomes the reference). They are rendered
by tunekit's renderer exactly as `tunekit eval` renders them, so what GRPO samples from is what eval generates
from. The reference model (grpo.beta > 0): the base with the adapter switched off under LoRA/QLoRA (TRL's own
path, no second copy), a frozen copy of the base under full fine-tuning.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
from typing import Literal

from pydantic import Field, model_validator

from tunekit.config.section import Section
from tunekit.core.errors import TunekitError
from tunekit.evaluation import rewards as reward_kinds
from tunekit.training.methods.base import Method, TrainerInputs, register
from tunekit.training.methods.pairs import PairBundle, split_records

log = logging.getLogger("tunekit")

# GRPOConfig.loss_type values of trl 1.16 that need no further settings
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo")
PROMPT_FORMATS = ("prompt", "prompt_completion", "alpaca", "chat")


class RewardSpec(Section):
    reward: str = Field(description="The reward's kind: " + ", ".join(reward_kinds.KINDS) + " (docs/methods.md, GRPO).")
    weight: float = Field(1.0, description="Its weight in the sum GRPO trains on.")
    name: str | None = Field(None, description="The name it is logged under (rewards/<name>/mean); default its kind.")
    pattern: str | None = Field(None, description="regex: the pattern the whole completion must match.")
    target: int | None = Field(None, ge=0, description="length: completion tokens allowed before the penalty starts "
                               "(default 0).")
    function: str | None = Field(None, description="function: `module:function`, importable from the working "
                                 "directory (needs grpo.trust_local_code: true).")


class GrpoSettings(Section):
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
    loss_type: Literal[GRPO_LOSSES] = Field(  # type: ignore[valid-type]
        "dapo", description="GRPO loss, as TRL names them: " + ", ".join(GRPO_LOSSES) + ".")
    epsilon: float = Field(0.2, gt=0, description="Clipping of the probability ratio (lower bound 1 - epsilon).")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clipping bound 1 + epsilon_high (DAPO: 0.28); "
                                       "null: epsilon.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantages divided by the rewards' spread in each group, the batch, or not at all.")
    iterations: int = Field(1, ge=1, description="Optimizer steps on each batch of completions (TRL's mu).")
    trust_local_code: bool = Field(False, description="Allow rewards of kind function (Python code of yours).")
    vllm: bool = Field(False, description="Sample with vLLM (colocated on the training GPU; pip install "
                       "'tunekit[vllm]').")

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


class Grpo(Method):
    name = "grpo"
    summary = ("group relative policy optimization: sampled completions scored by rewards a program checks "
               "(exact match, BLEU, chrF, ROUGE, a format pattern, JSON, tool calls, length, your function), "
               "TRL's GRPOTrainer")
    settings = GrpoSettings
    data_formats = PROMPT_FORMATS
    data_description = "prompts (data.format: prompt, or the prompts of prompt_completion, alpaca or chat records)"
    owned_formats = ("prompt",)
    has_reference = True
    no_grad_forwards = 1  # the reference's log-probabilities, with beta > 0 (plan_settings)
    loss_tracks_learning = False
    eval_loss_beside_generation = False  # with an eval section, evaluations score greedy answers only (prediction_step)

    def check(self, recipe) -> None:
        g, t = recipe.grpo, recipe.training
        self.check_common(recipe)  # the reference rule below holds only with a KL term, so not Method.check
        if g.beta > 0 and recipe.lora is not None and recipe.lora.init != "default":
            raise ValueError(f"grpo.beta: the reference is the base model, which lora.init={recipe.lora.init} "
                             "rewrites; use lora.init: default or grpo.beta: 0")
        if not g.rewards:
            raise ValueError("grpo.rewards: name at least one reward, e.g. [{reward: exact_match}] (docs/methods.md, GRPO)")
        seen = set()
        for i, spec in enumerate(g.rewards):
            reward_kinds.check(spec, i)
            name = reward_kinds.label(spec, i, g.rewards)
            if name in seen:
                raise ValueError(f"grpo.rewards[{i}].name: {name!r} is logged twice; give each reward its own name")
            seen.add(name)
            if spec.reward == "function" and not g.trust_local_code:
                raise ValueError(f"grpo.rewards[{i}]: a function reward runs your Python code ({spec.function}); set "
                                 "grpo.trust_local_code: true to allow it")
        if g.vllm and importlib.util.find_spec("vllm") is None:
            raise ValueError("grpo.vllm: vLLM is not installed; pip install 'tunekit[vllm]' (on a CUDA machine) or set "
                             "grpo.vllm: false")
        if (t.micro_batch_size * t.gradient_accumulation_steps) % g.completions:
            raise ValueError(f"training.micro_batch_size: GRPO batches count completions, and micro_batch_size x "
                             f"gradient_accumulation_steps ({t.micro_batch_size} x {t.gradient_accumulation_steps}) must "
                             f"be a multiple of grpo.completions ({g.completions})")

    def plan_settings(self, recipe) -> dict:
        """Sequences are prompt + completion; every completion of the optimizer step is sampled at once before
        it (TRL's generation batch: micro-batch x accumulation per process); a reference forward with beta > 0
        (the old policy's forward that grpo.iterations > 1 adds is not counted)."""
        g, t = recipe.grpo, recipe.training
        return {"seq_len": recipe.data.max_length + g.max_completion_length,
                "extra_forwards": int(g.beta > 0),
                "sampled": t.micro_batch_size * t.gradient_accumulation_steps}

    def build_data(self, recipe, tokenizer):
        return build(recipe, tokenizer)

    def trainer_config(self, args, recipe):
        from trl import GRPOConfig

        g = recipe.grpo
        kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
        # whole groups per process and eval step, as many as the micro-batch holds
        eval_batch = max(g.completions, args.per_device_train_batch_size // g.completions * g.completions)
        kwargs.update(
            per_device_eval_batch_size=eval_batch,
            num_generations=g.completions, max_completion_length=g.max_completion_length,
            temperature=g.temperature, top_p=g.top_p, beta=g.beta, loss_type=g.loss_type, epsilon=g.epsilon,
            epsilon_high=g.epsilon_high, scale_rewards=g.scale_rewards, num_iterations=g.iterations,
            reward_weights=[r.weight for r in g.rewards], remove_unused_columns=False, log_completions=False,
            use_vllm=g.vllm, vllm_mode="colocate")
        return GRPOConfig(**kwargs)

    def reference(self, recipe, precision, start_adapter) -> tuple[dict, str]:
        if recipe.grpo.beta == 0:
            return {}, "none (grpo.beta: 0)"
        if recipe.full_finetuning:
            from tunekit.models import loading as models

            ref = models.load_base(recipe.model, precision.dtype).eval().requires_grad_(False)
            return {"ref_model": ref}, f"a frozen copy of the base model ({precision.name})"
        if start_adapter is not None:
            return ({"reference_is_base": False},
                    f"the base with the starting adapter (a frozen copy of {start_adapter})")
        return {"reference_is_base": True}, "the base with the adapter switched off (no second copy)"

    def make_trainer(self, inputs: TrainerInputs):
        recipe, g = inputs.recipe, inputs.recipe.grpo
        ref_args, reference = self.reference(recipe, inputs.precision, inputs.start_adapter)
        scorers = reward_kinds.build(g.rewards, g.max_completion_length)
        log.info("grpo: %d completions per prompt, up to %d tokens, temperature %g, top_p %g, loss %s, beta %g; "
                 "rewards: %s; reference: %s", g.completions, g.max_completion_length, g.temperature, g.top_p,
                 g.loss_type, g.beta, ", ".join(f"{r.__name__} x {s.weight:g}" for r, s in zip(scorers, g.rewards)),
                 reference)
        trainer = trainer_class()(
            model=inputs.model, reward_funcs=scorers, args=inputs.args, train_dataset=inputs.data.train,
            eval_dataset=inputs.data.eval, processing_class=inputs.tokenizer, callbacks=inputs.callbacks,
            generation_eval=inputs.generation_eval, add_special_tokens=inputs.data.add_special_tokens, **ref_args)
        return trainer, trainer.tokens

    def scores(self, recipe, tokenizer, records, rendered, predictions):
        g = recipe.grpo
        scorers = reward_kinds.build(g.rewards, g.max_completion_length)
        raw = {r.where: r.values for r in records}
        samples = [reward_kinds.Sample(r.prompt, p, r.reference or "",
                                       len(tokenizer(p, add_special_tokens=False)["input_ids"]), raw.get(r.where, {}),
                                       r.where) for r, p in zip(rendered, predictions)]
        return reward_kinds.mean_scores(scorers, [s.weight for s in g.rewards], samples)


@dataclasses.dataclass
class PromptBundle(PairBundle):
    """train / eval: datasets of prompt, reference, where, record (the raw record as JSON text)."""

    add_special_tokens: bool = True  # whether tokenizing a prompt adds BOS etc. (False: the chat template wrote them)


def prompt_rows(records: list, renderer, tokenizer, max_length: int):
    """(rows, DataStats, add_special_tokens): each record's prompt as `tunekit eval` renders it, its reference
    answer, where it came from and the raw record; a prompt of max_length tokens or more is dropped."""
    from tunekit.data.records import DataStats

    rows, stats, special = [], DataStats(), True
    for record in records:
        rendered = renderer.render(record)
        special = rendered.add_special_tokens
        tokens = len(tokenizer(rendered.prompt, add_special_tokens=special)["input_ids"])
        if tokens >= max_length:
            stats.dropped_no_target += 1
            continue
        stats.examples += 1
        stats.tokens += tokens
        rows.append({"prompt": rendered.prompt, "reference": rendered.reference or "", "where": record.where,
                     "record": json.dumps(record.values, ensure_ascii=False, default=str)})
    if not rows:
        raise TunekitError(f"no usable prompts: every prompt fills data.max_length={max_length}")
    return rows, stats, special


def build(recipe, tokenizer) -> PromptBundle:
    import datasets

    from tunekit.data import mixture

    cfg = recipe.data
    renderer = mixture.Renderers(cfg, tokenizer)
    records, held, facts, report = split_records(recipe)
    rows, stats, special = prompt_rows(records, renderer, tokenizer, cfg.max_length)
    log.info("train prompts: %d, %d prompt tokens; %d dropped (the prompt alone fills data.max_length=%d)",
             stats.examples, stats.tokens, stats.dropped_no_target, cfg.max_length)
    bundle = PromptBundle(datasets.Dataset.from_list(rows), None, stats, None, renderer.template, facts, report, special)
    if held:
        rows, bundle.eval_stats, _ = prompt_rows(held, renderer, tokenizer, cfg.max_length)
        bundle.eval = datasets.Dataset.from_list(rows)
    return bundle


@functools.cache
def trainer_class():
    """GrpoTrainer, built on first use (imports TRL)."""
    from unittest import mock

    from trl import GRPOTrainer
    from trl.trainer import grpo_trainer

    from tunekit.data.records import CountingCollator
    from tunekit.training import sampling
    from tunekit.training.methods.pairs import BaseReference
    from tunekit.training.trainer import GenerationEval, SafeState

    class GrpoTrainer(SafeState, GenerationEval, BaseReference, GRPOTrainer):
        """GRPOTrainer with tunekit's checkpoints and generation metrics, sampling from the prompts as tunekit
        renders them (already templated text, tokenized as `tunekit eval` tokenizes it) with seeded sampling;
        the reference chosen as for DPO (pairs.BaseReference)."""

        def __init__(self, *args, add_special_tokens: bool = True, ref_model=None, **kwargs):
            self.add_special_tokens = add_special_tokens
            self.tokens = CountingCollator(None)  # its counters only: real and computed tokens sampled
            if ref_model is None:
                super().__init__(*args, **kwargs)
                return
            # Full fine-tuning with a KL term: TRL loads the reference again from the policy's hub name, which a
            # model loaded from a GGUF file or a local build has not; hand it the copy tunekit loaded instead.
            with mock.patch.object(grpo_trainer, "create_model_from_path", lambda *a, **k: ref_model):
                super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:  # prompts and completions, as the throughput counts them
                masks = [out["prompt_mask"], out["completion_mask"]]
                self.tokens.real += int(sum(m.sum() for m in masks))
                self.tokens.computed += sum(m.numel() for m in masks)
            return out

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            if self.use_vllm or self.use_transformers_continuous_batching or images or multimodal_fields:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            return sampling.generate(self, prompt_ids), None

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            if self.generation_eval is None:
                return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            # the held-out prompts are scored by their greedy answers' rewards (evaluation.DuringTraining); TRL's
            # pass would sample grpo.completions answers per prompt again, for a loss that says little
            return None, None, None

        def _tokenize_prompts(self, prompts: list):
            # TRL tokenizes text prompts with the tokenizer's special tokens; a chat template has written them
            ids = self.processing_class(text=prompts, add_special_tokens=self.add_special_tokens)["input_ids"]
            return ids, None, {}

    GrpoTrainer.__module__, GrpoTrainer.__qualname__ = __name__, "GrpoTrainer"
    return GrpoTrainer


def __getattr__(name: str):
    if name == "GrpoTrainer":  # `from tunekit.training.methods.grpo import GrpoTrainer` builds it (imports TRL)
        return trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register(Grpo())
