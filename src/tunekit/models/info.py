"""What a model's own files say about it (its transformers config, its context window), read
without loading any weights: config.json of a directory or the Hub, or the header of a GGUF file;
for planning before a download, a config.json given by hand or tunekit's shipped copy."""

from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path

from tunekit.models import hub
from tunekit.core.errors import TunekitError
from tunekit.config.schema import ModelConfig, Recipe
from tunekit.models.sources import resolve_model

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
        found = shipped_config(cfg.name_or_path) if shipped else None
        if found is None:
            raise
        if cfg.name_or_path not in _told:
            _told.add(cfg.name_or_path)
            log.info("%s: using tunekit's shipped copy of its config (%s)", cfg.name_or_path, e.why)
        return found


def _from_dict(raw: dict, where: str):
    from transformers import CONFIG_MAPPING

    raw = dict(raw)
    kind = raw.pop("model_type", None)
    if kind not in CONFIG_MAPPING:
        raise TunekitError(f"{where}: model_type {kind!r} is not an architecture this transformers knows; "
                           f"give the model's own config.json")
    return CONFIG_MAPPING[kind](**raw)


def shipped_config(name: str):
    """tunekit's copy of a well-known hub model's config (architecture numbers only), or None."""
    table = json.loads(SHIPPED.read_text())
    name = table["aliases"].get(name, name)
    raw = table["configs"].get(name)
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


def context_window(cfg: ModelConfig, shipped: bool = False, given=None) -> tuple[int, str] | None:
    """(tokens, where it was read) for the model (or from a `given` config), or None when its config
    cannot be read."""
    try:
        config = given if given is not None else model_config(cfg, shipped)
    except (OSError, ValueError):
        return None
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value, f"{key} in the config of {cfg.name_or_path}"
    return None


def fit_max_length(recipe: Recipe, shipped: bool = False, given=None) -> Recipe:
    """data.max_length against the model's context window: positions past it were never trained,
    and rotary or learned position embeddings either fail or silently degrade there. A length the
    recipe sets beyond the window is refused; the default is lowered to the window, with a warning."""
    found = context_window(recipe.model, shipped, given)
    if found is None:
        log.info("data.max_length not checked against the model's context window (its config is not reachable)")
        return recipe
    window, where = found
    if recipe.data.max_length <= window:
        return recipe
    if "max_length" in recipe.data.model_fields_set:
        raise TunekitError(f"data.max_length={recipe.data.max_length} is beyond the model's context window of "
                           f"{window} tokens ({where}); set data.max_length to at most {window}")
    log.warning("data.max_length defaults to %d, beyond the model's context window of %d tokens (%s); using %d",
                recipe.data.max_length, window, where, window)
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"max_length": window})})
