"""The base model's license, where the model itself states one."""

from __future__ import annotations

import re
from pathlib import Path

from tunekit.config.modelsource import resolve_model
from tunekit.core.errors import TunekitError


def license_of(spec: str) -> str | None:
    """The base model's license where it says one: a GGUF's general.license, or the `license:` line of a
    model directory's README front matter (the Hub's model card). Hub ids are not fetched for it."""
    try:
        source = resolve_model(spec)
    except TunekitError:
        return None
    if source.kind == "gguf":
        from tunekit.models.info import gguf_keys

        return gguf_keys(Path(source.location), where=f"license of {spec}").get("general.license")
    card = Path(source.location) / "README.md"
    if source.kind == "dir" and card.is_file():
        found = re.search(r"^license:\s*(\S+)", card.read_text(encoding="utf-8", errors="replace"), re.M)
        return found.group(1) if found else None
    return None
