"""Recipe -> TrainingArguments -> transformers.Trainer (saving safetensors only) -> run directory."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments, set_seed

from tunekit.config import defaults, dsconfig, fsdpconfig, parallelconfig
from tunekit.config.recipes import to_yaml
from tunekit.config.schema import Recipe
from tunekit.core import distributed, outputs
from tunekit.core.errors import TunekitError
from tunekit.core.hardware import Precision, resolve_precision
from tunekit.data import packing, preview
from tunekit.data.collating import CountingCollator
from tunekit.models import info, loader, vision
from tunekit.models.attention import choose as choose_attention
from tunekit.runs import checkpoints, layout
from tunekit.runs.layout import (
    ADAPTER_DIR,
    CHECKPOINTS_DIR,
    DEEPSPEED_FILE,
    HISTORY_FILE,
    INITIAL_ADAPTER_DIR,
    MODEL_DIR,
    RECIPE_FILE,
    SAMPLES_FILE,
    RunRecord,
)
from tunekit.training import checkpointing, methods, preflight, progress, trackers

log = logging.getLogger("tunekit")



class LossHistory(TrainerCallback):
    """Appends every Trainer log line to loss_history.jsonl as it happens (main process only), with the
    wall-clock time it was logged and, once the collator is known, the real tokens this process has collated so
    far (`tokens_collated`: throughput between lines, steady-state tokens/s in bench/gpu_check.py). The data
    loader collates one batch ahead of the step logged, except at an epoch's end."""

    def __init__(self, path: Path):
        self.path = path
        self.tokens = None  # () -> int, set once the trainer's collator exists

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            counted = {"tokens_collated": self.tokens()} if self.tokens else {}
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": state.global_step, "epoch": state.epoch, "time": round(time.time(), 3),
                                    **counted, **logs}) + "\n")


def deepspeed_config(recipe: Recipe, precision: Precision, world_size: int, shipped: bool = False) -> dict | None:
    """The recipe's DeepSpeed JSON with every "auto" that the recipe decides filled in (`shipped`: the
    hidden size may come from tunekit's copy of a well-known model's config)."""
    if recipe.training.deepspeed is None:
        return None
    hidden = getattr(info.model_config(recipe.model, shipped), "hidden_size", None)
    return dsconfig.resolve(dsconfig.read(recipe.training.deepspeed), recipe, world_size, precision.name,
                            f"training.deepspeed {recipe.training.deepspeed}", hidden)


def _every(kind: str, steps: int | None) -> dict:
    """Every `steps` optimizer steps, else at each epoch end (TrainingArguments' <kind>_strategy/<kind>_steps)."""
    return {f"{kind}_strategy": "steps", f"{kind}_steps": steps} if steps else {f"{kind}_strategy": "epoch"}


FUSED_ADAMW = "adamw_torch_fused"


def optimizer_name(t, ds: dict | None, cuda: bool) -> str:
    """training.optimizer as the Trainer runs it: AdamW left at its default runs fused (one kernel a step for every
    tensor together, as axolotl and torchtune default to on GPUs; on a CPU 4 ms against 22 for LoRA r16 on SmolLM2's
    420 tensors), except under DeepSpeed, whose engine steps the optimizer, and with weights sharded over CPU
    processes (FSDP2, training.parallelism), where torch's fused CPU kernel is not checked; a value the recipe sets
    is kept as set."""
    sharded_on_cpu = not cuda and (t.fsdp is not None or t.parallelism is not None)
    if t.optimizer == "adamw_torch" and "optimizer" not in t.model_fields_set and ds is None and not sharded_on_cpu:
        return FUSED_ADAMW
    return t.optimizer


# the base rate the arguments carry while training.learning_rate: auto is still being found
PROVISIONAL_RATE = 1e-4


