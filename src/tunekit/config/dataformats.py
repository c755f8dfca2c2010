"""The data formats a recipe may name (data.format), declared: each one's name and how it renders. The schema
takes its choices from here; the parsers live in tunekit.data.formats and register against these names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataFormat:
    name: str
    needs_chat: bool = False  # whole conversations: only a chat template renders them
    alpaca: bool = False  # the Alpaca prompt template applies


# in the order the recipe reference lists them
DECLARED: dict[str, DataFormat] = {f.name: f for f in (
    DataFormat("alpaca", alpaca=True),
    DataFormat("prompt_completion"),
    DataFormat("chat", needs_chat=True),
    DataFormat("text"),
    DataFormat("preference"),
    DataFormat("unpaired_preference"),
    DataFormat("prompt"),
)}


def declare(spec: DataFormat) -> DataFormat:
    """Declare one more data format (a plugin's declare(): tunekit.config.plugins)."""
    if spec.name in DECLARED:
        raise ValueError(f"data format {spec.name!r} is declared twice")
    DECLARED[spec.name] = spec
    return spec
