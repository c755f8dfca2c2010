"""training.method: distill -- the student (the recipe's model, its adapter or all its weights) trained to match a
teacher's next-token distributions (distill.teacher: runs.distillteacher), off-policy, on-policy (GKD) or mixed, with
tunekit's seeded sampling (training.sampling); its `distill:` section is declared in
tunekit.config.methodsettings. The modes, and why not TRL's DistillationTrainer: docs/methods.md, "Distillation: a
teacher's knowledge into a student"."""

from __future__ import annotations

import contextlib
import logging

from tunekit.training.methods.base import Method, TrainerInputs, register

log = logging.getLogger("tunekit")


class Distill(Method):
    name = "distill"

    def check(self, recipe, model: str) -> None:
        """The teacher can be had and shares the student's vocabulary (plan: the teacher's files only; validate:
        a model that cannot be had here is a warning)."""
        from tunekit.models import hub
        from tunekit.runs import distillteacher as teachers

        if model in ("shipped", "skip"):
            teachers.resolve(recipe)
            return
        try:
            teachers.check(recipe)
        except hub.Unavailable as e:
            if model != "optional":
                raise
            log.warning("distill.teacher: vocabulary not compared: %s", e)

    def build_data(self, recipe, tokenizer):
        """Prompts only (data.format: prompt): their ids as `tunekit eval` renders them; else the data tokenized
        as SFT tokenizes it (answers labelled), each example's prompt its ids before its last answer."""
        if "prompt" in recipe.data.formats():
            return prompts_only(recipe, tokenizer)
        from tunekit.data import arrow

        bundle = arrow.build(recipe.data, tokenizer, recipe.training.seed)
        bundle.train = indexed(bundle.train)
        if bundle.eval is not None:
            bundle.eval = indexed(bundle.eval)
        return bundle

    def trainer_class(self):
        from tunekit.training.trainers.distill import DistillTrainer

        return DistillTrainer

    def trainer_config(self, args, recipe):
        args.remove_unused_columns = False  # the example's place and prompt reach the trainer
        return args

    def make_trainer(self, inputs: TrainerInputs):
        from tunekit.runs import distillteacher as teachers

        recipe, d = inputs.recipe, inputs.recipe.distill
        teacher = teachers.check(recipe, inputs.tokenizer)
        with whole_unless(d.teacher_placement == "sharded", inputs.args):
            model = teachers.load(teacher, inputs.precision.dtype, d.teacher_4bit)
        trainer = self.trainer_class()(
            model=inputs.model, args=inputs.args, train_dataset=inputs.data.train, eval_dataset=inputs.data.eval,
            data_collator=collator(inputs.tokenizer), processing_class=inputs.tokenizer, callbacks=inputs.callbacks,
            generation_eval=inputs.generation_eval, teacher=model, settings=d)
        log.info("distill: teacher %s, frozen, %s%s; %s; %s%s, temperature %g%s; sft_weight %g",
                 teacher.describe(), "4-bit" if d.teacher_4bit or teacher.quantized_run else inputs.precision.name,
                 ", " + trainer.teacher_placement, d.mode.replace("_", "-") +
                 (f" ({d.on_policy_fraction:g} of the examples)" if d.mode == "mixed" else ""),
                 d.divergence, f" (beta {d.jsd_beta:g})" if d.divergence == "jsd" else "", d.temperature,
                 f", the teacher's top {d.top_k} tokens" if d.top_k else "", d.sft_weight)
        return trainer, trainer.tokens


def indexed(ds):
    """The data set with each example's place in it, which keys its samples (training.sampling)."""
    return ds.add_column("index", list(range(len(ds))))


def prompts_only(recipe, tokenizer):
    import datasets

    from tunekit.training.methods.rollouts import build

    bundle = build(recipe, tokenizer)

    def ids(ds):
        # a new table, not ds.select_columns([]): a table without columns has no rows to add a column beside
        tokenized = [tokenizer(p, add_special_tokens=bundle.add_special_tokens)["input_ids"] for p in ds["prompt"]]
        return indexed(datasets.Dataset.from_dict({"prompt_ids": tokenized}))

    bundle.train = ids(bundle.train)
    if bundle.eval is not None:
        bundle.eval = ids(bundle.eval)
    return bundle


def collator(tokenizer):
    from tunekit.training.trainers.distill import Collator

    return Collator(tokenizer)


@contextlib.contextmanager
def whole_unless(sharded: bool, args):
    """Where the run shards weights at load (ZeRO-3) and the teacher is to stay whole: loaded as a plain model."""
    from transformers.integrations.deepspeed import (
        is_deepspeed_zero3_enabled,
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    if sharded or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(args.hf_deepspeed_config)


register(Distill())
