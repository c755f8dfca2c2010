"""plan and data: what a recipe will cost (memory per device, time per step) and what training will see of its
data, both before loading any weights."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tunekit.api import arguments, checks, recipeargs
from tunekit.api.recipeargs import Overrides, RecipeLike
from tunekit.config.schema import Recipe
from tunekit.core import console
from tunekit.core.errors import TunekitError


@dataclass
class PlanResult:
    """The plan (tunekit.plan.estimate.Plan: `peak` bytes per device, `parts`, `step_seconds`, ...), the recipe
    it was made for, and with a `gpu_memory` budget that it exceeds, the fixes that fit (label, plan)."""

    plan: object  # tunekit.plan.estimate.Plan
    recipe: Recipe
    gpu_memory: int | None = None
    fixes: list = field(default_factory=list)

    @property
    def peak(self) -> int:
        """Bytes per device at the step's peak."""
        return self.plan.peak

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.plan.peak <= self.gpu_memory

    def report(self) -> str:
        from tunekit.plan import report

        return report.text(self.recipe, self.plan, self.gpu_memory, self.fixes)

    def to_json(self) -> str:
        from tunekit.plan import report

        return report.to_json(self.plan)


def plan(recipe: RecipeLike, overrides: Overrides = None, world_size: int | None = None,
         gpu_memory: int | str | None = None, peak_tflops: float = 989.0, utilization: float = 0.4,
         memory_bandwidth: float | None = None, model_config: str | os.PathLike | None = None) -> PlanResult:
    """Memory per device and time per step, from the model's config alone (no weights). `world_size`: devices
    (default 1, or under training.parallelism its smallest layout's; sizes that do not divide it are refused, as a
    launch of that many is). `gpu_memory`: bytes or a size such as "24GiB"; a plan above it comes with fixes.
    `memory_bandwidth`: GB/s of the elementwise work. `model_config`: the model's config.json, for a model not
    downloaded here."""
    arguments.whole("world_size", world_size, optional=True)
    gpu_memory = arguments.size("gpu_memory", gpu_memory)
    arguments.number("peak_tflops", peak_tflops)
    arguments.number("utilization", utilization, most=1)
    arguments.number("memory_bandwidth", memory_bandwidth, optional=True)
    arguments.path("model_config", model_config, optional=True)
    console.attach(when_unconfigured=True)  # progress and log lines in a notebook or script
    # torch-free first; a model given by model_config need not be here
    loaded = checks.before_weights(recipeargs.load(recipe, overrides),
                                   checks.PLAN_GIVEN_CONFIG if model_config else checks.PLAN)
    from tunekit.models.info import config_file, fit_max_length

    given = config_file(str(model_config)) if model_config else None
    if given is not None and loaded.training.parallelism is not None:  # the heads it splits, as for a model here
        from tunekit.config import parallelconfig

        parallelconfig.check_model(loaded.training.parallelism, given, loaded.model.attn_implementation,
                                   f"--model-config {model_config}")
    world_size = checks.world(loaded, world_size)  # as training refuses the processes it launched
    from tunekit.core.hardware import resolve_precision
    from tunekit.plan import estimate, fixes

    loaded = fit_max_length(loaded, shipped=True, given=given)
    precision = loaded.training.precision  # planned as written: a GPU's precision need not exist here
    if precision == "auto":
        precision = resolve_precision("auto").name
    settings = estimate.settings_from(loaded, world_size, precision, peak_tflops=peak_tflops,
                                      utilization=utilization,
                                      memory_bandwidth=memory_bandwidth * 1e9 if memory_bandwidth else None)
    cfg, model = estimate.meta_model(loaded, given)
    result = estimate.make(loaded, settings, cfg, model)
    suggested = (fixes.suggestions(loaded, result, gpu_memory, cfg, model)
                 if gpu_memory and result.peak > gpu_memory else [])
    return PlanResult(result, loaded, gpu_memory, suggested)


@dataclass
class DataPreview:
    """What training will see of the data: `preview` (tunekit.data.preview.Preview: counts, tokens per role,
    lengths, the shown examples with their trained tokens marked), the split's facts, the contamination found."""

    preview: object  # tunekit.data.preview.Preview
    facts: dict
    found: dict

    def text(self, colour: bool = False) -> str:
        from tunekit.reporting import dataview

        return dataview.text(self.preview, self.facts, self.found, colour)

    def json_lines(self) -> str:
        from tunekit.reporting import dataview

        return dataview.json_lines(self.preview, self.facts, self.found)


def data(recipe: RecipeLike, overrides: Overrides = None, show: int = 3) -> DataPreview:
    """The training data as training prepares it, with `show` examples rendered; loads the tokenizer only."""
    arguments.whole("show", show, least=0)
    console.attach(when_unconfigured=True)  # progress and log lines in a notebook or script
    loaded = checks.before_weights(recipeargs.load(recipe, overrides), checks.DATA)  # before torch
    from tunekit.training import methods

    method = methods.of(loaded)
    if method.data_formats is not None:  # a method with its own data (pairs, labelled completions)
        raise TunekitError(f"training.method: {method.name} trains on {method.data_description}; tunekit data "
                           f"shows the examples of methods that train on every data format ({methods.DEFAULT})")
    from tunekit.data import imagetokens, preview
    from tunekit.models import info, tokenizer

    loaded = info.fit_max_length(loaded)  # as training fits it
    renderer = preview.renderer_for(loaded.data, tokenizer.load(loaded.model), imagetokens.of(loaded.model))
    records, facts, found = preview.training_records(loaded.data, loaded.training.seed)
    return DataPreview(preview.preview(records, renderer, loaded.data, show), facts, found)
