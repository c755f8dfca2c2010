"""Vision-language models: whether a model reads images, its processor, and the parts it is made of (the language
model, the projector, the vision tower), which decide what trains (the recipe's `vision` section).

A model reads images when its config holds a `vision_config` (LLaVA, Qwen2.5-VL, Idefics3/SmolVLM, Gemma 3,
Llama 3.2 Vision all do): it is loaded with AutoModelForImageTextToText and its own processor. Its parts are found
from the model itself, not from its type: the language model is what `get_decoder()` returns, the vision tower
the other pretrained model inside it, the projector whatever else holds weights beside those two."""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from tunekit.config.modelsource import resolve_model
from tunekit.config.schema import ModelConfig, VisionConfig
from tunekit.core.errors import TunekitError
from tunekit.models import hub, info
from tunekit.models.unwrap import base_of

log = logging.getLogger("tunekit")


def reads_images(cfg: ModelConfig) -> bool:
    """Whether the model is a vision-language model (read from its config.json, without torch; tunekit's shipped
    copy of a well-known model's config where its own cannot be had)."""
    try:
        raw = info.raw_config(cfg, shipped=True)
    except hub.Unavailable:
        return False
    return isinstance(raw.get("vision_config"), dict)


def reads_images_here(cfg: ModelConfig, needed: bool, local: tuple[str, ...] = ()) -> bool | None:
    """reads_images for records that hold images, where a model that cannot be read here is not taken for a
    text-only one: a name that reads as a local path (it starts with a directory that is here, or with one of
    `local`, as runs/NAME does where the recipe's output_dir is runs/...) and is not there is an error saying so;
    another (a hub model not in the cache, offline) is its own error when `needed`, else a warning and None."""
    spec = cfg.name_or_path
    try:
        raw = info.raw_config(cfg, shipped=True)
    except TunekitError as failure:  # hub.Unavailable, or no such model on the Hub
        if _local_looking(spec, local):
            raise TunekitError(f"model.name_or_path: {spec} does not exist (no such directory; paths are relative "
                               "to the working directory); build or copy the model there, or fix the path") from None
        if needed or not isinstance(failure, hub.Unavailable):
            raise
        log.warning("the records' images were not checked against the model: %s", failure)
        return None
    return isinstance(raw.get("vision_config"), dict)


def _local_looking(spec: str, local: tuple[str, ...]) -> bool:
    """A name whose first part is a directory here (or one of `local`), and which is not there itself."""
    parts = Path(spec).expanduser().parts
    return len(parts) > 1 and (Path(parts[0]).is_dir() or parts[0] in local) and not Path(spec).expanduser().exists()


def check_recipe(cfg: ModelConfig, settings: VisionConfig | None) -> None:
    """Before weights load, where the model's config can be read here (its config.json, or tunekit's shipped copy):
    a `vision` section needs a model that reads images (nothing else reads it), and a model.tokenizer given beside
    a vision-language model must hold the model's image token (the text's image markers are its tokens)."""
    if settings is None and not cfg.tokenizer:
        return
    try:
        raw = info.raw_config(cfg, shipped=True)
    except TunekitError:  # the model cannot be read here: the checks of the model itself say so
        return
    reads = isinstance(raw.get("vision_config"), dict)
    if settings is not None and not reads:
        named = [name for name in type(settings).model_fields if name in settings.model_fields_set]
        key = f"vision.{named[0]}" if named else "vision"
        raise TunekitError(f"{key}: {cfg.name_or_path} is a text-only language model (its config has no "
                           "vision_config), so it has no vision tower or projector for the vision section to train; "
                           "remove the vision section, or train a vision-language model")
    if reads and cfg.tokenizer:
        check_tokenizer(cfg, raw)


