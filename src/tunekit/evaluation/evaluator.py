"""Evaluate a target (run directory, merged directory or base model): batched greedy generation
on held-out prompts built exactly as in training, then BLEU/chrF/ROUGE/exact match and loss."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from tunekit.config import methods
from tunekit.config.schema import EvalConfig, Recipe
from tunekit.core import console, distributed, outputs
from tunekit.core.errors import TunekitError
from tunekit.core.hardware import DTYPES
from tunekit.data import chattemplate, imagetokens, mixture, split
from tunekit.data.collating import collator, features
from tunekit.data.formats import Record
from tunekit.data.reading import read_records
from tunekit.data.tokenizing import IGNORE, Example, build_examples
from tunekit.evaluation import metrics, preference, rewardmodel, rewards
from tunekit.evaluation.table import format_table, table_rows  # noqa: F401  (evaluation.table_rows: tests, demo)
from tunekit.models import loader
from tunekit.runs.layout import EVAL_DIR, RunRecord, Target, resolve_target
from tunekit.runs.trained import load_trained
from tunekit.tooluse import episodes

log = logging.getLogger("tunekit")

def eval_dtype(requested: str) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32  # on CPU, bf16 generation changes greedy outputs with batch composition


def records_for(target: Target, data: str | None) -> list[Record]:
    records = held_out_records(target.recipe, data)
    if not records:
        raise TunekitError(f"{target.spec}: no eval data; pass --data FILE or set data.eval / data.eval_fraction")
    if target.kind == "run" and not (data or target.recipe.eval and target.recipe.eval.data):
        check_held_out(target, records)
    return records


def held_out_records(recipe: Recipe, data: str | None = None) -> list[Record]:
    """--data, else the recipe's eval.data, else its held-out records exactly as training split them."""
    source = data or (recipe.eval.data if recipe.eval else None)
    if source:
        return read_records(source, recipe.data.eval_split, "--data" if data else "eval.data")
    return split.held_out(recipe.data, recipe.training.seed)


