"""distill's teacher in `tunekit plan`: its frozen weights (4-bit or the compute dtype; divided by the world size
where ZeRO-3 or FSDP2 shard it, else a whole copy per device), its logits at the end of its forward, and its
forward's FLOPs, counted from the teacher model's own config (runs.distillteacher resolves it from files)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tunekit.config import methods
from tunekit.config.methodsettings import DistillSettings
from tunekit.plan.sizes import quantized_bytes

LOGITS = "teacher: logits"


@dataclass(frozen=True)
class TeacherSize:
    name: str
    params: int
    embeddings: int  # of params: the embeddings and output head (kept in the compute dtype when 4-bit)
    vocab: int
    four_bit: bool
    sharded: bool  # distill.teacher_placement: sharded (it is, under ZeRO-3 or FSDP2)


def of(recipe) -> TeacherSize | None:
    """The recipe's teacher counted on the meta device (no weights read), or None when nothing distills."""
    settings = methods.spec_of(recipe).settings_of(recipe)
    if not isinstance(settings, DistillSettings) or not settings.teacher:
        return None
    from transformers import AutoModelForCausalLM

    from tunekit.models import hub
    from tunekit.models.info import model_config
    from tunekit.runs import distillteacher

    t = distillteacher.resolve(recipe)
    try:
        cfg = model_config(t.model, shipped=True)
    except hub.Unavailable as e:
        raise distillteacher.unavailable(t, e) from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=t.model.trust_remote_code)
    params = {id(p): p.numel() for p in model.parameters()}
    edges = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
             for p in m.parameters()}
    text = cfg.get_text_config()
    return TeacherSize(t.spec, sum(params.values()), sum(params[i] for i in edges), text.vocab_size,
                       settings.teacher_4bit or t.quantized_run, settings.teacher_placement == "sharded")


def add(parts: dict, s) -> float:
    """The teacher's parts into `parts` (bytes per device); returns its forward's FLOPs per micro-batch."""
    t = s.teacher
    if t is None:
        return 0.0
    elem = 4 if s.precision == "fp32" else 2
    body = t.params - t.embeddings
    weights = quantized_bytes(body, 4, True) + t.embeddings * elem if t.four_bit else t.params * elem
    sharded = t.sharded and (s.fsdp or s.zero_stage >= 3) and s.world_size > 1
    where = f"sharded over {s.world_size} devices" if sharded else \
        "a whole copy per device" if s.world_size > 1 else "one copy"
    dtype = "4-bit" if t.four_bit else s.precision
    parts[f"teacher: weights (frozen, {dtype}, {where})"] = weights / s.world_size if sharded else weights
    tokens = s.micro_batch * s.seq_len
    parts[LOGITS] = tokens * t.vocab * (elem + 4 + 4)  # its logits, their fp32 upcast and log-softmax
    return 2 * t.params * tokens
