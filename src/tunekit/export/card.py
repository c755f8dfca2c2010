"""The model card (README.md) of what tunekit writes for others to load: `tunekit merge`'s directory, `tunekit
export --format safetensors`'s and `tunekit push`'s upload. One home for cards: YAML front matter the
Hugging Face Hub reads (base_model, library_name, tags, datasets, metrics, license, pipeline_tag), then the
run it came from: base model, method, data sources and counts, the eval table (before/after given the base
model's eval), the contamination report, the training curves (an SVG file beside the card), how to load it,
the license, the tunekit version and the resolved recipe. Files only: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tunekit.config.methods import DECLARED as METHODS
from tunekit.config.modelsource import looks_like_path, resolve_model
from tunekit.config.recipefile import load as load_recipe
from tunekit.config.recipefile import to_yaml
from tunekit.config.schema import DATA_SUFFIXES
from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import read_json
from tunekit.core.version import VERSION as __version__
from tunekit.evaluation.table import table_rows
from tunekit.runs.layout import ADAPTER_DIR, EVAL_DIR, METRICS_FIX, RECIPE_FILE, RunRecord, is_run

CURVES_FILE = "training_curves.svg"
ADAPTERS = {"lora": "LoRA", "qlora": "QLoRA", "full": "full fine-tuning"}
TITLES = {"adapter": "LoRA adapter", "merged": "Merged model"}
LIBRARY = {"adapter": "peft", "merged": "transformers"}
# the Hub's metric ids for the scores `tunekit eval` writes
HUB_METRICS = {"bleu": "bleu", "chrf": "chrf", "rouge1": "rouge", "rougeL": "rouge", "exact_match": "exact_match",
               "perplexity": "perplexity", "tool_call_args": "accuracy"}


@dataclass
class Card:
    name: str  # the model's name: the run's, or the file's
    what: str  # adapter | merged | a pushable export format's name
    base_model: str  # as the recipe (or the source) names it
    base_model_id: str | None = None  # its hub id, for the front matter; None where it is only a local path
    recipe: object | None = None  # the run's recipe
    record: RunRecord | None = None  # the run's run.json
    scores: dict | None = None  # the run's end-of-training eval (eval/metrics.json)
    baseline: dict | None = None  # the base model's eval of the same held-out data: the "before" column
    license: str | None = None
    weights: str = ""  # what the files are, in a few words
    notes: list[str] = field(default_factory=list)  # lines about how it was made (merge parity, GGUF check)
    repo: str | None = None  # where it is loaded from: a hub id, else "this_dir"
    curves: bool = False  # CURVES_FILE sits beside the card
    title: str | None = None  # default: what it is and its name
    format: Any = None  # the export format (export.writers.ExportFormat) of a pushed file: title, tags, usage
    peft_mend: bool = False  # an adapter plain peft 0.21.2 would load wrongly (models.peftconvert)


def hub_id(spec: str) -> str | None:
    """`spec` where it names a hub model (owner/name), else None (a local directory or GGUF file)."""
    try:
        return spec if resolve_model(spec).kind == "hub" else None
    except Exception:  # a local path that is gone: not a hub id either
        return None


def _hub_dataset(spec: str) -> bool:
    return not looks_like_path(spec) and Path(spec).suffix.lower() not in DATA_SUFFIXES and not Path(spec).exists()


def data_sources(recipe) -> list[str]:
    """The training (and eval) data as the recipe names it: a file or hub name per source."""
    out = []
    for spec in (recipe.data.train, recipe.data.eval):
        if spec is not None:
            out += [spec] if isinstance(spec, str) else [s.path for s in spec]
    return list(dict.fromkeys(out))


def from_run(run_dir: Path, what: str, **fields) -> Card:
    """A card for something made from the run in `run_dir` (its recipe, run.json and end-of-training eval)."""
    from tunekit.export.license import license_of

    recipe = load_recipe(run_dir / RECIPE_FILE)
    metrics_file = run_dir / EVAL_DIR / "metrics.json"
    scores = read_json(metrics_file, METRICS_FIX).get("scores") if metrics_file.is_file() else None
    base = recipe.model.name_or_path
    fields.setdefault("license", license_of(base))
    fields.setdefault("base_model_id", hub_id(base))
    fields.setdefault("peft_mend", what == "adapter" and _needs_mend(run_dir / ADAPTER_DIR, recipe))
    return Card(name=run_dir.resolve().name, what=what, base_model=base, recipe=recipe,
                record=RunRecord.load(run_dir) if is_run(run_dir) else None, scores=scores, **fields)


def _needs_mend(adapter_dir: Path, recipe) -> bool:
    """Whether peft 0.21.2 would rewrite this adapter's targets as it loads it (models.peftconvert)."""
    from tunekit.models import hub, info, peftconvert

    config = adapter_dir / "adapter_config.json"
    if not config.is_file():
        return False
    saved = read_json(config, "train the run again, or push the merged model")
    targets = saved.get("target_modules")
    if not peftconvert.may_be_rewritten(targets):  # a dense model's adapter: its base's config is not read
        return False
    try:
        raw = info.raw_config(recipe.model, shipped=True)
    except (hub.Unavailable, OSError, ValueError):
        return False
    return peftconvert.rewritten(raw, targets)


