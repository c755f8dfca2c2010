"""training.method: reward -- a reward model: the base with a one-number score head (LoRA, QLoRA or full), trained
on (prompt, chosen, rejected) pairs to score the chosen answer above the rejected one, with TRL's RewardTrainer;
its `reward:` recipe section is declared in tunekit.config.methodsettings.

The pairs are rendered and tokenized by tunekit's own code, as for dpo (training.methods.pairs), and handed to TRL as
the two whole sequences it scores (evaluation.rewardmodel.whole_pair). The model loads with its score head
(models.loader: AutoModelForSequenceClassification, num_labels 1; with LoRA the head is trained in full beside the
adapter and saved with it). Each evaluation during training logs the held-out pair accuracy as eval_accuracy and
the mean margin (chosen minus rejected score) as eval_margin, both measures training.metric_for_best may name
(its MethodSpec's eval_measures); `tunekit eval RUN` reports them as reward_accuracy and reward_margin
(evaluation.rewardmodel)."""

from __future__ import annotations

import functools
import logging

from tunekit.training.methods.base import built_on_use, register
from tunekit.training.methods.pairs import PreferenceMethod, build

log = logging.getLogger("tunekit")


class Reward(PreferenceMethod):
    name = "reward"

    def trainer_class(self):
        return trainer_class()

    def build_data(self, recipe, tokenizer):
        """The pairs as dpo builds them, each as its two whole sequences (prompt + answer, cut at data.max_length).
        The score is read at the last token that is not the pad token (models.tokenizer sets one: the
        end-of-sequence token where the tokenizer has none)."""
        from tunekit.evaluation.rewardmodel import whole_pair

        bundle = build(recipe, tokenizer)
        cut = recipe.data.max_length
        bundle.train = bundle.train.map(lambda p: whole_pair(p, cut), remove_columns=["prompt_ids"])
        if bundle.eval is not None:
            bundle.eval = bundle.eval.map(lambda p: whole_pair(p, cut), remove_columns=["prompt_ids"])
        return bundle

    def trainer_config(self, args, recipe):
        from trl import RewardConfig

        return RewardConfig(**self.trl_kwargs(args, recipe),
                            center_rewards_coefficient=recipe.reward.center_rewards_coefficient)

    def make_trainer(self, inputs):
        inputs.generation_eval = None  # a reward model generates nothing; its evaluations log pair accuracy
        trainer, collate = super().make_trainer(inputs)
        if inputs.recipe.quantization is not None:
            from tunekit.models import loader

            loader.trainable_in_fp32(trainer.model)  # TRL casts a quantized model's trained weights to bf16
        return trainer, collate


@functools.cache
def trainer_class():
    """RewardModelTrainer: TRL's RewardTrainer with tunekit's checkpoints, fed the pairs tokenized by tunekit's
    renderer (TRL imported here, on first use)."""
    import torch
    from trl import RewardTrainer

    from tunekit.training.trainer import GenerationEval, SafeState

    class RewardModelTrainer(SafeState, GenerationEval, RewardTrainer):
        """RewardTrainer with tunekit's pickle-free checkpoints. Its held-out accuracy and margin are counted over
        the pairs (TRL averages the batches' values, which weighs a short last batch as a full one) and reach the
        evaluation's metrics (eval_accuracy, eval_margin: the callbacks, metric_for_best), not only the logged
        line."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # already chosen_ids / rejected_ids from tunekit's renderer, cut at data.max_length

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            if not self.model.training:
                chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
                right = self.accelerator.gather_for_metrics((chosen > rejected).sum().reshape(1)).sum()
                margin = self.accelerator.gather_for_metrics((chosen - rejected).float().sum().reshape(1)).sum()
                total = self.accelerator.gather_for_metrics(torch.tensor([len(chosen)], device=chosen.device)).sum()
                self._pairs_right = getattr(self, "_pairs_right", 0) + int(right)
                self._pairs_margin = getattr(self, "_pairs_margin", 0.0) + float(margin)
                self._pairs_seen = getattr(self, "_pairs_seen", 0) + int(total)
            return (loss, outputs) if return_outputs else loss

        def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                            metric_key_prefix="eval"):
            self._pairs_right = self._pairs_seen = 0
            self._pairs_margin = 0.0
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            if self._pairs_seen:
                self._metrics["eval"].pop("accuracy", None)
                self._metrics["eval"].pop("margin", None)
                output.metrics[f"{metric_key_prefix}_accuracy"] = self._pairs_right / self._pairs_seen
                output.metrics[f"{metric_key_prefix}_margin"] = self._pairs_margin / self._pairs_seen
            return output

    RewardModelTrainer.__module__, RewardModelTrainer.__qualname__ = __name__, "RewardModelTrainer"
    return RewardModelTrainer


__getattr__ = built_on_use(__name__, RewardModelTrainer=trainer_class)


register(Reward())