def training_arguments(recipe: Recipe, precision: Precision, run_dir: Path, has_eval: bool,
                       ds: dict | None = None, process_group: dict | None = None,
                       learning_rate: float | None = None,
                       parallel: parallelconfig.Layout | None = None) -> TrainingArguments:
    """The Trainer's arguments for the recipe; `process_group` holds what `distributed.prepare` set up;
    `learning_rate`: the rate found for training.learning_rate: auto; `parallel`: training.parallelism's sizes at
    this launch's world size."""
    t = recipe.training
    rate = learning_rate or (PROVISIONAL_RATE if t.learning_rate == "auto" else t.learning_rate)
    save = _every("save", t.save_steps or t.max_steps)
    evaluation = _every("eval", t.eval_steps or t.max_steps) if has_eval else {"eval_strategy": "no"}
    if has_eval and t.eval_on_start:
        evaluation["eval_on_start"] = True
    best: dict = {}
    if t.metric_for_best and has_eval:
        # the best checkpoint is kept and loaded at the end, so one is saved at every evaluation
        save = {"save_strategy": evaluation["eval_strategy"], **({"save_steps": evaluation["eval_steps"]}
                                                                 if "eval_steps" in evaluation else {})}
        best = {"load_best_model_at_end": True, "metric_for_best_model": t.metric_for_best,
                "greater_is_better": t.best_is_greater, "restore_callback_states_from_checkpoint": True}
    args = TrainingArguments(
        output_dir=str(run_dir / CHECKPOINTS_DIR),
        per_device_train_batch_size=t.micro_batch_size,
        per_device_eval_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps or -1,
        learning_rate=rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_steps or t.warmup_ratio,
        weight_decay=t.weight_decay,
        neftune_noise_alpha=t.neftune_noise_alpha,
        max_grad_norm=t.max_grad_norm,
        optim=optimizer_name(t, ds, distributed.current().cuda),
        bf16=precision.name == "bf16",
        fp16=precision.name == "fp16",
        activation_checkpointing=t.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if t.gradient_checkpointing else None,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        save_total_limit=t.save_total_limit,
        seed=t.seed,
        data_seed=t.seed,
        deepspeed=ds,
        **fsdpconfig.trainer_arguments(t.fsdp, distributed.current().cuda),
        parallelism_config=parallelconfig.accelerate_config(parallel, recipe.model.attn_implementation)
        if parallel else None,
        report_to="none",  # tracker callbacks come from trackers.callbacks, TensorBoard's aimed at the run dir
        run_name=run_dir.name,
        project="tunekit",
        remove_unused_columns=False,
        logging_nan_inf_filter=False,  # a NaN loss must be seen, not averaged away
        train_sampling_strategy="group_by_length" if t.group_by_length else "random",
        **save,
        **evaluation,
        **best,
        **(process_group or {}),
    )
    if t.fsdp is not None:  # transformers passes no mixed-precision policy of its own to the FSDP plugin
        args.fsdp_plugin_args["mixed_precision_policy"] = fsdpconfig.mixed_precision_policy(t.fsdp, precision.name)
    return args


