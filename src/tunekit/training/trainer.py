"""What tunekit adds to every upstream trainer (TrainerAdditions: LoRA+, parallelism on CPU processes, checkpoints
without pickles, generation metrics at evaluations) and SafeStateTrainer, the Trainer SFT runs with its loss path.

The stock Trainer writes optimizer.pt, scheduler.pt, scaler.pt and rng_state.pth with torch.save and a
pickled training_args.bin; DeepSpeed writes its shards with torch.save too. Here the same state goes
through checkpointfile (safetensors), DeepSpeed engines get a safetensors checkpoint engine, and the
TrainingArguments pickle is not written (the run's recipe.yaml holds the same settings).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from unittest import mock

import numpy as np
import torch
from transformers import Trainer

from tunekit.core import checkpointfile
from tunekit.core.errors import TunekitError
from tunekit.data.collating import TRAINED_POSITIONS
from tunekit.models import experts, kernels, losspath
from tunekit.runs.checkpoints import OPTIMIZER
from tunekit.training.cpuprocesses import ParallelOnCpu
from tunekit.training.loraplus import LoraPlusOptimizer
from tunekit.training.routerbalance import RouterBalance
from tunekit.training.sequencepieces import over_sequence_pieces, skip_first_batches

log = logging.getLogger("tunekit")

SCHEDULER = "scheduler.safetensors"
SCALER = "scaler.safetensors"


def _rng_file(args) -> str:
    return "rng_state.safetensors" if args.world_size <= 1 else f"rng_state_{args.process_index}.safetensors"


class SafeState:
    """Mixin for transformers.Trainer and its subclasses (TRL's trainers): checkpoints without pickles."""

    # --- DeepSpeed: the Trainer assigns its engine to self.deepspeed right after building it and before
    # loading a checkpoint into it; that is where the engine is switched to safetensors.
    @property
    def deepspeed(self):
        return self.__dict__.get("_deepspeed_engine")

    @deepspeed.setter
    def deepspeed(self, engine):
        if engine is not None:
            from tunekit.training.checkpointdeepspeed import use_safetensors

            use_safetensors(engine)
        self.__dict__["_deepspeed_engine"] = engine

    def _uses_deepspeed_scheduler(self) -> bool:
        if not self.is_deepspeed_enabled:
            return False
        from accelerate.utils import DeepSpeedSchedulerWrapper

        return isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper)

    @property
    def _sharded_state(self) -> bool:
        """The weights are DTensors (FSDP2, or a model split by transformers as it loaded): checkpoints gather them
        whole (checkpointfsdp), every rank taking part."""
        return self.is_fsdp_enabled or getattr(self, "is_distributed_loading_by_transformers", False)

    # --- weights: Trainer._save minus torch.save(self.args)
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self._sharded_state:  # every rank takes part in gathering the unsharded weights; rank 0 writes them
            from tunekit.training import checkpointfsdp

            state_dict = checkpointfsdp.model_state(self.model)
        if not self.args.should_save and not self.is_distributed_loading_by_transformers:
            return
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        # only the trained adapter: a frozen reference copy (TRL's "ref" adapter) is rebuilt at each start
        only = {"selected_adapters": ["default"]} if len(getattr(model, "peft_config", {})) > 1 else {}
        with experts.router_config_as_loaded(model):
            model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=self.args.should_save, **only)
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    # --- optimizer, scheduler, gradient scaler
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.is_deepspeed_enabled:
            # DeepSpeed saves optimizer shards (and its own scheduler) through the engine installed above.
            self.model_wrapped.save_checkpoint(output_dir, exclude_frozen_parameters=self._is_peft())
        elif self._sharded_state:
            from tunekit.training import checkpointfsdp

            state = checkpointfsdp.optimizer_state(self.model, self.optimizer)  # every rank takes part
            if self.args.should_save:
                checkpointfile.save(state, os.path.join(output_dir, OPTIMIZER))
        elif self.args.should_save:
            checkpointfile.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER))
        if self.args.should_save and not self._uses_deepspeed_scheduler():
            checkpointfile.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if self._sharded_state:
            from tunekit.training import checkpointfsdp

            checkpointfsdp.load_optimizer_state(self.model, self.optimizer,
                                           checkpointfile.load(os.path.join(checkpoint, OPTIMIZER)))
        elif not self.is_deepspeed_enabled:
            device = self.args.device if self.args.world_size > 1 and self.args.device.type != "cpu" else "cpu"
            self.optimizer.load_state_dict(checkpointfile.load(os.path.join(checkpoint, OPTIMIZER), device))
        if not self._uses_deepspeed_scheduler():
            self.lr_scheduler.load_state_dict(checkpointfile.load(os.path.join(checkpoint, SCHEDULER)))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Under FSDP the checkpoint's weights are the Trainer's ordinary, gathered safetensors files; each
        rank keeps its shard of them (the stock path reads only accelerate's FSDP files)."""
        if not self._sharded_state:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from tunekit.training import checkpointfsdp

        checkpointfsdp.load_weights(self.model, resume_from_checkpoint)

    def _save_scaler(self, output_dir: str) -> None:
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and self.args.should_save:
            checkpointfile.save(scaler.state_dict(), os.path.join(output_dir, SCALER))

    def _load_scaler(self, checkpoint: str | None) -> None:
        scaler = getattr(self.accelerator, "scaler", None)
        if checkpoint is not None and scaler is not None and os.path.isfile(os.path.join(checkpoint, SCALER)):
            scaler.load_state_dict(checkpointfile.load(os.path.join(checkpoint, SCALER)))

    # --- random number generators (each process its own file)
    def _save_rng_state(self, output_dir: str) -> None:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.random.get_rng_state_all()
        os.makedirs(output_dir, exist_ok=True)
        checkpointfile.save(state, os.path.join(output_dir, _rng_file(self.args)))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, _rng_file(self.args))
        if not os.path.isfile(path):  # saved under another world size
            log.warning("%s has no RNG state for this process; random draws will differ from the first run", checkpoint)
            return
        state = checkpointfile.load(path)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.random.set_rng_state(state["cpu"])
        if torch.cuda.is_available() and "cuda" in state:
            torch.cuda.random.set_rng_state_all(state["cuda"])

    def _is_peft(self) -> bool:
        from peft import PeftModel

        return isinstance(self.accelerator.unwrap_model(self.model), PeftModel)


