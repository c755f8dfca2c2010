"""`tunekit plan`'s activation bytes per device: what autograd keeps per token in a decoder layer, the activations
held through a step (or, with gradient checkpointing, the layer inputs and one layer recomputed), the head and loss
(stock or chunked) and sampling's KV cache. `s` is a plan.estimate.Settings, `c` its Counts; how each term was
measured: docs/plan.md, "How the plan counts"."""

from __future__ import annotations

from tunekit.config import methods
from tunekit.config.schema import Recipe
from tunekit.plan import moe, shapes, splitting
from tunekit.plan.shapes import kv_width, q_width


def activation_bytes(cfg, s, recipe: Recipe, sparse: moe.Sparse | None = None,
                     qk_norms: int = 0) -> tuple[float, float]:
    """(decoder-layer activations, one layer recomputed) in bytes per device: layer_bytes_per_token for
    each position a device holds. With gradient checkpointing only each layer's input is kept, and the
    backward pass recomputes one layer at a time, with that layer's gradient temporaries. A mixture of experts'
    sparse layers (`sparse`) count as plan.moe says, the expert weights formed at their forward included."""
    h, layers, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    tokens = s.micro_batch * s.sequences * s.seq_len / splitting.pieces(s)  # a device's positions
    elem = 4 if s.precision == "fp32" else 2
    sparse_layers = sparse.layers if sparse else 0
    dense_token = layer_bytes_per_token(cfg, s, recipe, qk_norms=qk_norms) if sparse_layers < layers else 0.0
    sparse_token = layer_bytes_per_token(cfg, s, recipe, sparse, qk_norms) if sparse else 0.0
    formed = moe.formed_weights_bytes(sparse, s, recipe) if sparse else 0.0
    formed_from = moe.dequantized_bytes(sparse, s, recipe) if sparse else 0.0  # one layer's, at its forward
    if not s.gradient_checkpointing:
        kept = tokens * ((layers - sparse_layers) * dense_token + sparse_layers * sparse_token) + sparse_layers * formed
        return kept + formed_from, 0.0
    # the recomputed layer's backward also holds the gradients of its hidden state and of its MLP's gate and up
    # outputs: (h + 2I) per token, counted at 4 bytes (measured at fp32, bench/RESULTS.md); a sparse layer's are
    # top-k rows of twice its experts' width
    dense = dense_token + (h + 2 * inter) * 4 if dense_token else 0.0
    one_sparse = sparse_token + (h + 2 * sparse.top_k * sparse.width) * 4 if sparse else 0.0
    return layers * tokens * h * elem, tokens * max(dense, one_sparse) + formed + formed_from


def mean_layer_bytes_per_token(cfg, s, recipe: Recipe, sparse: moe.Sparse | None = None, qk_norms: int = 0) -> float:
    """layer_bytes_per_token averaged over the decoder layers, dense and sparse (the step time's elementwise work)."""
    layers, sparse_layers = cfg.num_hidden_layers, sparse.layers if sparse else 0
    dense = layer_bytes_per_token(cfg, s, recipe, qk_norms=qk_norms) if sparse_layers < layers else 0.0
    sparse_token = layer_bytes_per_token(cfg, s, recipe, sparse, qk_norms) if sparse else 0.0
    return ((layers - sparse_layers) * dense + sparse_layers * sparse_token) / layers


