"""The training methods (`training.method`): one module per method, registered here by name.

A method module owns everything that differs between methods: its recipe section (a pydantic class), the
data formats it trains on, its dataset builder, its trainer and TRL config, its reference model, the shape
of its training step for `tunekit plan`, and its evaluation measures. The recipe schema (the allowed
`training.method` values, the method sections and their cross-checks), `tunekit train`, `tunekit plan` and
`tunekit eval` read all of it from here, so no other module compares method names.

Method modules are imported by the recipe schema: at their top level they import only pydantic, typing, the
standard library and tunekit's lowest modules (errors); torch, TRL and tunekit's data, model and trainer
modules are imported inside the functions that run a training. docs/adding-a-method.md shows how to add one.
"""

from __future__ import annotations

from tunekit.training.methods.base import (
    DEFAULT,
    METHODS,
    Method,
    TrainerInputs,
    check,
    check_others,
    get,
    names,
    of,
    register,
    renamed_sections,
)

# The built-in methods register themselves on import, in this order (the order the recipe reference lists
# them in); a new method's module is imported here too.
# isort: off
from tunekit.training.methods import sft, dpo, kto, orpo, grpo  # noqa: F401
# isort: on

__all__ = ["DEFAULT", "METHODS", "Method", "TrainerInputs", "check", "check_others", "get", "names", "of", "register",
           "renamed_sections"]
