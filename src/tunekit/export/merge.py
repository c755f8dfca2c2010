"""Adapter + base -> merged weights that load with plain AutoModelForCausalLM.from_pretrained (a reward model's:
AutoModelForSequenceClassification, its score head merged in; parity on its scores, one per sequence).

LoRA is merged in fp32 and cast afterwards. A QLoRA adapter was trained against the dequantized
4-bit base, not the original weights, so the base is re-quantized exactly as in training,
dequantized, and the adapter merged into that: the merged model is the model that was trained.
(peft's merge into the 4-bit model re-quantizes the sum and loses most of the update.)"""

from __future__ import annotations

import itertools
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel

from tunekit.config import methods
from tunekit.config.recipefile import load as load_recipe
from tunekit.core import outputs
from tunekit.core.errors import TunekitError
from tunekit.core.hardware import DTYPES
from tunekit.data import imagetokens, mixture, split
from tunekit.data.collating import collator, features
from tunekit.data.tokenizing import build_examples
from tunekit.export import card
from tunekit.models import expertquant, loader
from tunekit.models.info import model_config
from tunekit.runs.layout import ADAPTER_DIR, MERGED_MARKER, RECIPE_FILE, RunRecord, adapter_run
from tunekit.runs.trained import quantization_as_trained

log = logging.getLogger("tunekit")


@dataclass
class Parity:
    max_abs_diff: float
    top1_agreement: float  # scores: the share of pairs ranked alike (chosen above rejected, or not)
    positions: int  # scores: the sequences scored
    measure: str = "logits"  # or "scores": a score head's one number per sequence (a reward model)

    def line(self) -> str:
        if self.measure == "scores":
            return (f"parity: max |score diff| {self.max_abs_diff:.2e}, pair order agreement "
                    f"{100 * self.top1_agreement:.2f}% over {self.positions} sequences")
        return (f"parity: max |logit diff| {self.max_abs_diff:.2e}, top-1 agreement {100 * self.top1_agreement:.2f}% "
                f"over {self.positions} positions")


def parity_batch(recipe, tokenizer, n: int = 4, image_tokens=None):
    """A few real examples from the run's own data, each rendered as for generation (through its last assistant
    message) and tokenized as in training, with their images' pixel inputs for a vision-language model."""
    records = (split.held_out(recipe.data, recipe.training.seed)
               or list(itertools.islice(split.train_source(recipe.data), n)))
    # each record by its source's format and fields
    renderer = mixture.Renderers(recipe.data, tokenizer, image_tokens=image_tokens)
    examples, _ = build_examples([renderer.render(r) for r in records[:n]], tokenizer, recipe.data, image_tokens)
    if not examples:
        raise TunekitError("merge: no usable example in the run's data for the parity check")
    tokenizer.padding_side = "right"
    return collator(tokenizer, image_tokens=image_tokens)(features(examples, image_tokens is not None))


@torch.no_grad()
def logits(model, batch) -> torch.Tensor:
    """The model's fp32 logits on `batch`, on the CPU. The batch goes to the model's device: a 4-bit base loads
    onto the GPU (bitsandbytes' kernels run only there) while the batch is built on the CPU."""
    model.eval()
    device = next(model.parameters()).device
    out = model(**{k: v.to(device) for k, v in batch.items() if k != "labels"})  # pixel inputs included
    return out.logits.float().cpu()


def parity_pairs(recipe, tokenizer, n: int = 4) -> list[list[int]]:
    """A reward run's parity sequences: a few pairs of its own data (held out where it has some), each as the two
    whole sequences it was trained to score (chosen, rejected, chosen, ...)."""
    from tunekit.evaluation.rewardmodel import pair_sequences

    records = (split.held_out(recipe.data, recipe.training.seed)
               or list(itertools.islice(split.train_source(recipe.data), 4 * n)))
    kept = pair_sequences(tokenizer, recipe, records[:4 * n])[:n]
    if not kept:
        raise TunekitError("merge: no usable pair in the run's data for the parity check")
    return [w[side] for _, _, w in kept for side in ("chosen_ids", "rejected_ids")]


@torch.no_grad()
def scores(model, sequences: list[list[int]], pad_id: int) -> torch.Tensor:
    """A score head's fp32 scores of `sequences`, [batch, 1], read as training reads them (the last token that is
    not padding); sets the model's pad_token_id, so a merged model saved after this reads them there too."""
    from tunekit.evaluation.rewardmodel import sequence_scores

    model.eval()
    return torch.tensor(sequence_scores(model, sequences, pad_id, len(sequences))).unsqueeze(-1)


def compare_scores(reference: torch.Tensor, merged: torch.Tensor) -> Parity:
    """Parity on [batch, 1] scores of (chosen, rejected) sequences in turn."""
    ranked = [(t[0::2] > t[1::2]) for t in (reference, merged)]
    return Parity(max_abs_diff=(reference - merged).abs().max().item(),
                  top1_agreement=(ranked[0] == ranked[1]).float().mean().item(),
                  positions=reference.shape[0], measure="scores")


