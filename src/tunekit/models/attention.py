"""Which attention a training run uses, and torch's variable-length flash kernel for packed batches.

Packed (padding-free) batches on SDPA are slow by construction in transformers 5.23: every forward infers the
packed sequences from position_ids (`masking_utils.find_packed_sequence_indices`, a host sync) and builds a
block-causal [length, length] mask, which keeps SDPA off its flash kernel. torch (2.10 and later) ships a
variable-length flash kernel, `torch.nn.attention.varlen.varlen_attn`, that takes the sequences' boundaries
instead. `varlen` is that kernel registered with transformers' attention interface: the collator builds the
boundaries once per batch on the host (DataCollatorWithFlattening's `cu_seq_lens_*` / `max_length_*`), they reach
every layer as keyword arguments, and no forward infers them. Padded batches and generation under the same name get
SDPA's own masks and SDPA.

`choose` makes it the default where it applies (a CUDA GPU of compute capability 8.0 or more, packed batches,
16-bit compute, a head size the kernel takes, no sliding window or attention dropout); everywhere else the model
keeps the attention it loaded with.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from dataclasses import dataclass

import torch

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


_kernel = None  # set by register(); tests put a CPU reference in its place


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
                                           and kwargs.get("past_key_values") is None and query.shape[2] > 1)
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
    global _kernel
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface

    if NAME in AttentionInterface._global_mapping:
        return
    AttentionInterface.register(NAME, varlen_forward)
    masking_utils.AttentionMaskInterface.register(NAME, masking_utils.sdpa_mask)
    masking_utils._preprocess_mask_arguments = _early_exit_for_packed(masking_utils._preprocess_mask_arguments)
    if _kernel is None and torch.cuda.is_available():
        _kernel = kernel()


def unfit_reason(config, precision: str, packed: bool, max_length: int, current: str | None) -> str | None:
    """Why the varlen kernel cannot serve this run, or None where it can."""
    if not packed:
        return "batches are not packed"
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 0):
        return "the flash kernel needs a GPU of compute capability 8.0 or more"
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10 or later has)"
    if precision not in ("bf16", "fp16"):
        return f"it computes in bf16 or fp16, and training.precision is {precision}"
    if current not in (None, "sdpa", NAME):
        return f"the model loaded with {current} attention"
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim not in HEAD_SIZES:
        return f"its head size {head_dim} is not one the flash kernel takes (a multiple of 8 up to 256)"
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window and window < max_length or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "the model slides an attention window"
    if getattr(config, "attention_dropout", 0.0):
        return "the model has attention dropout"
    return None


def choose(model, requested: str | None, precision: str, packed: bool, max_length: int) -> Choice:
    """The attention the run uses, switched on the loaded `model`: `varlen` by default where it applies (or where
    model.attn_implementation asks for it, refused in one line where it cannot run), else what the model loaded
    with."""
    from tunekit.core.errors import TunekitError

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    current = base.config._attn_implementation
    if requested not in (None, NAME):
        return Choice(current, f"model.attn_implementation: {requested}")
    why_not = unfit_reason(base.config, precision, packed, max_length, None if requested else current)
    if why_not is not None:
        if requested == NAME:
            raise TunekitError(f"model.attn_implementation: {NAME} cannot run here: {why_not}; set it to sdpa or "
                               "remove it")
        return Choice(current, f"{current}; torch's varlen flash kernel not used: {why_not}")
    register()
    base.set_attn_implementation(NAME)
    return Choice(NAME, "torch's variable-length flash kernel over packed sequences, their boundaries built by the "
                        "collator")
