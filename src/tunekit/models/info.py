"""What a model's own files say about it (its transformers config, its context window), read
without loading any weights: config.json of a directory or the Hub, or the header of a GGUF file;
for planning before a download, a config.json given by hand or tunekit's shipped copy. `raw_config`
and the context window need neither transformers nor torch (commands check them first)."""

from __future__ import annotations

import copy
import functools
import json
import logging
import struct
from pathlib import Path

from tunekit.config.modelsource import resolve_model
from tunekit.config.schema import ModelConfig, Recipe
from tunekit.core.errors import TunekitError
from tunekit.models import hub

log = logging.getLogger("tunekit")

# Names architectures use for the longest sequence they were built for, in transformers' configs.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


SHIPPED = Path(__file__).with_name("model_configs.json")
_told: set[str] = set()


def model_config(cfg: ModelConfig, shipped: bool = False):
    """The model's transformers config, without weights: config.json of a directory or the Hub, or
    the metadata of a GGUF file (read from its header, no conversion). A hub model that cannot be had
    here raises hub.Unavailable, unless `shipped` allows tunekit's copy of a well-known model's config.
    Read once per process; each caller gets its own copy."""
    try:
        return copy.deepcopy(_read_config(cfg))
    except hub.Unavailable as e:
        return _shipped_instead(cfg.name_or_path, e, shipped_config if shipped else None)


def raw_config(cfg: ModelConfig, shipped: bool = False) -> dict:
    """model_config as the plain dict config.json holds, read without transformers or torch (for a GGUF
    file: its architecture, context window and hidden size); a config.json that is not a JSON object is
    an error naming it. Unavailable and `shipped` as for model_config."""
    try:
        return copy.deepcopy(_read_raw(cfg.name_or_path, cfg.revision))
    except hub.Unavailable as e:
        return _shipped_instead(cfg.name_or_path, e, _shipped_raw if shipped else None)


def _shipped_instead(name: str, failure: hub.Unavailable, shipped):
    found = shipped(name) if shipped else None
    if found is None:
        raise failure
    if name not in _told:
        _told.add(name)
        log.info("%s: using tunekit's shipped copy of its config (%s)", name, failure.why)
    return found


def _from_dict(raw: dict, where: str):
    from transformers import CONFIG_MAPPING

    raw = dict(raw)
    kind = raw.pop("model_type", None)
    if kind not in CONFIG_MAPPING:
        raise TunekitError(f"{where}: model_type {kind!r} is not an architecture this transformers knows; "
                           f"give the model's own config.json")
    try:
        return CONFIG_MAPPING[kind](**raw)
    except Exception as e:  # transformers' own checks of the fields (huggingface_hub's strict dataclasses)
        said = " ".join(str(e).split()) or type(e).__name__
        raise TunekitError(f"{where}: transformers refuses this {kind} config: {said}") from None


def _shipped_raw(name: str) -> dict | None:
    table = json.loads(SHIPPED.read_text())
    return table["configs"].get(table["aliases"].get(name, name))


def shipped_config(name: str):
    """tunekit's copy of a well-known hub model's config (architecture numbers only), or None."""
    raw = _shipped_raw(name)
    return None if raw is None else _from_dict(raw, f"{SHIPPED.name} {name}")


def config_file(path: str):
    """A transformers config from a config.json file (`tunekit plan --model-config`)."""
    where = f"--model-config {path}"
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TunekitError(f"{where}: file not found") from None
    except IsADirectoryError:
        raise TunekitError(f"{where}: is a directory; give its config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TunekitError(f"{where}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise TunekitError(f"{where}: expected a JSON object (a model's config.json)")
    return _from_dict(raw, where)


@functools.lru_cache(maxsize=8)
def _read_config(cfg: ModelConfig):
    from transformers import AutoConfig

    source = resolve_model(cfg.name_or_path)
    if source.kind == "gguf":
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        header = dict(load_gguf_checkpoint(source.location, return_tensors=False)["config"])
        header.pop("_model_name_or_path", None)
        return _from_dict(header, f"{cfg.name_or_path} (GGUF header)")
    if source.kind == "hub":
        hub.require(cfg.name_or_path, cfg.revision)
    return AutoConfig.from_pretrained(source.location, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)


@functools.lru_cache(maxsize=8)
def _read_raw(spec: str, revision: str | None) -> dict:
    source = resolve_model(spec)
    if source.kind == "gguf":
        return gguf_header(Path(source.location))
    if source.kind == "hub":
        hub.require(spec, revision)
        path = Path(hub.config_file(spec, revision))
    else:
        path = Path(source.location) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TunekitError(f"model.name_or_path: {path} is not JSON ({e}); save the model's config again") from None
    if not isinstance(raw, dict):
        raise TunekitError(f"model.name_or_path: {path} is not a JSON object (a model's config.json)")
    return raw


# GGUF value types: struct format of each scalar; 8 is a string, 9 an array. Read here rather than with the
# gguf package's GGUFReader, which maps and indexes the whole file (tensors and vocabulary: seconds for
# SmolLM2) and imports numpy, when the pre-check needs three header keys before anything heavy loads.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_value(f, kind: int):
    """One value of a GGUF header; arrays (the vocabulary) are skipped and read as None."""
    if kind in _GGUF_SCALARS:
        form = "<" + _GGUF_SCALARS[kind]
        return struct.unpack(form, f.read(struct.calcsize(form)))[0]
    if kind == 8:
        (size,) = struct.unpack("<Q", f.read(8))
        return f.read(size).decode("utf-8", "replace")
    if kind != 9:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, count = struct.unpack("<IQ", f.read(12))
    if item in _GGUF_SCALARS:
        f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[item]), 1)
    else:
        for _ in range(count):
            _gguf_value(f, item)
    return None


