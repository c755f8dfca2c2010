"""FSDP2 and tensor parallelism on CPU processes (gloo), where accelerate would not run them.

accelerate turns an FSDP plugin into FSDP only for GPU-like devices and otherwise falls back to DDP without a word
(AcceleratorState.__init__, accelerate 1.15); FSDP2 itself runs on CPU with gloo, so the plugin is installed here,
once the accelerator exists and again just before the model is wrapped (TRL's GRPO trainer leaves the state
re-initialised in between)."""

from __future__ import annotations

import contextlib
from unittest import mock

from tunekit.training.sequencepieces import follow_epochs


class ParallelOnCpu:
    """Mixin for transformers.Trainer and its subclasses (TRL's trainers): FSDP2 and a ParallelismConfig taken on
    CPU processes as on GPUs."""

    def create_accelerator_and_postprocess(self):
        with self._parallel_on_cpu() if self.args.parallelism_config is not None else contextlib.nullcontext():
            super().create_accelerator_and_postprocess()
        self._fsdp_on_cpu()

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        self._fsdp_on_cpu()
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if hasattr(train_dataloader, "sp_world_size"):  # DeepSpeed's Ulysses loader (training.parallelism.sp)
            follow_epochs(train_dataloader)
        return model, train_dataloader

    def _parallel_on_cpu(self):
        """accelerate 1.15 takes a ParallelismConfig only on GPU-like devices, FSDP2 or DeepSpeed
        (ParallelismConfig._validate_accelerator refuses MULTI_CPU). A model split by transformers as it loads
        (training.parallelism.tp) owns its placement and runs on CPU processes with gloo (a two-process run
        equals one: tests/e2e/test_parallel_runs.py), so there the check is shown the processes as the devices they
        stand in for; everything else it checks still holds."""
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DistributedType

        check = ParallelismConfig._validate_accelerator

        def validate(config, accelerator):
            state = accelerator.state
            if state.distributed_type != DistributedType.MULTI_CPU:
                return check(config, accelerator)
            state.distributed_type = DistributedType.MULTI_GPU
            try:
                return check(config, accelerator)
            finally:
                state.distributed_type = DistributedType.MULTI_CPU

        return mock.patch.object(ParallelismConfig, "_validate_accelerator", validate)

    def _fsdp_on_cpu(self) -> None:
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if self.args.fsdp_plugin_args is None or state.distributed_type == DistributedType.FSDP:
            return
        if state.distributed_type != DistributedType.MULTI_CPU:
            raise RuntimeError(f"training.fsdp: accelerate did not enable FSDP ({state.distributed_type})")
        if getattr(state, "fsdp_plugin", None) is None:
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        state.distributed_type = DistributedType.FSDP
        self.is_fsdp_enabled = True
