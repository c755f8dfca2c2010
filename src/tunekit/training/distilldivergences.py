"""The per-token divergences distillation trains on (distill.divergence), between the student's and the teacher's
next-token distributions at the trained positions. Written here rather than taken from TRL: its stable
DistillationTrainer computes them only inside its own on-policy loop (fused with the lm_head), and its GKD trainer's
generalized_jsd_loss reduces over the batch where tunekit needs the per-token values (the SFT loss and the
mixed mode weigh tokens themselves). tests/training/test_distill.py checks them against GKD's."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def per_token(student: torch.Tensor, teacher: torch.Tensor, kind: str, beta: float = 0.5, temperature: float = 1.0,
              top_k: int | None = None) -> torch.Tensor:
    """(N,) divergences between rows of student and teacher logits (N, V): forward_kl = KL(teacher || student),
    reverse_kl = KL(student || teacher), jsd = beta KL(teacher || M) + (1 - beta) KL(student || M) with
    M = beta teacher + (1 - beta) student (GKD, Agarwal et al. 2024, eq. 1). Both logits are divided by the
    temperature; with top_k, both distributions are renormalised over the teacher's k most likely tokens."""
    student, teacher = student.float() / temperature, teacher.float() / temperature
    if top_k is not None and top_k < teacher.shape[-1]:
        keep = teacher.topk(top_k, dim=-1).indices
        student, teacher = student.gather(-1, keep), teacher.gather(-1, keep)
    s_log, t_log = F.log_softmax(student, -1), F.log_softmax(teacher, -1)
    if kind == "forward_kl":
        return _kl(t_log, s_log)
    if kind == "reverse_kl":
        return _kl(s_log, t_log)
    if kind == "jsd":
        mixture = torch.logsumexp(torch.stack([t_log + math.log(beta), s_log + math.log1p(-beta)]), dim=0)
        return beta * _kl(t_log, mixture) + (1 - beta) * _kl(s_log, mixture)
    raise ValueError(f"unknown divergence {kind!r}")
