"""The defaults put to the quality benchmark (bench/quality.py; bench/RESULTS.md, "Quality at equal compute"):
when a recipe leaves one of these unset, `tunekit validate` and the start of `tunekit train` say which value it
got and why, one line each."""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.config.recipefile import yaml_value


@dataclass(frozen=True)
class Measured:
    key: str  # dotted recipe key: section.field
    why: str


MEASURED: tuple[Measured, ...] = (
    Measured("training.learning_rate", "kept by bench/quality.py's rule: 4x it (8e-4) scored higher on six tasks "
             "but below beyond seed noise on translate-fr, and neither auto nor 3e-3 won on every task "
             "(bench/RESULTS.md); auto finds one per run"),
    Measured("lora.use_rslora", "bench/quality.py's rule (3 seeds, 4 deciding and 3 confirming tasks): rsLoRA "
             "scored higher on six but below alpha/r beyond seed noise on translate-fr, so peft's alpha/r stays; "
             "true is an option (bench/RESULTS.md)"),
)


def applied(recipe) -> list[str]:
    """One line per measured default the recipe did not set."""
    lines = []
    for m in MEASURED:
        section_name, name = m.key.split(".")
        section = getattr(recipe, section_name, None)
        if section is None or name in section.model_fields_set:
            continue
        lines.append(f"{m.key}: {yaml_value(getattr(section, name))} (default: {m.why})")
    return lines