def layer_bytes_per_token(cfg, s, recipe: Recipe, sparse: moe.Sparse | None = None, qk_norms: int = 0) -> float:
    """What autograd keeps per token in one Llama-style decoder layer, term by term as counted with saved-tensor
    hooks on a layer loaded as tunekit loads it (tests/plan/test_activations.py; h hidden, q = query heads x head
    dimension, kv key/value width, I the MLP's width, plan.shapes):
    - each RMSNorm its fp32 input and inverse RMS, with trained norm weights (full fine-tuning) also the normalised
      input; at fp32 its output too, which the projections after it keep;
    - below fp32, each of q, k, v, gate and up keeps its own 16-bit cast of its input (5h). Under LoRA's fused
      forward (models.lorafused) a 16-bit base's adapters take their input as it is: the attention's and the MLP's
      inputs are kept once each (2h), none with dropout, whose outputs the adapters keep instead; a 4-bit base on
      fp32 norms still casts (5h). Where peft's own forward runs (ZeRO-3) it casts the input to the adapter's fp32
      and autocast back, o_proj's too (5h + q);
    - attention: the rotated q and k, v, the output (2q + 2kv) and the kernel's log-sum-exp (fp32 per head);
      eager attention also its probabilities (2 x heads x seq);
    - the SwiGLU MLP's gate, up, SiLU(gate) and product (4I); under QLoRA below fp32 the first three in fp32
      (bitsandbytes' 4-bit layers return their fp32 input's dtype: the norms keep fp32 weights);
    - LoRA: each of the seven projections' r-wide adapter output (fp32 for the six whose 4-bit base returns fp32,
      fused); with dropout an fp32 copy of each adapted input (5h + q + I), at fp32 a second one of q, k, v, gate
      and up's (5h); fused on a 16-bit base, the dropout's output and mask in 16 bits, down_proj's output being
      the MLP's product (10h + 2q + I);
    - query and key norms (`qk_norms` RMS values per token, plan.shapes.qk_norm_groups): their fp32 inputs (q + kv)
      and inverse RMS, with trained norm weights also the normalised q and kv in the compute dtype;
    - under sequence parallelism o_proj keeps the all-to-all's output (q) where it would share attention's.
    Tensor parallelism splits what is per head or per column (plan.splitting); the norms and casts stay whole.
    A sparse layer (`sparse`, plan.moe) has a sparse block in place of the MLP: its three linear layers, their
    casts, adapters and dropout copies are not there, and the block keeps what plan.moe.block_bytes_per_token
    counts; shared experts beside it (DeepSeek-V3's, Qwen2-MoE's) count as an MLP of their width, and Qwen2-MoE's
    one-wide gate its own cast of the input, its adapter, and the shared output and sigmoid it multiplies."""
    h, inter, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    if sparse is not None:
        inter = sparse.shared  # no dense MLP but the shared experts, if any: the terms below at their width
    gated = sparse is not None and sparse.shared_gate
    mlp_inputs = (2 if inter else 0) + gated  # gate and up's own casts of the MLP input (and a shared gate's)
    linears = 4 + (3 if inter else 0) + gated
    # the norm outputs that linear layers keep: the attention's and the MLP's; a sparse block's grouped matmuls keep
    # their own gathered rows, its router the norm output only when trained (plan.moe)
    normed = 2 if inter else 1
    q, kv = q_width(cfg), kv_width(cfg)
    full, lora = recipe.full_finetuning, recipe.lora is not None
    fp32 = s.precision == "fp32"
    elem = 4 if fp32 else 2
    fused = lora and s.zero_stage != 3  # models.lorafused: ZeRO-3's partitioned adapters keep peft's forward
    plain16 = fused and not fp32 and recipe.quantization is None  # a 16-bit base under the fused forward
    dropout = lora and recipe.lora.dropout > 0
    whole = 2 * (4 * h + 4) + (2 * 4 * h if full else 0)  # the two norms
    if fp32:
        whole += normed * 4 * h
    elif plain16:
        whole += (0 if dropout else normed * h) * elem
    else:
        whole += ((3 + mlp_inputs) * h + (q if lora and not fused else 0)) * elem
    mlp = 4 * inter * elem if fp32 or recipe.quantization is None else 3 * inter * 4 + inter * 2
    if sparse is not None:
        mlp = (mlp if inter else 0) + moe.block_bytes_per_token(sparse, cfg, s, recipe)
        if gated:  # the shared experts' output and the gate's sigmoid, kept for their product
            mlp += (h + 1) * (4 if fp32 or recipe.quantization is not None else elem)
    split = (2 * q + 2 * kv) * elem + 4 * heads + mlp
    if shapes.attention(cfg, recipe) == "eager":
        split += 2 * heads * s.seq_len * elem
    if qk_norms:
        split += (q + kv) * (4 + (elem if full else 0)) + 4 * qk_norms
    if s.sp > 1 and (fp32 or not lora):  # o_proj keeps the all-to-all's output, apart from attention's
        split += q * elem
    if lora:
        whole += linears * recipe.lora.r * elem
        if fused and not fp32 and recipe.quantization is not None:
            whole += (linears - 1) * recipe.lora.r * (4 - elem)
        if dropout and plain16:
            whole += (2 * (3 + mlp_inputs) * h + 2 * q + inter) * elem
        elif dropout:
            whole += ((3 + mlp_inputs) * h + q + inter) * 4 + ((3 + mlp_inputs) * h * 4 if fp32 else 0)
    return whole + split / s.tp


