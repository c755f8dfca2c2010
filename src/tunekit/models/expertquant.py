"""QLoRA's 4-bit experts: a mixture of experts' 3-D expert weights stored in 4 bits beside the 4-bit linear layers.

transformers' bitsandbytes quantizer quantizes nn.Linear layers only, and a sparse block keeps its experts as 3-D
parameters (models.experts), most of the model. bitsandbytes' own answer for such parameters is used, its
parametrized 4-bit parameters (`bnb.nn.parametrize`): the codes (uint8, two per byte, with the blocks' scales) stand
in place of the parameter, and a parametrization dequantizes them whenever the parameter is read, so the experts' own
forward (grouped_mm or eager) runs unchanged on a weight in the dtype it was quantized from. peft's LoRA on the
parameter (target_parameters) stacks its own parametrization on top (W + BA). No grouped 4-bit kernel ships with the
installed stack; a dequantized layer's weights live through the forward and, kept by the grouped matmuls for their
backward, until the backward reaches the layer (plan.moe counts them)."""

from __future__ import annotations

import torch
from torch import nn

from tunekit.models import experts
from tunekit.models.unwrap import base_of


def quantize(model: nn.Module, quant) -> int:
    """Store every experts module's 3-D weights in 4 bits as `quant` (a BitsAndBytesConfig loading 4-bit) says:
    its quant type, double quantization, and the dtype they dequantize to (the weights' own, the training
    precision as loaded). Returns the count of weights quantized; 0 for a dense model."""
    if experts.layout(model) is None:  # a dense model
        return 0
    done = 0
    for module in base_of(model).modules():
        if not experts.holds_experts(module):
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 3 and p.dtype.is_floating_point:
                _store_4bit(module, name, quant)
                done += 1
    if done:
        _mend_peft_param_wrapper()
    if done and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the 16-bit experts just replaced
    return done


def is_quantized(module: nn.Module, name: str) -> bool:
    """Whether `module`'s parameter `name` is stored as 4-bit codes by quantize()."""
    from torch.nn.utils import parametrize

    return parametrize.is_parametrized(module, name) and hasattr(module.parametrizations[name][0], "weight_shape")


def dequantize(model: nn.Module, dtype: torch.dtype) -> int:
    """Turn the 4-bit experts back into plain 3-D weights in `dtype`, dequantized straight to it (a merge's fp32,
    without rounding to the dtype they were quantized from). Returns the count."""
    from torch.nn.utils import parametrize

    done = 0
    for module in base_of(model).modules():
        for name in [n for n in getattr(module, "parametrizations", {}) if is_quantized(module, n)]:
            module.parametrizations[name][0].quant_state.dtype = dtype
            weight = getattr(module, name).detach()
            # the codes are uint8, the weight is not: torch cannot leave the weight in the codes' place
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)
            setattr(module, name, nn.Parameter(weight, requires_grad=False))
            done += 1
    return done


def _store_4bit(module: nn.Module, name: str, quant) -> None:
    """bitsandbytes' replace_parameter_4bit, on the flattened weight: bitsandbytes 0.50.2's CPU kernels quantize and
    dequantize a tensor whose last dimension is under the block size (64) wrongly (relative error 0.2 to 0.4, where
    nf4's is 0.09, on a random 16 x 64 x 32 weight: a tiny model's down_proj); the flattened weight comes back
    right, on CPU and GPU alike."""
    import bitsandbytes.functional as F
    from bitsandbytes.nn import parametrize as bnb_parametrize
    from torch.nn.utils import parametrize

    weight = getattr(module, name)
    shape = weight.shape
    codes, state = F.quantize_4bit(weight.data.contiguous().view(-1), quant_type=quant.bnb_4bit_quant_type,
                                   compress_statistics=quant.bnb_4bit_use_double_quant)
    setattr(module, name, nn.Parameter(codes, requires_grad=False))
    del weight
    parametrize.register_parametrization(module, name, _flat_4bit()(state, shape), unsafe=True)
    # bitsandbytes' own hooks: reads within one forward of the module share a dequantization (cached), and the codes
    # go into the state dict; with LoRA on the weight, peft reads it twice more per forward outside that cache
    bnb_parametrize._register_parametrization_hooks(module, name)


_FLAT = None
MENDED_PEFT = "0.21.2"  # the peft whose ParamWrapper _mend_peft_param_wrapper mends


def _flat_4bit():
    """bitsandbytes' 4-bit parametrization over a flattened weight, read back in the weight's shape (a class built
    on first use: bitsandbytes is imported only where 4-bit weights load)."""
    global _FLAT
    if _FLAT is None:
        from bitsandbytes.nn.parametrize import Bnb4bitParametrization

        class Flat4bit(Bnb4bitParametrization):
            def __init__(self, quant_state, weight_shape):
                super().__init__(quant_state)
                self.weight_shape = torch.Size(weight_shape)

            @torch.no_grad()
            def forward(self, quantized_param: torch.Tensor) -> torch.Tensor:
                return super().forward(quantized_param).view(self.weight_shape)

        _FLAT = Flat4bit
    return _FLAT


def _mend_peft_param_wrapper() -> None:
    """Two mends to peft 0.21.2's ParamWrapper (LoRA on a parameter), which parametrizes the parameter for each
    forward, for a parameter that carries another parametrization (the 4-bit codes here):
    - it removes only the unfolded _LoraParameterProxy afterwards, not the _LoraFactorsProxy it folds a single
      adapter into: the proxies piled up, one more at every forward;
    - with LoRA on both expert weights the wrappers nest, and the inner one registers its proxy inside the outer
      one's parametrize.cached() context: torch's registration reads the parameter once to check it, and that read,
      without the proxy, is what the forward then got from the cache; the inner adapters got no gradient. The read
      is dropped from the cache once the proxy is registered.
    Applied to the pinned peft (0.21.2) only: another version runs as it is, and tests/models/test_expertquant.py
    (every expert adapter gets its gradient, no proxy stays) says whether it still needs them."""
    import contextlib

    import peft
    from peft.tuners.lora import layer
    from torch.nn.utils import parametrize

    wrapper = layer.ParamWrapper
    removal, activate = wrapper._remove_parametrizations, wrapper._activate_lora
    if peft.__version__ != MENDED_PEFT or getattr(removal, "_tunekit", False):
        return
    folded = layer._LoraFactorsProxy

    def remove(self):
        chain = self.get_base_layer().parametrizations[self.parameter_name]
        if len(chain) > 1 and isinstance(chain[-1], folded):
            del chain[-1]
            return
        removal(self)

    remove._tunekit = True
    wrapper._remove_parametrizations = remove

    @contextlib.contextmanager
    def activated(self, active_adapters):
        with activate(self, active_adapters):
            parametrize._cache.pop((id(self.get_base_layer()), self.parameter_name), None)
            yield

    wrapper._activate_lora = activated
