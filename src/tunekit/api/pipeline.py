"""validate, train, evaluate: a recipe checked, trained into its run directory (then scored and reported), and
runs or models scored on held-out data. Heavy libraries are imported inside, after the checks that need none."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tunekit.api import arguments, checks, recipeargs
from tunekit.api.recipeargs import Overrides, RecipeLike
from tunekit.config.schema import Recipe
from tunekit.core import console
from tunekit.core.errors import TunekitError

log = logging.getLogger("tunekit")


@dataclass
class Validated:
    """A recipe that passed every check `train` runs before loading weights."""

    recipe: Recipe  # every default filled, files made absolute
    deepspeed: dict | None = None  # the DeepSpeed config resolved for `world_size`, when asked for
    world_size: int | None = None
    precision: str | None = None  # and why, for the resolved DeepSpeed config

    @property
    def yaml(self) -> str:
        from tunekit.config import recipefile

        return recipefile.to_yaml(self.recipe)


def validate(recipe: RecipeLike, overrides: Overrides = None, world_size: int | None = None) -> Validated:
    """Refuse (TunekitError) whatever `train` would refuse before loading weights. A model or hub data set that
    cannot be had here is named in a warning. With `world_size`, the DeepSpeed config is also resolved for that
    many processes and returned; DeepSpeed's own check runs in any case (it imports torch: seconds)."""
    arguments.whole("world_size", world_size, optional=True)
    console.attach(when_unconfigured=True)  # progress and log lines in a notebook or script
    loaded = recipeargs.load(recipe, overrides)
    world_size = checks.launch_world(loaded, world_size)
    loaded = checks.before_weights(loaded, checks.VALIDATE, world_size or 1)
    if world_size is not None:  # training.parallelism's sizes must divide it, as a launch of that many
        checks.world(loaded, world_size)
    if not (loaded.training.deepspeed and world_size):
        return Validated(loaded)
    from tunekit.core.hardware import resolve_precision
    from tunekit.training.arguments import deepspeed_config

    precision = resolve_precision(loaded.training.precision)
    return Validated(loaded, deepspeed_config(loaded, precision, world_size, shipped=True), world_size,
                     f"{precision.name} ({precision.reason})")


@dataclass
class TrainingRun:
    """A trained run: its directory, the recipe as trained, the end-of-training scores and the report page."""

    run_dir: Path
    recipe: Recipe
    scores: dict | None = None  # eval/metrics.json's scores, when the recipe has an eval section
    report: Path | None = None
    exit_code: int = 0  # of the processes started again under torch.distributed.run (see `train`)

    @property
    def files(self) -> list[Path]:
        return _files(self.run_dir)


def train(recipe: RecipeLike, overrides: Overrides = None, force: bool = False, resume: bool = False,
          argv: Sequence[str] | None = None) -> TrainingRun:
    """Train the recipe into its run directory (output_dir), then its end-of-training eval and report.html.
    `force`: replace an existing run; `resume`: continue it from its newest complete checkpoint. Everything
    that can be checked without torch is checked first, and the run directory is held (a second process on it
    is refused) from the checks through the report. Under several processes (torchrun) every process calls
    this; only the main one evaluates and reports. `argv`: the command line (`train RECIPE ...`) to start
    again as CPU processes when `accelerate launch --num_processes N` started one on a machine without GPUs."""
    arguments.flag("force", force)
    arguments.flag("resume", resume)
    if argv is not None and (not isinstance(argv, (list, tuple)) or not all(isinstance(a, str) for a in argv)):
        raise TunekitError(f"argv: expected a list of strings (the command line: train RECIPE ...) or None, got "
                           f"{type(argv).__name__} {argv!r}")
    console.attach(when_unconfigured=True)  # progress and log lines in a notebook or script
    loaded = recipeargs.load(recipe, overrides)
    if loaded.training.ray is not None:
        return _train_on_ray(loaded, force, resume)
    out = Path(loaded.output_dir)
    main_process = os.environ.get("RANK", "0") == "0"
    if resume or main_process:  # fail fast, before torch is imported
        _check_output(out, force, resume)
    if main_process:  # data and model before torch; then DeepSpeed's own check, which imports it
        world = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None
        loaded = checks.before_weights(loaded, checks.TRAIN, world)
    from tunekit.core import distributed

    requested = distributed.accelerate_cpu_request()
    if requested:
        if argv is None:
            raise TunekitError(f"accelerate started one process for --num_processes {requested} on a machine "
                               "without GPUs; run tunekit train under torchrun (tunekit launch) instead")
        log.info("accelerate started one process for --num_processes %d on a machine without GPUs; "
                 "starting %d CPU processes (gloo) with torch.distributed.run", requested, requested)
        return TrainingRun(out, loaded, exit_code=distributed.relaunch(requested, list(argv)))

    return _train_here(loaded, force, resume)


