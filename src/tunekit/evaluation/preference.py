"""Preference pairs as tunekit's SFT code tokenizes them (the preference methods' training data is built from the
same tokenization, training.methods.pairs), and the measures on held-out pairs beside the generation metrics:
preference accuracy and the implicit rewards. Cheap to import: torch and the data modules load inside."""

from __future__ import annotations

from tunekit.config import methods
from tunekit.config.methods import PAIR_FORMATS
from tunekit.config.methodsettings import DEFAULT_BETA
from tunekit.core.errors import TunekitError


def split_answer(example) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the answer runs from the first trained token to the last (what a chat template
    writes after the end-of-turn marker is not trained, so not part of the answer)."""
    from tunekit.data.tokenizing import IGNORE

    trained = [i for i, label in enumerate(example.labels) if label != IGNORE]
    if not trained:
        return example.input_ids, []
    return example.input_ids[:trained[0]], example.input_ids[trained[0]:trained[-1] + 1]


def tokenize_pair(record, renderer, tokenizer) -> dict:
    """prompt_ids, chosen_ids and rejected_ids of one pair, untruncated."""
    from tunekit.data.formats import Record
    from tunekit.data.tokenizing import tokenize

    parsed = renderer.format.parse(record, renderer.cfg.fields)
    rejected_record = Record({**record.values, renderer.cfg.fields.chosen: parsed.rejected}, record.where)
    sides = []
    for r in (record, rejected_record):
        example, _ = tokenize(renderer.render(r), tokenizer, 10**9, mask_prompt=True)
        sides.append(split_answer(example))
    (prompt, chosen), (prompt_r, rejected) = sides
    if prompt != prompt_r:
        raise TunekitError(f"{record.where}: the prompt tokenizes differently before the chosen and the rejected "
                           "answer; use a chat template (data.template: chat) or end the prompt on a word boundary")
    if not chosen or not rejected:
        raise TunekitError(f"{record.where}: an empty chosen or rejected answer; every pair needs both")
    return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}


def answer_logps(model, pairs: list[dict], side: str, max_length: int, batch_size: int, pad_id: int):
    """Summed log-probability of each pair's `side` answer given its prompt, cut at max_length as in training."""
    import torch

    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
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


def measures(model, tokenizer, recipe, records: list, limit: int | None, batch_size: int,
             reward_beta: float | None) -> dict:
    """Measures on held-out pairs. preference_accuracy: the share of pairs whose chosen answer the model
    itself finds more likely than the rejected one (summed log-probabilities). With `reward_beta` and an
    adapter, the implicit rewards beta * (log p_adapter - log p_base) as TRL computes them, the base (adapter
    off) being the reference: reward_accuracy (chosen rewarded above rejected) and reward_margin (mean
    difference)."""
    from tunekit.data.mixture import Renderers

    renderer = Renderers(recipe.data, tokenizer)
    pairs = [tokenize_pair(r, renderer.of(r), tokenizer) for r in records[:limit or None]]
    pairs = [p for p in pairs if len(p["prompt_ids"]) < recipe.data.max_length]
    args = (recipe.data.max_length, batch_size, tokenizer.pad_token_id)
    model.eval()
    policy = {side: answer_logps(model, pairs, side, *args) for side in ("chosen", "rejected")}
    scores = {"preference_accuracy": float((policy["chosen"] > policy["rejected"]).float().mean()),
              "preference_pairs": len(pairs)}
    if hasattr(model, "disable_adapter") and reward_beta is not None:
        with model.disable_adapter():
            ref = {side: answer_logps(model, pairs, side, *args) for side in ("chosen", "rejected")}
        chosen, rejected = (reward_beta * (policy[s] - ref[s]) for s in ("chosen", "rejected"))
        scores.update(reward_accuracy=float((chosen > rejected).float().mean()),
                      reward_margin=float((chosen - rejected).mean()))
    return scores


def method_measures(model, tokenizer, recipe, records: list, limit: int | None, batch_size: int) -> dict:
    """The measures `tunekit eval` adds for the recipe's training method: on preference pairs, the pair
    measures, with the implicit rewards where the method declares them (its section's beta, else TRL's
    default); none on other data."""
    method = methods.spec_of(recipe)
    if recipe.data.format not in PAIR_FORMATS:
        return {}
    beta = getattr(method.settings_of(recipe), "beta", DEFAULT_BETA) if method.implicit_reward else None
    return measures(model, tokenizer, recipe, records, limit, batch_size, reward_beta=beta)