def compare(reference: torch.Tensor, merged: torch.Tensor, mask: torch.Tensor) -> Parity:
    keep = mask.bool()
    ref, got = reference[keep], merged[keep]
    return Parity(max_abs_diff=(ref - got).abs().max().item(),
                  top1_agreement=(ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
                  positions=int(keep.sum()))


def _merged_model(recipe, record: RunRecord, adapter_dir: Path, measure) -> tuple[torch.nn.Module, torch.Tensor]:
    """Return the merged fp32 model and the adapter model's `measure` (its logits or scores: the reference)."""
    if recipe.quantization is None:
        model = loader.load_adapter_model(recipe.model, adapter_dir, torch.float32)
        reference = measure(model)
        return model.merge_and_unload(), reference
    # Same load dtype as training so that the 4-bit codes and scales are the ones trained against.
    load_dtype, quant = quantization_as_trained(recipe, record, torch.float32)
    adapter_model = loader.load_adapter_model(recipe.model, adapter_dir, load_dtype, quant)
    reference = measure(adapter_model)
    del adapter_model
    base = loader.load_base(recipe.model, load_dtype, quant, score_head=loader.saved_with_score_head(adapter_dir))
    for module in base.modules():  # dequantize straight to fp32, without rounding to the load dtype
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            state.dtype = torch.float32
    base = base.dequantize(dtype=torch.float32).to(torch.float32)
    expertquant.dequantize(base, torch.float32)  # a mixture of experts' 4-bit experts: transformers' leaves them
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    return merged, reference


def _default_dtype(recipe) -> str:
    cfg = model_config(recipe.model)
    dtype = getattr(cfg, "dtype", None)  # transformers 5 reads a config.json's torch_dtype into dtype
    names = {v: k for k, v in DTYPES.items()}
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return names.get(dtype, "fp32")


def model_card(run_dir: Path, parity: Parity, dtype: str) -> str:
    return card.render(card.from_run(run_dir, "merged", weights=f"{dtype}, safetensors",
                                     notes=[f"Merged from run `{run_dir}` in fp32; {parity.line()}"]))


def merge(run_dir: Path, out: Path | None = None, dtype: str | None = None, force: bool = False,
          tolerance: float = 1e-3) -> Path:
    run_dir, record = adapter_run(Path(run_dir))
    adapter_dir = run_dir / ADAPTER_DIR
    out = Path(out) if out else run_dir / "merged"
    with outputs.exclusive(out, "merge output"):
        outputs.check_free(out, force, "merge output")
        return _merge(run_dir, record, adapter_dir, out, dtype, tolerance)


def _merge(run_dir: Path, record: RunRecord, adapter_dir: Path, out: Path, dtype: str | None,
           tolerance: float) -> Path:
    recipe = load_recipe(run_dir / RECIPE_FILE)
    dtype = dtype or _default_dtype(recipe)

    tokenizer = loader.load_tokenizer(recipe.model, adapter_dir)
    image_tokens = imagetokens.of(recipe.model)  # a vision-language model's processor, saved with the merge
    if methods.spec_of(recipe).score_head:  # a reward model: one score per sequence, not logits per token
        sequences = parity_pairs(recipe, tokenizer)

        def measure(model):
            return scores(model, sequences, tokenizer.pad_token_id)

        def judge(reference, got):
            return compare_scores(reference, got)
    else:
        batch = parity_batch(recipe, tokenizer, image_tokens=image_tokens)

        def measure(model):
            return logits(model, batch)

        def judge(reference, got):
            return compare(reference, got, batch["attention_mask"])
    log.info("merging %s adapter into %s in fp32", recipe.adapter_kind, recipe.model.name_or_path)
    merged, reference = _merged_model(recipe, record, adapter_dir, measure)
    parity = judge(reference, measure(merged))
    log.info(parity.line())
    if not parity.max_abs_diff <= tolerance:
        raise TunekitError(f"merge refused: {parity.line()} exceeds tolerance {tolerance:g}; nothing written to {out}")

    merged = merged.to(DTYPES[dtype])
    merged.config.use_cache = True
    with outputs.atomic_dir(out) as tmp:
        merged.save_pretrained(tmp, max_shard_size="2GB")
        if image_tokens is not None:
            image_tokens.processor.save_pretrained(tmp)
        tokenizer.padding_side = "left"
        tokenizer.save_pretrained(tmp)
        shutil.copy(run_dir / RECIPE_FILE, tmp / RECIPE_FILE)
        outputs.write_json(tmp / MERGED_MARKER, {
            "source_run": str(run_dir.resolve()), "base_model": recipe.model.name_or_path,
            "adapter": recipe.adapter_kind, "dtype": dtype, "parity": vars(parity), "tolerance": tolerance,
            "versions": outputs.versions(),
        })
        (tmp / "README.md").write_text(model_card(run_dir, parity, dtype), encoding="utf-8")
    log.info("merged model written to %s (%s)", out, dtype)
    return out