def check_held_out(target: Target, records: list[Record]) -> None:
    """The records about to be scored are the ones the run held out: its data files have not changed since."""
    recorded = (RunRecord.load(target.location).data.get("split") or {}).get("held_out_fingerprint")
    d = target.recipe.data
    if recorded is None and d.max_examples and d.eval_fraction:
        log.warning("%s was trained before tunekit recorded its held-out split: with data.max_examples and "
                    "data.eval_fraction both set, the records scored now may not be the ones it held out",
                    target.spec)
    if recorded and recorded != split.fingerprint(split.of(records)):
        raise TunekitError(f"{target.spec}: the held-out records read now differ from those the run held out "
                           "(its data files changed since training), so they may include trained examples; "
                           "restore the files or pass --data FILE with data training never saw")


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], add_special_tokens: bool, batch_size: int,
             max_new_tokens: int, images: list[tuple] | None = None, image_tokens=None) -> list[str]:
    """Greedy generation in batches of similar length, left-padded; outputs in input order. In a
    process group each process generates every world_size-th batch and all receive every output; the
    batches are those of one process, so the text is the same for any number of processes. A process
    out of batches repeats one (its output unused) while others still generate: under ZeRO-3 every
    forward needs all processes. `images`: each prompt's images, for a vision-language model's `image_tokens`."""
    rank, world = distributed.rank_and_world()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    lengths = [len(tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"]) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    mine = batches[rank::world]
    found: dict[int, str] = {}
    model.eval()
    bar = console.Progress("eval: generating", len(order), unit="answers")
    try:
        for k in range(-(-len(batches) // world)):
            idx = mine[k] if k < len(mine) else batches[0]
            answers = generate_batch(model, tokenizer, [prompts[i] for i in idx], add_special_tokens, max_new_tokens,
                                     images=[images[i] for i in idx] if images else None, image_tokens=image_tokens)
            if k < len(mine):
                found.update(zip(idx, answers))
            bar.update_to(min((k + 1) * batch_size * world, len(order)))
    finally:
        bar.close()
        tokenizer.padding_side = side
    for part in distributed.gather_objects(found) if world > 1 else []:
        found.update(part)
    return [found[i] for i in range(len(prompts))]


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[str], add_special_tokens: bool, max_new_tokens: int,
                   streamer=None, images: list[tuple] | None = None, image_tokens=None) -> list[str]:
    """One generate() call: greedy continuations of `prompts` (padded on the tokenizer's side; `generate` sets
    left), decoded without special tokens and stripped. Eval's decoding, which `tunekit chat` shares
    (evaluation.conversation), there with a transformers streamer showing the answer as it is generated. With a
    vision-language model's `image_tokens`, each prompt's `images` in its tokens and the batch's pixel inputs."""
    device = next(model.parameters()).device
    if images and any(images):
        ids = [image_tokens.expand(enc, enc, found, None)[0] for enc, found in
               zip(tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"], images)]
        batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        batch.update(image_tokens.pixels([list(found) for found in images], batch["input_ids"]))
        batch = batch.to(device)
    else:
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens).to(device)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, streamer=streamer)
    return [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in out[:, batch["input_ids"].shape[1]:]]


@torch.no_grad()
def token_loss(model, tokenizer, examples: list[Example], batch_size: int, image_tokens=None) -> float:
    """Mean cross-entropy per trained token (the training objective on held-out data)."""
    tokenizer.padding_side = "right"
    collate = collator(tokenizer, image_tokens=image_tokens)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        batch = collate(features(chunk, image_tokens is not None)).to(device)
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        labels = batch["labels"][:, 1:]
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels,
                                                   ignore_index=IGNORE, reduction="sum")
        total += losses.item()
        count += int((labels != IGNORE).sum())
    return total / max(count, 1)


def rendered_examples(recipe: Recipe, tokenizer, records: list[Record], cfg: EvalConfig) -> list:
    # each record by its source's format and fields
    renderer = mixture.Renderers(recipe.data, tokenizer, image_tokens=imagetokens.of(recipe.model))
    # unpaired preference data: only the completions labelled desirable are references
    rendered = [x for x in map(renderer.render, records) if x.desirable is not False]
    chattemplate.say(renderer.notes)
    if cfg.limit:
        rendered = rendered[: cfg.limit]
    if any(r.prompt is None for r in rendered):
        raise TunekitError("eval: format 'text' has no prompt/answer split to generate from; only loss applies")
    return rendered


def generation_scores(model, tokenizer, rendered: list, cfg: EvalConfig, image_tokens=None
                      ) -> tuple[dict, list[str]]:
    """Greedy generations on the rendered examples and their scores (every process gets all of them)."""
    predictions = generate(model, tokenizer, [r.prompt for r in rendered], rendered[0].add_special_tokens,
                           cfg.batch_size, cfg.max_new_tokens, [r.images for r in rendered], image_tokens)
    return text_scores(predictions, rendered, cfg), predictions


def toolkit(recipe: Recipe) -> episodes.Toolkit | None:
    """The tools a GRPO recipe's episodes may call (grpo.tools, grpo.environment); None without."""
    section, settings = methods.sampled(recipe)
    return episodes.Toolkit.of(settings, section)


def episode_scores(model, tokenizer, recipe: Recipe, records: list[Record], cfg: EvalConfig,
                   kit: episodes.Toolkit) -> tuple[dict, list, list[str], list]:
    """(scores, rendered, final answers, episodes): the held-out episodes played greedily with the tools, as
    training samples them (tooluse.episodes.run), each environment reset from its record."""
    renderer = mixture.Renderers(recipe.data, tokenizer, tools=kit.schemas())
    played = [kit.start(r.values, r.where) for r in records[: cfg.limit or None]]
    rendered = [renderer.render(r, e.observation) for r, e in zip(records, played)]
    chattemplate.say(renderer.notes)
    prompt_ids = [tokenizer(r.prompt, add_special_tokens=r.add_special_tokens)["input_ids"] for r in rendered]
    budget = methods.sampled(recipe)[1].max_completion_length
    model.eval()
    episodes.run(prompt_ids, played, episodes.greedy(model, tokenizer, cfg.batch_size),
                 episodes.Continuation(renderer.base.chat, tokenizer), budget, episodes.eos_ids(model, tokenizer))
    predictions = [e.answer for e in played]
    return text_scores(predictions, rendered, cfg), rendered, predictions, played


def text_scores(predictions: list[str], rendered: list, cfg: EvalConfig) -> dict:
    references = [r.reference for r in rendered]
    scores = metrics.score(predictions, references, cfg.metrics)
    scores.update(metrics.extra(predictions, references, cfg.extra_metrics))
    return scores


def evaluate_model(model, tokenizer, recipe: Recipe, records: list[Record],
                   cfg: EvalConfig) -> tuple[dict, list[dict]]:
    kit, played = toolkit(recipe), None
    started = time.perf_counter()
    image_tokens = imagetokens.of(recipe.model)
    if kit is None:
        rendered = rendered_examples(recipe, tokenizer, records, cfg)
        scores, predictions = generation_scores(model, tokenizer, rendered, cfg, image_tokens)
    else:
        scores, rendered, predictions, played = episode_scores(model, tokenizer, recipe, records, cfg, kit)
    gen_seconds = time.perf_counter() - started
    if "loss" in cfg.metrics:  # on the tokens training's eval loss reads: every trained turn of each record scored
        renderer = mixture.Renderers(recipe.data, tokenizer, image_tokens=image_tokens)
        scored = {r.where for r in rendered}
        pieces = [x for record in records if record.where in scored for x in renderer.examples(record)]
        examples, _ = build_examples(pieces, tokenizer, recipe.data, image_tokens)
        if examples:
            loss = token_loss(model, tokenizer, examples, cfg.batch_size, image_tokens)
            scores.update(eval_loss=loss, perplexity=math.exp(min(loss, 50)))
    # the training method's measures (preference accuracy and rewards on pairs, GRPO's rewards, ...)
    scores.update(preference.method_measures(model, tokenizer, recipe, records, cfg.limit, cfg.batch_size))
    more, extras = rewards.held_out(recipe, tokenizer, records, rendered, predictions, played)
    scores.update(more)
    if played is not None:
        scores.update(episode_means(played))
        extras = [dict(x, episode=e.transcript()) for x, e in zip(extras, played)]
    scores["examples"] = len(rendered)
    scores["generation_seconds"] = round(gen_seconds, 2)
    return scores, prediction_rows(rendered, predictions, extras)


def episode_means(played: list) -> dict:
    """Tool calls, failed calls and turns per held-out episode."""
    n = max(len(played), 1)
    return {"tool_calls_per_episode": sum(len(e.calls) for e in played) / n,
            "tool_failures_per_episode": sum(e.failures for e in played) / n,
            "turns_per_episode": sum(e.turns for e in played) / n}


def prediction_rows(rendered: list, predictions: list[str], extras: list[dict]) -> list[dict]:
    """predictions.jsonl's rows: each held-out example, its generation and what the method adds (rewards)."""
    return [{"where": r.where, "prompt": r.prompt, "reference": r.reference, "prediction": p,
             **({"images": [i.value if i.kind != "base64" else "(base64)" for i in r.images]} if r.images else {}),
             **extra} for r, p, extra in zip(rendered, predictions, extras)]


class DuringTraining:
    """Generation metrics at every Trainer evaluation (`training.eval_steps`, epochs, the last step), on
    the first `eval.limit` held-out examples, batched and split over the processes as `generate` does;
    the Trainer logs them beside eval_loss (SafeStateTrainer.evaluation_loop)."""

    def __init__(self, recipe: Recipe, tokenizer, records: list[Record], samples: Path | None = None):
        self.recipe, self.tokenizer, self.records, self.samples = recipe, tokenizer, records, samples
        self.cfg = recipe.eval
        self.kit = toolkit(recipe)
        self.image_tokens = imagetokens.of(recipe.model)
        self.rendered = rendered_examples(recipe, tokenizer, records, recipe.eval) if self.kit is None else None
        self.rows: list[dict] = []  # the last evaluation's predictions.jsonl rows

    def __call__(self, model) -> dict:
        training, played = model.training, None
        if self.kit is None:
            scores, predictions = generation_scores(model, self.tokenizer, self.rendered, self.cfg, self.image_tokens)
        else:  # fresh episodes each time: an environment's state is the episode's
            scores, self.rendered, predictions, played = episode_scores(model, self.tokenizer, self.recipe,
                                                                        self.records, self.cfg, self.kit)
            scores.update(episode_means(played))
        model.train(training)
        more, extras = rewards.held_out(self.recipe, self.tokenizer, self.records, self.rendered, predictions, played)
        scores.update(more)
        if played is not None:
            extras = [dict(x, episode=e.transcript()) for x, e in zip(extras, played)]
        self.rows = prediction_rows(self.rendered, predictions, extras)
        return {k: v for k, v in scores.items() if isinstance(v, (int, float))}

    def keep(self, step: int) -> None:
        """The last evaluation's rows appended to `samples` (samples.jsonl, cut back on resume) with the step."""
        if self.samples is not None:
            with open(self.samples, "a", encoding="utf-8") as f:
                f.writelines(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n" for row in self.rows)


def default_out(target: Target) -> Path:
    if target.location is not None:
        return target.location / EVAL_DIR
    return Path("runs") / f"eval-{Path(target.spec).stem.replace('/', '_')}"


def evaluate(target: Target, cfg: EvalConfig, data: str | None = None, out: Path | None = None,
             dtype: str = "auto", force: bool = False) -> dict:
    out = out or default_out(target)
    with outputs.exclusive(out, "eval output"):
        outputs.check_free(out, force, "eval output")
        return _evaluate(target, cfg, data, out, dtype)


def _evaluate(target: Target, cfg: EvalConfig, data: str | None, out: Path, dtype: str) -> dict:
    records = records_for(target, data)
    torch_dtype = eval_dtype(dtype)
    tokenizer = loader.load_tokenizer(target.recipe.model, target.tokenizer_dir)
    model = load_trained(target, torch_dtype)
    scored = methods.spec_of(target.recipe).score_head  # a reward model: its held-out pairs scored, nothing generated
    log.info("eval %s: %d examples, batch %d, %s, %s", target.label, min(len(records), cfg.limit or len(records)),
             cfg.batch_size, "each pair scored" if scored else f"greedy, max {cfg.max_new_tokens} new tokens",
             torch_dtype)
    if scored:
        scores, rows = rewardmodel.evaluate_pairs(model, tokenizer, target.recipe, records, cfg)
    else:
        scores, rows = evaluate_model(model, tokenizer, target.recipe, records, cfg)
    result = {
        "target": target.spec,
        "kind": target.kind,
        "scores": scores,
        "settings": {
            "data": data or "recipe eval split",
            "greedy": True,
            "batch_size": cfg.batch_size,
            "max_new_tokens": cfg.max_new_tokens,
            "dtype": str(torch_dtype).removeprefix("torch."),
            "bleu_signature": scores.get("bleu_signature"),
            "chrf_signature": scores.get("chrf_signature"),
            "metrics": {name: metrics.METRICS[name].settings for name in ([] if scored else cfg.metrics)},
        },
    }
    with outputs.atomic_dir(out) as tmp:
        outputs.write_json(tmp / "metrics.json", result)
        (tmp / "predictions.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    log.info("eval written to %s", out)
    return result


def end_of_training(recipe: Recipe, run_dir: Path) -> dict:
    """Score a finished run as `tunekit eval RUN_DIR` would, with the recipe's eval settings. eval/
    appears only once complete, and run.json says it is pending until then, so that `--resume` can
    finish it."""
    record = RunRecord.load(run_dir)
    record.update(run_dir, eval="pending")
    target = resolve_target(str(run_dir))
    result = evaluate(target, recipe.eval, out=run_dir / EVAL_DIR, force=True)
    record.update(run_dir, eval="completed")
    print(format_table([(target.label, result["scores"])]))
    return result

