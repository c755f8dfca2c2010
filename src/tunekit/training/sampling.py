"""Seeded sampling for GRPO, RLOO and on-policy distillation: each sampled token is a pure function of
(training.seed, step, the sequence's place in the step's batch of completions or in the data, its position),
whatever the number of processes or the micro-batch: the token is picked by the Gumbel-max trick with noise from a
generator seeded per sequence and position. Why not TRL's sampling: docs/methods.md, "How the methods are built"."""

from __future__ import annotations

import hashlib

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest(), "little") >> 1


def gumbel(seed: int, n: int) -> torch.Tensor:
    """n standard Gumbel draws from a generator seeded with `seed` (on the CPU: the same on every device)."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return -torch.log(-torch.log(u.clamp(1e-300, 1.0 - 1e-16))).float()


class SeededSampling(LogitsProcessor):
    """Warped logits plus Gumbel noise keyed by (key..., row, position): greedy decoding over them samples."""

    def __init__(self, key: tuple, rows: list[int], start: int, temperature: float, top_p: float, top_k: int):
        self.key, self.rows, self.start = key, rows, start
        self.warpers = ([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                        + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float()
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        position = input_ids.shape[1] - self.start
        noise = torch.stack([gumbel(_seed(*self.key, row, position), scores.shape[-1]) for row in self.rows])
        return scores + noise.to(scores.device)


def generate(trainer, prompt_ids: list[list[int]], rows: list[int] | None = None, turn: int = 0,
             max_new_tokens: int | None = None) -> list[list[int]]:
    """Completion ids (through the first end-of-sequence token) for this process's prompts, sampled with
    SeededSampling by the trainer's model (TRL's GRPOTrainer attributes). Episodes with tools (tooluse.episodes)
    pass each sequence's place in the step's batch of completions (`rows`), the turn (a later turn draws other
    noise) and the tokens their budget has left."""
    acc = trainer.accelerator
    mode = "train" if trainer.model.training else "eval"
    if rows is None:  # TRL hands each process a contiguous, equal slice of the step's batch of completions
        rows = [acc.process_index * len(prompt_ids) + i for i in range(len(prompt_ids))]
    key = (trainer.args.seed, mode, trainer.state.global_step) + (("turn", turn) if turn else ())
    return sample(trainer.model_wrapped, acc, trainer.processing_class.pad_token_id, prompt_ids,
                  SeededSampling(key, rows, max(map(len, prompt_ids)), trainer.temperature, trainer.top_p,
                                 trainer.top_k),
                  max_new_tokens or trainer.max_completion_length, trainer.eos_token_ids,
                  trainer.args.ds3_gather_for_generation)


def sample(model_wrapped, accelerator, pad_id: int, prompt_ids: list[list[int]], sampler: SeededSampling,
           max_new_tokens: int, eos_ids: list[int], gather: bool = True) -> list[list[int]]:
    """Completion ids (through the first end-of-sequence token) for the prompts (padded on the left here; the
    sampler's `start` is their padded width), drawn by `sampler`; under ZeRO-3, `gather`: the weights gathered once
    for the whole generation."""
    from trl.models import unwrap_model_for_generation

    width = max(map(len, prompt_ids))
    device = accelerator.device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                              eos_token_id=eos_ids, disable_compile=True)
    with unwrap_model_for_generation(model_wrapped, accelerator, gather_deepspeed3_params=gather) as model, \
            torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                             logits_processor=LogitsProcessorList([sampler]))
    completions = []
    for row in out[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos_ids]
        completions.append(row[:ends[0] + 1] if ends else row)
    return completions