def check_tokenizer(cfg: ModelConfig, raw: dict) -> None:
    """model.tokenizer holds the vision-language model's image token, at the id the model reads it at; read from
    the files (tokenizer.json, tokenizer_config.json, processor_config.json) of each where they are here, without
    transformers. Nothing is said where the files do not tell."""
    found = image_token(cfg.name_or_path, cfg.revision, raw)
    if found is None:
        return
    token, token_id = found
    theirs = vocabulary(cfg.tokenizer, cfg.revision)
    if theirs is None:
        return
    if token not in theirs:
        raise TunekitError(f"model.tokenizer: {cfg.tokenizer} has no {token} token, the image token of the "
                           f"vision-language model {cfg.name_or_path}; leave model.tokenizer out (the model's own "
                           f"tokenizer has it), or give a tokenizer that holds {token}")
    if token_id is not None and theirs[token] != token_id:
        raise TunekitError(f"model.tokenizer: {cfg.tokenizer} has {token} as token {theirs[token]}, and the "
                           f"vision-language model {cfg.name_or_path} reads images at token {token_id}; leave "
                           "model.tokenizer out (the model's own tokenizer has it), or give one with the same ids")


IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")  # config.json's id of the image token, by family
TOKEN_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")  # may name it


def image_token(spec: str, revision: str | None, raw: dict) -> tuple[str, int | None] | None:
    """A vision-language model's image token and the id its config reads it at, from its files: the processor's
    or tokenizer's `image_token`, else the token its config's image_token_id names; None where they do not say."""
    token_id = next((raw[k] for k in IMAGE_TOKEN_KEYS if isinstance(raw.get(k), int)), None)
    for name in TOKEN_FILES:
        token = _json(hub.local_file(spec, revision, name)).get("image_token")
        if isinstance(token, str) and token:
            return token, token_id
    if token_id is None:
        return None
    own = vocabulary(spec, revision) or {}
    token = next((t for t, i in own.items() if i == token_id), None)
    return (token, token_id) if token is not None else None


def vocabulary(spec: str, revision: str | None) -> dict[str, int] | None:
    """A tokenizer's tokens and their ids from its tokenizer.json (the added tokens and the model's vocabulary)
    and tokenizer_config.json (added_tokens_decoder); None where neither is here."""
    files = [_json(hub.local_file(spec, revision, name)) for name in ("tokenizer.json", "tokenizer_config.json")]
    tokenizer, config = files
    if not tokenizer and not config:
        return None
    found: dict[str, int] = {}
    vocab = (tokenizer.get("model") or {}).get("vocab") if isinstance(tokenizer.get("model"), dict) else None
    if isinstance(vocab, dict):
        found.update((t, i) for t, i in vocab.items() if isinstance(i, int))
    elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
        found.update((entry[0], i) for i, entry in enumerate(vocab) if isinstance(entry, list) and entry)
    for entry in tokenizer.get("added_tokens") or ():
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and isinstance(entry.get("id"), int):
            found[entry["content"]] = entry["id"]
    for i, entry in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and str(i).isdigit():
            found.setdefault(entry["content"], int(i))
    return found


