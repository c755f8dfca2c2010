"""training.parallelism -> accelerate's ParallelismConfig (and, for tp, transformers' DistributedConfig, which
splits the model as it loads), and every rule that refuses a layout before weights load: the recipe's own
(`check_recipe`, run with the recipe rules), the model's shape (`check_model`, from its config.json) and the
launch's world size (`layout`, when training starts). Each rule names the engine's reason; the engines:
docs/multi-gpu.md, "Past data parallelism: tensor, sequence and context parallel"."""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.config import methods
from tunekit.core.errors import TunekitError

KEY = "training.parallelism"


def check_recipe(recipe) -> None:
    """The rules across sections: the method, the sharding engine and the adapter each layout needs."""
    p, t = recipe.training.parallelism, recipe.training
    if p is None:
        return
    method = methods.spec_of(recipe)
    if not method.splits_work:
        raise ValueError(f"{KEY} applies to training.method sft, whose loss follows the sequence shards and the "
                         f"split layers; training.method: {method.name} trains with TRL's trainer: remove it")
    if p.sp > 1 and t.deepspeed is None:
        raise ValueError(f"{KEY}.sp splits sequences with DeepSpeed's Ulysses (accelerate's sequence-parallel "
                         "engine): set training.deepspeed, e.g. ds_configs/zero2.json")
    if p.sp > 1 and (not t.chunked_loss or t.kernels != "none"):
        raise ValueError(f"{KEY}.sp: each process holds a piece of every sequence, and tunekit's chunked loss is the "
                         "one that sums it over the pieces; set training.chunked_loss: true and training.kernels: none")
    if p.cp > 1 and t.fsdp is None:
        raise ValueError(f"{KEY}.cp is torch's context parallel, which accelerate runs under FSDP2 only: add "
                         "`fsdp: {}` under training")
    if p.cp > 1 and recipe.data.packing is True:
        raise ValueError(f"{KEY}.cp: torch's ring attention is causal over the whole row, so packed examples would "
                         "see each other; set data.packing: false")
    if p.sp > 1 and recipe.data.packing is True:
        raise ValueError(f"{KEY}.sp: DeepSpeed's Ulysses takes rows of training.micro_batch_size, and packing makes "
                         "one row of the micro-batch; set data.packing: false")
    if p.tp > 1:
        _tensor_parallel(recipe)
    if (p.dp_shard or 1) * p.dp_replicate > 1 and p.tp == 1 and p.cp == 1:
        raise ValueError(f"{KEY}.dp_shard and dp_replicate size the sharding beside tp or cp; for data parallelism "
                         "alone use training.fsdp or training.deepspeed and leave them out")
    if p.dp_replicate > 1 and p.dp_shard == 1:
        raise ValueError(f"{KEY}.dp_replicate > 1 with dp_shard 1 is plain data parallelism, which accelerate does "
                         "not compose with tp or cp; set dp_shard > 1 (HSDP) or dp_replicate: 1")


def _tensor_parallel(recipe) -> None:
    t = recipe.training
    if t.deepspeed is not None or t.fsdp is not None:
        key = "training.deepspeed" if t.deepspeed is not None else "training.fsdp"
        raise ValueError(f"{KEY}.tp: transformers splits the layers as they load and shards the rest itself "
                         f"(FSDP2 over {KEY}.dp_shard); remove {key}")
    if t.metric_for_best:
        raise ValueError(f"{KEY}.tp with training.metric_for_best: keeping the best checkpoint loads whole weights "
                         "into the split model, which the Trainer cannot do; remove one of them")
    if recipe.training.parallelism.dp_replicate > 1:
        raise ValueError(f"{KEY}.dp_replicate with tp: transformers rewrites accelerate's sizes from its own "
                         "(dp_shard as replicas x shards), a layout no run here has checked; use dp_shard alone")
    if not recipe.full_finetuning:
        raise ValueError(f"{KEY}.tp trains the whole model (adapter: none): peft 0.21's LoRA fails on the row-split "
                         "layers under tensor parallelism (a shape error in the first forward) and draws the "
                         "column-split layers' adapters unlike one process; for LoRA at scale use sp or training.fsdp")


def tp_fits(n: int, heads: int, kv: int) -> bool:
    """tp n hands each process whole attention and key/value heads."""
    return heads % n == 0 and kv % n == 0


def sp_fits(n: int, heads: int, kv: int) -> bool:
    """Ulysses at sp n hands each process whole attention heads; key/value heads divide n or n divides them."""
    return heads % n == 0 and (kv % n == 0 or n % kv == 0)


def check_model(p, config, attention: str | None, where: str) -> None:
    """What the model's shape allows (`p`: training.parallelism or None; `config`: its transformers config;
    `attention`: model.attn_implementation; `where`: the model, for messages)."""
    if p is None or p.split == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "vision_config", None) is not None:
        raise TunekitError(f"{KEY}: {where} is a vision-language model, whose image features are not split; "
                           f"train it without {KEY}")
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if p.tp > 1:
        if not tp_fits(p.tp, heads, kv):
            raise TunekitError(f"{KEY}.tp {p.tp} must divide {where}'s {heads} attention heads and {kv} key/value "
                               "heads (each process takes whole heads); use one of "
                               f"{_sizes(heads, lambda n: tp_fits(n, heads, kv))}")
        if not getattr(text, "base_model_tp_plan", None):
            raise TunekitError(f"{KEY}.tp: transformers has no tensor-parallel plan for {where}'s architecture "
                               f"({text.model_type}); use sp or training.fsdp")
    if p.sp > 1 and not sp_fits(p.sp, heads, kv):
        raise TunekitError(f"{KEY}.sp {p.sp} must divide {where}'s {heads} attention heads, and its {kv} key/value "
                           "heads divide it or it them (Ulysses hands each process whole heads); use one of "
                           f"{_sizes(heads, lambda n: sp_fits(n, heads, kv))}")
    if p.sp > 1 and attention in ("eager", "paged|eager"):
        raise TunekitError(f"{KEY}.sp: Ulysses leaves out the attention mask, which eager attention needs (DeepSpeed "
                           "refuses it); set model.attn_implementation: sdpa")
    if p.cp > 1 and attention not in (None, "sdpa"):
        raise TunekitError(f"{KEY}.cp: torch's ring attention replaces SDPA's kernels only; set "
                           f"model.attn_implementation: sdpa (got {attention})")


