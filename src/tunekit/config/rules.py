"""The recipe rules across sections, one function per topic, run in one order (RULES) by the schema's
validation, so every command that loads a recipe refuses the same recipes. Each reads the validated recipe and
the declarations (config.methods, config.metrickinds, config.rewardkinds) and raises ValueError with one line naming
the setting. Rules within one section sit beside its fields (config.schema, config.trainingschema)."""

from __future__ import annotations

import importlib.util
import re

from tunekit.config import methods, metrickinds, parallelconfig, rewardkinds
from tunekit.config.methodsettings import KL_LOSSES


def method_sections(recipe) -> None:
    """No section or data format that belongs to another method than the recipe's."""
    chosen = recipe.training.method
    mine = methods.DECLARED[chosen]
    for other in methods.DECLARED.values():
        if other.name == chosen:
            continue
        if other.section is not None and getattr(recipe, other.section) is not None:
            raise ValueError(f"{other.section}: these settings belong to training.method {other.name}; set "
                             f"training.method: {other.name} or remove the {other.section} section")
        for fmt in recipe.data.formats():
            if fmt in other.owned_formats and fmt not in (mine.data_formats or ()):
                raise ValueError(f"data.format: {fmt} is training data for training.method {other.name}; "
                                 f"set training.method: {other.name} or use another format")


def starting_adapter(recipe) -> None:
    if recipe.model.adapter_from and (recipe.full_finetuning or (recipe.lora and recipe.lora.init != "default")):
        raise ValueError("model.adapter_from continues a LoRA adapter: use adapter: lora with lora.init: default")


def data_formats(recipe) -> None:
    """Every data source's format is one the method trains on."""
    method = methods.spec_of(recipe)
    wrong = [f for f in recipe.data.formats() if not method.trains_on(f)]
    if wrong:
        raise ValueError(f"training.method: {method.name} trains on {method.data_description}; set data.format "
                         f"(and each source's format): {' or '.join(method.data_formats)} (got {wrong[0]})")


def learning_rate(recipe) -> None:
    method = methods.spec_of(recipe)
    if recipe.training.learning_rate == "auto" and not method.loss_tracks_learning:
        raise ValueError(f"training.learning_rate: auto runs a range test on the training loss, which "
                         f"training.method: {method.name} does not lower as it learns; set a rate, e.g. 1e-5")


def settings_apply(recipe) -> None:
    """A setting the method's trainer would not use is refused, not ignored (training.chunked_loss, on by
    default and written into every run's recipe.yaml, is documented as SFT's instead)."""
    method, t, d = methods.spec_of(recipe), recipe.training, recipe.data
    unused = [
        (t.group_by_length and not method.groups_by_length, "training.group_by_length", "samples in its own order"),
        (d.packing is True and not method.packs, "data.packing: true", "pads its batches"),
        (not d.mask_prompt and not method.prompt_loss_optional, "data.mask_prompt: false", "trains the answers only"),
    ]
    for hit, key, why in unused:
        if hit:
            raise ValueError(f"{key} does not apply to training.method: {method.name}, which {why}; remove it")


def reference(recipe) -> None:
    """The reference is the base model, which a lora.init other than default rewrites."""
    method, lora = methods.spec_of(recipe), recipe.lora
    if not method.has_reference or lora is None or lora.init == "default":
        return
    switch = method.reference_switch
    if switch is None:
        raise ValueError(f"training.method: {method.name} takes the base model as its reference, which lora.init="
                         f"{lora.init} rewrites; use lora.init: default")
    if getattr(method.settings_of(recipe), switch) > 0:
        key = f"{method.section}.{switch}"
        raise ValueError(f"{key}: the reference is the base model, which lora.init={lora.init} rewrites; use "
                         f"lora.init: default or {key}: 0")


