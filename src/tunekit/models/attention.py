"""Which attention a training run uses, and `varlen`: attention over packed batches that reads their boundaries
from the collator instead of building a mask (torch's variable-length flash kernel on a CUDA GPU, each sequence
alone on a CPU). `choose` makes it the default where it applies. Why and how: docs/precision-and-speed.md,
"`varlen` attention"."""

from __future__ import annotations

import importlib.util
import inspect
import logging
from dataclasses import dataclass

import torch

from tunekit.models.unwrap import base_of

log = logging.getLogger("tunekit")

NAME = "varlen"  # model.attn_implementation's value, and the name registered with transformers
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
HEAD_SIZES = range(8, 257, 8)  # the flash kernel's head sizes


@dataclass(frozen=True)
class Choice:
    name: str  # the implementation the model runs
    reason: str  # why, for the run log


def reads_boundaries(name: str | None) -> bool:
    """Whether packed batches for attention `name` carry the sequence boundaries (the collator's `cu_seq_lens_*`)."""
    return name in (NAME, "flash_attention_2")


def kernel():
    """torch's varlen_attn, called with causal masking in the form the installed torch takes (torch 2.10 has
    `is_causal`, later versions `window_size`) and GQA done by the kernel where it can (`enable_gqa`)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        if gqa and k.shape[1] != q.shape[1]:
            return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, enable_gqa=True, **causal)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **causal)

    return run


SHORT = 192  # tokens: up to this a CPU runs a sequence's attention faster in _Short than in SDPA's flash kernel


def _grouped(t, a: int, b: int, kv: int, group: int):
    """Tokens a:b of (tokens, heads, dim) as (key/value heads, group x length, dim): each key/value head's query
    heads stacked, so one batched matmul serves them all (GQA)."""
    n, dim = b - a, t.shape[-1]
    return t[a:b].view(n, kv, group, dim).permute(1, 2, 0, 3).reshape(kv, group * n, dim)


def _ungrouped(t, n: int, kv: int, group: int):
    dim = t.shape[-1]
    return t.view(kv, group, n, dim).permute(2, 0, 1, 3).reshape(n, kv * group, dim)


class _Short(torch.autograd.Function):
    """Causal attention over short sequences laid end to end ((tokens, heads, dim), `bounds` their starts and end),
    in fp32 as the flash kernel accumulates: three batched matmuls a sequence forward and four backward, the
    probabilities kept for backward. On a CPU, SDPA's flash kernel costs ~0.7 ms a call even on 16 tokens and its
    math kernel dispatches ~40 operators a call; this is measured in bench/RESULTS.md."""

    @staticmethod
    def forward(ctx, q, k, v, bounds: list[int], scale: float):
        with torch.autocast(q.device.type, enabled=False):
            kv, group = k.shape[1], q.shape[1] // k.shape[1]
            qf, kf, vf = q.float(), k.float(), v.float()
            out = torch.empty(qf.shape, dtype=torch.float32, device=q.device)
            probabilities = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                n = b - a
                scores = torch.bmm(_grouped(qf, a, b, kv, group), kf[a:b].permute(1, 2, 0)).mul_(scale)
                later = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
                scores.view(kv, group, n, n).masked_fill_(later, float("-inf"))
                p = torch.softmax(scores, -1)
                out[a:b] = _ungrouped(torch.bmm(p, vf[a:b].transpose(0, 1)), n, kv, group)
                probabilities.append(p)
        ctx.save_for_backward(qf, kf, vf, *probabilities)
        ctx.bounds, ctx.scale, ctx.dtypes = bounds, scale, (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qf, kf, vf, *probabilities = ctx.saved_tensors
        kv, group = kf.shape[1], qf.shape[1] // kf.shape[1]
        with torch.autocast(qf.device.type, enabled=False):
            g = grad_out.float()
            dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
            for p, a, b in zip(probabilities, ctx.bounds[:-1], ctx.bounds[1:]):
                n = b - a
                go = _grouped(g, a, b, kv, group)
                dv[a:b] = torch.bmm(p.transpose(1, 2), go).transpose(0, 1)
                dp = torch.bmm(go, vf[a:b].permute(1, 2, 0))
                ds = (dp - (dp * p).sum(-1, keepdim=True)).mul_(p).mul_(ctx.scale)
                dq[a:b] = _ungrouped(torch.bmm(ds, kf[a:b].transpose(0, 1)), n, kv, group)
                dk[a:b] = torch.bmm(ds.transpose(1, 2), _grouped(qf, a, b, kv, group)).transpose(0, 1)
        return dq.to(ctx.dtypes[0]), dk.to(ctx.dtypes[1]), dv.to(ctx.dtypes[2]), None, None


def per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """varlen_attn's contract on a CPU (self-attention: cu_q is cu_k): causal attention over each sequence of the
    flattened rows (tokens, heads, dim), the boundaries read on the host (they live there on a CPU). Runs of short
    sequences go through _Short; a longer one through SDPA's flash kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    starts = cu_q.tolist()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pieces, run = [], [starts[0]]

    def close_run():
        if len(run) > 1:
            a = run[0]
            pieces.append(_Short.apply(q[a:run[-1]], k[a:run[-1]], v[a:run[-1]], [x - a for x in run], scale))
        run[:] = [run[-1]]

    for a, b in zip(starts[:-1], starts[1:]):
        if b - a <= SHORT:
            run.append(b)
            continue
        close_run()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            piece = torch.nn.functional.scaled_dot_product_attention(  # (1, heads, length, dim): flash takes 4-D
                q[None, a:b].transpose(1, 2), k[None, a:b].transpose(1, 2), v[None, a:b].transpose(1, 2),
                is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        pieces.append(piece[0].transpose(0, 1))
        run[:] = [b]
    close_run()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def dispatch(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """torch's varlen flash kernel on a CUDA GPU, `per_sequence` elsewhere."""
    global _cuda
    if q.device.type != "cuda":
        return per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    if _cuda is None:
        _cuda = kernel()
    return _cuda(q, k, v, cu_q, cu_k, max_q, max_k, scale)


_cuda = None
_kernel = dispatch  # tests put a reference in its place


def boundaries_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens, longest) of a packed row from its position ids, which restart at 0 for each sequence: for a
    batch that did not come through the collator (one host sync; the collator's batches never need it)."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                   cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """transformers' attention-function contract (query [batch, heads, length, head_dim] -> ([batch, length,
    heads, head_dim], None)). A packed batch (sequence boundaries given, or position ids that restart with no mask)
    runs through the varlen kernel over the flattened rows; anything else (a padding mask, a cache) is SDPA's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    packed = cu_seq_lens_q is not None or (attention_mask is None and kwargs.get("position_ids") is not None
                                           and key.shape[2] == query.shape[2] > 1)  # no cached keys before
    if not packed or not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, softcap=softcap, **kwargs)
    if softcap is not None or dropout:
        raise ValueError(f"{NAME} attention takes no softcap or attention dropout; set model.attn_implementation: sdpa")
    if cu_seq_lens_q is None:
        cu_seq_lens_q, max_length_q = boundaries_from_positions(kwargs["position_ids"])
        cu_seq_lens_k, max_length_k = cu_seq_lens_q, max_length_q
    if sliding_window is not None and max(max_length_q, max_length_k) > sliding_window:
        raise ValueError(f"{NAME} attention does not slide a window ({sliding_window}) over sequences of "
                         f"{max(max_length_q, max_length_k)} tokens; set model.attn_implementation: sdpa")
    batch, heads, length, head_dim = query.shape
    dtype = query.dtype
    device = query.device.type
    if dtype == torch.float32 and torch.is_autocast_enabled(device):  # fp32 states (RoPE in fp32) under autocast
        dtype = torch.get_autocast_dtype(device)
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], head_dim).to(dtype)
               for t in (query, key, value))
    out = _kernel(q, k, v, cu_seq_lens_q, cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q,
                  max_length_q, max_length_k if max_length_k is not None else max_length_q, scaling)
    return out.reshape(batch, length, heads, head_dim), None


