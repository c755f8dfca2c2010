"""The defaults put to the quality benchmark (bench/quality.py; bench/RESULTS.md, "Quality at equal compute"):
when a recipe leaves one of these unset, `tunekit validate` and the start of `tunekit train` say which value it
got and why, one line each."""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.config.recipes import yaml_value


@dataclass(frozen=True)
class Measured:
    key: str  # dotted recipe key: section.field
    why: str
    # why, where a rule of the section's schema set another value than the field's own default
    why_else: str | None = None


MEASURED: tuple[Measured, ...] = (
    Measured("training.learning_rate", "kept after bench/quality.py: neither auto nor a higher fixed rate won on "
             "every task, measured on one 135M model (bench/RESULTS.md); auto finds one per run"),
    Measured("lora.use_rslora", "bench/quality.py: lower held-out answer loss than alpha/r scaling on all four "
             "tasks at 24 and 96 steps and at one epoch (bench/RESULTS.md); false restores alpha/r",
             "lora.lr_ratio is set: LoRA+ with rsLoRA overshot in bench/quality.py, a higher held-out answer loss "
             "than the script on three tasks of four (bench/RESULTS.md)"),  # schema: LoraConfig
)


def applied(recipe) -> list[str]:
    """One line per measured default the recipe did not set."""
    lines = []
    for m in MEASURED:
        section_name, name = m.key.split(".")
        section = getattr(recipe, section_name, None)
        if section is None or name in section.model_fields_set:
            continue
        value, why = getattr(section, name), m.why
        if m.why_else is not None and value != type(section).model_fields[name].default:
            why = m.why_else
        lines.append(f"{m.key}: {yaml_value(value)} (default: {why})")
    return lines