def peak_memory_gb() -> dict:
    """Peak resident memory of this process and, on GPU, peak allocated CUDA memory."""
    import resource

    import torch

    out = {"cpu_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}
    if torch.cuda.is_available():
        out["cuda_allocated"] = torch.cuda.max_memory_allocated() / 1024**3
    return out


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


def run(recipe: Recipe, force: bool = False, resume: bool = False) -> TrainResult:
    """Train the recipe into its run directory, or continue it from its newest complete checkpoint.
    The main process holds the run directory throughout. The end-of-training eval is the command's
    next step (`evaluation.end_of_training`), not part of training."""
    run_dir = Path(recipe.output_dir)
    launch = distributed.current()
    if resume:
        outputs.require_dir(run_dir, "--resume: output_dir")  # before the lock, which would create its parent
    recipe = info.fit_max_length(recipe)
    with outputs.exclusive(run_dir) if launch.is_main else contextlib.nullcontext():
        data_world = parallelconfig.data_world(recipe.training.parallelism, launch.world_size)
        resume_from = layout.check_resume(recipe, run_dir, data_world) if resume else None
        if resume and resume_from is None:
            log.info("training in %s completed before; only its end-of-training eval is left", run_dir)
            return TrainResult(run_dir, recipe, None)
        force = force or replaces_failed_start(run_dir, launch, resume_from)
        try:
            with terminated_as_exit():
                prepared = prepare(recipe, run_dir, launch, force, resume_from)
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
            resume_from: Path | None) -> Prepared:
    """Data, output directory, process group, model and Trainer; writes recipe.yaml and run.json. The training
    method (tunekit.training.methods) builds the data, its TRL config, its reference and its trainer."""
    method = methods.of(recipe)
    if resume_from is None:
        outputs.check_free(run_dir, force, "output_dir")
    if launch.is_main:
        for line in defaults.applied(recipe):
            log.info("%s", line)
    trackers.check(recipe.training.report_to)
    start = layout.starting_adapter(recipe)
    precision = resolve_precision(recipe.training.precision)
    log.info("precision: %s (%s)", precision.name, precision.reason)
    parallel = parallel_layout(recipe, launch)
    ds = deepspeed_config(recipe, precision, launch.world_size)
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
        preflight.warn_if_disk_short(recipe, run_dir)

    distributed.check_launcher(fsdp=recipe.training.fsdp is not None)
    process_group = distributed.prepare(deepspeed=ds is not None, fsdp=recipe.training.fsdp is not None)

    def arguments(rate: float | None = None):
        args = training_arguments(recipe, precision, run_dir, bundle.eval is not None, ds, process_group, rate,
                                  parallel)
        return method.trainer_config(args, recipe)

    args = arguments()
    if args.optim != recipe.training.optimizer:
        log.info("optimizer: %s (training.optimizer left at %s: the same AdamW, fused)", args.optim,
                 recipe.training.optimizer)
    same_everywhere(recipe, args)  # the process group is up (args.world_size sets it up)
    if launch.is_main:
        claim_run_dir(recipe, run_dir, force, resume_from)
    inputs = methods.TrainerInputs(recipe, None, args, bundle, tokenizer, precision, False, "",
                                   start_adapter=start.path if start else None)
    found = None
    if recipe.training.learning_rate == "auto":
        found = auto_learning_rate(inputs, method, run_dir, resume_from)
        inputs.args = arguments(found["value"])  # anew: a DeepSpeed optimizer's "auto" rate is filled from it
    load_model(inputs, method, run_dir, launch.is_main and resume_from is None)
    record = run_record(inputs, resume_from, start)
    record.learning_rate = found
    if launch.is_main:
        write_run_files(recipe, run_dir, ds, record)
        preview.write_examples(run_dir / preview.EXAMPLES_FILE, preview.run_examples(bundle.train, tokenizer))
    inputs.callbacks = run_callbacks(recipe, run_dir)
    inputs.generation_eval = generation_eval(recipe, tokenizer, bundle.eval is not None, run_dir / SAMPLES_FILE)
    trainer, collate = build_trainer(method, inputs)
    progress.install(trainer, lambda: collate.real)
    for callback in inputs.callbacks:
        if isinstance(callback, LossHistory):
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


def same_everywhere(recipe: Recipe, args: TrainingArguments) -> None:
    """Every process, on every node, runs the same tunekit and libraries on the same recipe."""
    if args.world_size == 1:
        return
    import hashlib

    from tunekit.core.outputs import versions

    facts = {f"{name} version": str(v) for name, v in versions().items()}
    hints = dict.fromkeys(facts, "install the same versions on every node (pip freeze on one, install that list "
                                 "on the others)")
    recipe_key = "recipe (sha256 of it as loaded, overrides applied)"
    facts[recipe_key] = hashlib.sha256(to_yaml(recipe).encode()).hexdigest()[:16]
    hints[recipe_key] = "give every node the same recipe file and the same --set overrides"
    distributed.check_same_everywhere(facts, hints)


def load_data(recipe: Recipe, method: methods.Method, tokenizer):
    """The method's tokenized train/eval data sets."""
    bundle = method.build_data(recipe, tokenizer)
    if recipe.training.metric_for_best and bundle.eval is None:
        raise TunekitError(f"training.metric_for_best: {recipe.training.metric_for_best} needs held-out data; "
                           "set data.eval or data.eval_fraction")
    log.info("prompt template: %s; prompt tokens %s", bundle.template,
             "masked" if recipe.data.mask_prompt else "trained")
    return bundle


def claim_run_dir(recipe: Recipe, run_dir: Path, force: bool, resume_from: Path | None) -> None:
    """The main process takes the run directory, or cuts its history back to the checkpoint it resumes."""
    if resume_from is None:
        outputs.claim(run_dir, force, "output_dir")
    else:
        log.info("resuming from %s", resume_from.name)
        for kept in (HISTORY_FILE, SAMPLES_FILE):
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


