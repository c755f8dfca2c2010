"""A recipe as the Python API takes it: a YAML file's path, a dict of sections, or a loaded Recipe, with
overrides as `--set` takes them ("training.learning_rate=1e-4") or as a dict of dotted keys to values."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from tunekit.api import arguments
from tunekit.config import recipefile
from tunekit.config.schema import Recipe
from tunekit.core.errors import TunekitError

RecipeLike = Union[str, os.PathLike, Mapping[str, Any], Recipe]
Overrides = Union[Sequence[str], Mapping[str, Any], None]


def override_lines(overrides: Overrides) -> list[str]:
    """Overrides as `--set` lines: a dict's values written as JSON (which YAML reads back as the same value)."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        lines = [overrides]
    elif isinstance(overrides, Mapping):
        lines = []
        for key, value in overrides.items():
            if not isinstance(key, str) or not key.strip():
                raise TunekitError(f"overrides: key {key!r} is not a dotted key; write e.g. "
                                   "{'training.learning_rate': 1e-4}")
            arguments.yaml_value(f"overrides[{key!r}]", value)
            lines.append(f"{key}={json.dumps(value)}")
    elif isinstance(overrides, (list, tuple)):
        lines = list(overrides)
    else:
        raise TunekitError(f"overrides: expected a list of 'dotted.key=value' strings or a dict of dotted keys to "
                           f"values, got {type(overrides).__name__}")
    for line in lines:
        if not isinstance(line, str):
            raise TunekitError(f"override {line!r}: expected a 'dotted.key=value' string")
        recipefile.parse_override(line)
    return lines


def is_path(recipe: Any) -> bool:
    return isinstance(recipe, (str, os.PathLike))


def check_type(recipe: Any) -> None:
    if not isinstance(recipe, (str, os.PathLike, Mapping, Recipe)):
        raise TunekitError(f"recipe: expected a YAML file's path, a dict or a Recipe, got {type(recipe).__name__}")


def load(recipe: RecipeLike, overrides: Overrides = None) -> Recipe:
    """The recipe validated, its files checked and made absolute, as `tunekit validate` reads a file. A dict's
    relative paths are looked up from the current directory; a Recipe with overrides is validated anew."""
    check_type(recipe)
    lines = override_lines(overrides)
    if is_path(recipe):
        return recipefile.load(Path(recipe), lines)
    if isinstance(recipe, Recipe):
        if not lines:
            return recipe
        raw = recipe.model_dump(mode="json", exclude_unset=True)
        raw.setdefault("output_dir", recipe.output_dir)
    else:
        arguments.yaml_value("recipe", dict(recipe))  # what a YAML file could hold: a set or an object is named
        raw = copy.deepcopy(dict(recipe))
    return recipefile.from_dict(recipefile.apply_overrides(raw, lines), source="recipe", base=Path.cwd())