def kv_cache_bytes(cfg, s) -> float:
    """The KV cache of sampling: keys and values of every layer for each sampled sequence at full length
    (prompt + completion), in the compute dtype (transformers' dynamic cache)."""
    elem = 4 if s.precision == "fp32" else 2
    return 2 * cfg.num_hidden_layers * kv_width(cfg) * elem * s.sampled * s.seq_len


def sampling(parts: dict, cfg, s, c) -> float:
    """GRPO's sampling before the step: its KV cache into `parts`; returns its FLOPs per micro-batch (one
    forward's worth per sampled token, spread over the accumulation steps; with tools, each turn's generate() reads
    the episode so far again: at most a full sequence per turn)."""
    if not s.sampled:
        return 0.0
    parts["sampling: KV cache"] = kv_cache_bytes(cfg, s)
    return 2 * c.total * s.sampled * s.seq_len * s.sample_turns / s.accumulation


def loss_path_bytes(cfg, s, recipe: Recipe, chunked: bool) -> float:
    """Bytes of the head + cross-entropy, every position trained (the worst case).

    Stock path: logits in the compute dtype, their fp32 upcast for the loss (none when already fp32),
    and 6 bytes per logit for the log-softmax output and the gradient temporaries of its backward
    (measured: 9.75 bytes per logit in total at fp32, where logits are 4 of them).
    Chunked path (losspath): the trained positions' hidden states gathered, their gradient held from
    forward to backward, one chunk of logits (fp32, log-sum-exp, softmax and gradient in place; below
    fp32 also the compute-dtype logits or the gradient cast back, one at a time: measured with
    bench/plan_check.py), and an fp32 gradient for a trained head.
    The head's width follows the method: the vocabulary for a language-model head, 1 for a score head (a reward
    model: one number per position, the last real one's read; its loss is on those scores alone)."""
    h = cfg.hidden_size
    vocab = 1 if methods.spec_of(recipe).score_head else cfg.vocab_size  # the head's outputs per position
    tokens = s.micro_batch * s.sequences * s.seq_len / splitting.pieces(s)
    elem = 4 if s.precision == "fp32" else 2
    # below fp32, a head stored in fp32 (full fine-tuning's master weights) is cast for the matmul; FSDP2 and
    # ZeRO-3 gather it in the compute dtype instead (their gathered head unit, sharding.py). QLoRA keeps its
    # head in the compute dtype (models.loader.prepare_quantized): no cast
    gathered = s.fsdp or s.zero_stage >= 3
    head_cast = vocab * h * elem if elem != 4 and not gathered and recipe.full_finetuning else 0
    if not chunked:
        return tokens * vocab * (elem + (4 if elem != 4 else 0) + 6) + head_cast
    from tunekit.models.losspath import chunk_rows

    hidden_elem = 4 if (recipe.full_finetuning or s.precision == "fp32") else 2
    rows = min(tokens, chunk_rows(vocab))
    head_grad = vocab * h * 4 if recipe.full_finetuning else 0
    per_logit = 4 if elem == 4 else 4 + elem
    return 2 * tokens * h * hidden_elem + rows * vocab * per_logit + head_grad + head_cast