def _check_output(out: Path, force: bool, resume: bool, keep: tuple[str, ...] = ()) -> None:
    """--resume needs the run directory; a new run needs it free (or --force), but for a launcher's `keep` files."""
    from tunekit.core.outputs import check_free, check_writable, exclusive, require_dir

    if resume:
        require_dir(out, "--resume: output_dir")
        return
    check_writable(out, "output_dir")
    with exclusive(out):  # a run in progress is named, not reported as "exists"
        from tunekit.runs.layout import ended_before_training

        # a run that ended before its first step is started again without --force (training.runner says so)
        check_free(out, force or ended_before_training(out) is not None, "output_dir", keep)


def _train_here(loaded: Recipe, force: bool, resume: bool, launcher=None) -> TrainingRun:
    """This process's part of the run: training, then on the main process the end-of-training eval, the
    benchmarks and the report, the run directory held throughout (by `launcher`, a runner.Launcher, where it
    holds it itself)."""
    from tunekit.core.outputs import exclusive
    from tunekit.evaluation import evaluator
    from tunekit.training import runner

    launcher = launcher or runner.Launcher()
    out = Path(loaded.output_dir)
    if os.environ.get("RANK", "0") != "0":
        result = runner.run(loaded, force=force, resume=resume, launcher=launcher)
        return TrainingRun(out, result.recipe)
    with contextlib.nullcontext() if launcher.holds_lock else exclusive(out):  # through the end-of-training eval
        result = runner.run(loaded, force=force, resume=resume, launcher=launcher)
        scores = None
        if result.recipe.eval is not None:
            from tunekit.runs.layout import eval_scores

            scores = eval_scores(out) if result.trainer is None else None  # --resume of a run stopped in its benchmarks
            if scores is None:
                scores = evaluator.end_of_training(result.recipe, out)["scores"]
            if result.recipe.eval.benchmarks is not None:
                from tunekit.evaluation import benchrun

                benchrun.end_of_training(result.recipe, out)
        from tunekit.reporting import report

        page = report.write([out])
        log.info("report: %s", page)
    return TrainingRun(out, result.recipe, scores, page)


def _train_on_ray(loaded: Recipe, force: bool, resume: bool) -> TrainingRun:
    """training.ray: the checks here, then the run on the cluster's workers (training.raylaunch), each running
    `_ray_worker`; the run directory (output_dir, or under training.ray.storage) is the one every worker writes,
    held by this process for the whole job."""
    from tunekit.core.outputs import claim, exclusive
    from tunekit.runs.layout import check_resume, eval_scores
    from tunekit.training import raylaunch

    if "WORLD_SIZE" in os.environ:
        raise TunekitError("training.ray starts its own workers on the Ray cluster; run `tunekit train RECIPE` as one "
                           "process (not under torchrun, accelerate or tunekit launch), or remove training.ray")
    ray_cfg = loaded.training.ray
    out = raylaunch.run_dir_of(loaded.output_dir, ray_cfg)
    loaded = loaded.model_copy(update={"output_dir": str(out)})
    _check_output(out, force, resume, raylaunch.RAY_FILES)
    checks.world(loaded, None)
    loaded = checks.before_weights(loaded, checks.TRAIN, ray_cfg.workers)
    if resume:  # what every worker would refuse (a run already complete, no checkpoint), said here once
        from tunekit.config import parallelconfig

        check_resume(loaded, out, parallelconfig.data_world(loaded.training.parallelism, ray_cfg.workers))
    raylaunch.import_ray()

    def clear() -> None:
        """Once the cluster can give the workers: Ray's bookkeeping of an earlier job gone, and a new run's directory
        cleared, so that a checkpoint a restarted worker finds is this run's own."""
        raylaunch.forget(out)
        if not resume:
            claim(out, True, "output_dir")

    with exclusive(out):  # for the whole job, restarts included (the workers do not take it)
        raylaunch.launch(ray_cfg, out, _ray_worker, {"recipe": loaded, "resume": resume, "cwd": os.getcwd()}, clear)
    scores = eval_scores(out) if loaded.eval is not None else None
    page = out / "report.html"
    log.info("ray: finished; run directory %s", out)
    return TrainingRun(out, loaded, scores, page if page.is_file() else None)


def _ray_worker(config: dict) -> None:
    """A Ray Train worker: tunekit's training in Ray's process group, reporting to Ray (training.rayreport). A
    worker started again after a failure resumes from the run's last complete checkpoint."""
    from tunekit.runs.checkpoints import newest_complete
    from tunekit.runs.layout import CHECKPOINTS_DIR, RunRecord, eval_pending, is_run
    from tunekit.training import raylaunch, rayreport, runner

    console.attach(when_unconfigured=True)
    if Path(config["cwd"]).is_dir():
        os.chdir(config["cwd"])  # the driver's folder, where it is on this node: the recipe's relative paths
    recipe = config["recipe"]
    out = Path(recipe.output_dir)
    # the driver cleared the run directory of a new run: a complete checkpoint in it is this run's, from before a
    # restart (tunekit's own, not Ray's list: a worker killed in its report leaves the last one unregistered)
    resume = config["resume"] or newest_complete(out / CHECKPOINTS_DIR) is not None
    if resume and is_run(out) and RunRecord.load(out).status == "completed" and not eval_pending(recipe, out):
        log.info("the run in %s completed before this restart; nothing is left to do", out)
        return
    # a new start replaces what an attempt that failed before its first checkpoint left
    _train_here(recipe, force=not resume, resume=resume,
                launcher=runner.Launcher((rayreport.ReportToRay(),), raylaunch.RAY_FILES, holds_lock=True))


