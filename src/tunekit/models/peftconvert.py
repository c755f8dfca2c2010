"""A mend to peft 0.21.2's conversion of LoRA configs for transformers 5's mixtures of experts (peft issue #3711).

Before it injects an adapter, peft rewrites the config of a model whose experts transformers 5 fused (DeepSeek-V3,
GLM-4.5, Qwen3-MoE, OLMoE, ...), as if it were written for transformers 4: every target ending in gate_proj, up_proj
or down_proj is taken for a routed expert's and moved to the fused 3-D expert weights (gate_up_proj at twice the
rank). A shared expert's or a dense layer's MLP (DeepSeek-V3's shared_experts, its first dense layers) then gets no
LoRA on a new adapter, and an adapter saved with them does not load. tunekit names its targets within a decoder layer
("mlp.shared_experts.gate_proj", models.experts); the mend keeps a dotted target that names a linear layer of the
model as it is (under a LoRA wrapper too: TRL's trainers add their reference adapter beside the trained one), and
lets peft convert the rest, as the fix proposed upstream does. Applied to the pinned peft (0.21.2) only:
tests/models/test_experts.py checks that a DeepSeek-V3 adapter holds, and loads back, its shared experts' LoRA."""

from __future__ import annotations

MENDED_PEFT = "0.21.2"


def reaches(name: str, target: str) -> bool:
    """peft's rule for a target_modules entry: the module's name, or its last dotted parts."""
    return name == target or name.endswith(f".{target}")


def mend() -> None:
    """Install the mend (once; a no-op on another peft)."""
    import peft
    from peft.utils import transformers_weight_conversion as conversion
    from torch import nn

    original = conversion.convert_peft_config_for_transformers
    if peft.__version__ != MENDED_PEFT or getattr(original, "_tunekit", False):
        return

    def convert(peft_config, model, conversions=None):
        targets = peft_config.target_modules
        if not isinstance(targets, (list, set, tuple)):
            return original(peft_config, model, conversions)
        linear = {n.removesuffix(".base_layer") for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        kept = {t for t in targets if "." in t and any(reaches(n, t) for n in linear)}
        peft_config.target_modules = set(targets) - kept
        try:
            original(peft_config, model, conversions)
        finally:
            peft_config.target_modules = set(peft_config.target_modules or ()) | kept

    convert._tunekit = True
    conversion.convert_peft_config_for_transformers = convert


# the targets peft 0.21.2 rewrites (its _MOE_TARGET_MODULE_MAPPING's keys), named as tunekit names them: dotted
MLP = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate")


def may_be_rewritten(targets) -> bool:
    """Whether an adapter's saved targets could be ones peft 0.21.2 rewrites (a dotted MLP projection), read without
    any import; rewritten() says for certain."""
    return isinstance(targets, list) and any("." in t and t.rsplit(".", 1)[-1] in MLP for t in targets)


def rewritten(raw: dict, targets) -> bool:
    """Whether peft 0.21.2 without the mend would rewrite these LoRA targets of the model whose config.json is `raw`
    as it loads the adapter (what a model card must tell whoever loads it with plain peft). peft (and torch) are
    imported only for a mixture of experts."""
    from tunekit.models import moecheck

    if not moecheck.is_sparse(raw) or isinstance(targets, str) or not targets:
        return False
    import peft
    from peft.utils import transformers_weight_conversion as conversion

    if peft.__version__ != MENDED_PEFT:
        return False
    model_type = raw.get("model_type")
    kind = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
    old = conversion._MOE_TARGET_MODULE_MAPPING.get(kind, {})
    return any(reaches(t, k) for t in targets for k in old)