def _sizes(heads: int, fits) -> str:
    """The sizes above 1 that divide the heads and pass `fits`, as a message lists them."""
    return ", ".join(str(n) for n in range(2, heads + 1) if heads % n == 0 and fits(n)) or "none above 1"


@dataclass(frozen=True)
class Layout:
    """The sizes at a world size: `data` processes see different batches, `split` share each one."""

    tp: int
    sp: int
    cp: int
    dp_shard: int
    dp_replicate: int
    world: int

    @property
    def split(self) -> int:
        return self.tp * self.sp * self.cp

    @property
    def data(self) -> int:
        return self.world // self.split


def layout(p, world: int, option: str | None = None) -> Layout:
    """training.parallelism's sizes for `world` processes; a world they do not fit is refused, saying which would.
    `option`: the argument that gave the world size where it is not the processes launched (`tunekit plan`'s and
    `validate`'s --world-size), named in the refusal."""
    given = f"the {world} processes launched" if option is None else f"{option} {world}"
    were = f"{world} were launched" if option is None else f"{option} is {world}"
    fix = "launch" if option is None else f"give {option}"
    if world % p.split:
        fewer = f" (a parallel group needs {p.split})" if world < p.split else ""
        raise TunekitError(f"{KEY}: tp x sp x cp = {p.split} does not divide {given}{fewer}; {fix} a multiple of "
                           f"{p.split}")
    dp_shard = p.dp_shard if p.dp_shard is not None else world // (p.split * p.dp_replicate) if p.sp == 1 else 1
    if p.sp == 1 and dp_shard * p.dp_replicate * p.split != world:
        raise TunekitError(f"{KEY}: dp_replicate {p.dp_replicate} x dp_shard {dp_shard} x tp {p.tp} x cp {p.cp} = "
                           f"{dp_shard * p.dp_replicate * p.split} processes, but {were}; make the product {world} "
                           "(or leave dp_shard out)")
    return Layout(p.tp, p.sp, p.cp, dp_shard, p.dp_replicate, world)


def data_world(p, world: int) -> int:
    """Processes that see different batches: the world size over tp x sp x cp (all of it without
    training.parallelism). Examples per optimizer step are this x micro-batch x accumulation."""
    return world if p is None else layout(p, world).data


def accelerate_config(lay: Layout, attention: str | None):
    """accelerate's ParallelismConfig for the layout (None when nothing is split). Sequence lengths vary from batch
    to batch (sp_seq_length_is_variable)."""
    if lay.split == 1:
        return None
    from accelerate import ParallelismConfig as Accelerate
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    sp = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                         sp_attn_implementation=attention or "sdpa") if lay.sp > 1 else None
    sharded = lay.tp > 1 or lay.cp > 1
    return Accelerate(dp_replicate_size=lay.dp_replicate if sharded else 1,
                      dp_shard_size=lay.dp_shard if sharded else 1, tp_size=lay.tp, cp_size=lay.cp, sp_size=lay.sp,
                      sp_handler=sp)


def load_arguments(lay: Layout | None, attention: str | None) -> dict:
    """from_pretrained's keywords: for tp, transformers' DistributedConfig, which splits the layers by the
    architecture's plan and shards the rest with FSDP2 over dp_shard as the weights load; for sp, SDPA attention
    unless model.attn_implementation names one (DeepSpeed's Ulysses wraps the attention the model resolved, and
    refuses one other than what it was told: accelerate_config's)."""
    if lay is None:
        return {}
    if lay.sp > 1:
        return {} if attention else {"attn_implementation": "sdpa"}
    if lay.tp == 1:
        return {}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=lay.tp, fsdp_size=lay.dp_shard,
                                                    dp_replicate_size=lay.dp_replicate)}


def require_device(lay: Layout, cuda: bool) -> None:
    if lay.cp > 1 and not cuda:
        raise TunekitError(f"{KEY}.cp needs GPUs: torch's ring attention shards SDPA's GPU kernels, and its CPU kernel "
                           "has no sharding rule (aten._scaled_dot_product_flash_attention_for_cpu); use sp on CPU")


def describe(lay: Layout) -> str:
    parts = [f"tensor parallel {lay.tp} (layers split)" if lay.tp > 1 else "",
             f"sequence parallel {lay.sp} (DeepSpeed Ulysses)" if lay.sp > 1 else "",
             f"context parallel {lay.cp} (ring attention)" if lay.cp > 1 else "",
             f"FSDP2 over {lay.dp_shard}" if lay.dp_shard > 1 and (lay.tp > 1 or lay.cp > 1) else "",
             f"{lay.dp_replicate} replicas" if lay.dp_replicate > 1 else ""]
    return (f"{', '.join(x for x in parts if x)}; {lay.split} processes share each batch, {lay.data} "
            f"data-parallel group{'s' if lay.data > 1 else ''}")
