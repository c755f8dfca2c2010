"""The causal-LM loss computed only where it is trained, in chunks: the head's forward is replaced, for training
and eval-loss batches, by one that runs head + cross-entropy on the labelled positions a chunk at a time, so no
logits tensor larger than one chunk exists. Why our own: docs/precision-and-speed.md, "The loss on trained
positions"."""

from __future__ import annotations

import contextlib
import inspect
import logging
import re

import torch
import torch.nn.functional as F
from torch import nn

from tunekit.models.unwrap import base_of

log = logging.getLogger("tunekit")

IGNORE = -100
CHUNK_BYTES = 128 * 2**20  # fp32 logits per chunk: 682 positions at SmolLM2's 49,152 tokens, 261 at Llama 3's


def chunk_rows(vocab: int) -> int:
    return max(16, min(8192, CHUNK_BYTES // (4 * vocab)))


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight.T + bias, targets), gradients computed chunk by
    chunk in forward. Numerically the stock path: logits in the weight's dtype, softmax and loss in
    fp32, the logits' gradient cast back to the weight's dtype before the two matmuls."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows: int, need_grad: bool):
        need_h = need_grad and hidden.requires_grad
        need_w = need_grad and weight.requires_grad
        need_b = need_grad and bias is not None and bias.requires_grad
        device = hidden.device.type
        if torch.is_autocast_enabled(device) and weight.dtype == torch.float32:
            # an fp32 head (full fine-tuning's master weights) is cast once here, not by autocast in
            # every chunk's matmul
            compute = torch.get_autocast_dtype(device)
            weight_c = weight.to(compute)
            bias_c = None if bias is None else bias.to(compute)
        else:
            weight_c, bias_c = weight, bias
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.shape[0], rows):
            h, t = hidden[start:start + rows], targets[start:start + rows]
            logits = F.linear(h, weight_c, bias_c).float()
            target = logits.gather(1, t[:, None]).squeeze(1)
            # log-sum-exp in place: torch.logsumexp allocates a second chunk-sized temporary
            top = logits.amax(dim=-1, keepdim=True)
            e = logits.sub_(top).exp_()
            norm = e.sum(dim=-1, keepdim=True)
            total += ((top + norm.log()).squeeze(1) - target).sum()
            if need_h or need_w or need_b:
                g = e.div_(norm)  # softmax, in place of the logits
                g[torch.arange(g.shape[0], device=g.device), t] -= 1.0
                g = g.to(hidden.dtype)
                if need_h:
                    grad_h[start:start + rows] = g @ weight_c
                if need_w:
                    grad_w += (g.t() @ h).float()
                if need_b:
                    grad_b += g.float().sum(0)
                del g
            del logits, e
        ctx.save_for_backward(*(x for x in (grad_h, grad_w, grad_b) if x is not None))
        ctx.which = (need_h, need_w, need_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        need_h, need_w, need_b = ctx.which
        grad_h = next(saved) * grad_out.to(ctx.saved_tensors[0].dtype) if need_h else None
        grad_w = (next(saved) * grad_out).to(ctx.dtypes[0]) if need_w else None
        grad_b = (next(saved) * grad_out).to(ctx.dtypes[1]) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of the head on `hidden` [N, H] against `targets` [N] (no ignored entries)."""
    rows = rows or chunk_rows(weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, rows, torch.is_grad_enabled())


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor-parallel head's weight (a DTensor split by vocabulary) gathered whole, differentiably; the
    logits are still made a chunk at a time. Anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shift_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position t is trained on labels[t + 1]; the last position of each row predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:]


# a line that assigns to `logits` (not the `logits=logits,` keyword of the returned output)
_LOGITS_ASSIGNED = re.compile(r"^\s*logits\s*(?:[-+*/]|//)?=(?!=)(?!\s*logits\s*[,)])", re.MULTILINE)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the chunked path cannot stand in for this model's head, or None when it can: the head must be
    a plain nn.Linear whose output the model's forward returns as the logits unchanged, with no other loss
    term (models that scale or soft-cap logits after the head, mixture-of-experts models with a router
    loss, a LoRA-wrapped or quantized head keep the stock path)."""
    base = base_of(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"its output head is {type(head).__name__}, not a plain Linear layer"
    name = next((n for n, m in base.named_children() if m is head), None)
    if name is None:
        return "its output head is not a direct child of the model"
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return f"the source of {type(base).__name__}.forward cannot be read"
    if f"self.{name}(" not in source or len(_LOGITS_ASSIGNED.findall(source)) != 1:
        return f"{type(base).__name__}.forward changes the logits after the head"
    if "aux_loss" in source:  # mixture-of-experts router loss, added to the loss only when labels are passed
        return f"{type(base).__name__}.forward adds an auxiliary loss to the language-model loss"
    return None


class TrainedPositionsHead:
    """Installed on a model's output head; `active(targets)` makes the next forward return the summed
    loss over trained positions (a 0-d fp32 tensor) instead of logits. `loss_sum` computes it, with
    linear_cross_entropy_sum's signature: that function (chunked) when None, or a fused kernel's
    (models.kernels, training.kernels)."""

    def __init__(self, model: nn.Module, loss_sum=None):
        base = base_of(model)
        self.head: nn.Linear = base.get_output_embeddings()
        self.rows = chunk_rows(self.head.out_features)
        self.targets: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None  # the trained positions' flat indices, when the collator found them
        self.trained = 0
        self.loss_sum = loss_sum
        stock = self.head.forward

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            if self.targets is None:
                return stock(hidden)
            targets = self.targets.to(hidden.device).reshape(-1)
            # the trained positions' indices: from the collator (found on the host), else one host sync here
            keep = self.keep if self.keep is not None else (targets != IGNORE).nonzero().squeeze(1)
            self.trained = keep.numel()
            # Under ZeRO-3 the weight is gathered only inside this call, so the loss is computed here.
            loss_sum = self.loss_sum or linear_cross_entropy_sum
            return loss_sum(hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep), _whole(self.head.weight),
                            _whole(self.head.bias), targets.index_select(0, keep), self.rows)

        self.head.forward = forward  # an instance attribute: parameter names and state dicts are unchanged

    @contextlib.contextmanager
    def active(self, targets: torch.Tensor, keep: torch.Tensor | None = None):
        """The next forward returns the summed loss on `targets`' trained positions (`keep`: their flat indices,
        if known)."""
        self.targets, self.keep = targets, keep
        try:
            yield
        finally:
            self.targets = self.keep = None


def install(model: nn.Module) -> TrainedPositionsHead | None:
    """The chunked head for `model`, or None (said once) where the stock path has to stay."""
    reason = unsupported_reason(model)
    if reason is not None:
        log.warning("loss: computed over all positions (the stock path), because %s", reason)
        return None
    log.info("loss: head and cross-entropy on trained positions only, in chunks")
    return TrainedPositionsHead(model)


def mean_loss(model: nn.Module, batch: dict, head: TrainedPositionsHead | None = None) -> torch.Tensor:
    """Mean loss over the trained tokens of `batch` (labels included): through `head` when given, else
    the model's stock loss. What the Trainer computes without gradient accumulation."""
    if head is None:
        return model(**batch).loss
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with head.active(shift_targets(batch["labels"])):
        return model(**inputs).logits / head.trained
