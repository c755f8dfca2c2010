"""`tunekit plan`'s model: memory per device and time per step, from the recipe and the model's config only (its page:
plan.report). Here the settings, the parameter counts, and the plan put together from its parts, with its peak and
the other ways to shard or split the same recipe; the model's state by part is in plan.modelstate, the activations
in plan.activations, what FSDP2 and ZeRO-3 gather in plan.sharding, the time per step in plan.steptime. How the
bytes follow what tunekit loads: docs/plan.md, "How the plan counts"."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from tunekit.config import dsconfig, methods, parallelconfig
from tunekit.config.schema import Recipe
from tunekit.models import experts, moecheck, vision
from tunekit.plan import activations, distillteacher, modelstate, moe, shapes, sharding, splitting, steptime

ROUTER_LOGITS = "router logits and balancing loss"  # a mixture of experts' (plan.moe)
LATER_GRADIENTS = "gradients of the later layers (fp32)"


@dataclass
class Counts:
    total: int
    trainable: int
    quantized: int  # weights stored in 4/8 bit
    frozen_plain: int  # frozen weights kept in a float dtype
    tied_trainable_head: int = 0  # output head shared with the input embeddings, and trained
    embeddings: int = 0  # of frozen_plain: the embeddings and the output head (tied ones once)
    inactive: int = 0  # a mixture of experts: expert weights a token does not use (the experts not picked for it)
    experts: str = ""  # a mixture of experts, in words: "top-8 of 128 experts in 48 layers"
    frozen_experts: int = 0  # of frozen_plain: a mixture of experts' frozen expert weights (their own line in the plan)


@dataclass
class Settings:
    world_size: int = 1
    micro_batch: int = 1
    seq_len: int = 1024
    precision: str = "bf16"
    gradient_checkpointing: bool = False
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    optimizer: str = "adamw_torch"
    accumulation: int = 1  # gradient accumulation steps
    sequences: int = 1  # sequences per example: 2 for DPO (chosen and rejected in one batch)
    extra_forwards: int = 0  # no-grad forwards over the batch: DPO's reference; KTO's KL, reference and reference KL
    sampled: int = 0  # sequences sampled at once per device before the step (GRPO: micro-batch x accumulation)
    sample_turns: int = 1  # generate() calls per sampled sequence: episodes with tools re-read their context each turn
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    utilization: float = 0.4
    memory_bandwidth: float | None = None  # bytes/s the elementwise work reaches (plan.steptime); None: not counted
    fsdp: bool = False  # training.fsdp: FSDP2 in place of DeepSpeed
    fsdp_reshard_after_forward: bool = True
    fsdp_offload: bool = False
    fsdp_auto_wrap: bool = True
    teacher: object = None  # distill's teacher (plan.distillteacher.TeacherSize), else None
    fsdp_reduce_dtype: str = "float32"
    # ZeRO-3's sizes in elements (None: "auto", filled from the hidden size); the defaults are ds_configs/zero3.json's
    zero3_prefetch: int | None = None
    zero3_persistence: int | None = None
    zero3_max_live: int = 1_000_000_000
    zero3_reuse: int = 1_000_000_000
    zero3_reduce_bucket: int | None = None
    zero3_contiguous_gradients: bool = True
    tp: int = 1  # training.parallelism (plan.splitting)
    sp: int = 1
    cp: int = 1


@dataclass
class Plan:
    settings: Settings
    counts: Counts
    parts: dict = field(default_factory=dict)  # bytes per device by part
    cpu_bytes: int = 0  # moved to CPU RAM by offload
    flops_per_step: float = 0.0
    step_seconds: float = 0.0
    # Parts that are not live all step long, grouped by the moment they are live together; the peak
    # is everything else plus the largest group. The loss path is freed at the start of the backward
    # pass, before any checkpointed layer is recomputed. With one process, no DeepSpeed and no
    # accumulation, gradients exist only from the backward pass to the optimizer step (the Trainer
    # frees them after it), when activations are gone.
    phases: tuple = ()
    moments: tuple = ()  # when each phase is live, in words
    categories: dict = field(default_factory=dict)  # sharding.GATHERED or GRADIENTS for the transient parts
    remarks: dict = field(default_factory=dict)  # a part's note in the report, by its key
    time: steptime.StepTime | None = None  # step_seconds in parts: matmuls and elementwise work
    # beside a sharded plan on several devices: {"fsdp": (label, Plan), "zero3": (label, Plan)}, this one among them
    versus: dict | None = field(default=None, compare=False, repr=False)
    vision: str | None = None  # a vision-language model's tower and projector (models.vision.sizes)
    communication: dict = field(default_factory=dict)  # bytes a device sends per step, by what sends them
    # a recipe that splits its rows or layers (training.parallelism), on several devices: [(label, Plan)] of each
    # way to split them over the whole world, and of ZeRO-3 alone (`layouts`)
    layouts: list = field(default_factory=list, compare=False, repr=False)

    @property
    def peak(self) -> int:
        phased = {k for phase in self.phases for k in phase}
        held = sum(v for k, v in self.parts.items() if k not in phased)
        return held + max((sum(self.parts[k] for k in phase) for phase in self.phases), default=0)


def meta_model(recipe: Recipe, cfg=None):
    """The model's config (`cfg` when given, else its own, else tunekit's shipped copy) and the model
    (with its adapter) built on the meta device: no weights. A method that ends in a score head (a reward
    model) builds it as training loads it: AutoModelForSequenceClassification, num_labels 1, no language-model
    head; a vision-language model with AutoModelForImageTextToText, LoRA where training puts it, and the config
    returned is its language model's (what the activations, logits and step time are planned from)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    from tunekit.models.info import model_config
    from tunekit.models.loader import lora_config

    if cfg is None:
        cfg = model_config(recipe.model, shipped=True)
    images = getattr(cfg, "vision_config", None) is not None
    auto, built = AutoModelForImageTextToText if images else AutoModelForCausalLM, cfg
    if methods.spec_of(recipe).score_head:
        auto, built = AutoModelForSequenceClassification, copy.deepcopy(cfg)
        built.num_labels = 1
    with torch.device("meta"):
        model = auto.from_config(built, trust_remote_code=recipe.model.trust_remote_code)
    cfg = model.config  # as built: with the attention it chose (plan.shapes.attention)
    peft_cfg = lora_config(recipe)
    if peft_cfg is not None:
        peft_cfg.init_lora_weights = True  # shapes are the same; PiSSA/OLoRA cannot decompose meta tensors
        from peft import get_peft_model

        if images:
            peft_cfg = vision.scope_lora(model, peft_cfg, recipe.vision)
        else:
            peft_cfg = experts.scope_lora(model, peft_cfg, recipe.moe, say=False)
        model = get_peft_model(model, peft_cfg)
    elif images:
        vision.freeze_for_full(model, recipe.vision)
    return (cfg.get_text_config() if images else cfg), model


