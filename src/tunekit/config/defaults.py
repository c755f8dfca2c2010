"""The defaults put to the quality benchmark (bench/quality.py; bench/RESULTS.md, "Quality at equal compute"):
when a recipe leaves one of these unset, `tunekit validate` and the start of `tunekit train` say which value it
got and why, one line each."""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.config.loading import yaml_value


@dataclass(frozen=True)
class Measured:
    key: str  # dotted recipe key: section.field
    why: str


MEASURED: tuple[Measured, ...] = (
    Measured("training.learning_rate", "kept after bench/quality.py: neither auto nor a higher fixed rate won on "
             "every task, measured on one 135M model (bench/RESULTS.md); auto finds one per run"),
    Measured("lora.use_rslora", "bench/quality.py: lower held-out answer loss than alpha/r scaling on all four "
             "tasks at 24 steps and on both measured at 96 (bench/RESULTS.md); false restores alpha/r"),
)


def applied(recipe) -> list[str]:
    """One line per measured default the recipe did not set."""
    lines = []
    for m in MEASURED:
        section_name, name = m.key.split(".")
        section = getattr(recipe, section_name, None)
        if section is None or name in section.model_fields_set:
            continue
        value = getattr(section, name)
        lines.append(f"{m.key}: {yaml_value(value)} (default: {m.why})")
    return lines
