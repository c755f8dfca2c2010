"""What the methods that sample completions and score them by the recipe's rewards share (training.method grpo,
rloo): the prompts as tunekit renders them, the rewards (tunekit.evaluation.rewards), TRL's config settings both
trainers read, the reference model, and a trainer mixin with tunekit's seeded sampling, token counts and
held-out rewards in place of TRL's evaluation pass (training.trainers.rollouts). Each method module adds its own
TRL config and reference."""

from __future__ import annotations

import dataclasses
import json
import logging

from tunekit.config.methodsettings import RewardSpec, SampledSettings
from tunekit.core.errors import TunekitError
from tunekit.evaluation import rewards
from tunekit.training.methods.base import Method, TrainerInputs
from tunekit.training.methods.pairs import PairBundle, split_records

log = logging.getLogger("tunekit")


def scorers_of(specs: list[RewardSpec], max_completion_length: int, section: str = "grpo") -> list:
    """The recipe's rewards as TRL's GRPOTrainer and RLOOTrainer call them (evaluation.rewards.Reward), named by
    their section in errors."""
    return rewards.build(specs, max_completion_length, section)


def config_kwargs(args, g: SampledSettings) -> dict:
    """The Trainer's arguments plus the sampling settings GRPOConfig and RLOOConfig both read."""
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    # whole groups per process and eval step, as many as the micro-batch holds
    eval_batch = max(g.completions, args.per_device_train_batch_size // g.completions * g.completions)
    kwargs.update(
        per_device_eval_batch_size=eval_batch,
        num_generations=g.completions, max_completion_length=g.max_completion_length,
        temperature=g.temperature, top_p=g.top_p, beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
        num_iterations=g.iterations, reward_weights=[r.weight for r in g.rewards], remove_unused_columns=False,
        log_completions=False, use_vllm=g.vllm, vllm_mode="colocate")
    return kwargs


def log_start(name: str, g: SampledSettings, scorers: list, reference: str, more: str = "") -> None:
    log.info("%s: %d completions per prompt, up to %d tokens, temperature %g, top_p %g%s, beta %g; rewards: %s; "
             "reference: %s", name, g.completions, g.max_completion_length, g.temperature, g.top_p, more, g.beta,
             ", ".join(f"{r.__name__} x {s.weight:g}" for r, s in zip(scorers, g.rewards)), reference)


def frozen_base(recipe, precision) -> tuple[dict, str]:
    """Full fine-tuning with a KL term: a frozen copy of the base as the reference."""
    from tunekit.models import loader

    ref = loader.load_base(recipe.model, precision.dtype).eval().requires_grad_(False)
    return {"ref_model": ref}, f"a frozen copy of the base model ({precision.name})"


@dataclasses.dataclass
class PromptBundle(PairBundle):
    """train / eval: datasets of prompt, reference, where, record (the raw record as JSON text)."""

    add_special_tokens: bool = True  # whether tokenizing a prompt adds BOS etc. (False: the chat template wrote them)
    renderer: object = None  # data.mixture.Renderers that rendered the prompts (an episode's observation re-renders)
    toolkit: object = None  # tooluse.episodes.Toolkit with grpo.tools / grpo.environment, else None


def prompt_rows(records: list, renderer, tokenizer, max_length: int):
    """(rows, DataStats, add_special_tokens): each record's prompt as `tunekit eval` renders it, its reference
    answer, where it came from and the raw record; a prompt of max_length tokens or more is dropped."""
    from tunekit.data.tokenizing import DataStats

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

    from tunekit.config import methods
    from tunekit.data import mixture
    from tunekit.tooluse.episodes import Toolkit

    cfg = recipe.data
    section, settings = methods.sampled(recipe)
    toolkit = Toolkit.of(settings, section)
    renderer = mixture.Renderers(cfg, tokenizer, tools=toolkit.schemas() if toolkit else None)
    records, held, facts, report = split_records(recipe)
    rows, stats, special = prompt_rows(records, renderer, tokenizer, cfg.max_length)
    log.info("train prompts: %d, %d prompt tokens; %d dropped (the prompt alone fills data.max_length=%d)",
             stats.examples, stats.tokens, stats.dropped_no_target, cfg.max_length)
    bundle = PromptBundle(datasets.Dataset.from_list(rows), None, stats, None, renderer.template, facts,
                          report, special, renderer, toolkit)
    if toolkit is not None:
        log.info("tools: %s; up to %d turns, %g s and %d characters a call", ", ".join(
            t["function"]["name"] for t in toolkit.schemas()), toolkit.max_turns, toolkit.timeout, toolkit.output_chars)
    if held:
        rows, bundle.eval_stats, _ = prompt_rows(held, renderer, tokenizer, cfg.max_length)
        bundle.eval = datasets.Dataset.from_list(rows)
    return bundle


class SampledMethod(Method):
    """A method that samples completions and learns from their rewards (grpo, rloo): its prompts built by `build`,
    its trainer made from the same inputs; each names its trainer, TRL config and reference."""

    def build_data(self, recipe, tokenizer):
        return build(recipe, tokenizer)

    def log_more(self, g: SampledSettings) -> str:
        """What the start line says beyond the settings both methods read."""
        return ""

    def make_trainer(self, inputs: TrainerInputs):
        g = self.settings_of(inputs.recipe)
        ref_args, reference = self.reference(inputs.recipe, inputs.precision, inputs.start_adapter)
        scorers = scorers_of(g.rewards, g.max_completion_length, self.name)
        log_start(self.name, g, scorers, reference, self.log_more(g))
        trainer = self.trainer_class()(
            model=inputs.model, reward_funcs=scorers, args=inputs.args, train_dataset=inputs.data.train,
            eval_dataset=inputs.data.eval, processing_class=inputs.tokenizer, callbacks=inputs.callbacks,
            generation_eval=inputs.generation_eval, add_special_tokens=inputs.data.add_special_tokens,
            data=inputs.data, **ref_args)
        return trainer, trainer.tokens
