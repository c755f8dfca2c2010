"""Preference tuning (training.method: dpo | kto | orpo) with TRL's trainers, inside tunekit's guarantees.

Pairs are rendered and tokenized by tunekit's own SFT code (data.Renderer, data.tokenize), so a DPO run
sees exactly the prompts an SFT run on the same model sees, and the tokens that carry the loss are
exactly the ones SFT would train: the chosen or rejected answer with its end-of-turn marker. TRL's own
tokenization (which re-renders with its chat-template call) is bypassed by handing it the token ids.
The trainer keeps tunekit's pickle-free checkpoints (trainer.SafeState). The reference model: with a fresh
LoRA adapter, the base with the adapter switched off (no second copy); with an adapter carried over from
an earlier run (model.adapter_from), a frozen copy of that adapter; with full fine-tuning, a frozen copy
of the base. ORPO has no reference model.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import warnings

import torch
import torch.nn.functional as F
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

with warnings.catch_warnings():  # TRL 1.16 keeps ORPO under trl.experimental and warns on import; pinned here
    warnings.simplefilter("ignore")
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from . import data as data_mod
from . import models
from .data import IGNORE, DataStats, Record, Renderer
from .errors import TunekitError
from .recipe import PREFERENCE_METHODS, PreferenceConfig, Recipe
from .trainer import GenerationEval, SafeState

log = logging.getLogger("tunekit")


def _split(example: data_mod.Example) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the answer starts at the first trained token."""
    start = next((i for i, label in enumerate(example.labels) if label != IGNORE), len(example.labels))
    return example.input_ids[:start], example.input_ids[start:]


def tokenize_pair(record: Record, renderer: Renderer, tokenizer) -> dict:
    """prompt_ids, chosen_ids and rejected_ids of one pair, untruncated."""
    parsed = renderer.format.parse(record, renderer.cfg.fields)
    rejected_record = Record({**record.values, renderer.cfg.fields.chosen: parsed.rejected}, record.where)
    sides = []
    for r in (record, rejected_record):
        example, _ = data_mod.tokenize(renderer.render(r), tokenizer, 10**9, mask_prompt=True)
        sides.append(_split(example))
    (prompt, chosen), (prompt_r, rejected) = sides
    if prompt != prompt_r:
        raise TunekitError(f"{record.where}: the prompt tokenizes differently before the chosen and the rejected "
                           "answer; use a chat template (data.template: chat) or end the prompt on a word boundary")
    if not chosen or not rejected:
        raise TunekitError(f"{record.where}: an empty chosen or rejected answer; every pair needs both")
    return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}


def tokenize_unpaired(record: Record, renderer: Renderer, tokenizer) -> dict:
    """prompt_ids, completion_ids and label of one KTO example, untruncated."""
    rendered = renderer.render(record)
    example, _ = data_mod.tokenize(rendered, tokenizer, 10**9, mask_prompt=True)
    prompt, completion = _split(example)
    if not completion:
        raise TunekitError(f"{record.where}: an empty completion; every example needs one")
    return {"prompt_ids": prompt, "completion_ids": completion, "label": rendered.desirable}


def build_pairs(records: list[Record], renderer: Renderer, tokenizer, max_length: int) -> tuple[list[dict], DataStats]:
    """Tokenized pairs; a pair whose prompt alone fills max_length is dropped (no answer token would be
    left), longer answers are cut at max_length by the collator. Counted like SFT data."""
    pairs, stats = [], DataStats()
    paired = renderer.cfg.format == "preference"
    answers = ("chosen_ids", "rejected_ids") if paired else ("completion_ids",)
    for record in records:
        pair = (tokenize_pair if paired else tokenize_unpaired)(record, renderer, tokenizer)
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
    train_stats: DataStats
    eval_stats: DataStats | None
    template: str


def build(recipe: Recipe, tokenizer) -> PairBundle:
    import datasets

    cfg = recipe.data
    renderer = Renderer(cfg, tokenizer)
    records = data_mod.read_records(cfg.train, cfg.train_split, "data.train")
    held: list[Record] = []
    if cfg.eval:
        held = data_mod.read_records(cfg.eval, cfg.eval_split, "data.eval")
    elif cfg.eval_fraction > 0:
        records, held = data_mod.split_records(records, cfg.eval_fraction, recipe.training.seed)
    if cfg.max_examples:
        records = records[:cfg.max_examples]
    train, train_stats = build_pairs(records, renderer, tokenizer, cfg.max_length)
    paired = cfg.format == "preference"
    if not paired:  # KTOTrainer samples in order (its KL term pairs neighbours), so the order is drawn here
        random.Random(recipe.training.seed).shuffle(train)
    log.info(train_stats.line("train pairs" if paired else "train examples", cfg.max_length))
    bundle = PairBundle(datasets.Dataset.from_list(train), None, train_stats, None, renderer.template)
    if held:
        pairs, bundle.eval_stats = build_pairs(held, renderer, tokenizer, cfg.max_length)
        bundle.eval = datasets.Dataset.from_list(pairs)
    return bundle


