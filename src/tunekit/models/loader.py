"""Model side: materialise a model source, load the tokenizer, build quantization and LoRA configs,
and load a model for training, merging or inference."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BitsAndBytesConfig,
)

from tunekit.config import dsconfig, methods, parallelconfig
from tunekit.config.modelsource import ModelSource, resolve_model
from tunekit.config.schema import ModelConfig, Recipe
from tunekit.core import distributed
from tunekit.core.hardware import DTYPES, Precision
from tunekit.core.outputs import cache_root
from tunekit.models import expertquant, experts, hub, kernels, lorafused, peftconvert, vision
from tunekit.models.ggufread import one_reader
from tunekit.models.tokenizer import from_pretrained as tokenizer_from_pretrained
from tunekit.models.unwrap import base_of

log = logging.getLogger("tunekit")
# every adapter tunekit makes or loads (training, resume, TRL's reference adapter, merge, eval, the plan's meta model)
# comes through here: peft keeps its LoRA targets as tunekit names them (models.peftconvert)
peftconvert.mend()


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a Hugging Face directory (safetensors) and reuse it.

    transformers loads GGUF but refuses to save or train a model still marked as GGUF-quantized;
    its weights are already plain tensors, so dropping the quantization marker makes it an
    ordinary model."""
    target = _gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to a Hugging Face directory (once; cached at %s)", gguf.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with one_reader():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def materialize(spec: str, revision: str | None = None, key: str = "model.name_or_path") -> str:
    """A path or hub id that from_pretrained can read (a hub model checked to be reachable)."""
    source: ModelSource = resolve_model(spec, key)
    if source.kind == "gguf":
        return str(convert_gguf(Path(source.location)))
    if source.kind == "hub":
        hub.require(spec, revision, key)
    return source.location


def load_tokenizer(cfg: ModelConfig, directory: Path | None = None):
    """The recipe's tokenizer, or the one saved in a run/merged `directory`."""
    spec = str(directory) if directory is not None else cfg.tokenizer or cfg.name_or_path
    key = "model.tokenizer" if cfg.tokenizer else "model.name_or_path"
    location = spec if directory is not None else materialize(spec, cfg.revision, key)
    return tokenizer_from_pretrained(location, key, spec, revision=cfg.revision,
                                     trust_remote_code=cfg.trust_remote_code)


def quantization_config(recipe: Recipe, precision: Precision,
                        storage: torch.dtype = torch.uint8) -> BitsAndBytesConfig | None:
    """bitsandbytes settings for the recipe's quantized base; `storage` is the dtype the packed 4-bit
    weights are kept in (only the layout differs, not the quantized values)."""
    q = recipe.quantization
    if q is None:
        return None
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = precision.name if q.compute_dtype == "auto" else q.compute_dtype
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[compute],
        bnb_4bit_quant_storage=storage,
    )


# peft's names; "pissa_niter_16" is PiSSA with a 16-iteration randomized SVD (minutes faster per
# layer on 7B models than the full SVD, the variant peft's documentation recommends)
INIT = {"default": True, "pissa": "pissa_niter_16", "olora": "olora"}


def lora_config(recipe: Recipe) -> PeftLoraConfig | None:
    lc = recipe.lora
    if lc is None:
        return None
    return PeftLoraConfig(
        r=lc.r,
        lora_alpha=lc.alpha,
        lora_dropout=lc.dropout,
        target_modules=lc.target_modules,
        modules_to_save=lc.modules_to_save or None,
        bias=lc.bias,
        use_dora=lc.use_dora,
        use_rslora=lc.use_rslora,
        init_lora_weights=INIT[lc.init],
        # a score head (a reward model): peft trains a full copy of it beside the adapter and saves it with it
        task_type="SEQ_CLS" if methods.spec_of(recipe).score_head else "CAUSAL_LM",
    )


def keep_4bit_trainable_on_cpu(model) -> int:
    """On CPUs with avx512_bf16, bitsandbytes repacks a 4-bit weight into an inference-only layout
    after the first no-grad forward (generate, eval); no gradient then reaches the LoRA layers
    above it and training silently stalls. Turning the fast path off keeps training correct."""
    count = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


SCORE_HEAD = "SequenceClassification"  # ends a score-head model's architecture (LlamaForSequenceClassification)


def saved_with_score_head(directory: Path) -> bool:
    """A saved model or adapter whose model ends in a score head (a reward model): its config.json names a
    ...ForSequenceClassification architecture, or its adapter_config.json the task SEQ_CLS."""
    for name, read in (("config.json", lambda c: any(a.endswith(SCORE_HEAD) for a in c.get("architectures") or ())),
                       ("adapter_config.json", lambda c: c.get("task_type") == "SEQ_CLS")):
        file = Path(directory) / name
        if file.is_file() and read(json.loads(file.read_text(encoding="utf-8"))):
            return True
    return False


