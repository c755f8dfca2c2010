"""Rollouts: the parts of tunekit's GRPO and RLOO trainers that are the same over TRL's two trainers."""

from __future__ import annotations

from unittest import mock

from tunekit.data.collating import CountingCollator
from tunekit.training.trainers.tooluse import ToolUse


class Rollouts(ToolUse):
    """Samples from the prompts as tunekit renders them (already templated text, tokenized as `tunekit eval`
    tokenizes it), counts the tokens sampled, scores held-out prompts by their greedy answers' rewards
    (evaluation.DuringTraining) instead of TRL's evaluation pass. `trl_module`: the TRL module whose
    create_model_from_path would load the reference again."""

    trl_module = None

    def __init__(self, *args, add_special_tokens: bool = True, ref_model=None, data=None, **kwargs):
        self.add_special_tokens = add_special_tokens
        self.tokens = CountingCollator(None)  # its counters only: real and computed tokens sampled
        self.toolkit = getattr(data, "toolkit", None)
        self.renderer = getattr(data, "renderer", None)
        self.episodes: list | None = None  # the batch being sampled, with tools
        if ref_model is None:
            super().__init__(*args, **kwargs)
            return
        # Full fine-tuning with a KL term: TRL loads the reference again from the policy's hub name, which a
        # model loaded from a GGUF file or a local build has not; hand it the copy tunekit loaded instead.
        with mock.patch.object(self.trl_module, "create_model_from_path", lambda *a, **k: ref_model):
            super().__init__(*args, **kwargs)

    def _generate_and_score_completions(self, inputs):
        if self.toolkit is not None:
            inputs = self.start_episodes(inputs)
        out = super()._generate_and_score_completions(inputs)
        if self.episodes is not None:
            out["tool_mask"] = self.tool_mask(out["completion_ids"])
            self.log_episodes()
            self.episodes = None
        if self.model.training:  # prompts and completions, as the throughput counts them
            masks = [out["prompt_mask"], out["completion_mask"]]
            self.tokens.real += int(sum(m.sum() for m in masks))
            self.tokens.computed += sum(m.numel() for m in masks)
        return out

    def seeded(self, images, multimodal_fields) -> bool:
        """Whether tunekit's seeded sampling (training.sampling) samples, not TRL's own paths."""
        return not (self.use_vllm or self.use_transformers_continuous_batching or images or multimodal_fields)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self.generation_eval is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        # the held-out prompts are scored by their greedy answers' rewards (evaluation.DuringTraining); TRL's
        # pass would sample `completions` answers per prompt again, for a loss that says little
        return None, None, None

    def _tokenize_prompts(self, prompts: list):
        # TRL tokenizes text prompts with the tokenizer's special tokens; a chat template has written them
        ids = self.processing_class(text=prompts, add_special_tokens=self.add_special_tokens)["input_ids"]
        return ids, None, {}