def config(args, recipe: Recipe) -> DPOConfig | KTOConfig | ORPOConfig:
    """The Trainer's arguments as TRL's config for the recipe's method, with its settings."""
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    kwargs.update(max_length=recipe.data.max_length, dataset_num_proc=None)
    if recipe.training.method == "orpo":
        return ORPOConfig(**kwargs, beta=recipe.orpo.beta)
    kwargs["precompute_ref_log_probs"] = False
    if recipe.training.method == "kto":
        k = recipe.kto
        kwargs["train_sampling_strategy"] = "sequential"  # KTO's KL term pairs each example with its neighbours
        return KTOConfig(**kwargs, beta=k.beta, loss_type=k.loss_type, desirable_weight=k.desirable_weight,
                         undesirable_weight=k.undesirable_weight)
    p = recipe.preference
    return DPOConfig(**kwargs, beta=p.beta, loss_type=[p.loss_type], label_smoothing=p.label_smoothing,
                     truncation_mode="keep_start", padding_free=False)


def reference(recipe: Recipe, precision, start_adapter) -> tuple[dict, str]:
    """The trainer's reference arguments (ref_model, reference_is_base) and how the run output names it."""
    if not PREFERENCE_METHODS[recipe.training.method].has_reference:
        return {}, "none (the loss has no reference model)"
    if recipe.full_finetuning:
        ref = models.load_base(recipe.model, precision.dtype).eval().requires_grad_(False)
        return {"ref_model": ref}, f"a frozen copy of the base model ({precision.name})"
    if start_adapter is not None:
        return ({"ref_model": None, "reference_is_base": False},
                f"the base with the starting adapter (a frozen copy of {start_adapter})")
    return {"ref_model": None, "reference_is_base": True}, "the base with the adapter switched off (no second copy)"