def front_matter(card: Card) -> dict:
    """The YAML header the Hub reads for its model page, search and filters."""
    method = card.record.training_method if card.record else card.recipe.training.method if card.recipe else None
    adapter = card.recipe.adapter_kind if card.recipe is not None else None
    meta: dict = {}
    if card.base_model_id:
        meta["base_model"] = card.base_model_id
    library = card.format.library if card.format is not None else LIBRARY[card.what]
    if library:
        meta["library_name"] = library
    if card.license:
        meta["license"] = card.license
    tags = ["tunekit", method, "full-fine-tuning" if adapter == "full" else adapter]
    tags += list(card.format.tags) if card.format is not None else []
    meta["tags"] = list(dict.fromkeys(t for t in tags if t))
    datasets = [s for s in data_sources(card.recipe) if _hub_dataset(s)] if card.recipe is not None else []
    if datasets:
        meta["datasets"] = datasets
    found = list(dict.fromkeys(HUB_METRICS[k] for k in (card.scores or {}) if k in HUB_METRICS))
    if found:
        meta["metrics"] = found
    meta["pipeline_tag"] = "text-classification" if scores_sequences(card) else "text-generation"
    return meta


def scores_sequences(card: Card) -> bool:
    """The model ends in a score head (a reward model): it scores sequences and generates nothing."""
    return card.recipe is not None and METHODS[card.recipe.training.method].score_head


def render(card: Card) -> str:
    header = yaml.safe_dump(front_matter(card), sort_keys=False, allow_unicode=True)
    what = f"{card.format.label} model" if card.format is not None else TITLES[card.what]
    title = card.title or f"{what}: {card.name}"
    parts = [f"---\n{header}---\n", f"# {title}\n", _summary(card)]
    parts += [section for section in (_usage(card), _data(card), _evaluation(card), _contamination(card),
                                      _curves(card), _recipe(card)) if section]
    return "\n".join(parts)


def _summary(card: Card) -> str:
    local = not card.base_model_id and _local(card.base_model)
    lines = [f"Base model: `{card.base_model}`" + (" (a local path where it was trained)" if local else "")]
    if card.recipe is not None:
        recipe, record = card.recipe, card.record
        method = record.training_method if record else recipe.training.method
        adapter = recipe.adapter_kind
        how = f"{method} ({_summary_of(method)}), {ADAPTERS.get(adapter, adapter)}"
        if recipe.lora is not None and adapter != "full":
            how += f" (rank {recipe.lora.r}, alpha {recipe.lora.alpha})"
        lines.append(f"Method: {how}")
        if record is not None:
            lines.append(f"Training: {record.global_step} steps, {record.effective_batch} examples per step, "
                         f"{record.precision.get('name')}; final train loss "
                         + (f"{record.train_loss:.4f}" if record.train_loss is not None else "-"))
    if card.weights:
        lines.append(f"Weights: {card.weights}")
    lines += card.notes
    lines.append(f"License: {card.license or 'not stated by the base model; check its own terms'}")
    lines.append(f"Made with tunekit {__version__}")
    return "  \n".join(lines) + "\n"


def _summary_of(method: str) -> str:
    from tunekit.training import methods  # the registry says what each method is

    try:
        return methods.get(method).summary
    except TunekitError:  # a method this version does not know (a run of another version)
        return "a training method this tunekit does not know"


def _local(spec: str) -> bool:
    return looks_like_path(spec) or spec.endswith(".gguf") or Path(spec).exists()