class GenerationEval:
    """Mixin for transformers.Trainer and its subclasses: generation metrics at every evaluation."""

    def __init__(self, *args, generation_eval=None, **kwargs):
        self.generation_eval = generation_eval  # model -> {metric: value}, see evaluation.DuringTraining
        super().__init__(*args, **kwargs)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """The stock loss pass, then the generation metrics, so that both are logged together and reach
        the callbacks and best-checkpoint tracking as eval_<metric>."""
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                         metric_key_prefix)
        if self.generation_eval is not None:
            # TRL's unwrapping gathers ZeRO-3's partitioned weights once for the whole generation instead of at
            # every forward (measured on 2 CPU processes: 37 s -> a few seconds for 4 answers of 32 tokens); the
            # full model must then fit on each device, as it must for the end-of-training eval.
            from trl.models import unwrap_model_for_generation

            with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as model:
                scores = self.generation_eval(model)
            output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in scores.items()})
            if self.is_world_process_zero():
                self.generation_eval.keep(self.state.global_step)
        return output


def loss_head(model, chunked: bool, stock_only: bool) -> losspath.TrainedPositionsHead | None:
    """The SFT loss path, said once in the log: the kernels the model was patched with (training.kernels), else
    tunekit's chunked head (training.chunked_loss) or, None, the model's own loss (stock or Liger's)."""
    fused = kernels.applied(model)
    if fused is not None and stock_only:
        raise TunekitError(f"training.kernels: {fused}: this trainer computes its own loss (label smoothing or a "
                           "loss function); set training.kernels: none")
    if fused == "liger":
        log.info("loss: Liger's fused linear cross-entropy in the model's forward (training.kernels: liger); "
                 "tunekit's chunked loss is off")
        return None
    if fused == "cut_cross_entropy":
        log.info("loss: Cut Cross-Entropy on trained positions only (training.kernels: cut_cross_entropy); "
                 "tunekit's chunked loss is off")
        return losspath.TrainedPositionsHead(model, kernels.cce_loss_sum)
    return losspath.install(model) if chunked and not stock_only else None


class TrainerAdditions(LoraPlusOptimizer, ParallelOnCpu, SafeState, GenerationEval, RouterBalance):
    """What every tunekit trainer mixes into its upstream trainer (transformers' or TRL's), first among its
    bases: LoRA+, FSDP2 and tensor parallelism on CPU processes, pickle-free checkpoints, generation metrics,
    a mixture-of-experts model's expert load (counted over the loss pass only: RouterBalance comes after
    GenerationEval)."""


class SafeStateTrainer(TrainerAdditions, Trainer):
    """The Trainer tunekit runs for SFT: pickle-free checkpoints, the chunked loss (or training.kernels'),
    generation metrics."""

    def __init__(self, *args, chunked_loss: bool = False, **kwargs):
        # transformers refuses to checkpoint the optimizer of a model split as it loads (training.parallelism.tp):
        # its own writer cannot gather DTensor optimizer state. This one can (checkpointfsdp, the FSDP2 path), so the
        # refusal is passed with save_only_model shown set, and the checkpoints still hold the optimizer state.
        split = getattr(kwargs.get("model"), "is_distributed_loading_by_transformers", False) and "args" in kwargs
        with mock.patch.object(kwargs["args"], "save_only_model", True) if split else contextlib.nullcontext():
            super().__init__(*args, **kwargs)
        stock_only = self.label_smoother is not None or self.compute_loss_func is not None
        self.loss_head = loss_head(self.model, chunked_loss, stock_only)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        import transformers.trainer

        with mock.patch.object(transformers.trainer, "skip_first_batches", skip_first_batches):
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The stock loss, computed by `losspath` on trained positions only; normalized as the stock path
        does (by the Trainer's token count across accumulation steps and processes, else the batch mean). Under
        sequence parallelism each process holds a piece of every row, its labels already shifted (DeepSpeed's
        Ulysses loader): the mean is over the trained tokens of all the pieces."""
        pieces = "shift_labels" in inputs
        inputs = dict(inputs)
        keep = inputs.pop(TRAINED_POSITIONS, None)  # found by the collator; the model never sees them
        if self.loss_head is None or not (pieces or "labels" in inputs):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            loss = self.keep_aux_loss(outputs, loss, num_items_in_batch)  # a mixture of experts' router loss
            return (loss, outputs) if return_outputs else loss
        targets = inputs.pop("shift_labels") if pieces else losspath.shift_targets(inputs.pop("labels"))
        inputs.pop("labels", None)
        with self.loss_head.active(targets, keep):
            outputs = model(**inputs)
        total = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if pieces:
            engine = self.model_wrapped
            averaged = engine.zero_optimization_stage() == 3 and engine.zero_reduce_scatter()
            loss = over_sequence_pieces(total, self.loss_head.trained, averaged)
        elif self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = total / (num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch)
                            else num_items_in_batch)
            if self.args.average_tokens_across_devices:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1
                               else self.args.n_gpu)
        else:
            loss = total / self.loss_head.trained
        return (loss, outputs) if return_outputs else loss