def _json(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def location(cfg: ModelConfig) -> str:
    """Where the model's files are (a directory, or a hub id checked to be reachable), without loading or
    converting anything: a GGUF file is never a vision-language model here."""
    source = resolve_model(cfg.name_or_path)
    if source.kind == "hub":
        hub.require(cfg.name_or_path, cfg.revision)
    return source.location


@functools.lru_cache(maxsize=4)
def _processor(location: str, revision: str | None, trust_remote_code: bool):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(location, revision=revision, trust_remote_code=trust_remote_code)


def load_processor(cfg: ModelConfig, location: str):
    """The model's processor (image processor and tokenizer together), from `location` (the materialized model or
    a run directory it was saved to)."""
    try:
        processor = _processor(location, cfg.revision, cfg.trust_remote_code)
    except ImportError as e:  # transformers says which package, over several lines
        missing = " ".join(str(e).split()).split(" Check out")[0]
        raise TunekitError(f"model.name_or_path: the processor of {cfg.name_or_path} needs a package that is not "
                           f"installed ({missing}); install it (Qwen2.5-VL's processor needs torchvision for its "
                           "video half: pip install torchvision)") from None
    except (OSError, ValueError) as e:
        raise TunekitError(f"model.name_or_path: cannot load the processor of {cfg.name_or_path} ({e}); a "
                           "vision-language model needs its processor files (processor_config.json or "
                           "preprocessor_config.json) beside its weights") from None
    if getattr(processor, "image_processor", None) is None:
        raise TunekitError(f"model.name_or_path: {cfg.name_or_path} has a vision config but its processor "
                           f"({type(processor).__name__}) has no image processor; save the model's processor with it")
    return processor


@dataclass(frozen=True)
class Parts:
    """Qualified module names: the language model, the vision tower, the projector (empty where the tower holds
    it, as Qwen2.5-VL's patch merger is)."""

    language: str
    tower: str | None
    projector: tuple[str, ...]

    def under(self, name: str, *prefixes: str | None) -> bool:
        return any(p is not None and (name == p or name.startswith(p + ".")) for p in prefixes)


def parts(model) -> Parts:
    """The parts of a loaded vision-language model (a PEFT wrapper looked through)."""
    from transformers import PreTrainedModel

    base = base_of(model)
    decoder = base.get_decoder()
    names = {id(m): n for n, m in base.named_modules()}
    language = names.get(id(decoder))
    if not language:
        raise TunekitError(f"{type(base).__name__}: its language model is not a module inside it; tunekit cannot "
                           "tell which weights are the language model's")
    parent = language.rpartition(".")[0]
    container = base.get_submodule(parent) if parent else base
    towers = [n for n, m in container.named_children()
              if isinstance(m, PreTrainedModel) and m is not decoder]
    tower = f"{parent}.{towers[0]}" if parent and towers else (towers[0] if towers else None)
    projector = tuple(f"{parent}.{n}" if parent else n for n, m in container.named_children()
                      if m is not decoder and n not in towers and any(True for _ in m.parameters()))
    return Parts(language, tower, projector)


def unquantized(location: str, cfg: ModelConfig) -> list[str]:
    """Modules a 4-/8-bit load leaves unquantized: what transformers leaves by default (the output head) and the
    vision tower and projector, which stay in the compute dtype (they are small beside the language model, and a
    projector trained in full cannot be 4-bit). Found on the model built from its config on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.quantizers.base import get_keys_to_not_convert

    config = AutoConfig.from_pretrained(location, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=cfg.trust_remote_code)
    found = parts(model)
    return sorted({*get_keys_to_not_convert(model), *((found.tower,) if found.tower else ()), *found.projector})


def linear_names(model, prefixes: tuple[str, ...], wanted: list[str] | str) -> list[str]:
    """The linear layers under `prefixes` that LoRA targets: every one for "all-linear", else those whose own
    name is listed (as peft matches a list)."""
    from torch import nn

    out = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not any(name.startswith(p + ".") for p in prefixes):
            continue
        if wanted == "all-linear" or name.rpartition(".")[2] in wanted:
            out.append(name)
    return out


def scope_lora(model, peft_cfg, vision: VisionConfig | None):
    """`peft_cfg` aimed at the parts that train: LoRA on the language model's linear layers (and the tower's with
    vision.train_tower), the projector trained in full beside it with vision.train_projector. peft's
    "all-linear" would put LoRA on the tower and projector too."""
    vision = vision or VisionConfig()
    found = parts(model)
    prefixes = (found.language,) + ((found.tower,) if vision.train_tower and found.tower else ())
    targets = linear_names(model, prefixes, peft_cfg.target_modules)
    if not targets:
        wanted = peft_cfg.target_modules
        shown = wanted if isinstance(wanted, str) else ", ".join(sorted(wanted))
        raise TunekitError(f"lora.target_modules: {shown} names no linear layer of the language "
                           f"model ({found.language}); name its projections (q_proj, v_proj, ...) or use all-linear")
    peft_cfg.target_modules = targets
    if vision.train_projector:
        if not found.projector:
            raise TunekitError(f"vision.train_projector: {type(model).__name__} has no projector apart from its vision "
                               "tower; set vision.train_tower instead")
        peft_cfg.modules_to_save = [*(peft_cfg.modules_to_save or ()), *found.projector]
    return peft_cfg


def image_side(model) -> set[int]:
    """ids of the vision tower's and projector's parameters (none for a text-only model)."""
    base = base_of(model)
    if getattr(base.config, "vision_config", None) is None:
        return set()
    found = parts(base)
    return {id(p) for n, p in base.named_parameters() if found.under(n, found.tower, *found.projector)}


def freeze_for_full(model, vision: VisionConfig | None) -> None:
    """Full fine-tuning: the tower and projector frozen unless the recipe trains them."""
    vision = vision or VisionConfig()
    found = parts(model)
    frozen = ((found.tower,) if not vision.train_tower else ()) + (found.projector if not vision.train_projector
                                                                  else ())
    for name, p in model.named_parameters():
        if found.under(name, *frozen):
            p.requires_grad = False


ASSUMED_SIDE = 448  # pixels a side of the image a tower that reads each image at its own size is planned at


@dataclass(frozen=True)
class ImageWork:
    """What the image side adds to a step, per image: for `tunekit plan`'s FLOPs."""

    parameters: int  # the tower's and projector's
    trained: int  # those of them that train
    side: int  # pixels a side: the tower's image_size, else ASSUMED_SIDE
    patches: int  # (side / patch_size) squared
    assumed: bool  # the tower has no fixed image size (Qwen2.5-VL's reads each image at its own)