def _usage(card: Card) -> str:
    where = card.repo or "this_dir"
    task = "SequenceClassification" if scores_sequences(card) else "CausalLM"  # a reward model: its score head
    if card.what == "adapter":
        code = (f'from peft import AutoPeftModelFor{task}\nfrom transformers import AutoTokenizer\n\n'
                f'model = AutoPeftModelFor{task}.from_pretrained("{where}")\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{where}")')
        if not card.base_model_id:
            code += ("\n# the base model named in adapter_config.json is a local path: load your copy of it and\n"
                     f'# PeftModel.from_pretrained(base, "{where}")')
        if card.peft_mend:  # peft issue #3711
            code = ("# peft 0.21.2 would move this adapter's MLP targets to the routed experts: mend it first\n"
                    "from tunekit.models import peftconvert\npeftconvert.mend()\n" + code)
        return f"## How to load\n\n```python\n{code}\n```\n"
    if card.what == "merged":
        return (f"## How to load\n\n```python\nfrom transformers import AutoModelFor{task}, AutoTokenizer\n\n"
                f'model = AutoModelFor{task}.from_pretrained("{where}")\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{where}")\n```\n')
    return card.format.usage(card.repo)


def _data(card: Card) -> str:
    if card.recipe is None:
        return ""
    lines = ["## Data", "", "Sources: " + ", ".join(f"`{s}`" for s in data_sources(card.recipe))]
    data = (card.record.data or {}) if card.record else {}
    split, train, held = data.get("split") or {}, data.get("train") or {}, data.get("eval") or {}
    rows = [("records read", split.get("train_records_read")), ("training records", split.get("train")),
            ("held out", f"{split.get('held_out')} ({split.get('held_out_from') or 'none'})" if split else None),
            ("training examples", train.get("examples")), ("training tokens", train.get("tokens")),
            ("trained tokens (labels)", train.get("trained_tokens")), ("eval examples", held.get("examples"))]
    rows = [(k, v) for k, v in rows if v is not None]
    if rows:
        lines += ["", "| | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def _score(v) -> str:
    return "-" if v is None else (f"{v:d}" if isinstance(v, int) else f"{v:.2f}")


def _evaluation(card: Card) -> str:
    """The end-of-training scores; beside the base model's, with the change, when a baseline is given."""
    if not card.scores:
        return ""
    after, before = card.scores, card.baseline
    rows = [(k, name) for k, name in table_rows([after] + ([before] if before else [])) if k in after]
    if before:
        lines = ["| metric | base model (before) | this model (after) | change |", "|---|---|---|---|"]
        for key, name in rows:
            change = f"{after[key] - before[key]:+.2f}" if key in before and key != "examples" else ""
            lines.append(f"| {name} | {_score(before.get(key))} | {_score(after[key])} | {change} |")
        intro = "Greedy answers to the held-out examples, scored before (the base model) and after training."
    else:
        lines = ["| metric | this model |", "|---|---|"] + [f"| {name} | {_score(after[key])} |" for key, name in rows]
        intro = ("Greedy answers to the held-out examples after training (no base model eval was given: "
                 "`tunekit push --baseline EVAL_DIR` adds it).")
    return "\n".join(["## Evaluation", "", intro, ""] + lines) + "\n"


def _contamination(card: Card) -> str:
    found = ((card.record.data or {}).get("contamination") or {}) if card.record else {}
    if not found:
        return ""
    rows = [("training examples screened", found.get("train_examples")), ("eval examples", found.get("eval_examples")),
            ("duplicate training examples", found.get("duplicates")),
            ("eval examples sharing a prompt or answer with training", found.get("eval_exact")),
            ("eval examples sharing an n-gram with training", found.get("eval_ngram")),
            ("training examples dropped", found.get("dropped"))]
    settings = (f"data.dedup {'on' if found.get('dedup') else 'off'}, data.decontaminate "
                f"{'on' if found.get('decontaminate') else 'off'}")
    return "\n".join(["## Contamination", "", f"Held-out data checked against the training data ({settings}).", "",
                      "| | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v is not None]) + "\n"


def _curves(card: Card) -> str:
    return f"## Training curves\n\n![training curves]({CURVES_FILE})\n" if card.curves else ""


def _recipe(card: Card) -> str:
    if card.recipe is None:
        return ""
    return ("## Recipe\n\nThe recipe as trained, every default filled (`tunekit train`):\n\n"
            f"```yaml\n{to_yaml(card.recipe)}```\n")
