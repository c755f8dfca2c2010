"""What a model's own files say about it (its transformers config, its context window), read
without loading any weights: config.json of a directory or the Hub, or the header of a GGUF file."""

from __future__ import annotations

import copy
import functools
import logging

from .errors import TunekitError
from .recipe import ModelConfig, Recipe
from .sources import resolve_model

log = logging.getLogger("tunekit")

# Names architectures use for the longest sequence they were built for, in transformers' configs.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_config(cfg: ModelConfig):
    """The model's transformers config, without weights: config.json of a directory or the Hub, or
    the metadata of a GGUF file (read from its header, no conversion). Raises OSError/ValueError when
    a hub model's config cannot be reached. Read once per process; each caller gets its own copy."""
    return copy.deepcopy(_read_config(cfg))


@functools.lru_cache(maxsize=8)
def _read_config(cfg: ModelConfig):
    from transformers import AutoConfig

    source = resolve_model(cfg.name_or_path)
    if source.kind == "gguf":
        from transformers import CONFIG_MAPPING
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        header = dict(load_gguf_checkpoint(source.location, return_tensors=False)["config"])
        header.pop("_model_name_or_path", None)
        return CONFIG_MAPPING[header.pop("model_type")](**header)
    return AutoConfig.from_pretrained(source.location, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)


def context_window(cfg: ModelConfig) -> tuple[int, str] | None:
    """(tokens, where it was read) for the model, or None when its config cannot be reached."""
    try:
        config = model_config(cfg)
    except (OSError, ValueError):
        return None
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value, f"{key} in the config of {cfg.name_or_path}"
    return None


def fit_max_length(recipe: Recipe) -> Recipe:
    """data.max_length against the model's context window: positions past it were never trained,
    and rotary or learned position embeddings either fail or silently degrade there. A length the
    recipe sets beyond the window is refused; the default is lowered to the window, with a warning."""
    found = context_window(recipe.model)
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
