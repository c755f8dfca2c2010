"""`tunekit plan`'s time per micro-batch, two ways: on a GPU, the larger of the matmuls' FLOPs at peak x
utilization and the host's work fitted to measured runs (plan.gpu_fit); with a memory bandwidth (a CPU), the
matmuls plus the bytes the elementwise work moves. What is counted and how it was measured: docs/plan.md,
"Time per micro-batch"."""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.config import methods
from tunekit.models import vision
from tunekit.models.unwrap import base_of
from tunekit.plan import gpu_fit, shapes, sharding


@dataclass
class HostWork:
    """The host's work per micro-batch in a GPU plan (docs/plan.md, "Time per micro-batch"), counted from the model."""

    layer_forwards: int  # decoder layers run forward over all forward passes, a vision tower's layers included
    layer_backwards: int
    adapter_forwards: int  # LoRA-adapted linears run forward over all forward passes
    adapter_backwards: int
    full: bool  # full fine-tuning: each layer's backward also takes its weights' gradients
    dropout: bool  # LoRA dropout: a mask per adapted linear and forward
    four_bit: int  # uses of a 4-bit weight
    zero3_gathers: int  # parameters ZeRO-3 gathers
    fsdp_gathers: int  # units FSDP2 gathers
    operators: float = 0.0  # PyTorch operators dispatched
    seconds: float = 0.0


@dataclass
class StepTime:
    flops: float  # the matmuls' FLOPs per micro-batch
    elementwise_bytes: float  # 0 without a bandwidth
    matmul_seconds: float
    elementwise_seconds: float
    host: HostWork | None = None  # a GPU plan's host work; None with a memory bandwidth
    basis: str = ""  # a GPU plan's: the runs its figures were fitted to, in words

    @property
    def seconds(self) -> float:
        device = self.matmul_seconds + self.elementwise_seconds
        return max(device, self.host.seconds) if self.host else device


def attention_flops(cfg, s, recipe) -> float:
    """Score and value products of every layer, forward, for the micro-batch's sequences."""
    d = shapes.q_width(cfg)
    causal_half = 1.0 if recipe.model.attn_implementation == "eager" else 0.5
    sequences = s.micro_batch * s.sequences
    return cfg.num_hidden_layers * sequences * 4 * s.seq_len * s.seq_len * d * causal_half


def matmul_parameters(model, c) -> int:
    """Parameters that enter a matmul: all but untied input embeddings."""
    inputs, output = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or (output is not None and output.weight is inputs.weight):
        return c.total
    return c.total - inputs.weight.numel()


def step_flops(cfg, model, s, recipe, c) -> float:
    tokens = s.micro_batch * s.sequences * s.seq_len
    image = vision.image_work(model)
    # a mixture of experts: each token goes through its top-k experts only
    weights = matmul_parameters(model, c) - (image.parameters if image else 0) - c.inactive
    trainable = c.trainable - (image.trained if image else 0)
    trained = weights if recipe.full_finetuning else min(trainable, weights)  # weights with a gradient matmul
    forward = 2 * weights * tokens + attention_flops(cfg, s, recipe)
    backward = 2 * (weights + trained) * tokens + 2 * attention_flops(cfg, s, recipe)
    recomputed = forward if s.gradient_checkpointing else 0.0
    if image:
        patches = s.micro_batch * s.sequences * image.patches
        forward += 2 * image.parameters * patches
        backward += 4 * image.trained * patches
    return forward + backward + recomputed + s.extra_forwards * forward


def elementwise_bytes(cfg, s, c, per_token_layer: float, optimizer_state: float, head_width: int) -> float:
    """Bytes moved by the step's elementwise work (docs/plan.md, "Time per micro-batch"); `head_width`: the outputs per
    position (the vocabulary, or 1 for a reward model's score head)."""
    tokens = s.micro_batch * s.sequences * s.seq_len
    passes = 4 + (2 if s.gradient_checkpointing else 0)
    layers = cfg.num_hidden_layers * tokens * per_token_layer * passes
    layers += s.extra_forwards * cfg.num_hidden_layers * tokens * per_token_layer
    logits = tokens * head_width * 4 * 4
    optimizer = c.trainable * (4 + 4 + optimizer_state + 4 + optimizer_state) / s.accumulation
    return layers + logits + optimizer


