"""What `tunekit plan` suggests when a recipe does not fit: the cheapest changes first (checkpointing, a smaller
micro-batch, QLoRA, LoRA, ZeRO stages, FSDP2, offload), each planned again and kept only where it lowers the peak."""

from __future__ import annotations

import dataclasses

from tunekit.config.schema import Recipe
from tunekit.plan import estimate
from tunekit.plan.estimate import Plan, Settings


def sharding_options(recipe: Recipe, s: Settings, experts: bool = False) -> list[tuple[str, Recipe, Settings]]:
    """ZeRO stages and FSDP2 on several devices, each in place of the other where the recipe has it; none that
    shards parameters for a mixture of experts' 4-bit experts (`experts`: the model has them; refused in training,
    models.moecheck)."""
    options = []
    unshardable = experts and recipe.quantization is not None
    plain = dataclasses.replace(s, fsdp=False, zero_stage=0, offload_optimizer=False, offload_params=False)
    if s.world_size > 1:
        swap = " (in place of training.fsdp)" if s.fsdp else ""
        for stage in (1, 2, 3):
            if (s.fsdp or s.zero_stage < stage) and not (stage == 3 and recipe.quantization is not None):
                options.append((f"deepspeed: ds_configs/zero{stage}.json{swap}", recipe,
                                dataclasses.replace(plain if s.fsdp else s, zero_stage=stage)))
        swap = " (in place of training.deepspeed)" if s.zero_stage else ""
        if not s.fsdp and not unshardable:
            options.append(("training.fsdp: {}" + swap, recipe, dataclasses.replace(plain, fsdp=True)))
        if not s.fsdp_offload and not unshardable:
            label = "training.fsdp.cpu_offload=true" if s.fsdp else "training.fsdp: {cpu_offload: true}" + swap
            options.append((label, recipe, dataclasses.replace(s if s.fsdp else plain, fsdp=True, fsdp_offload=True)))
    if not s.offload_optimizer and not (unshardable and s.zero_stage == 3):
        stage = max(s.zero_stage, 2)
        options.append((f"deepspeed: ds_configs/zero{stage if stage == 2 else 3}_offload.json"
                        + (" (in place of training.fsdp)" if s.fsdp else ""), recipe,
                        dataclasses.replace(plain if s.fsdp else s, zero_stage=stage, offload_optimizer=True,
                                            offload_params=stage == 3)))
    return options


def suggestions(recipe: Recipe, plan: Plan, budget: int, cfg, model) -> list[tuple[str, Plan]]:
    """Cheapest changes first; each is re-planned and kept only if it lowers the peak."""
    s = plan.settings
    options: list[tuple[str, Recipe, Settings]] = []
    if not s.gradient_checkpointing:
        # FSDP's activation checkpointing wraps the units auto_wrap makes
        options.append(("training.fsdp.activation_checkpointing=true" if s.fsdp and s.fsdp_auto_wrap
                        else "training.gradient_checkpointing=true", recipe,
                        dataclasses.replace(s, gradient_checkpointing=True)))
    if s.micro_batch > 1:
        half = max(1, s.micro_batch // 2)
        options.append((f"training.micro_batch_size={half} with gradient_accumulation_steps x{s.micro_batch // half}",
                        recipe, dataclasses.replace(s, micro_batch=half,
                                                    accumulation=s.accumulation * (s.micro_batch // half))))
    if recipe.adapter_kind == "lora":
        from tunekit.config.schema import QuantizationConfig

        qrecipe = recipe.model_copy(update={"quantization": QuantizationConfig()})
        options.append(("QLoRA: a quantization section (4-bit nf4 base)", qrecipe, s))
    if recipe.full_finetuning:
        from tunekit.config.schema import LoraConfig

        options.append(("adapter=lora", recipe.model_copy(update={"adapter": "lora", "lora": LoraConfig()}), s))
    options += sharding_options(recipe, s, experts=bool(plan.counts.experts))
    out = []
    for label, r, st in options:
        m = model if r.adapter_kind == recipe.adapter_kind else None
        p = (estimate.make(r, st, cfg, m, versus=False) if m is not None
             else estimate.make(r, st, versus=False))
        if p.peak < plan.peak:
            out.append((label, p))
    return sorted(out, key=lambda lp: lp[1].peak)