def count(recipe: Recipe, model) -> Counts:
    total = trainable = quantized = embeddings = frozen_experts = 0
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    head = {id(p) for p in output.parameters()} if output is not None else set()
    # kept in the compute dtype under QLoRA (models.loader.prepare_quantized): embeddings, head, and a
    # vision-language model's tower and projector
    embedding = (head | ({id(p) for p in inputs.parameters()} if inputs is not None else set())
                 | vision.image_side(model))
    seen: set[int] = set()
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # tied weights (embeddings = output head) count once
                continue
            seen.add(id(p))
            n = p.numel()
            total += n
            kind = sharding.kind(recipe, name, module, pname, embedding, p)
            trainable += n if kind == "trainable" else 0
            quantized += n if kind == "quantized" else 0
            if kind == "frozen" and (id(p) in embedding or isinstance(module, torch.nn.Embedding)):
                embeddings += n
            elif kind == "frozen" and experts.holds_experts(module):
                frozen_experts += n
    tied = 0
    if recipe.full_finetuning and output is not None and inputs is not None and output.weight is inputs.weight:
        tied = output.weight.numel()
    found = experts.layout(model)
    return Counts(total, trainable, quantized, total - trainable - quantized, tied, embeddings,
                  found.inactive if found else 0,
                  f"top-{found.top_k} of {found.count} experts in {found.layers} layers" if found else "",
                  frozen_experts)


