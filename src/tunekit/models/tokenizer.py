"""The recipe's tokenizer alone, for commands that load no model (`tunekit data`): the same tokenizer
models.loader.load_tokenizer gives training, without importing peft, bitsandbytes or DeepSpeed and
without converting a GGUF file's weights (its tokenizer is read from the file's metadata)."""

from __future__ import annotations

from pathlib import Path

from tunekit.config.modelsource import resolve_model
from tunekit.config.schema import ModelConfig
from tunekit.core.errors import TunekitError
from tunekit.models import hub


def load(cfg: ModelConfig):
    """The recipe's fast tokenizer, its pad token set as training sets it."""
    spec = cfg.tokenizer or cfg.name_or_path
    key = "model.tokenizer" if cfg.tokenizer else "model.name_or_path"
    source = resolve_model(spec, key)
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    location = source.location
    if source.kind == "gguf":
        location, kwargs["gguf_file"] = str(Path(source.location).parent), Path(source.location).name
    elif source.kind == "hub":
        hub.require(spec, cfg.revision, key)
    return from_pretrained(location, key, spec, **kwargs)


def from_pretrained(location: str, key: str, spec: str, **kwargs):
    """AutoTokenizer.from_pretrained, as every tokenizer tunekit uses is loaded: a fast one (label masking
    reads character offsets), with a pad token (the end-of-sequence token where it has none)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(location, **kwargs)
    except (OSError, ValueError) as e:
        raise hub.load_error(key, spec, e) from None
    if not getattr(tok, "is_fast", False):
        raise TunekitError(f"{key}: {spec!r} has no fast tokenizer; label masking needs character offsets")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok
