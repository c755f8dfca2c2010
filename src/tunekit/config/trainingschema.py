"""The recipe's training section (training:): optimisation, precision, checkpoints and evaluation steps, and the
two ways of sharding or splitting the work beyond DeepSpeed's JSON config, training.fsdp (FSDP2) and
training.parallelism; the section's own rules beside its fields. The rest of the recipe, and `Recipe` itself, is
config.schema."""

from __future__ import annotations

import math
from typing import Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from tunekit.config import methods, plugins
from tunekit.config.section import Section

PrecisionName = Literal["auto", "bf16", "fp16", "fp32"]  # as written; hardware.Precision is the resolved one
plugins.run("declare")  # installed plugins' methods, before training.method's choices are fixed


class FsdpConfig(Section):
    """PyTorch FSDP2 (per-parameter sharding with `fully_shard`) through accelerate; the alternative to
    training.deepspeed."""

    reshard_after_forward: bool = Field(
        True, description="true: parameters, gradients and optimizer state stay sharded across processes, each "
        "layer gathered for its forward and again for its backward (like ZeRO-3); false: a layer's gathered "
        "parameters are kept from its forward to its backward (less communication, more memory; like ZeRO-2).")
    cpu_offload: bool = Field(False, description="Keep the sharded parameters, gradients and optimizer state in CPU "
                              "memory; the optimizer step runs on the CPU.")
    auto_wrap: bool = Field(True, description="Shard each decoder layer as its own unit (the model's "
                            "_no_split_modules), so only one layer is gathered at a time; false shards the model "
                            "as one unit.")
    activation_checkpointing: bool = Field(
        False, description="FSDP's activation checkpointing of each decoder layer (use it in place of "
        "training.gradient_checkpointing under FSDP).")
    reduce_dtype: Literal["float32", "param"] = Field(
        "float32", description="Precision of the gradient reduction across processes: float32, or the dtype the "
        "parameters compute in (training.precision; less traffic, less exact).")


class ParallelismConfig(Section):
    """Splitting one batch's work across processes, past data parallelism, through accelerate's
    ParallelismConfig: the product tp x sp x cp of the sizes is the processes that share each batch; the world
    size over that product is data parallel (config.parallelconfig holds the rules)."""

    tp: int = Field(1, ge=1, description="Tensor parallel: each layer's matrices split over this many processes "
                    "(transformers' tensor-parallel plan for the architecture); must divide the attention and "
                    "key/value heads.")
    sp: int = Field(1, ge=1, description="Sequence parallel: each sequence split over this many processes, the "
                    "attention heads exchanged around attention (DeepSpeed's Ulysses, ALST); needs "
                    "training.deepspeed and must divide the attention heads.")
    sp_backend: Literal["deepspeed"] = Field("deepspeed", description="The sequence-parallel engine: deepspeed, "
                                             "the one accelerate has.")
    cp: int = Field(1, ge=1, description="Context parallel: each sequence split over this many processes, keys and "
                    "values passed round a ring (torch's context parallel, SDPA attention); needs training.fsdp "
                    "and a GPU.")
    cp_backend: Literal["torch"] = Field("torch", description="The context-parallel engine: torch, the one "
                                         "accelerate has.")
    dp_shard: int | None = Field(None, ge=1, description="Processes the model is sharded over (FSDP2) beside tp "
                                 "or cp; null: the world size over tp x cp x dp_replicate.")
    dp_replicate: int = Field(1, ge=1, description="Replicas of that sharding (HSDP: sharded within a node, "
                              "replicated across nodes), with tp or cp.")

    @model_validator(mode="after")
    def _rules(self) -> "ParallelismConfig":
        if self.sp > 1 and self.cp > 1:
            raise ValueError("training.parallelism.sp and training.parallelism.cp both split the sequence; keep one "
                             "(sp under DeepSpeed, cp under FSDP2)")
        return self

    @property
    def split(self) -> int:
        """Processes that share each batch: tp x sp x cp."""
        return self.tp * self.sp * self.cp


RAY_URI_SCHEMES = ("s3://", "gs://", "gcs://", "abfs://", "hdfs://", "ray://")


class RayConfig(Section):
    """The run as a Ray Train job (TorchTrainer) on a Ray cluster: `tunekit train RECIPE` connects, starts the
    workers, and each runs tunekit's own training (DDP, ZeRO or FSDP2 as the recipe says) in one process group
    (tunekit.training.raylaunch)."""

    workers: int = Field(..., ge=1, description="Training processes (Ray Train workers): the world size.")
    resources_per_worker: dict[str, float] | None = Field(
        None, description="Ray resources each worker takes, e.g. {CPU: 8, GPU: 1}; null: one GPU (and one CPU) "
        "per worker where the cluster has GPUs, else one CPU. GPU: 0 or 1 (one process drives one GPU).")
    address: str | None = Field(
        None, description="The cluster: null connects to RAY_ADDRESS or a cluster started on this machine "
        "(ray start), else starts a local one for the run; or HOST:PORT of the head node's GCS, or auto.")
    storage: str | None = Field(
        None, description="A directory every node mounts (NFS, a cluster volume); the run directory is then "
        "STORAGE/<output_dir's name>. null: output_dir as written (one machine, or output_dir already shared).")
    max_failures: int = Field(0, ge=-1, description="Times Ray restarts the workers after one fails (-1: without "
                              "limit); each restart resumes from the run's last complete checkpoint.")
    start_timeout: float = Field(60.0, gt=0, description="Seconds to wait for the cluster to give every worker "
                                 "its resources before the run is refused.")

    @field_validator("resources_per_worker")
    @classmethod
    def _resources(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        for name, amount in v.items():
            if amount < 0:
                raise ValueError(f"{name}: {amount:g} is negative; give an amount of at least 0")
        if v.get("GPU", 0) not in (0, 1):
            raise ValueError(f"GPU: {v['GPU']:g}; a worker is one training process and drives one GPU: give 0 or 1 "
                             "(more GPUs: more workers)")
        if not any(amount > 0 for amount in v.values()):
            raise ValueError("every amount is 0; a worker needs at least one resource, e.g. {CPU: 1}")
        return v

    @field_validator("address", "storage")
    @classmethod
    def _not_remote(cls, v: str | None, info) -> str | None:
        if v is None:
            return v
        if info.field_name == "address" and v.startswith("ray://"):
            raise ValueError(f"{v}: Ray Client runs the driver here, away from the cluster's storage; submit the run "
                             "to the cluster instead: ray job submit --address http://HEAD:8265 -- tunekit train "
                             "RECIPE (address: null there)")
        if info.field_name == "storage" and v.startswith(RAY_URI_SCHEMES):
            raise ValueError(f"{v}: tunekit writes the run directory as ordinary files; mount the bucket on every "
                             "node (s3fs, gcsfuse, a cluster volume) and give the mount's path")
        return v


class TrainingConfig(Section):
    precision: PrecisionName = Field("auto", description="'auto' picks bf16 where the hardware supports it, "
                                     "else fp16 on GPU, else fp32.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    micro_batch_size: int = Field(4, gt=0, description="Examples per device per forward pass.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    chunked_loss: bool = Field(True, description="Run the output head and cross-entropy only on trained positions, "
                               "in chunks (the full logits tensor never exists); false uses the stock full-logits "
                               "loss. SFT's: the preference and GRPO trainers compute their own loss.")
    kernels: Literal["none", "liger", "cut_cross_entropy"] = Field(
        "none", description="Fused GPU kernels in place of the chunked loss (training.chunked_loss), SFT's: liger: "
        "Liger Kernel's fused linear cross-entropy, RMSNorm, RoPE and SwiGLU (the model families Liger covers); "
        "cut_cross_entropy (or cce): Cut Cross-Entropy's linear cross-entropy on trained positions. Triton kernels: "
        "a CUDA GPU only (`tunekit train` refuses them without one) and pip install 'tunekit[kernels]'.")
    group_by_length: bool = Field(False, description="Batch examples of similar length together (less padding, "
                                  "unpacked runs; SFT).")
    learning_rate: Union[float, Literal["auto"]] = Field(
        2e-4, description="Peak learning rate, or auto: found by a learning-rate range test on the run's own data "
        "before training (tunekit.training.lrfind; the curve and the rate in run.json and the report).")
    lr_range_test_steps: int = Field(16, ge=4, description="learning_rate: auto: optimizer steps of the range test "
                                     "(rates from 1e-5 to 1e-1), in addition to training's.")
    lr_scheduler: Literal[
        "linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt"
    ] = Field("cosine", description="Learning-rate schedule after warmup.")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Warmup as a fraction of all steps.")
    warmup_steps: int = Field(0, ge=0, description="Warmup steps (overrides warmup_ratio when > 0).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    neftune_noise_alpha: float | None = Field(
        None, gt=0, description="NEFTune: uniform noise of this scale (alpha / sqrt(tokens x hidden size)) "
        "added to the input embeddings while training (transformers' neftune_noise_alpha); null adds none.")
    max_grad_norm: float = Field(1.0, ge=0.0, description="Gradient clipping norm (0 disables).")
    optimizer: Literal[
        "adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor", "sgd"
    ] = Field("adamw_torch", description="Optimizer, by its transformers name.")
    logging_steps: int = Field(10, gt=0, description="Log loss every N optimizer steps.")
    eval_steps: int | None = Field(None, gt=0, description="Evaluate loss every N steps; null evaluates once "
                                   "per epoch.")
    eval_on_start: bool = Field(False, description="Also evaluate before the first step (the starting model's "
                                "figures, step 0, beside the later ones).")
    save_steps: int | None = Field(None, gt=0, description="Checkpoint every N steps; null checkpoints once per epoch.")
    save_total_limit: int | None = Field(2, gt=0, description="Keep at most this many checkpoints.")
    seed: int = Field(42, description="Seed for initialisation, data order and the eval split.")
    deepspeed: str | None = Field(None, description="DeepSpeed JSON config, e.g. ds_configs/zero2.json.")
    fsdp: FsdpConfig | None = Field(None, description="Shard the model with PyTorch FSDP2 instead of DeepSpeed "
                                    "(`fsdp: {}` takes every default).")
    parallelism: ParallelismConfig | None = Field(
        None, description="Tensor, sequence or context parallelism beside data parallelism (accelerate's "
        "ParallelismConfig): sizes tp, sp, cp, dp_shard, dp_replicate.")
    ray: RayConfig | None = Field(None, description="Train as a Ray Train job on a Ray cluster: workers, "
                                  "resources_per_worker, address, storage, max_failures (docs/multi-gpu.md).")
    metric_for_best: str | None = Field(
        None, description="Keep the checkpoint with the best value of this evaluation metric (eval_loss, or with an "
        "eval section bleu, chrf, rouge1, rougeL, exact_match, ...): the run's final adapter/model is that one. "
        "A checkpoint is saved at every evaluation.")
    greater_is_better: bool | None = Field(
        None, description="Direction of metric_for_best; null: lower is better for losses and perplexity, higher "
        "for everything else.")
    early_stopping_patience: int | None = Field(
        None, gt=0, description="Stop after this many evaluations in a row without a better metric_for_best.")
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=list, description="Experiment trackers that receive the metrics, the run name (the run "
        "directory's name) and the resolved recipe; each is an optional extra: pip install 'tunekit[tensorboard]'. "
        "TensorBoard writes into the run directory's tensorboard/; W&B, MLflow and trackio read their usual "
        "environment variables (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, ...).")
    method: Literal[tuple(methods.DECLARED)] = Field(  # type: ignore[valid-type]  # names from the declarations
        methods.DEFAULT, description="; ".join(f"{m.name}: {m.summary}" for m in methods.DECLARED.values())
        + " (tunekit.training.methods).")

    @field_validator("kernels", mode="before")
    @classmethod
    def _kernels_short_name(cls, v: Any) -> Any:
        return "cut_cross_entropy" if v == "cce" else v

    @field_validator("learning_rate", mode="before")
    @classmethod
    def _rate(cls, v: Any) -> Any:
        """A number in (0, 1] or auto, with pydantic's own wording for a number out of range."""
        if v == "auto":
            return v
        try:
            rate = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"Input should be a valid number or auto (got {v!r})") from None
        if not math.isfinite(rate):
            raise ValueError(f"Input should be a finite number or auto (got {v!r})")
        if rate <= 0:
            raise ValueError("Input should be greater than 0")
        if rate > 1:
            raise ValueError("Input should be less than or equal to 1")
        return rate

    @model_validator(mode="after")
    def _rules(self) -> "TrainingConfig":
        if self.warmup_ratio > 0 and self.warmup_steps > 0:
            raise ValueError("training.warmup_ratio and training.warmup_steps are both set; keep one")
        if self.metric_for_best is None and (self.early_stopping_patience or self.greater_is_better is not None):
            raise ValueError("training.early_stopping_patience and training.greater_is_better need "
                             "training.metric_for_best, e.g. metric_for_best: eval_loss")
        if self.deepspeed is not None and self.fsdp is not None:
            raise ValueError("training.deepspeed and training.fsdp are both set; they are two ways of sharding "
                             "the same state, keep one")
        if self.fsdp is not None and self.fsdp.activation_checkpointing and not self.fsdp.auto_wrap:
            raise ValueError("training.fsdp.activation_checkpointing checkpoints each decoder layer, the units "
                             "auto_wrap makes; set training.fsdp.auto_wrap: true, or use "
                             "training.gradient_checkpointing")
        if self.fsdp is not None and self.fsdp.activation_checkpointing and self.gradient_checkpointing:
            raise ValueError("training.gradient_checkpointing and training.fsdp.activation_checkpointing are both "
                             "on; under FSDP keep training.fsdp.activation_checkpointing")
        if self.kernels != "none" and not methods.DECLARED[self.method].chunked_loss:
            raise ValueError(f"training.kernels does not apply to training.method: {self.method}, whose trainer "
                             "computes its own loss; remove it")
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError("training.report_to names a tracker twice; list each once")
        if self.metric_for_best and self.save_steps and self.save_steps != self.eval_steps:
            raise ValueError("training.metric_for_best saves a checkpoint at every evaluation; remove "
                             "training.save_steps or set it equal to training.eval_steps")
        return self

    @property
    def best_is_greater(self) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        name = (self.metric_for_best or "").removeprefix("eval_")
        return not (name.endswith("loss") or name == "perplexity")