@dataclass
class Evaluation:
    """One target's scores, as written to `out`/metrics.json (with predictions.jsonl beside it)."""

    label: str  # run:NAME, merged:NAME or base:MODEL
    scores: dict
    out: Path
    metrics: dict = field(repr=False)  # the whole metrics.json: target, kind, scores, settings

    @property
    def files(self) -> list[Path]:
        return _files(self.out)


@dataclass
class Evaluations:
    """`evaluate`'s result: the target's evaluation, then the compared one's."""

    evaluations: list[Evaluation]

    @property
    def scores(self) -> dict:
        """The (first) target's scores."""
        return self.evaluations[0].scores

    def table(self) -> str:
        from tunekit.evaluation.table import format_table

        return format_table([(e.label, e.scores) for e in self.evaluations])


DTYPES = ("auto", "bf16", "fp16", "fp32")  # eval's and chat's model dtype, as `tunekit eval --dtype` takes it


def _file_given(flag: str, value) -> None:
    if value is not None and not Path(value).is_file():
        raise TunekitError(f"{flag} {value}: " + ("is a directory; give a file" if Path(value).is_dir() else
                                                  "file not found"))


def _target(spec: str, recipe: RecipeLike | None, data: str | None):
    """What `spec` names: a run, a merged directory, or a base model read with `recipe`'s data and prompt
    settings (or with `data` alone)."""
    from tunekit.runs.layout import Target, is_trained, resolve_target

    if recipe is None or recipeargs.is_path(recipe):
        return resolve_target(spec, None if recipe is None else str(recipe), data)
    path = Path(spec)
    if is_trained(path):
        return resolve_target(spec, None, data)
    from tunekit.config.modelsource import resolve_model

    resolve_model(spec, "eval target")
    return Target("base", spec, recipeargs.load(recipe, {"model.name_or_path": spec}))


def evaluate(target: str | os.PathLike, recipe: RecipeLike | None = None, data: str | os.PathLike | None = None,
             compare: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
             limit: int | None = None, batch_size: int | None = None, max_new_tokens: int | None = None,
             dtype: str = "auto", force: bool = False) -> Evaluations:
    """Generate on held-out data and score it, as `tunekit eval` does. `target` (and `compare`): a run directory,
    a merged directory or a base model (hub id, directory, GGUF file), which takes its data and prompt settings
    from `recipe` (path, dict or Recipe) or reads `data` alone. `data`: an eval file in place of the recipe's
    held-out data. `out`: where metrics.json and predictions.jsonl go (default TARGET/eval for a run; with
    `compare`, OUT/target and OUT/compare)."""
    for name, value in (("target", target), ("data", data), ("compare", compare), ("out", out)):
        arguments.path(name, value, optional=name != "target")
    if recipe is not None:
        recipeargs.check_type(recipe)
    for name, value in (("limit", limit), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        arguments.whole(name, value, optional=True)
    arguments.choice("dtype", dtype, DTYPES)
    arguments.flag("force", force)
    console.attach(when_unconfigured=True)  # progress and log lines in a notebook or script
    from pydantic import ValidationError

    from tunekit.config.recipefile import format_validation_error
    from tunekit.config.schema import EvalConfig
    from tunekit.data import precheck
    from tunekit.runs.layout import ADAPTER_DIR

    data = None if data is None else str(data)
    _file_given("--data", data)
    if recipeargs.is_path(recipe):
        _file_given("--recipe", str(recipe))
    resolved = [_target(str(t), recipe, data) for t in [target] + ([compare] if compare else [])]
    for t in resolved:  # before torch: a merged directory or a full fine-tuning run is its own model
        lora_run = t.kind == "run" and (t.location / ADAPTER_DIR).is_dir()
        precheck.check_eval(t.recipe, data, base_model=t.kind == "base" or lora_run, tokenizer=t.kind == "base")
    from tunekit.evaluation import evaluator

    found = []
    for i, t in enumerate(resolved):
        base = t.recipe.eval or EvalConfig()
        updates = {k: v for k, v in (("limit", limit), ("batch_size", batch_size),
                                    ("max_new_tokens", max_new_tokens)) if v is not None}
        try:
            cfg = EvalConfig.model_validate({**base.model_dump(), **updates})
        except ValidationError as e:
            raise TunekitError(format_validation_error(e, "eval")) from None
        where = (Path(out) / ("target" if i == 0 else "compare") if out and compare
                 else (Path(out) if out else evaluator.default_out(t)))
        result = evaluator.evaluate(t, cfg, data, where, dtype, force)
        found.append(Evaluation(t.label, result["scores"], where, result))
    return Evaluations(found)


def _files(path: Path) -> list[Path]:
    """The files under a directory (or the file itself), sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