def phase_groups(s: Settings, parts: dict, act_key: str, autocast_key: str | None,
                 terms: list[sharding.Term]) -> tuple[tuple, tuple]:
    """(moments, phases): the groups of parts live together, each with when, in words."""
    def at(when):
        return tuple(t.key for t in terms if when in t.when)

    act_key = (act_key, ROUTER_LOGITS) if ROUTER_LOGITS in parts else (act_key,)  # freed with the activations
    groups = [("the end of the forward pass", act_key + ("logits and loss",) + ((autocast_key,) if autocast_key else ())
               + ((distillteacher.LOGITS,) if distillteacher.LOGITS in parts else ()) + at("forward"))]
    backward = (("activations (one layer recomputed)",) if s.gradient_checkpointing else ()) + at("backward")
    if backward:
        groups.append(("a recomputed layer's backward" if s.gradient_checkpointing else "a layer's backward",
                       act_key + backward + ((LATER_GRADIENTS,) if LATER_GRADIENTS in parts else ())))
    if s.sampled:  # sampling ends before the step's forward
        groups.append(("the sampling before the step", ("sampling: KV cache",) + at("sampling")))
    end = at("end")
    if end_only_gradients(s):
        end = tuple(k for k in ("gradients (fp32)", "gradient of the tied head, accumulating") if k in parts) + end
    if end:
        groups.append(("the end of the backward pass", end))
    return tuple(m for m, _ in groups), tuple(keys for _, keys in groups)


def end_only_gradients(s: Settings) -> bool:
    """Whether gradients live only from the backward pass to the optimizer step (the Trainer frees them after it):
    one process, no DeepSpeed, no accumulation."""
    return s.world_size == 1 and s.zero_stage == 0 and s.accumulation == 1


def later_gradients(model, c: Counts, layers: int) -> float:
    """Trainable elements whose gradients exist when the backward pass recomputes the first decoder layer, last: all
    but that layer's own and the input embeddings' (a tied head's start with the head, first)."""
    inputs, output = model.get_input_embeddings(), model.get_output_embeddings()

    def trained(module) -> int:
        return sum(p.numel() for p in module.parameters() if p.requires_grad) if module is not None else 0
    tied = inputs is not None and output is not None and inputs.weight is output.weight
    first = 0 if tied else trained(inputs)
    return c.trainable - first - (c.trainable - first - trained(output)) / layers