def host_work(cfg, model, s, recipe) -> HostWork:
    """What the host does per micro-batch (docs/plan.md, "Time per micro-batch"), with the operators and seconds
    of plan.gpu_fit."""
    forwards = 1 + int(s.gradient_checkpointing) + s.extra_forwards
    adapted = sum(1 for name, _ in model.named_parameters() if "lora_A." in name)
    base = base_of(model)
    tower = getattr(base.config, "vision_config", None)
    tower_layers = (getattr(tower, "num_hidden_layers", None) or getattr(tower, "depth", 0)) if tower else 0
    ps = sharding.params(recipe, model)
    layers = cfg.num_hidden_layers
    work = HostWork(layer_forwards=layers * forwards + tower_layers, layer_backwards=layers,
                    adapter_forwards=adapted * (1 + int(s.gradient_checkpointing)), adapter_backwards=adapted,
                    full=recipe.full_finetuning, dropout=bool(recipe.lora and recipe.lora.dropout),
                    four_bit=sum(p.kind == "quantized" for p in ps) * (forwards + 1),
                    zero3_gathers=len(ps) * (forwards + 1) if s.zero_stage == 3 and not s.fsdp else 0,
                    fsdp_gathers=(layers + 2) * (1 + int(s.fsdp_reshard_after_forward)) if s.fsdp else 0)
    work.operators = operators(work, gpu_fit.FIT["operators"])
    k = gpu_fit.FIT["coefficients"]
    work.seconds = (k["seconds_per_operator"] * work.operators + k["seconds_per_four_bit_use"] * work.four_bit
                    + k["seconds_per_zero3_gather"] * work.zero3_gathers
                    + k["seconds_per_fsdp_gather"] * work.fsdp_gathers)
    return work


def operators(work: HostWork, per: dict) -> float:
    """PyTorch operators dispatched per micro-batch, from the counts `per` layer and adapted linear (gpu_fit)."""
    adapter = "_dropout" if work.dropout else ""
    return (work.layer_forwards * per["layer_forward"]
            + work.layer_backwards * per["layer_backward_full" if work.full else "layer_backward"]
            + work.adapter_forwards * per["adapter_forward" + adapter]
            + work.adapter_backwards * per["adapter_backward" + adapter])


def estimate(cfg, model, s, recipe, c, per_token_layer: float, optimizer_state: float,
             extra_flops: float = 0.0) -> StepTime:
    """The step's time per micro-batch; `extra_flops`: work outside the training step (GRPO's sampling). Without a
    memory bandwidth, a GPU plan: the matmuls against the host's work; with one, matmuls and elementwise work."""
    flops = step_flops(cfg, model, s, recipe, c) + extra_flops
    matmul = flops / (s.peak_tflops * 1e12 * s.utilization)
    if not s.memory_bandwidth:
        return StepTime(flops, 0.0, matmul, 0.0, host_work(cfg, model, s, recipe), gpu_fit.FIT["basis"])
    width = 1 if methods.spec_of(recipe).score_head else cfg.vocab_size
    moved = elementwise_bytes(cfg, s, c, per_token_layer, optimizer_state, width)
    return StepTime(flops, moved, matmul, moved / s.memory_bandwidth)


def lines(recipe, s, t: StepTime | None, flops: float, seconds: float) -> list[str]:
    """The plan's report on its FLOPs and step time (`s`: its Settings)."""
    out = [f"training FLOPs per step per device: {flops:.3e} "
           f"({'6' if recipe.full_finetuning else '~4'} x parameters in matmuls x tokens, + attention's score and "
           "value products" + (", + a forward recomputed" if s.gradient_checkpointing else "") + ")"]
    at = f"{s.peak_tflops:g} TFLOP/s peak and {100 * s.utilization:.0f}% utilization"
    if t is not None and t.host is not None:
        return out + gpu_lines(t, seconds, at)
    if t is None or not t.elementwise_seconds:
        return out + [f"estimated step time: {seconds:.3f} s at {at}"]
    return out + [f"estimated step time: {seconds:.3f} s: matmuls {t.matmul_seconds:.3f} s at {at}, "
                  f"elementwise work {t.elementwise_seconds:.3f} s ({t.elementwise_bytes / 1e9:.1f} GB at "
                  f"{s.memory_bandwidth / 1e9:.3g} GB/s)"]


def gpu_lines(t: StepTime, seconds: float, at: str) -> list[str]:
    """A GPU plan's step time: the host's work against the matmuls, and where the figures come from."""
    h, fit = t.host, gpu_fit.FIT
    work = [f"{h.operators:,.0f} PyTorch operators"] + [f"{n:,} {what}" for n, what in (
        (h.four_bit, "uses of 4-bit weights"), (h.zero3_gathers, "ZeRO-3 parameter gathers"),
        (h.fsdp_gathers, "FSDP2 unit gathers")) if n]
    host = f"the host's work {h.seconds:.3f} s ({', '.join(work)})"
    matmuls = f"the matmuls' {t.matmul_seconds:.3f} s at {at}"
    varying = fit["coefficients"]["varying_rows_seconds"]
    return [f"estimated step time: {seconds:.3f} s per micro-batch, {t.basis}: "
            + (f"{host} outlasts {matmuls}" if h.seconds >= t.matmul_seconds else f"{matmuls} outlast {host}"),
            f"  for full-length rows: packed rows of natural length took {varying:.2f} s more per micro-batch in those "
            f"runs; the fit's worst recorded row: {fit['worst'][0]:.2f}x its measured tokens/s (bench/RESULTS.md)"]


def provenance(t: StepTime | None) -> dict | None:
    """A GPU plan's time, where it comes from (for --json): the runs fitted to, the coefficients, the worst row."""
    if t is None or t.host is None:
        return None
    fit = gpu_fit.FIT
    return {"basis": fit["basis"], "gpus": fit["gpus"], "runs": fit["runs"], "script": fit["script"],
            "coefficients": fit["coefficients"], "worst_ratio": fit["worst"]}
