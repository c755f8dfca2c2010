"""training.method: sft -- supervised fine-tuning on the answers (tunekit's own Trainer and loss path);
declared in tunekit.config.methods.

It trains on every data format no other method owns (a preference pair's chosen answer included), packs
examples where the model allows it and takes the chunked loss path. On preference pairs, `tunekit eval`
adds the pair measures (evaluation.preference)."""

from __future__ import annotations

from tunekit.training.methods.base import Method, TrainerInputs, register


class Sft(Method):
    name = "sft"

    def build_data(self, recipe, tokenizer):
        from tunekit.data import arrow, imagetokens

        return arrow.build(recipe.data, tokenizer, recipe.training.seed, image_tokens=imagetokens.of(recipe.model))

    def make_trainer(self, inputs: TrainerInputs):
        from tunekit.data import imagetokens
        from tunekit.data.collating import CountingCollator, collator
        from tunekit.models import attention
        from tunekit.training.trainer import SafeStateTrainer

        recipe = inputs.recipe
        image_tokens = imagetokens.of(recipe.model)
        pieces = recipe.training.parallelism.sp if recipe.training.parallelism is not None else 1
        # flash kernels read packed boundaries from 1-D tensors, which Ulysses' loader cannot split by position
        boundaries = attention.reads_boundaries(inputs.attention) and pieces == 1
        import torch

        # on CPU processes every batch is as long as it can be (padded rows come in multiples of 8): gloo's
        # all-gather takes one shape on every process
        fixed = None if torch.cuda.is_available() else -(-recipe.data.max_length // 8) * 8
        collate = CountingCollator(collator(inputs.tokenizer, inputs.packed, boundaries, image_tokens, pieces,
                                            recipe.training.micro_batch_size, fixed, positions=True))
        trainer = SafeStateTrainer(
            model=inputs.model,
            args=inputs.args,
            train_dataset=inputs.data.train,
            eval_dataset=inputs.data.eval,
            data_collator=collate,
            # saved with each checkpoint: a vision-language model's processor holds its tokenizer and image processor
            processing_class=inputs.tokenizer if image_tokens is None else image_tokens.processor,
            callbacks=inputs.callbacks,
            chunked_loss=recipe.training.chunked_loss,
            generation_eval=inputs.generation_eval,
        )
        return trainer, collate


register(Sft())
