"""The defaults put to the quality benchmark (bench/quality.py; bench/RESULTS.md, "Quality at equal compute"):
when a recipe leaves one of these unset, `tunekit validate` and the start of `tunekit train` say which value it
got and why, one line each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    key: str  # dotted recipe key: section.field
    why: str


MEASURED: tuple[Measured, ...] = (
    Measured("training.learning_rate", "kept after bench/quality.py: neither auto nor a higher fixed rate won on "
             "every task, measured on one 135M model (bench/RESULTS.md); auto finds one per run"),
)


def applied(recipe) -> list[str]:
    """One line per measured default the recipe did not set."""
    lines = []
    for m in MEASURED:
        section_name, name = m.key.split(".")
        section = getattr(recipe, section_name, None)
        if section is None or name in section.model_fields_set:
            continue
        lines.append(f"{m.key}: {getattr(section, name)} (default: {m.why})")
    return lines
