"""What a model's own files say about it (architecture config, context window), read without
loading any weights: config.json of a directory, the header of a GGUF file, or a hub config."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .errors import TunekitError
from .recipe import ModelConfig, Recipe
from .sources import resolve_model

log = logging.getLogger("tunekit")

# Names architectures use for the longest sequence they were built for, in transformers' configs.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def _hub_config(cfg: ModelConfig) -> dict | None:
    """config.json of a hub model, from the local cache or the Hub; None when neither has it."""
    from huggingface_hub import constants
    from transformers.utils import cached_file

    try:
        path = cached_file(cfg.name_or_path, "config.json", revision=cfg.revision,
                           local_files_only=constants.HF_HUB_OFFLINE, _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):
        return None
    return json.loads(Path(path).read_text()) if path else None


def _gguf_context(path: Path) -> int | None:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields.get("general.architecture")
    field = reader.fields.get(f"{arch.contents()}.context_length") if arch is not None else None
    return int(field.contents()) if field is not None else None


def context_window(cfg: ModelConfig) -> tuple[int, str] | None:
    """(tokens, where it was read) for the model, or None when its config cannot be reached."""
    source = resolve_model(cfg.name_or_path)
    if source.kind == "gguf":
        n = _gguf_context(Path(source.location))
        return (n, f"context_length in the GGUF header of {Path(source.location).name}") if n else None
    config = (json.loads((Path(source.location) / "config.json").read_text()) if source.kind == "dir"
              else _hub_config(cfg))
    if not config:
        return None
    for key in CONTEXT_KEYS:
        value = config.get(key)
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