class BaseReference:
    """Mixin for TRL's DPO and KTO trainers (see PreferenceTrainer): removes TRL's "ref" adapter copy when the
    reference is the base itself."""

    def __init__(self, *args, reference_is_base: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if reference_is_base and "ref" in getattr(self.model, "peft_config", {}):
            self.model.delete_adapter("ref")


class PreferenceTrainer(SafeState, GenerationEval, BaseReference, DPOTrainer):
    """DPOTrainer with tunekit's checkpoints and generation metrics, fed the pairs tokenized above.

    Given a PEFT model, TRL copies its adapter into a second adapter "ref" and uses that as the
    reference. With a freshly initialised LoRA adapter (B = 0) that copy computes exactly the base
    model, so it is removed again: TRL then takes the reference log-probabilities with the adapter
    switched off, and no copy of anything is held or saved. An adapter that starts from an earlier run
    (model.adapter_from) keeps TRL's copy: the reference is then the model that run produced."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # already prompt_ids / chosen_ids / rejected_ids from tunekit's renderer


class UnpairedTrainer(SafeState, GenerationEval, BaseReference, KTOTrainer):
    """KTOTrainer as PreferenceTrainer is DPOTrainer, fed tunekit's prompt_ids / completion_ids / label."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if not self.calculate_KL:
            return dataset

        # TRL's KL estimate, as its own preparation builds it: each micro-batch's completions rotated by one,
        # so every prompt meets a completion written for another prompt of the same batch.
        def rotate(batch):
            return {"KL_completion_ids": batch["completion_ids"][-1:] + batch["completion_ids"][:-1]}

        return dataset.map(rotate, batched=True, batch_size=args.per_device_train_batch_size)


class PairCounter(data_mod.CountingCollator):
    """Token counts of ORPO's batches: chosen and rejected rows, each with its own mask, run as one batch of
    the wider width."""

    @staticmethod
    def count(batch, features) -> tuple[int, int]:
        masks = [batch["chosen_attention_mask"], batch["rejected_attention_mask"]]
        return sum(int(m.sum()) for m in masks), 2 * len(features) * max(m.shape[1] for m in masks)


class OddsRatioTrainer(SafeState, GenerationEval, ORPOTrainer):
    """ORPOTrainer as PreferenceTrainer is DPOTrainer, fed the same pairs.

    Two changes to TRL's loss. TRL takes the SFT term of ORPO over the whole chosen sequence, prompt included
    (its comment: "orpo chosen nll loss is computed over the full prompt and response"); here it covers exactly
    the answer tokens SFT trains, as the ORPO paper's SFT term does and as every other tunekit method does.
    TRL averages that term over each micro-batch's tokens, so the result depends on how an optimizer step is
    split into micro-batches and processes; here it is averaged over the answer tokens of the whole step, as
    tunekit's SFT loss is, and 2 processes train exactly as 1 does (the odds-ratio term is a per-pair mean)."""

    loss_is_scaled_for_ga = False  # the Trainer divides by the accumulation steps; the token count below undoes it
    token_counter = PairCounter  # train.py wraps the collator in it

    def tokenize_row(self, feature, model=None) -> dict:
        """TRL's columns from tunekit's ids: prompt + answer cut at max_length (keep the start), prompt masked."""
        row = {"prompt_input_ids": feature["prompt_ids"], "prompt_attention_mask": [1] * len(feature["prompt_ids"])}
        for side in ("chosen", "rejected"):
            ids = (feature["prompt_ids"] + feature[f"{side}_ids"])[:self.max_length]
            row.update({f"{side}_input_ids": ids, f"{side}_attention_mask": [1] * len(ids),
                        f"{side}_labels": [IGNORE] * len(feature["prompt_ids"]) + ids[len(feature["prompt_ids"]):]})
        return row

    def concatenated_forward(self, model, batch):
        out = super().concatenated_forward(model, batch)
        chosen_logits = out[2]  # the chosen rows' logits, shifted: position t predicts token t + 1
        labels = batch["chosen_labels"][:, 1:]
        labels = F.pad(labels, (0, chosen_logits.shape[1] - labels.shape[1]), value=IGNORE)
        nll = F.cross_entropy(chosen_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
        self._answer_nll = nll, labels.ne(IGNORE).sum()
        return (*out[:4], nll, *out[5:])

    def _get_num_items_in_batch(self, batch_samples, device):
        """The chosen answer tokens of the whole optimizer step, every process's included."""
        count = sum(b["chosen_labels"][..., 1:].ne(IGNORE).sum() for b in batch_samples).to(device)
        return self.accelerator.gather(count).sum() if self.args.world_size > 1 else count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._step_tokens = num_items_in_batch
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        loss, metrics = super().get_batch_loss_metrics(model, batch, train_eval)
        if train_eval == "train" and getattr(self, "_step_tokens", None):
            # micro-batch token mean -> this micro-batch's share of the step's token mean (the Trainer then
            # divides by the accumulation steps and the processes' gradients are averaged)
            nll, tokens = self._answer_nll
            share = tokens * self.accelerator.num_processes * self.current_gradient_accumulation_steps
            loss = loss + nll * (share / self._step_tokens - 1)
        return loss, metrics


TRAINERS = {"dpo": PreferenceTrainer, "kto": UnpairedTrainer, "orpo": OddsRatioTrainer}


def trainer_class(recipe: Recipe):
    return TRAINERS[recipe.training.method]


@torch.no_grad()
def answer_logps(model, pairs: list[dict], side: str, max_length: int, batch_size: int, pad_id: int) -> torch.Tensor:
    """Summed log-probability of each pair's `side` answer given its prompt, cut at max_length as in training."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(pairs), batch_size):
        seqs = [(p["prompt_ids"] + p[f"{side}_ids"])[:max_length] for p in pairs[start:start + batch_size]]
        starts = [len(p["prompt_ids"]) for p in pairs[start:start + batch_size]]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        token_logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        positions = torch.arange(1, width, device=device)[None]
        answer = (positions >= torch.tensor(starts, device=device)[:, None]) & mask[:, 1:].bool()
        out.append((token_logps * answer).sum(-1).cpu())
    return torch.cat(out)


def measures(model, tokenizer, recipe: Recipe, records: list[Record], limit: int | None, batch_size: int) -> dict:
    """DPO's measures on held-out pairs. preference_accuracy: the share of pairs whose chosen answer the
    model itself finds more likely than the rejected one (summed log-probabilities). With an adapter, the
    implicit rewards beta * (log p_adapter - log p_base) as TRL computes them, the base (adapter off) being
    the reference: reward_accuracy (chosen rewarded above rejected) and reward_margin (mean difference), for
    every method but ORPO, whose loss has no reference."""
    renderer = Renderer(recipe.data, tokenizer)
    pairs = [tokenize_pair(r, renderer, tokenizer) for r in records[:limit or None]]
    pairs = [p for p in pairs if len(p["prompt_ids"]) < recipe.data.max_length]
    args = (recipe.data.max_length, batch_size, tokenizer.pad_token_id)
    model.eval()
    policy = {side: answer_logps(model, pairs, side, *args) for side in ("chosen", "rejected")}
    scores = {"preference_accuracy": float((policy["chosen"] > policy["rejected"]).float().mean()),
              "preference_pairs": len(pairs)}
    method = PREFERENCE_METHODS.get(recipe.training.method)
    if hasattr(model, "disable_adapter") and (method is None or method.has_reference):  # ORPO has no reference
        with model.disable_adapter():
            ref = {side: answer_logps(model, pairs, side, *args) for side in ("chosen", "rejected")}
        beta = (recipe.preference or PreferenceConfig()).beta
        chosen, rejected = (beta * (policy[s] - ref[s]) for s in ("chosen", "rejected"))
        scores.update(reward_accuracy=float((chosen > rejected).float().mean()),
                      reward_margin=float((chosen - rejected).mean()))
    return scores
