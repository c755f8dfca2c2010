"""Ray Train's reporting fed from the run: at each checkpoint tunekit completes, `ray.train.report` with the metrics
logged so far and that checkpoint, registered where it lies in the run directory (no copy); at the end of
training, the last metrics. As Ray's own RayTrainReportCallback does (on_save, merged log_history), with the
checkpoint tunekit marked complete in place of a copy. `report` is a barrier: every rank calls it, rank 0 alone
with the checkpoint (Ray keeps rank 0's metrics)."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback


def metrics_of(log_history: list[dict], step: int) -> dict:
    """The latest value of every logged number, with the step."""
    merged: dict = {}
    for entry in log_history:
        merged.update({k: v for k, v in entry.items() if isinstance(v, (int, float))})
    merged["step"] = step
    return merged


class ReportToRay(TrainerCallback):
    """After checkpointmark.MarkComplete in the callback list: a checkpoint is reported once it is complete."""

    def on_save(self, args, state, control, **kwargs):
        import ray.train

        metrics = metrics_of(state.log_history, state.global_step)
        if state.is_world_process_zero:
            ckpt = ray.train.Checkpoint.from_directory(str(Path(args.output_dir) / f"checkpoint-{state.global_step}"))
            # NO_UPLOAD: already in the run's storage (Ray's experiment folder), registered as it lies
            ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
                             delete_local_checkpoint_after_upload=False)
        else:
            ray.train.report(metrics)

    def on_train_end(self, args, state, control, **kwargs):
        import ray.train

        ray.train.report(metrics_of(state.log_history, state.global_step))