def grpo_rewards(recipe) -> None:
    """At least one reward, each well formed, logged under its own name, code run only when trusted (grpo, rloo)."""
    key, g = methods.sampled(recipe)
    if g is None:
        return
    if not g.rewards:
        raise ValueError(f"{key}.rewards: name at least one reward, e.g. [{{reward: exact_match}}] "
                         "(docs/methods.md, GRPO)")
    seen = set()
    for i, spec in enumerate(g.rewards):
        rewardkinds.check(spec, i, key)
        if rewardkinds.DECLARED[spec.reward].episode and not g.acts:
            raise ValueError(f"{key}.rewards[{i}] ({spec.reward}) scores an episode with tools; set {key}.tools or "
                             f"{key}.environment, or choose another reward")
        if spec.reward == "environment" and not g.environment:
            raise ValueError(f"{key}.rewards[{i}] (environment) is the environment's get_reward(); set "
                             f"{key}.environment: module:Class")
        name = rewardkinds.label(spec, i, g.rewards)
        if name in seen:
            raise ValueError(f"{key}.rewards[{i}].name: {name!r} is logged twice; give each reward its own name")
        seen.add(name)
        if spec.reward == "function" and not g.trust_local_code:
            raise ValueError(f"{key}.rewards[{i}]: a function reward runs your Python code ({spec.function}); set "
                             f"{key}.trust_local_code: true to allow it")
    for setting in ("tools", "environment"):
        if getattr(g, setting) and not g.trust_local_code:
            raise ValueError(f"{key}.{setting}: tools run your Python code; set {key}.trust_local_code: true to "
                             "allow it")
    if g.acts and g.vllm:
        raise ValueError(f"{key}.vllm: episodes with tools sample with tunekit's seeded sampling; set {key}.vllm: "
                         "false")
    for i, spec in enumerate(g.tools):
        if not re.fullmatch(r"[\w.]+(:\w+)?", spec):
            raise ValueError(f"{key}.tools[{i}]: {spec!r} is not module:function or module")
    if g.environment is not None and not re.fullmatch(r"[\w.]+:\w+", g.environment):
        raise ValueError(f"{key}.environment: {g.environment!r} is not module:Class")


def episode_settings(recipe) -> None:
    """max_turns, tool_timeout and tool_output_chars bound episodes with tools; without tools or an environment
    nothing reads them. Refused when they differ from their defaults (which every run's recipe.yaml writes)."""
    key, g = methods.sampled(recipe)
    if g is None or g.acts:
        return
    for name in ("max_turns", "tool_timeout", "tool_output_chars"):
        if getattr(g, name) != type(g).model_fields[name].default:
            raise ValueError(f"{key}.{name} applies to episodes with tools, and this recipe sets no {key}.tools or "
                             f"{key}.environment; set one or remove {name}")


def installed(recipe) -> None:
    """An optional package a setting needs is there."""
    key, g = methods.sampled(recipe)
    if g is not None and g.vllm and importlib.util.find_spec("vllm") is None:
        raise ValueError(f"{key}.vllm: vLLM is not installed; pip install 'tunekit[vllm]' (on a CUDA machine) or set "
                         f"{key}.vllm: false")


def batch(recipe) -> None:
    """The micro-batch suits the method's loss: KTO's KL estimate needs neighbours, GRPO's groups fill it."""
    t, kto = recipe.training, recipe.kto
    key, grpo = methods.sampled(recipe)
    if kto is not None and kto.loss_type in KL_LOSSES and t.micro_batch_size < 2:
        raise ValueError("training.micro_batch_size: KTO's loss kto estimates its KL term from the other "
                         "examples of a micro-batch; use 2 or more (or kto.loss_type: apo_zero_unpaired)")
    if grpo is not None and (t.micro_batch_size * t.gradient_accumulation_steps) % grpo.completions:
        raise ValueError(f"training.micro_batch_size: {key.upper()} batches count completions, and micro_batch_size "
                         f"x gradient_accumulation_steps ({t.micro_batch_size} x {t.gradient_accumulation_steps}) "
                         f"must be a multiple of {key}.completions ({grpo.completions})")


def best_metric_is_logged(recipe) -> None:
    """metric_for_best names a metric the evaluations log: a generation metric of the eval section that runs
    during training, or eval_loss (beside those only where the method computes it: not GRPO); a score head's
    (a reward model's) evaluations generate nothing and log eval_loss, eval_accuracy and eval_margin."""
    name = recipe.training.metric_for_best
    if name is None:
        return
    key = name.removeprefix("eval_")
    method = methods.spec_of(recipe)
    if method.eval_measures:
        if key not in ("loss", *method.eval_measures):
            raise ValueError(f"training.metric_for_best: {name} is not logged at evaluations of training.method: "
                             f"{method.name}, which generate nothing; logged: eval_loss, "
                             + ", ".join(f"eval_{m}" for m in method.eval_measures))
        return
    during = recipe.eval is not None and recipe.eval.during_training
    logs_loss = not during or method.eval_loss_beside_generation
    declared = metrickinds.DECLARED
    generated = []
    if during:
        generated = [k for m in recipe.eval.metrics if declared[m].scored for k, _ in declared[m].rows]
    scored = [m.name for m in methods.DECLARED.values() if key in m.eval_measures]
    if scored and key not in generated:
        raise ValueError(f"training.metric_for_best: {name} is a reward model's held-out pair measure, logged by "
                         f"training.method: {' or '.join(scored)}, not {method.name}, whose evaluations log "
                         + (", ".join(["eval_loss"] * logs_loss + generated) or "no such measure"))
    if (key != "loss" or not logs_loss) and key not in generated and not (recipe.eval and "/" in key):
        hint = ("add an eval section (it logs " + ", ".join(k for m in declared.values() if m.scored for k, _ in
                                                           m.rows) + " during training)") if not generated else \
            "logged: " + ", ".join(["eval_loss"] * logs_loss + generated)
        raise ValueError(f"training.metric_for_best: {name} is not logged at evaluations; {hint}")