def run_record(inputs: methods.TrainerInputs, resume_from: Path | None, start) -> RunRecord:
    """run.json as training starts (logged: parameters and the batch per optimizer step)."""
    recipe, args, bundle, precision = inputs.recipe, inputs.args, inputs.data, inputs.precision
    total, trainable = loader.count_parameters(inputs.model)
    log.info("parameters: %s total, %s trainable (%.2f%%), adapter: %s", f"{total:,}", f"{trainable:,}",
             100 * trainable / max(total, 1), recipe.adapter_kind)
    data_world = parallelconfig.data_world(recipe.training.parallelism, args.world_size)
    effective = data_world * args.per_device_train_batch_size * args.gradient_accumulation_steps
    shared = f" ({data_world} seeing different batches)" if data_world != args.world_size else ""
    log.info("batch: world size %d%s x micro-batch %d x accumulation %d = %d examples per optimizer step",
             args.world_size, shared, args.per_device_train_batch_size, args.gradient_accumulation_steps, effective)
    return RunRecord(
        status="running", started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=outputs.command_line(),
        versions=outputs.versions(), precision={"name": precision.name, "reason": precision.reason},
        adapter=recipe.adapter_kind, training_method=recipe.training.method, base_model=recipe.model.name_or_path,
        parameters={"total": total, "trainable": trainable}, world_size=args.world_size, effective_batch=effective,
        resumed_from=resume_from.name if resume_from else None, adapter_from=start.source if start else None,
        data={"template": bundle.template, "packed": inputs.packed, "attention": inputs.attention,
              "split": {k: v for k, v in bundle.split.items() if k != "mix"}, "mix": bundle.split.get("mix"),
              "contamination": bundle.contamination,
              "train": vars(bundle.train_stats), "eval": vars(bundle.eval_stats) if bundle.eval_stats else None},
    )


def write_run_files(recipe: Recipe, run_dir: Path, ds: dict | None, record: RunRecord) -> None:
    """recipe.yaml (as trained), the resolved DeepSpeed config and run.json, by the main process."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RECIPE_FILE).write_text(to_yaml(recipe), encoding="utf-8")
    if ds is not None:
        outputs.write_json(run_dir / DEEPSPEED_FILE, ds)
    record.save(run_dir)


def run_callbacks(recipe: Recipe, run_dir: Path) -> list:
    """Loss history, checkpoint marks, the non-finite stop, early stopping and the trackers."""
    return ([LossHistory(run_dir / HISTORY_FILE), checkpointing.MarkComplete(), checkpointing.StopOnNonFinite()]
            + ([EarlyStoppingCallback(recipe.training.early_stopping_patience)]
               if recipe.training.early_stopping_patience else [])
            + trackers.callbacks(recipe.training.report_to, run_dir, recipe.model_dump(mode="json"))
            + (fsdp_callbacks() if recipe.training.fsdp is not None else []))


def fsdp_callbacks() -> list:
    from tunekit.training import fsdpstate

    return [fsdpstate.ReportUnits()]


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


def best_checkpoint(trainer: Trainer, recipe: Recipe) -> dict | None:
    """Which evaluation the final weights come from, with metric_for_best; whether training stopped early."""
    t, state = recipe.training, trainer.state
    if not t.metric_for_best or state.best_global_step is None:
        return None
    planned = state.max_steps
    return {"metric": t.metric_for_best, "greater_is_better": t.best_is_greater, "value": state.best_metric,
            "step": state.best_global_step, "stopped_early": state.global_step < planned,
            "last_step": state.global_step}


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
        history = trainer.state.log_history
        losses = [h["loss"] for h in history if "loss" in h]
        last_eval = next((h for h in reversed(history) if "eval_loss" in h), {})
        runtime = result.metrics.get("train_runtime")
        p.record.update(
            run_dir,
            status="completed",
            finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            global_step=trainer.state.global_step,
            train_loss=result.training_loss,
            first_logged_loss=losses[0] if losses else None,
            last_logged_loss=losses[-1] if losses else None,
            eval_loss=last_eval.get("eval_loss"),
            best=best_checkpoint(trainer, p.recipe),
            eval_scores={k.removeprefix("eval_"): v for k, v in last_eval.items()
                         if k.startswith("eval_") and not k.endswith(("_runtime", "_per_second"))},
            output=final.name,
            throughput={
                "train_runtime_s": runtime,
                "tokens_real": p.collate.real,
                "tokens_computed": p.collate.computed,
                "padding_fraction": p.collate.padding_fraction,
                "real_tokens_per_s": p.collate.real / runtime if runtime else None,
                "note": "this process's batches, eval passes during training included",
            },
            peak_memory_gb=peak_memory_gb(),
        )
        if p.record.best:
            b = p.record.best
            log.info("%s/ holds the best checkpoint: step %d, %s %.4f%s", final.name, b["step"], b["metric"],
                     b["value"], f"; stopped early at step {b['last_step']}" if b["stopped_early"] else "")
        log.info("run directory: %s (%s/)", run_dir, final.name)
    distributed.finish()
