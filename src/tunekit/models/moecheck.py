"""A recipe for a mixture-of-experts model, checked before any weight loads (and before torch or transformers are
imported: read from the model's config.json as a plain dict). What models.experts and models.expertquant cannot do is
refused in one line; lora.dropout's default, which peft's LoRA on the experts does not take, is settled in the
recipe the run records."""

from __future__ import annotations

from tunekit.config import methods
from tunekit.config.schema import MoeConfig
from tunekit.core.errors import TunekitError
from tunekit.models import hub, info, vision


def is_sparse(raw: dict) -> bool:
    """Whether a config.json (a vision-language model's: its text_config) is a mixture of experts: experts per layer
    (DeepSeek-V3's and GLM-4.5's n_routed_experts) and experts per token."""
    text = raw.get("text_config") or raw
    count = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    return bool(count) and bool(text.get("num_experts_per_tok"))


def has_balancing_loss(raw: dict) -> bool:
    """Whether a mixture of experts' config.json sets a load-balancing loss (router_aux_loss_coef), as the models
    transformers computes one for do; DeepSeek-V3's and GLM-4.5's routers balance by a score-correction bias
    instead, and their configs set none."""
    return "router_aux_loss_coef" in (raw.get("text_config") or raw)


def check_recipe(recipe):
    """Refused: a moe section for a dense model, a balancing loss weighed for a model whose config sets none, LoRA
    dropout asked for on the experts, an 8-bit base of a mixture
    of experts (its experts would silently stay in 16 bits: only 4 bits reach them, models.expertquant), 4-bit
    experts under ZeRO-3 or FSDP2, or under a method that copies the adapter as its reference. Returns the recipe
    with lora.dropout's default dropped where LoRA reaches the experts (models.experts.scope_lora drops it from
    peft's config), so that the run's recipe says what trained."""
    try:
        raw = info.raw_config(recipe.model, shipped=True)
    except (hub.Unavailable, OSError, ValueError):
        return recipe  # the load that follows says why the model cannot be had
    name = recipe.model.name_or_path
    if not is_sparse(raw):
        if recipe.moe is not None:
            raise TunekitError(f"moe: {name} is not a mixture-of-experts model; remove the moe section")
        return recipe
    moe = recipe.moe or MoeConfig()
    if not has_balancing_loss(raw) and (moe.aux_loss_coef or moe.aux_loss_scope == "layer"):
        key = "aux_loss_coef" if moe.aux_loss_coef else "aux_loss_scope"
        raise TunekitError(f"moe.{key}: {name}'s config sets no load-balancing loss (no router_aux_loss_coef: its "
                           "router balances otherwise, as DeepSeek-V3's by a score-correction bias), so there is "
                           f"none to weigh; remove moe.{key}")
    lora = recipe.lora
    # LoRA reaches the experts (scope_lora; a vision-language model's LoRA stays on its language model's linears)
    on_experts = lora is not None and moe.experts and not vision.reads_images(recipe.model)
    if on_experts and "dropout" in lora.model_fields_set and lora.dropout > 0:
        raise TunekitError(f"lora.dropout: {lora.dropout} cannot apply to {name}'s experts: peft's LoRA on their 3-D "
                           "weights (moe.experts) takes no dropout; set lora.dropout: 0, or moe.experts: false to "
                           "train attention alone with dropout")
    q = recipe.quantization
    if q is not None and q.bits == 8:
        raise TunekitError(f"quantization.bits: 8 leaves {name}'s experts (3-D weights that bitsandbytes' 8-bit "
                           "loading does not reach) in 16 bits; use bits: 4, whose experts are stored in 4 bits too")
    if q is not None and on_experts and _copies_the_adapter(recipe):
        raise TunekitError(f"quantization: training.method: {methods.spec_of(recipe).name} trains against TRL's copy "
                           "of the adapter as its reference, which peft cannot make on 4-bit experts; set "
                           "moe.experts: false (LoRA on attention alone) or remove the quantization section")
    if q is not None:
        from tunekit.config import dsconfig

        t = recipe.training
        zero3 = t.deepspeed and dsconfig.zero_stage(dsconfig.read(t.deepspeed)) == 3
        if zero3 or t.fsdp is not None:
            raise TunekitError(f"quantization: {name}'s 4-bit experts (bitsandbytes' parametrized codes, their scales "
                               f"beside them) cannot be sharded by {'ZeRO-3' if zero3 else 'FSDP2'}; train QLoRA "
                               "on one device or under DDP, or remove the quantization section")
    return without_dropout(recipe) if on_experts else recipe  # its default: dropped, and the run records so


def without_dropout(recipe):
    """The recipe with lora.dropout 0: what trains where LoRA reaches the experts (models.experts.scope_lora)."""
    if recipe.lora is None or not recipe.lora.dropout:
        return recipe
    return recipe.model_copy(update={"lora": recipe.lora.model_copy(update={"dropout": 0.0})})


def _copies_the_adapter(recipe) -> bool:
    """Whether the method's TRL trainer copies the adapter as its reference ("ref", training.trainers.reference):
    DPO, KTO, and GRPO and RLOO with a nonzero beta."""
    method = methods.spec_of(recipe)
    switch = method.reference_switch
    return method.has_reference and (switch is None or getattr(method.settings_of(recipe), switch) > 0)