def _early_exit_for_packed(original):
    """masking_utils._preprocess_mask_arguments, except that under `varlen` a batch with no padding mask and no
    cache builds no mask: there transformers 5.23 would infer packed sequences from position_ids (a host sync per
    forward) for a mask the kernel never reads."""
    def preprocess(config, inputs_embeds, attention_mask, past_key_values, position_ids, *args, **kwargs):
        if getattr(config, "_attn_implementation", None) == NAME and attention_mask is None \
                and past_key_values is None:
            return True, None, None, None, None, None, None
        return original(config, inputs_embeds, attention_mask, past_key_values, position_ids, *args, **kwargs)

    preprocess.tunekit_original = original
    return preprocess


def register() -> None:
    """`varlen` in transformers' attention and mask interfaces (its masks are SDPA's, for padded batches), once."""
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface

    if NAME in AttentionInterface._global_mapping:
        return
    AttentionInterface.register(NAME, varlen_forward)
    masking_utils.AttentionMaskInterface.register(NAME, masking_utils.sdpa_mask)
    masking_utils._preprocess_mask_arguments = _early_exit_for_packed(masking_utils._preprocess_mask_arguments)


def unfit_reason(config, precision: str, packed: bool, max_length: int, current: str | None,
                 cuda: bool | None = None) -> str | None:
    """Why `varlen` cannot serve this run, or None where it can (`cuda`: on a CUDA GPU; None: if there is one)."""
    if not packed:
        return "batches are not packed"
    if current not in (None, "sdpa", NAME):
        return f"the model loaded with {current} attention"
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window and window < max_length or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "the model slides an attention window"
    if getattr(config, "attention_dropout", 0.0):
        return "the model has attention dropout"
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return None  # a CPU: per_sequence
    if torch.cuda.get_device_capability() < (8, 0):
        return "the flash kernel needs a GPU of compute capability 8.0 or more"
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10 or later has)"
    if precision not in ("bf16", "fp16"):
        return f"the flash kernel computes in bf16 or fp16, and training.precision is {precision}"
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim not in HEAD_SIZES:
        return f"its head size {head_dim} is not one the flash kernel takes (a multiple of 8 up to 256)"
    return None


def choose(model, requested: str | None, precision: str, packed: bool, max_length: int) -> Choice:
    """The attention the run uses, switched on the loaded `model`: `varlen` by default where it applies (or where
    model.attn_implementation asks for it, refused in one line where it cannot run), else what the model loaded
    with."""
    from tunekit.core.errors import TunekitError

    base = base_of(model)
    current = base.config._attn_implementation
    if requested not in (None, NAME):
        return Choice(current, f"model.attn_implementation: {requested}")
    why_not = unfit_reason(base.config, precision, packed, max_length, None if requested else current)
    if why_not is not None:
        if requested == NAME:
            raise TunekitError(f"model.attn_implementation: {NAME} cannot run here: {why_not}; set it to sdpa or "
                               "remove it")
        return Choice(current, f"{current} ({NAME} not used: {why_not})")
    register()
    base.set_attn_implementation(NAME)
    how = ("torch's variable-length flash kernel" if torch.cuda.is_available() else
           "each sequence alone (the CPU's packed attention)")
    return Choice(NAME, f"{NAME}: {how} over the packed sequences, their boundaries built by the collator")
