"""The checks a recipe passes before any weights are loaded, in one order for `validate`, `train`, `plan` and
`data`: the output directory can be written (validate and train), the data parse and the model can be had
(data.precheck), GRPO's rewards can be made (a function reward's module imports), then DeepSpeed's own check
of training.deepspeed and its "auto" values resolved against the recipe (validate and train; they import
deepspeed and torch, seconds). What each verb asks of the data and the model differs (`data_needed`, `model`:
see data.precheck.check); the rules and their order do not."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tunekit.config import methods
from tunekit.config.schema import Recipe
from tunekit.core.errors import TunekitError

log = logging.getLogger("tunekit")


@dataclass(frozen=True)
class Needs:
    """What a verb asks of the recipe's surroundings: see data.precheck.check for `data_needed` and `model`.
    `output_dir`: the run directory must be creatable and writable. `deepspeed`: DeepSpeed's own check runs."""

    data_needed: bool
    model: str
    output_dir: bool = False
    deepspeed: bool = False
    benchmarks: str = ""  # eval.benchmarks: "names" (lm-eval there, names known, task files readable), "data" too

VALIDATE = Needs(data_needed=False, model="optional", output_dir=True, deepspeed=True, benchmarks="names")
# train checks output_dir itself (--resume, locks)
TRAIN = Needs(data_needed=True, model="needed", deepspeed=True, benchmarks="data")
PLAN = Needs(data_needed=False, model="shipped")
PLAN_GIVEN_CONFIG = Needs(data_needed=False, model="skip")
DATA = Needs(data_needed=True, model="needed")


def before_weights(recipe: Recipe, needs: Needs, world_size: int | None = None) -> Recipe:
    """Every check that refuses the recipe before a weight is loaded; returns the recipe as data.precheck
    fits it. `world_size`: DeepSpeed's batch size is checked for this many processes (None: not checked here;
    training checks it at its real world size)."""
    if needs.output_dir:
        from tunekit.core.outputs import check_writable

        check_writable(Path(recipe.output_dir), "output_dir")
    from tunekit.data import precheck

    recipe = precheck.check(recipe, data_needed=needs.data_needed, model=needs.model)
    from tunekit.training import methods as trainers

    trainers.of(recipe).check(recipe, needs.model)  # the method's own: distillation's teacher
    if recipe.training.parallelism is not None and needs.model != "skip":
        parallelism(recipe, needs.model)
    if needs.model != "skip":
        from tunekit.models import moecheck

        recipe = moecheck.check_recipe(recipe)  # a mixture of experts' (its LoRA dropout settled)
    section, settings = methods.sampled(recipe)
    if settings is not None:  # a reward's own code imports (trust_local_code: the recipe asked for it)
        from tunekit.evaluation import rewards

        rewards.check_loadable(settings.rewards, settings.max_completion_length, section)
        from tunekit.tooluse.episodes import Toolkit

        kit = Toolkit.of(settings, section)  # tools and environment import, each with a schema, the class with reset
        if kit is not None:
            kit.probe()  # one environment made: a constructor that raises is found before weights load
    if needs.deepspeed and recipe.training.deepspeed:
        deepspeed(recipe, world_size)
    if needs.benchmarks and recipe.eval is not None and recipe.eval.benchmarks is not None:
        from tunekit.evaluation import benchmarks  # lm-eval there; before training, every task's data at hand

        benchmarks.import_lm_eval()
        benchmarks.check_tasks(recipe.eval.benchmarks.tasks, "eval.benchmarks.tasks", data=needs.benchmarks == "data")
    return recipe


def parallelism(recipe: Recipe, model: str) -> None:
    """training.parallelism against the model's shape (heads, tensor-parallel plan), read from its config.json; a
    model that cannot be had here is checked when it can (`tunekit validate` of a hub model offline)."""
    from tunekit.config import parallelconfig
    from tunekit.models import hub, info

    try:
        config = info.model_config(recipe.model, shipped=model == "shipped")
    except hub.Unavailable:
        if model == "needed":
            raise
        return
    parallelconfig.check_model(recipe.training.parallelism, config, recipe.model.attn_implementation,
                               f"model.name_or_path {recipe.model.name_or_path}")


def launch_world(recipe: Recipe, world_size: int | None, option: str = "--world-size") -> int | None:
    """`world_size` as given, or training.ray.workers (the processes a Ray run starts), which it must not
    contradict."""
    ray = recipe.training.ray
    if ray is None:
        return world_size
    if world_size is not None and world_size != ray.workers:
        raise TunekitError(f"{option} {world_size} contradicts training.ray.workers {ray.workers}, the processes the "
                           f"run starts; leave {option} out or make them agree")
    return ray.workers


def world(recipe: Recipe, world_size: int | None, option: str = "--world-size") -> int:
    """The world size a recipe is planned or validated at, refused where training.parallelism's sizes do not fit
    it, with the rule training applies to the processes it launched (config.parallelconfig.layout); None (no
    --world-size) is training.ray.workers, or 1, or under training.parallelism the fewest processes its sizes run
    on, said in one line."""
    given = launch_world(recipe, world_size, option)
    if given != world_size:
        world_size, option = given, "training.ray.workers"
    p = recipe.training.parallelism
    if p is None:
        return 1 if world_size is None else world_size
    from tunekit.config import parallelconfig

    if world_size is not None:
        parallelconfig.layout(p, world_size, option)
        return world_size
    fewest = p.split * (p.dp_replicate * (p.dp_shard or 1) if p.sp == 1 else 1)
    if fewest > 1:
        lay = parallelconfig.layout(p, fewest, option)
        log.info("%s left out: planned at %d, the fewest processes training.parallelism runs on (%s); give %s for "
                 "more", option, fewest, parallelconfig.describe(lay), option)
    return fewest


def deepspeed(recipe: Recipe, world_size: int | None) -> None:
    """DeepSpeed's own check of training.deepspeed (it imports deepspeed and torch), then its "auto" values
    filled from the recipe at the precision training would take here; a contradiction raises."""
    from tunekit.config import dsconfig

    path = recipe.training.deepspeed
    dsconfig.check_file(path)
    from tunekit.core.hardware import resolve_precision

    where = f"training.deepspeed {path}"
    dsconfig.resolve(dsconfig.read(path, where), recipe, world_size, resolve_precision(recipe.training.precision).name,
                     where)
