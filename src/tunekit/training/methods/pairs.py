"""What the preference methods (dpo, kto, orpo) share: their data tokenized by tunekit's SFT code
(data.rendering.Renderer, data.tokenizing.tokenize) and handed to TRL as token ids, the reference model and the
TRL trainer path (the measures on held-out pairs: evaluation.preference). Cheap to import: torch, TRL and tunekit's
data and model modules load inside the functions. Which reference, and why: docs/methods.md, "How the methods are
built"."""

from __future__ import annotations

import dataclasses
import logging
import random

from tunekit.core.errors import TunekitError
from tunekit.evaluation.preference import split_answer, tokenize_pair
from tunekit.training.methods.base import Method, TrainerInputs

log = logging.getLogger("tunekit")


def tokenize_unpaired(record, renderer, tokenizer) -> dict:
    """prompt_ids, completion_ids and label of one KTO example, untruncated."""
    from tunekit.data.tokenizing import tokenize

    rendered = renderer.render(record)
    example, _ = tokenize(rendered, tokenizer, 10**9, mask_prompt=True)
    prompt, completion = split_answer(example)
    if not completion:
        raise TunekitError(f"{record.where}: an empty completion; every example needs one")
    return {"prompt_ids": prompt, "completion_ids": completion, "label": rendered.desirable}


def build_pairs(records: list, renderer, tokenizer, max_length: int, tokenize=tokenize_pair):
    """Tokenized examples ((list of dicts, DataStats)), each record by its source's renderer (`renderer`: a
    data.mixture.Renderers); one whose prompt alone fills max_length is dropped (no
    answer token would be left), longer answers are cut at max_length by the collator. Counted like SFT data."""
    from tunekit.data.tokenizing import DataStats

    pairs, stats = [], DataStats()
    for record in records:
        pair = tokenize(record, renderer.of(record), tokenizer)
        answers = [key for key in pair if key.endswith("_ids") and key != "prompt_ids"]
        if len(pair["prompt_ids"]) >= max_length:
            stats.dropped_no_target += 1
            continue
        longest = len(pair["prompt_ids"]) + max(len(pair[a]) for a in answers)
        stats.truncated += longest > max_length
        stats.examples += 1
        stats.tokens += len(pair["prompt_ids"]) + sum(len(pair[a]) for a in answers)
        stats.trained_tokens += min(longest, max_length) - len(pair["prompt_ids"])
        pairs.append(pair)
    if not pairs:
        raise TunekitError(f"no usable preference examples: every prompt fills data.max_length={max_length}")
    return pairs, stats


@dataclasses.dataclass
class PairBundle:
    train: object  # datasets.Dataset
    eval: object | None
    train_stats: object  # data.tokenizing.DataStats
    eval_stats: object | None
    template: str
    split: dict  # tunekit.data.split.summary
    contamination: dict  # tunekit.data.contamination.report


def split_records(recipe) -> tuple[list, list, dict, dict]:
    """data.split's training and held-out records, its facts and the contamination report, their lines logged."""
    from tunekit.data import mixture, split

    records, held, facts, report = split.training(recipe.data, recipe.training.seed)
    log.info(split.line(facts))
    if facts.get("mix"):
        log.info(mixture.line(facts["mix"]))
    log.info(report["line"])
    return records, held, facts, report


def distinct(tokenize, method):
    """`tokenize`, refusing a pair whose chosen and rejected answers render to the same tokens, for a `method`
    (config.methods.MethodSpec) that learns only from their difference (data.precheck compares their texts)."""
    from tunekit.data.formats import identical_pair

    def tokenize_distinct(record, renderer, tokenizer) -> dict:
        pair = tokenize(record, renderer, tokenizer)
        if pair["chosen_ids"] == pair["rejected_ids"]:
            raise identical_pair(record.where, method, "text once rendered")
        return pair
    return tokenize_distinct


def build(recipe, tokenizer, tokenize=tokenize_pair, shuffle: bool = False, what: str = "train pairs") -> PairBundle:
    """The recipe's train (and held-out) examples, tokenized by `tokenize`; `shuffle`: the order drawn once
    here with the recipe's seed (for a trainer that samples in order)."""
    import datasets

    from tunekit.config import methods
    from tunekit.data import mixture

    cfg = recipe.data
    if methods.spec_of(recipe).learns_from_difference:
        tokenize = distinct(tokenize, methods.spec_of(recipe))
    renderer = mixture.Renderers(cfg, tokenizer)
    records, held, facts, report = split_records(recipe)
    train, train_stats = build_pairs(records, renderer, tokenizer, cfg.max_length, tokenize)
    if shuffle:
        random.Random(recipe.training.seed).shuffle(train)
    log.info(train_stats.line(what, cfg.max_length))
    bundle = PairBundle(datasets.Dataset.from_list(train), None, train_stats, None, renderer.template, facts, report)
    if held:
        pairs, bundle.eval_stats = build_pairs(held, renderer, tokenizer, cfg.max_length, tokenize)
        bundle.eval = datasets.Dataset.from_list(pairs)
    return bundle


class PreferenceMethod(Method):
    """A method trained by one of TRL's preference trainers on examples built by `build`."""

    def build_data(self, recipe, tokenizer) -> PairBundle:
        return build(recipe, tokenizer)

    def trl_kwargs(self, args, recipe) -> dict:
        """The Trainer's arguments as keyword arguments of a TRL config, with tunekit's data settings."""
        kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
        kwargs.update(max_length=recipe.data.max_length, dataset_num_proc=None)
        if self.has_reference:
            kwargs["precompute_ref_log_probs"] = False
        return kwargs

    def reference(self, recipe, precision, start_adapter) -> tuple[dict, str]:
        if not self.has_reference:
            return super().reference(recipe, precision, start_adapter)
        if recipe.full_finetuning:
            from tunekit.models import loader

            ref = loader.load_base(recipe.model, precision.dtype).eval().requires_grad_(False)
            return {"ref_model": ref}, f"a frozen copy of the base model ({precision.name})"
        if start_adapter is not None:
            return ({"ref_model": None, "reference_is_base": False},
                    f"the base with the starting adapter (a frozen copy of {start_adapter})")
        return {"ref_model": None, "reference_is_base": True}, "the base with the adapter switched off (no second copy)"

    def make_trainer(self, inputs: TrainerInputs):
        from tunekit.data.collating import CountingCollator

        recipe = inputs.recipe
        ref_args, reference = self.reference(recipe, inputs.precision, inputs.start_adapter)
        log.info("%s: %s; reference: %s", self.name,
                 ", ".join(f"{k} {v}" for k, v in self.settings_of(recipe).model_dump().items()), reference)
        trainer = self.trainer_class()(
            model=inputs.model, **ref_args, args=inputs.args, train_dataset=inputs.data.train,
            eval_dataset=inputs.data.eval, processing_class=inputs.tokenizer, callbacks=inputs.callbacks,
            generation_eval=inputs.generation_eval)
        collate = getattr(trainer, "token_counter", CountingCollator)(trainer.data_collator)
        trainer.data_collator = collate
        return trainer, collate