def make(recipe: Recipe, s: Settings, cfg=None, model=None, versus: bool = True) -> Plan:
    """The plan for settings `s`; with `versus`, a sharded plan on several devices (or one that could be)
    also gets FSDP2's and ZeRO-3's peaks for the same recipe (Plan.versus)."""
    if model is None:
        cfg, model = meta_model(recipe)
    c = count(recipe, model)
    parts = modelstate.state_parts(recipe, s, c)
    sparse, qk_norms = moe.of(model, cfg, recipe), shapes.qk_norm_groups(model, cfg)
    if sparse is not None and sparse.lora:  # as training runs it (experts.scope_lora)
        recipe = moecheck.without_dropout(recipe)
    kept, recomputed = activations.activation_bytes(cfg, s, recipe, sparse, qk_norms)
    from tunekit.models.losspath import unsupported_reason

    # the method's trainer may take log-probabilities from the full logits (TRL's): the stock path
    chunked = (recipe.training.chunked_loss and methods.spec_of(recipe).chunked_loss
               and unsupported_reason(model) is None)
    act_key = "activations (checkpointed: layer inputs)" if s.gradient_checkpointing else "activations"
    parts[act_key] = kept
    parts["logits and loss"] = activations.loss_path_bytes(cfg, s, recipe, chunked)
    if s.gradient_checkpointing:
        parts["activations (one layer recomputed)"] = recomputed
        if end_only_gradients(s) and not s.fsdp and "gradients (fp32)" in parts:
            # beside the first layer's recomputation (a mixture of experts' layers, mostly expert weights, made it
            # the peak of full fine-tuning: bench/plan_check_moe.json)
            parts[LATER_GRADIENTS] = later_gradients(model, c, cfg.num_hidden_layers) * 4
    if sparse is not None and sparse.scopes:
        parts[ROUTER_LOGITS] = moe.router_loss_bytes(sparse, cfg, s)
    autocast_key = None
    if s.precision != "fp32" and s.zero_stage == 0 and not s.fsdp:
        # mixed precision keeps a 16-bit copy of each fp32 trained weight for its backward
        autocast_key = f"autocast copies of trained weights ({s.precision})"
        parts[autocast_key] = c.trainable * 2
    if c.tied_trainable_head:
        # The shared embedding/head matrix gets two fp32 gradient contributions (head, embedding
        # lookup) that exist side by side with its .grad before they are summed (measured).
        parts["gradient of the tied head, accumulating"] = 2 * c.tied_trainable_head * 4
    share = splitting.split_share(model) if s.tp > 1 else 0.0
    splitting.divide_state(parts, s, share)
    sent = {}
    if s.world_size > 1:
        held = sum(v for k, v in parts.items() if k.startswith("weights"))
        if recipe.full_finetuning:  # fp32 masters, gathered in the compute dtype
            held *= (4 if s.precision == "fp32" else 2) / 4
        sent = splitting.communication(cfg, s, c.trainable * (share / s.tp + 1 - share), held)
    cpu = modelstate.shard(parts, recipe, s, c)
    terms = sharding.transient_terms(recipe, s, cfg, model)
    parts.update({t.key: t.bytes for t in terms})

    sampled = activations.sampling(parts, cfg, s, c) + distillteacher.add(parts, s)
    per_token = activations.mean_layer_bytes_per_token(cfg, s, recipe, sparse, qk_norms)
    time = splitting.divide_time(steptime.estimate(cfg, model, s, recipe, c, per_token,
                                                   modelstate.OPTIMIZER_BYTES.get(s.optimizer, 8), sampled), s)
    moments, phases = phase_groups(s, parts, act_key, autocast_key, terms)
    plan = Plan(s, c, {k: int(v) for k, v in parts.items()}, int(cpu), time.flops, time.seconds, phases, moments,
                {t.key: t.category for t in terms}, modelstate.remarks(recipe, s, parts), time,
                vision=vision.sizes(model), communication=sent)
    if shapes.latent_attention(cfg):  # its latent projections, norms and rotary halves are not counted
        plan.remarks[act_key] = ("multi-head latent attention counted as plain attention: 50-70% under a layer's "
                                 "measured bytes on a tiny DeepSeek-V3, tests/plan/test_moe_activations.py")
    # neither shards 4-bit experts (models.moecheck refuses both): no comparison to offer
    shardable = not (recipe.quantization is not None and sparse is not None)
    if versus and s.world_size > 1 and s.tp * splitting.pieces(s) == 1 and shardable:
        plan.versus = fsdp_versus_zero3(recipe, plan, cfg, model)
    if versus and s.world_size > 1 and recipe.training.parallelism is not None:
        plan.layouts = layouts(recipe, s, cfg, model)
    return plan


