"""run.json as a training run writes it: the record as training starts, and what it holds once it completes."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tunekit.config import parallelconfig
from tunekit.config.recipefile import to_yaml
from tunekit.config.schema import Recipe
from tunekit.core import outputs
from tunekit.models import loader
from tunekit.runs.layout import DEEPSPEED_FILE, RECIPE_FILE, RunRecord
from tunekit.training import methods

log = logging.getLogger("tunekit")


def at_start(inputs: methods.TrainerInputs, resume_from: Path | None, start) -> RunRecord:
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


def best_checkpoint(trainer, recipe: Recipe) -> dict | None:
    """Which evaluation the final weights come from, with metric_for_best; whether training stopped early."""
    t, state = recipe.training, trainer.state
    if not t.metric_for_best or state.best_global_step is None:
        return None
    planned = state.max_steps
    return {"metric": t.metric_for_best, "greater_is_better": t.best_is_greater, "value": state.best_metric,
            "step": state.best_global_step, "stopped_early": state.global_step < planned,
            "last_step": state.global_step}


def complete(record: RunRecord, run_dir: Path, trainer, result, collate, recipe: Recipe, final: Path) -> None:
    """run.json once the final weights stand: status, losses, the last evaluation's scores, throughput, memory."""
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    last_eval = next((h for h in reversed(history) if "eval_loss" in h), {})
    runtime = result.metrics.get("train_runtime")
    record.update(
        run_dir,
        status="completed",
        finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        global_step=trainer.state.global_step,
        train_loss=result.training_loss,
        first_logged_loss=losses[0] if losses else None,
        last_logged_loss=losses[-1] if losses else None,
        eval_loss=last_eval.get("eval_loss"),
        best=best_checkpoint(trainer, recipe),
        eval_scores={k.removeprefix("eval_"): v for k, v in last_eval.items()
                     if k.startswith("eval_") and not k.endswith(("_runtime", "_per_second"))},
        output=final.name,
        throughput={
            "train_runtime_s": runtime,
            "tokens_real": collate.real,
            "tokens_computed": collate.computed,
            "padding_fraction": collate.padding_fraction,
            "real_tokens_per_s": collate.real / runtime if runtime else None,
            "note": "this process's batches, eval passes during training included",
        },
        peak_memory_gb=peak_memory_gb(),
    )


def peak_memory_gb() -> dict:
    """Peak resident memory of this process and, on GPU, peak allocated CUDA memory."""
    import resource

    import torch

    out = {"cpu_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}
    if torch.cuda.is_available():
        out["cuda_allocated"] = torch.cuda.max_memory_allocated() / 1024**3
    return out
