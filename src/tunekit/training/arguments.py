"""The recipe as the Trainer's arguments (transformers.TrainingArguments), with its DeepSpeed config resolved and
the optimizer the Trainer runs; and the check that every process runs them alike."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainingArguments

from tunekit.config import dsconfig, fsdpconfig, parallelconfig
from tunekit.config.recipefile import to_yaml
from tunekit.config.schema import Recipe
from tunekit.core import distributed
from tunekit.core.hardware import Precision
from tunekit.models import info
from tunekit.runs.layout import CHECKPOINTS_DIR


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
