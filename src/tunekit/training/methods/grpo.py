"""training.method: grpo -- group relative policy optimization from rewards a program checks, with TRL's
GRPOTrainer; its `grpo:` recipe section is declared in tunekit.config.methodsettings, its rewards in
tunekit.config.rewardkinds and scored by tunekit.evaluation.rewards.

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
import json
import logging

from tunekit.config.methodsettings import RewardSpec
from tunekit.core.errors import TunekitError
from tunekit.evaluation import rewards
from tunekit.training.methods.base import Method, TrainerInputs, register
from tunekit.training.methods.pairs import PairBundle, split_records

log = logging.getLogger("tunekit")

class Grpo(Method):
    name = "grpo"

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
            from tunekit.models import loader

            ref = loader.load_base(recipe.model, precision.dtype).eval().requires_grad_(False)
            return {"ref_model": ref}, f"a frozen copy of the base model ({precision.name})"
        if start_adapter is not None:
            return ({"reference_is_base": False},
                    f"the base with the starting adapter (a frozen copy of {start_adapter})")
        return {"reference_is_base": True}, "the base with the adapter switched off (no second copy)"

    def make_trainer(self, inputs: TrainerInputs):
        recipe, g = inputs.recipe, inputs.recipe.grpo
        ref_args, reference = self.reference(recipe, inputs.precision, inputs.start_adapter)
        scorers = scorers_of(g.rewards, g.max_completion_length)
        log.info("grpo: %d completions per prompt, up to %d tokens, temperature %g, top_p %g, loss %s, beta %g; "
                 "rewards: %s; reference: %s", g.completions, g.max_completion_length, g.temperature, g.top_p,
                 g.loss_type, g.beta, ", ".join(f"{r.__name__} x {s.weight:g}" for r, s in zip(scorers, g.rewards)),
                 reference)
        trainer = trainer_class()(
            model=inputs.model, reward_funcs=scorers, args=inputs.args, train_dataset=inputs.data.train,
            eval_dataset=inputs.data.eval, processing_class=inputs.tokenizer, callbacks=inputs.callbacks,
            generation_eval=inputs.generation_eval, add_special_tokens=inputs.data.add_special_tokens, **ref_args)
        return trainer, trainer.tokens

def scorers_of(specs: list[RewardSpec], max_completion_length: int) -> list:
    """The recipe's rewards as TRL's GRPOTrainer calls them (evaluation.rewards.Reward)."""
    return rewards.build(specs, max_completion_length)


@dataclasses.dataclass
class PromptBundle(PairBundle):
    """train / eval: datasets of prompt, reference, where, record (the raw record as JSON text)."""

    add_special_tokens: bool = True  # whether tokenizing a prompt adds BOS etc. (False: the chat template wrote them)


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

    from tunekit.data import mixture

    cfg = recipe.data
    renderer = mixture.Renderers(cfg, tokenizer)
    records, held, facts, report = split_records(recipe)
    rows, stats, special = prompt_rows(records, renderer, tokenizer, cfg.max_length)
    log.info("train prompts: %d, %d prompt tokens; %d dropped (the prompt alone fills data.max_length=%d)",
             stats.examples, stats.tokens, stats.dropped_no_target, cfg.max_length)
    bundle = PromptBundle(datasets.Dataset.from_list(rows), None, stats, None, renderer.template, facts,
                          report, special)
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

    from tunekit.data.collating import CountingCollator
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
