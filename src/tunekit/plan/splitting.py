"""training.parallelism in `tunekit plan`: what tensor, sequence and context parallelism take off each device,
and the bytes each device sends per optimizer step (config.parallelconfig has the engines). How each engine
splits the work, and which versions were read: docs/plan.md, "Tensor, sequence and context parallel: what each
takes off a device"."""

from __future__ import annotations

import dataclasses

from tunekit.plan import shapes

STATE_PREFIXES = ("weights", "gradients", "optimizer (", "master weights")


def sizes(recipe) -> dict:
    """Settings' tp, sp and cp from training.parallelism (1 each without it)."""
    p = recipe.training.parallelism
    return {} if p is None else {"tp": p.tp, "sp": p.sp, "cp": p.cp}


def pieces(s) -> int:
    """Positions of a row are split this many ways: sp x cp."""
    return s.sp * s.cp


def split_share(model) -> float:
    """The share of the parameters tp splits: the decoder layers' linear weights and the output head."""
    import torch

    classes = set(getattr(model, "_no_split_modules", None) or [])
    seen: set[int] = set()
    split = 0
    for layer in (m for m in model.modules() if type(m).__name__ in classes):
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
                seen.add(id(m.weight))
                split += m.weight.numel()
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) not in seen:
        split += head.weight.numel()
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    return split / max(total, 1)


def divide_state(parts: dict, s, share: float) -> None:
    """tp's split of the weights, gradients and optimizer state, in place: `share` of each part is 1/tp."""
    if s.tp == 1:
        return
    for key in parts:
        if key.startswith(STATE_PREFIXES):
            parts[key] *= share / s.tp + 1 - share


def divide_time(time, s):
    """A device's share of the step's matmuls (1/(tp x sp x cp)) and of its elementwise work (1/(sp x cp): the
    per-token bytes it was planned from are tp's share already)."""
    n, rows = s.tp * pieces(s), pieces(s)
    if n == 1:
        return time
    return dataclasses.replace(time, flops=time.flops / n, elementwise_bytes=time.elementwise_bytes / rows,
                               matmul_seconds=time.matmul_seconds / n,
                               elementwise_seconds=time.elementwise_seconds / rows)


def communication(cfg, s, trained: float, held: float) -> dict[str, float]:
    """Bytes each device sends per optimizer step, by what sends them; `trained`: the trained parameters a
    device holds after tp's split, `held`: the bytes of the weights it holds before sharding (ZeRO-3 and FSDP2
    gather them: quantized codes as stored)."""
    elem = 4 if s.precision == "fp32" else 2
    layers, h, q, kv = cfg.num_hidden_layers, cfg.hidden_size, shapes.q_width(cfg), shapes.kv_width(cfg)
    tokens = s.micro_batch * s.sequences * s.seq_len / pieces(s) * s.accumulation
    passes = 3 if s.gradient_checkpointing else 2  # forward, backward, and a recomputed forward
    sent: dict[str, float] = {}
    if s.tp > 1:
        sent[f"tensor parallel {s.tp}: all-reduces of the row-split layers' outputs"] = (
            2 * passes * layers * tokens * h * elem * 2 * (s.tp - 1) / s.tp)
    if s.sp > 1:
        per_layer = (2 * q / s.tp + 2 * kv / s.tp) * tokens * elem * (s.sp - 1) / s.sp
        sent[f"sequence parallel {s.sp}: all-to-alls around attention"] = passes * layers * per_layer
    if s.cp > 1:
        ring = layers * (s.cp - 1) * tokens * 2 * kv / s.tp * elem
        sent[f"context parallel {s.cp}: keys and values round the ring"] = ring * (passes - 1 + 2)
    n = s.world_size // s.tp
    if n > 1:
        gathered = s.fsdp or s.zero_stage >= 3 or s.tp > 1
        grad_elem = 4 if s.fsdp and s.fsdp_reduce_dtype == "float32" else elem
        # DeepSpeed's ZeRO-2 and 3 reduce every micro-batch's gradients; DDP, ZeRO-1 and FSDP2 (under the Trainer's
        # no_sync) once a step. A recomputed layer is gathered once for its recomputation and backward.
        reductions = s.accumulation if s.zero_stage >= 2 else 1
        if gathered:
            sent[f"parameters gathered over {n} processes (forward and backward)"] = (
                2 * held * (n - 1) / n * s.accumulation)
            sent[f"gradients reduce-scattered over {n} processes"] = trained * grad_elem * (n - 1) / n * reductions
        else:
            sent[f"gradients all-reduced over {n} processes"] = trained * grad_elem * 2 * (n - 1) / n * reductions
    return sent


def words(s) -> str:
    parts = [f"tensor parallel {s.tp}" if s.tp > 1 else "", f"sequence parallel {s.sp}" if s.sp > 1 else "",
             f"context parallel {s.cp}" if s.cp > 1 else ""]
    return ", ".join(p for p in parts if p)