def image_work(model) -> ImageWork | None:
    """The tower's and projector's work per image; None for a text-only model."""
    base = base_of(model)
    vc = getattr(base.config, "vision_config", None)
    if vc is None:
        return None
    ids = image_side(model)
    # a projector trained in full runs its trained copy (PEFT's modules_to_save), not the original beside it
    ps = [p for n, p in model.named_parameters() if id(p) in ids and ".original_module." not in n]
    side = getattr(vc, "image_size", None)
    side = side if isinstance(side, int) else None
    patch = getattr(vc, "patch_size", None) or 14
    used = side or ASSUMED_SIDE
    return ImageWork(sum(p.numel() for p in ps), sum(p.numel() for p in ps if p.requires_grad), used,
                     (used // patch) ** 2, side is None)


def sizes(model) -> str | None:
    """One line for `tunekit plan`: the tower's and projector's parameters and whether they train; None for a
    text-only model."""
    base = base_of(model)
    if getattr(base.config, "vision_config", None) is None:
        return None
    found = parts(base)
    words = []
    for label, names in (("tower", (found.tower,) if found.tower else ()), ("projector", found.projector)):
        ps = [p for n, p in model.named_parameters() if any(f".{x}." in f".{n}" for x in names)]
        if ps:
            trained = sum(p.numel() for p in ps if p.requires_grad)
            words.append(f"{label} {sum(p.numel() for p in ps):,} parameters ("
                         + (f"{trained:,} trained" if trained else "frozen") + ")")
    work = image_work(model)
    side = f"{work.side}x{work.side}" + (" (assumed: this tower reads each image at its own size)" if work.assumed
                                         else "")
    return ("vision: " + ", ".join(words) + "; under QLoRA both stay unquantized (planned with the embeddings and "
            f"head); image tokens count within data.max_length; the tower's FLOPs are planned for one {side} image "
            f"per example, {work.patches:,} patches")


def describe(model, vision: VisionConfig | None, adapter: str) -> str:
    """One line: what trains and what is frozen."""
    vision = vision or VisionConfig()
    found = parts(model)
    how = "LoRA" if adapter == "lora" else "in full"
    trained = [f"the language model ({found.language}, {how})"]
    frozen = []
    for label, names, on, mode in (("the projector", found.projector, vision.train_projector, "in full"),
                                   ("the vision tower", (found.tower,) if found.tower else (), vision.train_tower,
                                    how)):
        if names:
            (trained if on else frozen).append(f"{label} ({', '.join(_short(n) for n in names)}"
                                               + (f", {mode})" if on else ")"))
    return f"vision: training {', '.join(trained)}; frozen: {', '.join(frozen) or 'nothing'}"


def _short(name: str) -> str:
    return re.sub(r"^(?:base_model\.)?(?:model\.)?", "", name)
