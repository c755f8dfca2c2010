"""The first answer: what a command reads, checked before anything heavy (torch, transformers, datasets, ...) is
imported, so that a bad data line, a missing file or a model that cannot be had here is one line within a second
or two. train, validate, eval and plan run this first; a file's first CHECKED records are parsed here, and every
record again when data is prepared. Why, and what it costs: docs/data.md, "Reading records and the first check"."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

from tunekit.config import methods, rewardkinds
from tunekit.config.modelsource import resolve_model
from tunekit.config.schema import DataConfig, ModelConfig, Recipe
from tunekit.core.errors import TunekitError
from tunekit.data import images, mixture
from tunekit.data.formats import FORMATS, identical_pair
from tunekit.data.reading import file_records
from tunekit.models import hub, info, vision

log = logging.getLogger("tunekit")

CHECKED = 20_000  # records parsed per file


def data_files(recipe: Recipe) -> list[tuple[str, str, str, DataConfig]]:
    """(recipe key, file or hub name, split, the data settings it is read with) of every data source the recipe
    names: each source of a mixture (data.train[1], ...) with its own format and fields."""
    d = recipe.data
    found = [(s.key, s.spec, s.split, s.cfg) for s in mixture.sources(d)]
    if recipe.eval is not None and recipe.eval.data:
        found.append(("eval.data", recipe.eval.data, d.eval_split, d))
    return found


def _limit(key: str, cfg: DataConfig) -> int | None:
    """data.max_examples caps each training source."""
    return cfg.max_examples if key.startswith("data.train") else None


def check(recipe: Recipe, data_needed: bool, model: str) -> Recipe:
    """The recipe's data, then its model source, then data.max_length against the model's context window.
    `data_needed`: a hub data set that cannot be had here is an error (else a warning). `model`: "needed"
    (it must be readable here; a max_length set beyond the window is refused, and lowering a default one
    is left to training), "shipped" (else tunekit's copy of a well-known model's config, else an error),
    "optional" (as shipped, else a warning saying what was not checked) or "skip". "shipped" and "optional"
    return the recipe with data.max_length fitted."""
    checks = [c for c in (_reference_check(recipe), _images_check(recipe, model), _pairs_check(recipe))
              if c is not None]

    def each(record, parsed) -> None:
        for c in checks:
            c(record, parsed)
    for key, spec, split, cfg in data_files(recipe):
        check_data(spec, split, key, cfg, data_needed, _limit(key, cfg), each)
    assert model in ("needed", "shipped", "optional", "skip"), model
    if model == "skip":
        return recipe
    shipped, optional = model != "needed", model == "optional"
    fitted = _tolerated(lambda: info.raw_config(recipe.model, shipped), optional,
                        "data.max_length not checked against the model's context window: ")
    if model != "shipped":  # plan reads the model's config only, validate says what it could not check
        _tolerated(lambda: check_tokenizer(recipe.model), optional, "")
    if not fitted:
        return recipe
    recipe = info.fit_max_length(recipe, shipped=shipped, refuse_only=not shipped)
    _check_completion_room(recipe, shipped)
    return recipe


def _reference_check(recipe: Recipe):
    """For GRPO rewards that score against the reference answer: a check that each record has one."""
    key, settings = methods.sampled(recipe)
    needing = rewardkinds.needing_reference(settings.rewards, key) if settings is not None else []
    if not needing:
        return None

    def check(record, parsed) -> None:
        if not parsed.messages[-1]["content"].strip():
            raise TunekitError(f"{record.where}: no reference answer, and {needing[0]} scores against one; give "
                               "each record one (data.fields.answer) or use rewards without a reference")
    return check


def _pairs_check(recipe: Recipe):
    """For a method that learns only from the difference between a pair's answers (a reward model): a check that
    they differ (as rendered tokens they are checked again when the data is prepared)."""
    method = methods.spec_of(recipe)
    if not method.learns_from_difference:
        return None

    def check(record, parsed) -> None:
        if parsed.rejected is not None and parsed.rejected == parsed.messages[-1]["content"]:
            raise identical_pair(record.where, method)
    return check


def _images_check(recipe: Recipe, model: str):
    """Records with images (data.images) need a model that reads them (models.vision), trained with SFT. First, where
    the model's config can be read here: a `vision` section needs such a model, and a model.tokenizer beside one
    its image token (vision.check_recipe). A model that cannot be read here is said so, not taken for a text-only
    one (an error where `model` is "needed", else a warning)."""
    vision.check_recipe(recipe.model, recipe.vision)
    told: dict[str, bool | None] = {}

    def check(record, parsed) -> None:
        if not parsed.images:
            return
        if "reads" not in told:
            told["reads"] = vision.reads_images_here(recipe.model, needed=model == "needed",
                                                     local=Path(recipe.output_dir).parts[:1])
        if told["reads"] is False:
            images.refuse_text_only(parsed.images, recipe.model.name_or_path)
        if not methods.spec_of(recipe).images:
            able = ", ".join(m.name for m in methods.DECLARED.values() if m.images)
            raise TunekitError(f"{parsed.images[0].where}: the record has images, and training.method: "
                               f"{recipe.training.method} trains on text only; images train with method {able}")
    return check


def _check_completion_room(recipe: Recipe, shipped: bool) -> None:
    """Sampling (GRPO, RLOO, distillation on-policy or mixed): prompt + completion within the context window."""
    key, settings = methods.sampled(recipe)
    if settings is None and recipe.distill is not None and recipe.distill.samples:
        key, settings = "distill", recipe.distill
    found = info.context_window(recipe.model, shipped) if settings is not None else None
    if found and recipe.data.max_length + settings.max_completion_length > found[0]:
        window, where = found
        raise TunekitError(f"{key}.max_completion_length={settings.max_completion_length}: with prompts of up to "
                           f"data.max_length={recipe.data.max_length} tokens, sequences pass the model's context "
                           f"window of {window} tokens ({where}); keep the two within {window} together")


def _tolerated(step, optional: bool, said: str) -> bool:
    """Run `step`; a model that cannot be had here (hub.Unavailable) is an error, or with `optional` a
    warning (and False)."""
    try:
        step()
    except hub.Unavailable as e:
        if not optional:
            raise
        log.warning("%s%s", said, e)
        return False
    return True


def check_model(cfg: ModelConfig, shipped: bool = False) -> None:
    """The model (and a separate model.tokenizer) can be had here: a local directory with a config.json
    that reads, a GGUF file (a path or inside an installed package) with a readable header, a hub model
    that is cached or reachable. Raises hub.Unavailable where it cannot be had now."""
    info.raw_config(cfg, shipped)
    check_tokenizer(cfg)


def check_tokenizer(cfg: ModelConfig) -> None:
    """A model.tokenizer given apart from the model: there, or a hub id that is cached or reachable."""
    if cfg.tokenizer and resolve_model(cfg.tokenizer, "model.tokenizer").kind == "hub":
        hub.require(cfg.tokenizer, cfg.revision, "model.tokenizer")


def check_data(spec: str, split: str, key: str, cfg: DataConfig, needed: bool = True,
               limit: int | None = None, each=None) -> None:
    """A data file's first records (CHECKED, or `limit` when smaller) parse under cfg's format, and pass
    `each(record, parsed)` when given; a hub data set can be had here (else hub.Unavailable when `needed`, a
    warning otherwise)."""
    path = Path(spec)
    if not path.exists():
        try:
            hub.probe_dataset(spec, key)
        except hub.Unavailable as e:
            if needed:
                raise
            log.warning("%s; its records were not checked", e)
        return
    records = file_records(spec, key)  # refuses a path that is not a data file
    parse = FORMATS[cfg.format].parse
    count = 0
    for count, record in enumerate(  # noqa: B007 (count is read after the loop)
            itertools.islice(records, min(CHECKED, limit or CHECKED)), 1):
        parsed = parse(record, cfg.fields)
        if each is not None:
            each(record, parsed)
    if count == 0:
        raise TunekitError(f"{key}: {spec} holds no examples")
    if count == CHECKED:
        log.info("%s: the first %d records checked; the rest are checked as data is prepared", key, CHECKED)


def check_eval(recipe: Recipe, data: str | None, base_model: bool, tokenizer: bool) -> None:
    """`tunekit eval`: the one data source it scores (--data, else eval.data, else the held-out data) and the
    base model it loads (`base_model`: a base model, or a LoRA run's base) and its separate tokenizer
    (`tokenizer`: a base model only; a run or merged directory holds its own)."""
    d = recipe.data
    named = data or (recipe.eval.data if recipe.eval else None)
    found = [("--data" if data else "eval.data", named, d.eval_split, d)] if named else \
        [(s.key, s.spec, s.split, s.cfg) for s in mixture.eval_sources(d) or mixture.train_sources(d)]
    for key, spec, split, cfg in found:
        check_data(spec, split, key, cfg, limit=_limit(key, cfg))
    if base_model:
        info.raw_config(recipe.model, False)
    if tokenizer:
        check_tokenizer(recipe.model)
