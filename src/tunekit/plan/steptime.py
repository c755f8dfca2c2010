"""`tunekit plan`'s time per step: the matmuls' FLOPs at the device's peak x utilization, plus, where a memory
bandwidth is given, the bytes the elementwise work moves at that bandwidth.

FLOPs per device and micro-batch:
- each weight matrix: 2 per weight and token forward; backward 2 for the input's gradient and, for what
  trains, 2 for the weight's gradient. Input embeddings are a lookup (their gradient a scatter), no matmul:
  untied ones are left out; tied, the matrix is the output head's and counts once, as the head.
- attention's score and value products (QK^T, PV): 4 x seq x d per token forward (d = query heads x head
  dimension), halved under the causal mask where the kernel skips the masked half (sdpa and flash attention
  do; eager multiplies the whole square); backward twice the forward. On Llama-3.2-1B they are 2% of a
  step's FLOPs at 512 tokens, a quarter at 8,192.
- gradient checkpointing runs the forward twice; a no-grad forward (a reference model) is one forward.
- a vision-language model's tower and projector run on image patches, not on the text's tokens: 2 per weight
  and patch forward (models.vision.image_work: one image per example), and 4 more for those that train; a frozen
  tower takes no backward (its input, the pixels, needs no gradient).

Elementwise bytes (counted only with a bandwidth): the decoder layers' activations (estimate's bytes per
token and layer) written and read in forward and their gradients written and read in backward, 4 passes (a
recomputed forward 2 more, a no-grad forward 1); the logits likewise, in fp32 (a score head: 1 per position);
and the optimizer's pass over the trained weights (weight, gradient and state read, weight and state written).
QLoRA's dequantization of its 4-bit weights is not counted. On a CPU this work (dropout masks, casts, norms,
rotary, SiLU) took more than half of a LoRA step of a 1B model (bench/RESULTS.md), and no one utilization of the
matmul peak describes it across model sizes: its share falls as the hidden size grows. Without a bandwidth (the
default) the utilization stands for the whole step, as a model-FLOPs utilization does."""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.config import methods
from tunekit.models import vision
from tunekit.plan import shapes


@dataclass
class StepTime:
    flops: float  # the matmuls' FLOPs per micro-batch
    elementwise_bytes: float  # 0 without a bandwidth
    matmul_seconds: float
    elementwise_seconds: float

    @property
    def seconds(self) -> float:
        return self.matmul_seconds + self.elementwise_seconds


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
    weights = matmul_parameters(model, c) - (image.parameters if image else 0)
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
    """Bytes moved by the step's elementwise work (see the module's docstring); `head_width`: the outputs per
    position (the vocabulary, or 1 for a reward model's score head)."""
    tokens = s.micro_batch * s.sequences * s.seq_len
    passes = 4 + (2 if s.gradient_checkpointing else 0)
    layers = cfg.num_hidden_layers * tokens * per_token_layer * passes
    layers += s.extra_forwards * cfg.num_hidden_layers * tokens * per_token_layer
    logits = tokens * head_width * 4 * 4
    optimizer = c.trainable * (4 + 4 + optimizer_state + 4 + optimizer_state) / s.accumulation
    return layers + logits + optimizer


def estimate(cfg, model, s, recipe, c, per_token_layer: float, optimizer_state: float,
             extra_flops: float = 0.0) -> StepTime:
    """The step's time per micro-batch; `extra_flops`: work outside the training step (GRPO's sampling)."""
    flops = step_flops(cfg, model, s, recipe, c) + extra_flops
    matmul = flops / (s.peak_tflops * 1e12 * s.utilization)
    if not s.memory_bandwidth:
        return StepTime(flops, 0.0, matmul, 0.0)
    width = 1 if methods.of(recipe).score_head else cfg.vocab_size
    moved = elementwise_bytes(cfg, s, c, per_token_layer, optimizer_state, width)
    return StepTime(flops, moved, matmul, moved / s.memory_bandwidth)