def eval_metrics(recipe) -> None:
    """eval.metrics and eval.extra_metrics score generated text (the loss reads a language-model head); a method
    with a score head generates nothing and has no such head, so naming them is refused. The default list, which
    every run's recipe.yaml writes, is left: nothing reads it there."""
    method, e = methods.spec_of(recipe), recipe.eval
    if e is None or not method.score_head:
        return
    named = [("eval.metrics", e.metrics)] if e.metrics and e.metrics != metrickinds.defaults() else []
    named += [("eval.extra_metrics", e.extra_metrics)] if e.extra_metrics else []
    if named:
        key, names = named[0]
        measures = ", ".join(f"eval_{m}" for m in method.eval_measures)
        raise ValueError(f"{key}: {', '.join(names)} cannot be computed for training.method: {method.name}, which "
                         f"generates nothing (its evaluations score the held-out pairs: eval_loss, {measures}); "
                         f"remove {key}")


def distillation(recipe) -> None:
    """A teacher is named; the answers an off-policy example or the SFT loss trains on are in the data; a 4-bit
    teacher stays whole."""
    d = recipe.distill
    if d is None:  # another method's recipe (a distill section there is refused by method_sections)
        return
    if not d.teacher:
        raise ValueError("distill.teacher: name the teacher: a hub name, a local model directory or the output_dir "
                         "of a tunekit run")
    answerless = [f for f in recipe.data.formats() if f == "prompt"]
    if answerless and d.mode != "on_policy":
        raise ValueError(f"distill.mode: {d.mode} trains on the data's answers, and data.format: prompt has none; "
                         "set distill.mode: on_policy (the student answers itself) or give data with answers")
    if answerless and d.sft_weight:
        raise ValueError("distill.sft_weight: the SFT loss trains on the data's answers, and data.format: prompt "
                         "has none; set distill.sft_weight: 0")
    t = recipe.training
    if d.teacher_4bit and d.teacher_placement == "sharded" and (t.deepspeed or t.fsdp is not None):
        raise ValueError("distill.teacher_4bit: a 4-bit teacher is not sharded (its packed weights and their scales "
                         "must stay together); set distill.teacher_placement: replicated")


def sharding_fits_the_quantization(recipe) -> None:
    if recipe.training.fsdp is not None and recipe.quantization is not None and recipe.quantization.bits == 8:
        raise ValueError("quantization.bits 8 with training.fsdp: FSDP2 shards bitsandbytes' int8 weights "
                         "apart from their scales, which the forward pass needs together; use bits: 4 (QLoRA) "
                         "or training.deepspeed")


def precision_agrees(recipe) -> None:
    q, p = recipe.quantization, recipe.training.precision
    if q is not None and q.compute_dtype != "auto" and p not in ("auto", "fp32") and q.compute_dtype != p:
        raise ValueError(f"training.precision is {p} but quantization.compute_dtype is {q.compute_dtype}: "
                         f"{p} and {q.compute_dtype} both on; make them agree")


def attention(recipe) -> None:
    """model.attn_implementation: varlen runs over packed batches only."""
    if recipe.model.attn_implementation != "varlen":
        return
    p = recipe.training.parallelism
    why = ("data.packing is false" if recipe.data.packing is False else
           f"training.method: {recipe.training.method} pads its batches" if not methods.spec_of(recipe).packs else
           "training.parallelism sp/cp pads its batches" if p is not None and p.sp * p.cp > 1 else None)
    if why:
        raise ValueError(f"model.attn_implementation: varlen reads the boundaries of packed batches, and {why}; set "
                         "model.attn_implementation: sdpa")


# the order a recipe breaking several rules is told of the first
def parallelism(recipe) -> None:
    """training.parallelism's layout against the method, the sharding engine and the adapter (its rules live with
    the rest of it, in config.parallelconfig)."""
    parallelconfig.check_recipe(recipe)


RULES = (method_sections, starting_adapter, data_formats, learning_rate, settings_apply, reference, grpo_rewards,
         episode_settings, installed, batch, distillation, best_metric_is_logged, eval_metrics,
         sharding_fits_the_quantization, precision_agrees, attention, parallelism)


def run(recipe) -> None:
    """Every rule, in order; the first broken one raises ValueError."""
    for rule in RULES:
        rule(recipe)