def layouts(recipe: Recipe, s: Settings, cfg, model) -> list[tuple[str, Plan]]:
    """Each way to split a row's positions or the layers over all `s.world_size` devices that the model's heads
    allow (config.parallelconfig's checks), and ZeRO-3 alone, at the same sequence length: sp under ZeRO-3, cp
    under FSDP2, tp (full fine-tuning only) with transformers' own sharding."""
    n = s.world_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    alone = dataclasses.replace(s, tp=1, sp=1, cp=1, fsdp=False, zero_stage=3, offload_optimizer=False,
                                offload_params=False)
    options = [("ZeRO-3 alone", alone)]
    if parallelconfig.sp_fits(n, heads, kv):
        options.append((f"sp {n}", dataclasses.replace(alone, sp=n)))
    options.append((f"cp {n}", dataclasses.replace(alone, zero_stage=0, fsdp=True, cp=n)))
    if recipe.full_finetuning and parallelconfig.tp_fits(n, heads, kv):
        options.append((f"tp {n}", dataclasses.replace(alone, zero_stage=0, tp=n)))
    return [(label, make(recipe, st, cfg, model, versus=False)) for label, st in options]


def fsdp_versus_zero3(recipe: Recipe, plan: Plan, cfg, model) -> dict:
    """This recipe under FSDP2 and under ZeRO-3: {"fsdp": (label, Plan), "zero3": (label, Plan)}, the plan
    itself for the one it uses; the other with the same offload (ZeRO-3's of parameters and optimizer
    state, FSDP2's cpu_offload), ZeRO-3 as ds_configs/zero3.json (or zero3_offload.json) has it."""
    s = plan.settings
    offload = s.fsdp_offload if s.fsdp else s.offload_params or s.offload_optimizer
    plain = dataclasses.replace(s, fsdp=False, zero_stage=0, offload_optimizer=False, offload_params=False)
    if s.fsdp:
        fsdp = ("training.fsdp", plan)
    else:
        label = "training.fsdp: {cpu_offload: true}" if offload else "training.fsdp: {}"
        fsdp = (label, make(recipe, dataclasses.replace(plain, fsdp=True, fsdp_offload=offload), cfg, model, False))
    if s.zero_stage == 3:
        zero3 = (short_path(recipe.training.deepspeed) if recipe.training.deepspeed else "ZeRO stage 3", plan)
    else:
        label = f"ds_configs/zero3{'_offload' if offload else ''}.json"
        zero3 = (label, make(recipe, dataclasses.replace(plain, zero_stage=3, offload_optimizer=offload,
                                                         offload_params=offload), cfg, model, False))
    return {"fsdp": fsdp, "zero3": zero3}


def short_path(path: str) -> str:
    from pathlib import Path

    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def settings_from(recipe: Recipe, world_size: int, precision: str, **overrides) -> Settings:
    t = recipe.training
    method = methods.spec_of(recipe)
    ds = dsconfig.read(t.deepspeed) if t.deepspeed else {}
    zero = ds.get("zero_optimization") or {}
    shape = {"seq_len": recipe.data.max_length, **method.plan_settings(recipe)}
    fsdp = {}
    if t.fsdp is not None:  # FSDP's activation checkpointing recomputes each decoder layer, as gradient checkpointing
        fsdp = {"fsdp": True, "fsdp_reshard_after_forward": t.fsdp.reshard_after_forward,
                "fsdp_offload": t.fsdp.cpu_offload, "fsdp_auto_wrap": t.fsdp.auto_wrap,
                "fsdp_reduce_dtype": t.fsdp.reduce_dtype}
    stage = dsconfig.zero_stage(ds)
    base = Settings(world_size=world_size, micro_batch=t.micro_batch_size, precision=precision,
                    gradient_checkpointing=t.gradient_checkpointing or bool(t.fsdp and t.fsdp.activation_checkpointing),
                    zero_stage=stage,
                    offload_optimizer=(zero.get("offload_optimizer") or {}).get("device") == "cpu",
                    offload_params=(zero.get("offload_param") or {}).get("device") == "cpu",
                    optimizer=t.optimizer, accumulation=t.gradient_accumulation_steps,
                    teacher=distillteacher.of(recipe),
                    **shape, **fsdp, **splitting.sizes(recipe),
                    **(sharding.zero3_settings(zero) if stage == 3 else {}))
    return dataclasses.replace(base, **overrides)