@contextlib.contextmanager
def new_score_head():
    """Loading a causal language model's checkpoint with a score head in place of its language-model head: the
    head left out and the score head newly made are what is meant, not a load report's warnings (TRL does the
    same in its RewardTrainer)."""
    from transformers.modeling_layers import GenericForSequenceClassification as Scored

    old = (getattr(Scored, "_keys_to_ignore_on_load_missing", None),
           getattr(Scored, "_keys_to_ignore_on_load_unexpected", None))
    Scored._keys_to_ignore_on_load_missing = [*(old[0] or ()), r"^score\.weight$"]
    Scored._keys_to_ignore_on_load_unexpected = [*(old[1] or ()), r"^lm_head\."]
    try:
        yield
    finally:
        Scored._keys_to_ignore_on_load_missing, Scored._keys_to_ignore_on_load_unexpected = old


def load_base(cfg: ModelConfig, dtype: torch.dtype, quant: BitsAndBytesConfig | None = None, device_map=None,
              score_head: bool = False, split: dict | None = None, experts_4bit: bool = True):
    """The model `cfg` names; `score_head`: with a one-number score head in place of the language-model head (a
    reward model: AutoModelForSequenceClassification, num_labels 1), as it is also for a directory saved so. A
    vision-language model (models.vision) loads with AutoModelForImageTextToText. `split`: from_pretrained's
    keywords that split the model over processes as it loads (config.parallelconfig.load_arguments). A 4-bit
    `quant` stores a mixture of experts' experts in 4 bits too (models.expertquant) unless `experts_4bit` is off:
    the caller does it once its adapter is on (an adapter goes on plain weights, see load_for_training)."""
    location = materialize(cfg.name_or_path, cfg.revision)
    saved_so = Path(location).is_dir() and saved_with_score_head(Path(location))
    if cfg.trust_remote_code:
        log.warning("trust_remote_code is ON for %s: its own modelling code will run", cfg.name_or_path)
    kwargs = dict(dtype=dtype, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    if cfg.attn_implementation:  # varlen is switched on once packing is decided (models.attention); SDPA until then
        kwargs["attn_implementation"] = "sdpa" if cfg.attn_implementation == "varlen" else cfg.attn_implementation
    if quant is not None and vision.reads_images(cfg):
        quant = copy.deepcopy(quant)
        quant.llm_int8_skip_modules = vision.unquantized(location, cfg)
    if quant is not None:
        kwargs["quantization_config"] = quant
    if device_map is not None:
        kwargs["device_map"] = device_map
    if score_head or saved_so:
        kwargs["num_labels"] = 1
    kwargs.update(split or {})
    try:
        with new_score_head() if score_head and not saved_so else contextlib.nullcontext():
            auto = (AutoModelForSequenceClassification if score_head or saved_so else
                    AutoModelForImageTextToText if vision.reads_images(cfg) else AutoModelForCausalLM)
            model = auto.from_pretrained(location, **kwargs)
    except (OSError, ValueError) as e:
        raise hub.load_error("model.name_or_path", cfg.name_or_path, e) from None
    if quant is not None:
        keep_4bit_trainable_on_cpu(model)
        if experts_4bit:
            experts_in_4bit(model, quant)
    return model


def experts_in_4bit(model, quant: BitsAndBytesConfig | None) -> None:
    """A mixture of experts' 3-D expert weights stored in 4 bits under a 4-bit `quant` (models.expertquant)."""
    if quant is not None and quant.load_in_4bit and expertquant.quantize(model, quant):
        log.info("quantization: the experts' 3-D weights are stored in 4 bits too (%s)", quant.bnb_4bit_quant_type)


HALF = (torch.float16, torch.bfloat16)


def _input_in_weight_dtype(module: nn.Module, args: tuple) -> tuple:
    return (args[0].to(module.weight.dtype), *args[1:])


def prepare_quantized(model, compute: torch.dtype, gradient_checkpointing: bool = False):
    """A bitsandbytes-quantized base made ready for LoRA: every weight frozen, the embeddings and output head
    in `compute` (the dtype the 4-/8-bit matmuls compute in), every other unquantized weight (norms, biases)
    in fp32, gradient checkpointing on when asked.

    Why not peft's prepare_model_for_kbit_training (0.21.2): it casts every unquantized weight to fp32,
    embeddings and head included, which on Llama-3.1-8B is 3.9 GiB of a 10.8 GiB QLoRA peak for two frozen
    matrices whose matmuls autocast runs in the compute dtype anyway. The rest of what it does is done here:
    freeze, norms and other small weights in fp32, free the cache, checkpointing without reentry (its
    input-gradient hook serves reentrant checkpointing only). The held-out loss is unchanged
    (tests/models/test_qlora_dtypes.py; numbers in docs/precision-and-speed.md)."""
    base = base_of(model)
    embeddings = [m for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None]
    kept = {id(p) for m in embeddings + [m for m in base.modules() if isinstance(m, nn.Embedding)]
            for p in m.parameters(recurse=False)}
    kept |= vision.image_side(base)  # a vision-language model's tower and projector, unquantized, stay as loaded
    # a mixture of experts' 3-D weights, stored in 4 bits once the adapter is on (models.expertquant), as loaded
    sparse = experts.layout(base) is not None
    to_4bit = {id(p) for m in base.modules() if sparse and experts.holds_experts(m)
               for p in m.parameters(recurse=False) if p.dim() == 3}
    for p in model.parameters():
        p.requires_grad = False
        if id(p) in to_4bit:
            continue
        if p.dtype.is_floating_point and type(p).__name__ != "Params4bit":  # 4-bit codes keep their storage
            target = compute if id(p) in kept else torch.float32
            if p.dtype != target and (p.dtype in HALF or id(p) in kept):
                p.data = p.data.to(target)
    head = base.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None and head.weight.dtype != torch.float32:
        # the fp32 final norm hands the head fp32 states: without autocast (evaluation) the matmul needs one dtype
        head.register_forward_pre_hook(_input_in_weight_dtype)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the memory of the weights cast above
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def trainable_in_fp32(model) -> None:
    """Weights trained in full beside an adapter (lora.modules_to_save, a reward model's score head: copies of
    half-precision modules) get an fp32 master copy, as LoRA's own matrices have; AdamW on bf16 weights loses
    small steps. Those copies take the half-precision activations cast to their dtype, as peft's LoRA layers do
    (DeepSpeed runs no autocast)."""
    from peft.utils import ModulesToSaveWrapper

    for p in model.parameters():
        if p.requires_grad and p.dtype in HALF:
            p.data = p.data.to(torch.float32)
    for wrapper in model.modules():
        if isinstance(wrapper, ModulesToSaveWrapper):
            for trained in wrapper.modules_to_save.values():
                trained.register_forward_pre_hook(_inputs_in_own_dtype)


def _inputs_in_own_dtype(module, args):
    dtype = next(module.parameters()).dtype
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def load_for_training(recipe: Recipe, precision: Precision, start_adapter: Path | None = None):
    """Base model (quantized for QLoRA) with a fresh LoRA adapter (or `start_adapter`, trainable), or the
    full model."""
    kernels.require(recipe)  # training.kernels where it cannot run: refused before any weight loads
    # ZeRO-3 flattens every parameter of a module into one buffer of a single dtype, and FSDP2 shards only
    # floating-point parameters (accelerate leaves uint8 ones out, whole on every device): the packed 4-bit
    # weights are stored in the dtype of the other weights (peft's QLoRA + ZeRO-3 / FSDP recipe)
    zero3 = recipe.training.deepspeed and dsconfig.zero_stage(dsconfig.read(recipe.training.deepspeed)) == 3
    sharded = zero3 or recipe.training.fsdp is not None
    quant = quantization_config(recipe, precision, precision.dtype if sharded else torch.uint8)
    # Full fine-tuning keeps fp32 master weights (mixed precision autocasts the matmuls);
    # a frozen base is stored in the training precision to halve its memory.
    weights = torch.float32 if recipe.full_finetuning else precision.dtype
    device_map = None
    if quant is not None and torch.cuda.is_available():
        device_map = {"": int(os.environ.get("LOCAL_RANK", 0))}
    p = recipe.training.parallelism
    split = parallelconfig.load_arguments(parallelconfig.layout(p, distributed.current().world_size) if p else None,
                                          recipe.model.attn_implementation)
    model = load_base(recipe.model, weights, quant, device_map, score_head=methods.spec_of(recipe).score_head,
                      split=split, experts_4bit=False)
    model.config.use_cache = False
    if quant is not None:
        model = prepare_quantized(model, precision.dtype, recipe.training.gradient_checkpointing)
    kernels.apply(model, recipe.training.kernels)
    peft_cfg = lora_config(recipe)
    images = vision.reads_images(recipe.model)
    if images and peft_cfg is not None:
        peft_cfg = vision.scope_lora(model, peft_cfg, recipe.vision)
    elif images:
        vision.freeze_for_full(model, recipe.vision)
    if images:
        log.info("%s", vision.describe(model, recipe.vision, recipe.adapter))
    elif peft_cfg is not None:
        peft_cfg = experts.scope_lora(model, peft_cfg, recipe.moe)
    coef = experts.balance_router(model, recipe.moe)
    if coef is not None:
        log.info("moe: the experts run through transformers' %s path (moe.kernel); the router's load-balancing "
                 "loss %s", experts.choose_kernel(model, recipe.moe),
                 f"is added to the loss at {coef:g} (moe.aux_loss_coef), counted "
                 f"{'per layer' if recipe.moe and recipe.moe.aux_loss_scope == 'layer' else 'over all layers'} "
                 "(moe.aux_loss_scope)" if coef else "is off (moe.aux_loss)" if experts.computes_balancing_loss(model)
                 else f"is not computed: transformers has none for {type(model).__name__}, whose router stays as "
                 "pre-trained (DeepSeek-V3's, for one, balances by a score-correction bias, kept as loaded)")
    if start_adapter is not None:
        model = PeftModel.from_pretrained(model, str(start_adapter), is_trainable=True)
    elif peft_cfg is not None:
        # the adapter's initialisation draws from the global RNG, seeded here: a vision-language model built
        # under ZeRO-3's partitioned init draws from it while loading (a text model or a plain load does not),
        # which gave ZeRO-3 other LoRA matrices than DDP
        from transformers import set_seed

        set_seed(recipe.training.seed)
        model = get_peft_model(model, peft_cfg)
    # after the adapter: peft nests its wrappers of a 4-bit parameter in another order than of a plain one, and the
    # adapter must load onto plain weights too (a merge, peft elsewhere)
    experts_in_4bit(model, quant)
    if quant is not None or peft_cfg is not None or start_adapter is not None:
        # beside fp32 adapter matrices: one dtype for everything trained (ZeRO-3 flattens them into one buffer)
        trainable_in_fp32(model)
        lorafused.fuse(model)
    return model


def load_adapter_model(base_cfg: ModelConfig, adapter_dir: Path, dtype: torch.dtype, quant=None):
    base = load_base(base_cfg, dtype, quant, score_head=saved_with_score_head(adapter_dir), experts_4bit=False)
    if quant is not None:
        # as in training: embeddings and head in the compute dtype, the other unquantized layers (norms) in fp32
        base = prepare_quantized(base, quant.bnb_4bit_compute_dtype)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    experts_in_4bit(model, quant)  # as in training: once the adapter is on
    return model


def count_parameters(model) -> tuple[int, int]:
    total = trainable = 0
    for name, p in model.named_parameters():
        # ZeRO-3 leaves an empty placeholder and records the real size in ds_numel;
        # a 4-bit tensor packs two parameters per byte of its storage dtype (4-bit experts: models.expertquant)
        packed = p.__class__.__name__ == "Params4bit" or (name.endswith(".original") and p.dtype == torch.uint8)
        n = getattr(p, "ds_numel", p.numel()) * (2 * p.element_size() if packed else 1)
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def save_initial_adapter(model, directory: Path) -> None:
    """Save an adapter as initialised (PiSSA/OLoRA), marked so that loading it does not initialise again."""
    config = model.peft_config["default"]
    mode, config.init_lora_weights = config.init_lora_weights, True
    try:
        model.save_pretrained(str(directory))
    finally:
        config.init_lora_weights = mode


def convert_to_plain_lora(adapter_dir: Path, initial_dir: Path) -> None:
    """Rewrite a PiSSA/OLoRA adapter in place so that it applies to the original base weights.

    Those methods train W_res + B A with W_res = W - s B0 A0, so the update to W is s (B A - B0 A0):
    a LoRA of twice the rank, A' = [A; A0] and B' = [B, -B0], with alpha raised to keep the scale s
    (peft's LoraModel.subtract_mutated_init does the same inside save_pretrained, which the Trainer's
    save path and gathered ZeRO shards do not reach)."""
    from safetensors.torch import load_file, save_file

    weights_file = adapter_dir / "adapter_model.safetensors"
    trained, initial = load_file(str(weights_file)), load_file(str(initial_dir / "adapter_model.safetensors"))
    out = {}
    for name, tensor in trained.items():
        if "lora_A" in name:
            out[name] = torch.cat([tensor, initial[name].to(tensor.dtype)], dim=0).contiguous()
        elif "lora_B" in name:
            out[name] = torch.cat([tensor, -initial[name].to(tensor.dtype)], dim=1).contiguous()
        else:
            out[name] = tensor
    save_file(out, str(weights_file), metadata={"format": "pt"})
    config_file = adapter_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["lora_alpha"] = config["lora_alpha"] * (2 ** 0.5 if config.get("use_rslora") else 2)
    config["r"] = 2 * config["r"]
    config["init_lora_weights"] = True
    config_file.write_text(json.dumps(config, indent=2) + "\n")
