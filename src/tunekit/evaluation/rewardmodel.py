"""Reward models (training.method: reward): a base with a one-number score head, which scores a whole sequence.

What training, `tunekit eval` and GRPO share of them: the pair sequences a reward model is trained and judged on
(prompt + answer as tunekit renders them, cut at data.max_length as in training), the scores of a batch of
sequences (read where TRL's RewardTrainer reads them: the last token that is not padding), the held-out pair
accuracy `tunekit eval RUN` reports for a reward run (reward_accuracy), and the reward a grpo.rewards entry
{reward: model, run: RUN} gives a completion. Cheap to import: torch, the data and the model modules load inside
the functions."""

from __future__ import annotations

import logging
from pathlib import Path

from tunekit.config import methods
from tunekit.core.errors import TunekitError

log = logging.getLogger("tunekit")


def whole_pair(pair: dict, max_length: int) -> dict:
    """A tokenized pair (prompt_ids, chosen_ids, rejected_ids: evaluation.preference.tokenize_pair) as the two
    sequences a reward model scores: prompt + chosen and prompt + rejected, cut at max_length (keep the start)."""
    return {side: (pair["prompt_ids"] + pair[side])[:max_length] for side in ("chosen_ids", "rejected_ids")}


def sequence_scores(model, sequences: list[list[int]], pad_id: int, batch_size: int) -> list[float]:
    """The score of each token sequence, in batches padded on the right with `pad_id`, as in training: the score
    head's output at the last token that is not `pad_id`."""
    import torch

    model.config.pad_token_id = pad_id  # where the score is read (TRL sets the same when it trains)
    device = next(model.parameters()).device
    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start:start + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in chunk], device=device)
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk], device=device)
            out += model(input_ids=ids, attention_mask=mask).logits[:, 0].float().cpu().tolist()
    return out


def pair_sequences(tokenizer, recipe, records: list) -> list[tuple]:
    """(record, tokenized pair, its two whole sequences) of each record, rendered and cut as in training; records
    whose prompt alone fills data.max_length are left out, as training leaves them out."""
    from tunekit.data.mixture import Renderers
    from tunekit.evaluation.preference import tokenize_pair

    renderer = Renderers(recipe.data, tokenizer)
    cut = recipe.data.max_length
    kept = []
    for record in records:
        pair = tokenize_pair(record, renderer.of(record), tokenizer)
        if len(pair["prompt_ids"]) < cut:
            kept.append((record, pair, whole_pair(pair, cut)))
    return kept


def scored_pairs(model, tokenizer, recipe, records: list, limit: int | None, batch_size: int) -> list[dict]:
    """Each held-out pair's chosen and rejected score (pair_sequences: cut and left out as in training)."""
    kept = pair_sequences(tokenizer, recipe, records[:limit or None])
    model.eval()
    sequences = [w[side] for _, _, w in kept for side in ("chosen_ids", "rejected_ids")]
    scores = sequence_scores(model, sequences, tokenizer.pad_token_id, batch_size)
    return [{"where": record.where, "prompt": tokenizer.decode(pair["prompt_ids"], skip_special_tokens=True).strip(),
             "chosen": tokenizer.decode(pair["chosen_ids"], skip_special_tokens=True).strip(),
             "rejected": tokenizer.decode(pair["rejected_ids"], skip_special_tokens=True).strip(),
             "chosen_score": scores[2 * i], "rejected_score": scores[2 * i + 1],
             "correct": scores[2 * i] > scores[2 * i + 1]}
            for i, (record, pair, _) in enumerate(kept)]


def pair_scores(rows: list[dict]) -> dict:
    """The held-out pair accuracy as reward_accuracy (the share of pairs whose chosen answer scores above the
    rejected one; a tie counts as wrong) and reward_margin (the mean difference): the names `tunekit eval` gives
    the same measures of DPO's implicit reward (evaluation.preference), so the table and the report page show
    them alike; the mean scores and the pairs scored (examples)."""
    n = max(len(rows), 1)
    return {"reward_accuracy": sum(r["correct"] for r in rows) / n,
            "reward_margin": sum(r["chosen_score"] - r["rejected_score"] for r in rows) / n,
            "chosen_score": sum(r["chosen_score"] for r in rows) / n,
            "rejected_score": sum(r["rejected_score"] for r in rows) / n,
            "examples": len(rows)}


def evaluate_pairs(model, tokenizer, recipe, records: list, cfg) -> tuple[dict, list[dict]]:
    """`tunekit eval` of a reward model: (scores, predictions.jsonl rows) on held-out pairs, no generation."""
    from tunekit.config.methods import PAIR_FORMATS

    if recipe.data.format not in PAIR_FORMATS:
        raise TunekitError(f"eval: a reward model is judged on (prompt, chosen, rejected) pairs; data.format is "
                           f"{recipe.data.format} (pass --data FILE of format {' or '.join(PAIR_FORMATS)})")
    rows = scored_pairs(model, tokenizer, recipe, records, cfg.limit, cfg.batch_size)
    if not rows:
        raise TunekitError(f"eval: no held-out pair is left: every prompt fills data.max_length="
                           f"{recipe.data.max_length}")
    scores = pair_scores(rows)
    log.info("reward model: pair accuracy %.3f on %d held-out pairs, mean margin %.3f", scores["reward_accuracy"],
             scores["examples"], scores["reward_margin"])
    return scores, rows


# ---------------------------------------------------------------- grpo.rewards: {reward: model, run: RUN}

def reward_run(spec: str, key: str = "run") -> Path:
    """The run directory of a finished reward model run, else one line naming the setting `key`;
    reads only run.json, so a bad recipe is refused before any weight loads."""
    from tunekit.runs.layout import RunRecord, completed_run, is_run

    run_dir = Path(spec)
    if not is_run(run_dir):
        raise TunekitError(f"{key}: {spec} is not a tunekit run directory (no run.json); give the output_dir "
                           "of a finished run of training.method: reward")
    record = RunRecord.load(run_dir)
    if record.training_method not in methods.DECLARED or not methods.DECLARED[record.training_method].score_head:
        raise TunekitError(f"{key}: {spec} is a training.method: {record.training_method} run, not a reward "
                           "model; train one with training.method: reward")
    return completed_run(run_dir, key, "reward model run")[0]


class ModelReward:
    """A reward model's score of prompt + completion (the text as the policy sees it), loaded from its run on the
    first call and kept; on the GPU where there is one."""

    def __init__(self, run_dir: Path, batch_size: int = 8):
        self.run_dir, self.batch_size = run_dir, batch_size
        self.model = self.tokenizer = None

    def load(self) -> None:
        import torch

        from tunekit.models import loader
        from tunekit.runs.layout import resolve_target
        from tunekit.runs.trained import load_trained

        target = resolve_target(str(self.run_dir))
        cuda = torch.cuda.is_available()
        dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
        self.tokenizer = loader.load_tokenizer(target.recipe.model, target.tokenizer_dir)
        self.model = load_trained(target, dtype).eval()
        log.info("reward model %s loaded (%s)", self.run_dir, str(dtype).removeprefix("torch."))

    def ids(self, text: str) -> list[int]:
        """The text's tokens; the tokenizer's own special tokens only where the text does not start with them
        already (a chat template writes them)."""
        bos = self.tokenizer.bos_token
        return self.tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]

    def scores(self, texts: list[str]) -> list[float]:
        if self.model is None:
            self.load()
        return sequence_scores(self.model, [self.ids(t) for t in texts], self.tokenizer.pad_token_id,
                               self.batch_size)

    def __call__(self, prompt: str, completion: str) -> float:
        return self.scores([prompt + completion])[0]
