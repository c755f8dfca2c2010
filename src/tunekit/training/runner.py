"""A training run: the recipe's data, model and trainer (its arguments: training.arguments), the fit, then the
final weights renamed into place and run.json completed (training.runrecord) in the run directory."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from transformers import EarlyStoppingCallback, Trainer, set_seed

from tunekit.config import defaults, dsconfig, fsdpconfig, parallelconfig
from tunekit.config.schema import Recipe
from tunekit.core import distributed, outputs
from tunekit.core.errors import TunekitError
from tunekit.core.hardware import resolve_precision
from tunekit.data import packing, preview
from tunekit.data.collating import CountingCollator
from tunekit.models import info, loader, vision
from tunekit.models.attention import choose as choose_attention
from tunekit.runs import checkpoints, layout
from tunekit.runs.layout import (
    ADAPTER_DIR,
    CHECKPOINTS_DIR,
    EXPERT_LOAD_FILE,
    HISTORY_FILE,
    INITIAL_ADAPTER_DIR,
    MODEL_DIR,
    SAMPLES_FILE,
    RunRecord,
)
from tunekit.training import (
    arguments,
    checkpointmark,
    diskspace,
    losshistory,
    methods,
    nonfinite,
    progress,
    runrecord,
    trackers,
)

log = logging.getLogger("tunekit")



@dataclass
class TrainResult:
    run_dir: Path
    recipe: Recipe  # as trained (data.max_length fitted to the model)
    trainer: Trainer | None  # None when --resume found only the end-of-training eval left


@dataclass
class Prepared:
    """Everything `fit` needs, built by `prepare` before any weights are trained."""

    recipe: Recipe
    run_dir: Path
    launch: distributed.Launch
    resume_from: Path | None
    trainer: Trainer
    collate: CountingCollator
    record: RunRecord


@dataclass(frozen=True)
class Launcher:
    """What a launcher that drives the processes from outside (training.raylaunch) brings to a run: its Trainer
    callbacks (after the run's own), the files it keeps in the run directory (a new start leaves them), and whether
    it holds the run directory's lock itself (from its own process, across restarts)."""

    callbacks: tuple = ()
    keep: tuple[str, ...] = ()
    holds_lock: bool = False


def run(recipe: Recipe, force: bool = False, resume: bool = False, launcher: Launcher = Launcher()) -> TrainResult:
    """Train the recipe into its run directory, or continue it from its newest complete checkpoint.
    The main process holds the run directory throughout. The end-of-training eval is the command's
    next step (`evaluation.end_of_training`), not part of training."""
    run_dir = Path(recipe.output_dir)
    launch = distributed.current()
    if resume:
        outputs.require_dir(run_dir, "--resume: output_dir")  # before the lock, which would create its parent
    recipe = info.fit_max_length(recipe)
    with outputs.exclusive(run_dir) if launch.is_main and not launcher.holds_lock else contextlib.nullcontext():
        data_world = parallelconfig.data_world(recipe.training.parallelism, launch.world_size)
        resume_from = layout.check_resume(recipe, run_dir, data_world) if resume else None
        if resume and resume_from is None:
            log.info("training in %s completed before; only its end-of-training eval is left", run_dir)
            return TrainResult(run_dir, recipe, None)
        force = force or replaces_failed_start(run_dir, launch, resume_from)
        try:
            with terminated_as_exit():
                prepared = prepare(recipe, run_dir, launch, force, resume_from, launcher)
                result = fit(prepared)
                finalize(prepared, result)
        except BaseException as e:
            if launch.is_main and layout.is_run(run_dir):
                layout.mark_ended(run_dir, e)  # run.json never stays "running" once this process ends
            raise
    return TrainResult(run_dir, recipe, prepared.trainer)


@contextlib.contextmanager
def terminated_as_exit():
    """SIGTERM (a scheduler's stop, torchrun stopping the other ranks) ends training as an error does, so run.json
    records it; Python's default would end the process where it stands."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(f"stopped by signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def replaces_failed_start(run_dir: Path, launch: distributed.Launch, resume_from: Path | None) -> bool:
    """A run that ended before its first optimizer step is replaced by a new start without --force."""
    why = layout.ended_before_training(run_dir) if resume_from is None else None
    if why and launch.is_main:
        log.info("output_dir %s holds a run that ended before its first step (%s); starting it again", run_dir, why)
    return why is not None


def prepare(recipe: Recipe, run_dir: Path, launch: distributed.Launch, force: bool,
            resume_from: Path | None, launcher: Launcher = Launcher()) -> Prepared:
    """Data, output directory, process group, model and Trainer; writes recipe.yaml and run.json. The training
    method (tunekit.training.methods) builds the data, its TRL config, its reference and its trainer."""
    method = methods.of(recipe)
    if resume_from is None:
        outputs.check_free(run_dir, force, "output_dir", launcher.keep)
    if launch.is_main:
        for line in defaults.applied(recipe):
            log.info("%s", line)
    trackers.check(recipe.training.report_to)
    start = layout.starting_adapter(recipe)
    precision = resolve_precision(recipe.training.precision)
    log.info("precision: %s (%s)", precision.name, precision.reason)
    parallel = parallel_layout(recipe, launch)
    ds = arguments.deepspeed_config(recipe, precision, launch.world_size)
    if ds is not None:
        log.info("deepspeed: %s; %s", recipe.training.deepspeed, dsconfig.describe(ds))
    if recipe.training.fsdp is not None:
        log.info("fsdp: %s", fsdpconfig.describe(recipe.training.fsdp, launch.cuda))

    # Tokenizer and data first: bad data fails here, before anything is written or loaded.
    tokenizer = loader.load_tokenizer(recipe.model)
    tokenizer.padding_side = "right"
    bundle = load_data(recipe, method, tokenizer)
    if launch.is_main and resume_from is None:
        # before the process group: the estimate builds the model from its config, which under a ZeRO-3
        # config would be a collective that only this process joins
        diskspace.warn_if_disk_short(recipe, run_dir)

    distributed.check_launcher(fsdp=recipe.training.fsdp is not None)
    process_group = distributed.prepare(deepspeed=ds is not None, fsdp=recipe.training.fsdp is not None)

    def trainer_arguments(rate: float | None = None):
        args = arguments.training_arguments(recipe, precision, run_dir, bundle.eval is not None, ds, process_group,
                                            rate, parallel)
        return method.trainer_config(args, recipe)

    args = trainer_arguments()
    if args.optim != recipe.training.optimizer:
        log.info("optimizer: %s (training.optimizer left at %s: the same AdamW, fused)", args.optim,
                 recipe.training.optimizer)
    arguments.same_everywhere(recipe, args)  # the process group is up (args.world_size sets it up)
    if launch.is_main:
        claim_run_dir(recipe, run_dir, force, resume_from, launcher.keep)
    inputs = methods.TrainerInputs(recipe, None, args, bundle, tokenizer, precision, False, "",
                                   start_adapter=start.path if start else None)
    found = None
    if recipe.training.learning_rate == "auto":
        found = auto_learning_rate(inputs, method, run_dir, resume_from)
        inputs.args = trainer_arguments(found["value"])  # anew: a DeepSpeed optimizer's "auto" rate is filled from it
    load_model(inputs, method, run_dir, launch.is_main and resume_from is None)
    record = runrecord.at_start(inputs, resume_from, start)
    record.learning_rate = found
    if launch.is_main:
        runrecord.write_run_files(recipe, run_dir, ds, record)
        preview.write_examples(run_dir / preview.EXAMPLES_FILE, preview.run_examples(bundle.train, tokenizer))
    inputs.callbacks = run_callbacks(recipe, run_dir) + list(launcher.callbacks)
    inputs.generation_eval = generation_eval(recipe, tokenizer, bundle.eval is not None, run_dir / SAMPLES_FILE)
    trainer, collate = build_trainer(method, inputs)
    trainer.expert_load_file = run_dir / EXPERT_LOAD_FILE
    progress.install(trainer, lambda: collate.real)
    for callback in inputs.callbacks:
        if isinstance(callback, losshistory.LossHistory):
            callback.tokens = lambda: collate.real
    return Prepared(recipe, run_dir, launch, resume_from, trainer, collate, record)


def parallel_layout(recipe: Recipe, launch: distributed.Launch) -> parallelconfig.Layout | None:
    """training.parallelism's sizes at this launch's world size (refused where they do not fit it), logged."""
    if recipe.training.parallelism is None:
        return None
    parallel = parallelconfig.layout(recipe.training.parallelism, launch.world_size)
    parallelconfig.require_device(parallel, launch.cuda)
    log.info("parallelism: %s", parallelconfig.describe(parallel))
    return parallel


def build_trainer(method: methods.Method, inputs: methods.TrainerInputs):
    """(trainer, counting collator) from the method, with what every method's trainer takes alike: LoRA+."""
    trainer, collate = method.make_trainer(inputs)
    trainer.loraplus_lr_ratio = inputs.recipe.lora.lr_ratio if inputs.recipe.lora else None
    return trainer, collate


def auto_learning_rate(inputs: methods.TrainerInputs, method: methods.Method, run_dir: Path,
                       resume_from: Path | None) -> dict:
    """training.learning_rate: auto: the rate a range test finds (a throwaway model trained by the method's own
    trainer), or on --resume the rate the run found before."""
    from tunekit.training import lrfind

    if resume_from is not None:
        found = RunRecord.load(run_dir).learning_rate
        if not found:
            raise TunekitError(f"--resume: {run_dir}/run.json has no learning rate found for training.learning_rate: "
                               "auto; start the run again with --force")
        log.info("learning rate: auto -> %.2g (found before the run was interrupted)", found["value"])
        return found

    def make_trainer(test_args, callback):
        test = dataclasses.replace(inputs, args=test_args, callbacks=[callback], generation_eval=None)
        load_model(test, method, run_dir, False)
        return build_trainer(method, test)[0]

    found = lrfind.find(make_trainer, inputs.args, inputs.recipe.training.lr_range_test_steps)
    log.info("%s", found.describe())
    return dataclasses.asdict(found)


def load_data(recipe: Recipe, method: methods.Method, tokenizer):
    """The method's tokenized train/eval data sets."""
    bundle = method.build_data(recipe, tokenizer)
    if recipe.training.metric_for_best and bundle.eval is None:
        raise TunekitError(f"training.metric_for_best: {recipe.training.metric_for_best} needs held-out data; "
                           "set data.eval or data.eval_fraction")
    log.info("prompt template: %s; prompt tokens %s", bundle.template,
             "masked" if recipe.data.mask_prompt else "trained")
    return bundle


def claim_run_dir(recipe: Recipe, run_dir: Path, force: bool, resume_from: Path | None,
                  keep: tuple[str, ...] = ()) -> None:
    """The main process takes the run directory, or cuts its history back to the checkpoint it resumes."""
    if resume_from is None:
        outputs.claim(run_dir, force, "output_dir", keep)
    else:
        log.info("resuming from %s", resume_from.name)
        for kept in (HISTORY_FILE, SAMPLES_FILE, EXPERT_LOAD_FILE):
            checkpoints.truncate_history(run_dir / kept, checkpoints.step_of(resume_from))


def load_model(inputs: methods.TrainerInputs, method: methods.Method, run_dir: Path, fresh_main: bool) -> None:
    """The model to train, with its adapter, into `inputs` (and whether batches are packed, the attention);
    `fresh_main`: the main process of a new run saves a rewritten adapter initialisation."""
    recipe = inputs.recipe
    set_seed(recipe.training.seed)  # what loading draws (the adapter is seeded again as it is made: models.loader)
    model = loader.load_for_training(recipe, inputs.precision, inputs.start_adapter)
    if inputs.start_adapter is not None:
        log.info("adapter: starting from %s", inputs.start_adapter)
    p = recipe.training.parallelism
    # ring attention is causal over the whole row; Ulysses takes rows of the micro-batch size: padded batches
    setting = False if p is not None and p.sp * p.cp > 1 else recipe.data.packing
    packed = method.packs and packing.use(model, setting,  # TRL's collators pad the pairs
                                          images=vision.reads_images(recipe.model))
    attention = choose_attention(model, recipe.model.attn_implementation, inputs.precision.name, packed,
                                 recipe.data.max_length)
    log.info("batches: %s; attention: %s", "packed (padding-free)" if packed else
             "padded" + (", grouped by length" if recipe.training.group_by_length else ""), attention.reason)
    if recipe.lora is not None and recipe.lora.init != "default" and fresh_main:
        loader.save_initial_adapter(model, run_dir / INITIAL_ADAPTER_DIR)
    inputs.model, inputs.packed, inputs.attention = model, packed, attention.name


def run_callbacks(recipe: Recipe, run_dir: Path) -> list:
    """Loss history, checkpoint marks, the non-finite stop, early stopping and the trackers."""
    return ([losshistory.LossHistory(run_dir / HISTORY_FILE), checkpointmark.MarkComplete(),
             nonfinite.StopOnNonFinite()]
            + ([EarlyStoppingCallback(recipe.training.early_stopping_patience)]
               if recipe.training.early_stopping_patience else [])
            + trackers.callbacks(recipe.training.report_to, run_dir, recipe.model_dump(mode="json"))
            + (fsdp_callbacks() if recipe.training.fsdp is not None else []))


def fsdp_callbacks() -> list:
    from tunekit.training import checkpointfsdp

    return [checkpointfsdp.ReportUnits()]


def generation_eval(recipe: Recipe, tokenizer, evaluates: bool, samples: Path | None = None):
    """BLEU/ROUGE/... at each evaluation during training, when the recipe has an eval section."""
    if not (evaluates and recipe.eval is not None and recipe.eval.during_training):
        return None
    from tunekit.evaluation.evaluator import DuringTraining, held_out_records

    return DuringTraining(recipe, tokenizer, held_out_records(recipe), samples)


FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _out_of_space(e: BaseException) -> str | None:
    """The reason, when `e` says the disk (or the file-size limit) is full. safetensors reports I/O
    errors as SafetensorError("... (os error 28)"), not as OSError, so its text is read too."""
    if isinstance(e, OSError) and e.errno in FULL:
        return e.strerror
    found = re.search(r"os error (\d+)", str(e))
    if found and int(found.group(1)) in FULL:
        return os.strerror(int(found.group(1)))
    return None


def fit(p: Prepared):
    """The Trainer's loop; a failure is recorded in run.json, and a full disk becomes one line."""
    trainer = p.trainer
    try:
        return trainer.train(resume_from_checkpoint=str(p.resume_from) if p.resume_from else None)
    except BaseException as e:
        for callback in trainer.callback_handler.callbacks:  # close the progress bars before the error line
            if isinstance(callback, progress.Console):
                callback.close()
        if p.launch.is_main:
            p.record.fail(p.run_dir, e, trainer.state.global_step)
        if distributed.lost_peer(e):
            last = checkpoints.newest_complete(p.run_dir / CHECKPOINTS_DIR)
            raise TunekitError(
                f"lost contact with another process at step {trainer.state.global_step}: a rank or a node stopped "
                "(its own log says why); relaunch every node with --resume to continue from "
                f"{last.name if last else 'the start (no checkpoint was complete)'}") from None
        reason = _out_of_space(e)
        if reason:
            last = checkpoints.newest_complete(p.run_dir / CHECKPOINTS_DIR)
            raise TunekitError(
                f"out of disk space in {p.run_dir} at step {trainer.state.global_step} ({reason}); free space, then "
                f"add --resume to continue from {last.name if last else 'the start (no checkpoint was complete)'}"
            ) from None
        raise


def finalize(p: Prepared, result) -> None:
    """The final adapter or model, renamed into place once complete, and the completed run.json."""
    trainer, run_dir = p.trainer, p.run_dir
    final = run_dir / (MODEL_DIR if p.recipe.full_finetuning else ADAPTER_DIR)
    # save_model gathers ZeRO-3 shards and must run on every rank; only rank 0 writes files.
    tmp = run_dir / f".{final.name}.partial"
    if p.launch.is_main and tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed while saving
    trainer.save_model(str(tmp))
    if p.launch.is_main:
        if p.recipe.lora is not None and p.recipe.lora.init != "default":
            loader.convert_to_plain_lora(tmp, run_dir / INITIAL_ADAPTER_DIR)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        runrecord.complete(p.record, run_dir, trainer, result, p.collate, p.recipe, final)
        if p.record.best:
            b = p.record.best
            log.info("%s/ holds the best checkpoint: step %d, %s %.4f%s", final.name, b["step"], b["metric"],
                     b["value"], f"; stopped early at step {b['last_step']}" if b["stopped_early"] else "")
        log.info("run directory: %s (%s/)", run_dir, final.name)
    distributed.finish()