def gguf_keys(path: Path, done=lambda found: False, where: str | None = None) -> dict:
    """The scalar and string keys of a GGUF file's header (arrays read as None), read with the standard library
    up to where `done(found)` holds, else to the header's end."""
    where = where or f"model.name_or_path: {path}"
    try:
        with path.open("rb") as f:
            magic, version, _, count = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version not in (2, 3):
                raise TunekitError(f"{where}: not a GGUF file (version 2 or 3) that tunekit can read")
            found: dict = {}
            for _ in range(count):
                (size,) = struct.unpack("<Q", f.read(8))
                key = f.read(size).decode("utf-8", "replace")
                found[key] = _gguf_value(f, struct.unpack("<I", f.read(4))[0])
                if done(found):
                    break
    except (struct.error, ValueError, MemoryError, OverflowError):
        raise TunekitError(f"{where}: its GGUF header is damaged or cut short") from None
    return found


def gguf_header(path: Path) -> dict:
    """A GGUF file's architecture, context window and hidden size, under the names transformers gives
    them (model_type, max_position_embeddings, hidden_size), read from its header with the standard
    library: only up to those keys, which GGUF writers put before the vocabulary."""
    def done(found: dict) -> bool:
        arch = found.get("general.architecture")
        return bool(arch) and {f"{arch}.context_length", f"{arch}.embedding_length"} <= found.keys()

    found = gguf_keys(path, done)
    arch = found.get("general.architecture")
    names = {"model_type": arch, "max_position_embeddings": found.get(f"{arch}.context_length"),
             "hidden_size": found.get(f"{arch}.embedding_length")}
    return {k: v for k, v in names.items() if v is not None}


def context_window(cfg: ModelConfig, shipped: bool = False, given=None) -> tuple[int, str] | None:
    """(tokens, where it was read) for the model (or from a `given` transformers config), or None when
    its config cannot be read. Needs no transformers unless `given`."""
    try:
        config = given if given is not None else raw_config(cfg, shipped)
    except (OSError, ValueError):
        return None
    def read(config, key):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    # a vision-language model's window is its language model's (text_config)
    for where, part in (("", config), ("text_config.", read(config, "text_config"))):
        for key in CONTEXT_KEYS if part is not None else ():
            value = read(part, key)
            if isinstance(value, int) and value > 0:
                return value, f"{where}{key} in the config of {cfg.name_or_path}"
    return None


def fit_max_length(recipe: Recipe, shipped: bool = False, given=None, refuse_only: bool = False) -> Recipe:
    """data.max_length against the model's context window: positions past it were never trained,
    and rotary or learned position embeddings either fail or silently degrade there. A length the
    recipe sets beyond the window is refused; the default is lowered to the window, with a warning
    (`refuse_only`: not yet, and nothing said; a later call does it)."""
    found = context_window(recipe.model, shipped, given)
    if found is None:
        if not refuse_only:
            log.info("data.max_length not checked against the model's context window (its config is not reachable)")
        return recipe
    window, where = found
    if recipe.data.max_length <= window:
        return recipe
    if "max_length" in recipe.data.model_fields_set:
        raise TunekitError(f"data.max_length={recipe.data.max_length} is beyond the model's context window of "
                           f"{window} tokens ({where}); set data.max_length to at most {window}")
    if refuse_only:
        return recipe
    log.warning("data.max_length defaults to %d, beyond the model's context window of %d tokens (%s); using %d",
                recipe.data.max_length, window, where, window)
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"max_length": window})})
