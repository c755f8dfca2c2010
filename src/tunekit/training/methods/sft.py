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
        from tunekit.training.trainer import SafeStateTrainer

        recipe = inputs.recipe
        image_tokens = imagetokens.of(recipe.model)
        collate = CountingCollator(collator(inputs.tokenizer, inputs.packed, inputs.attention == "flash_attention_2",
                                            image_tokens))
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
