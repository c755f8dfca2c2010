"""Every `tunekit.*` name quoted in docs/, README.md and the package's docstrings resolves: a module, or an
attribute of one; so does every name written from a package down (`data.chattemplate`, `plan.report.text`) that is
not a recipe key (`data.format`) or a file name. A name that moved or went away leaves no stale reference behind."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "tunekit"
NAME = re.compile(r"\btunekit(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# strings that look like dotted names but are keys and formats of files tunekit writes, not Python names
NOT_PYTHON = {"tunekit.json": "the merged directory's record file", "tunekit.finetune": "a GGUF metadata key",
              "tunekit.state": "the state files' format name", "tunekit.plugins": "the plugins' entry point group",
              "tunekit.training.trainers.cpo": "the module docs/adding-a-method.md's example adds (test_methods)"}


def docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                found.append((getattr(node, "lineno", 1), text))
    return found


def texts() -> list[tuple[str, str]]:
    """(where, text) of README.md, every docs page and every docstring of the package."""
    found = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in
             [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]]
    return found + [(f"{p.relative_to(ROOT)}:{line}", text) for p in sorted(PACKAGE.rglob("*.py"))
                    for line, text in docstrings(p)]


def quoted() -> dict[str, list[str]]:
    """name -> where it is quoted."""
    where: dict[str, list[str]] = {}
    for place, text in texts():
        for name in NAME.findall(text):
            where.setdefault(name.rstrip("."), []).append(place)
    return where


def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                try:  # a submodule not imported by its package
                    obj = importlib.import_module(f"{obj.__name__}.{attr}")
                    continue
                except (ImportError, AttributeError):
                    return False
            obj = getattr(obj, attr)
        return True
    return False


def test_names_are_found_in_docs_and_docstrings():
    names = quoted()
    assert len(names) > 10 and "tunekit.data.tooldemo" in names  # the scan reads what it should


def test_every_quoted_tunekit_name_resolves():
    stale = {name: places[:3] for name, places in sorted(quoted().items())
             if name not in NOT_PYTHON and not resolves(name)}
    assert not stale, f"tunekit names quoted in docs or docstrings that do not resolve: {stale}"


@pytest.mark.parametrize("name", ["tunekit.data.no_such_module", "tunekit.core.errors.NoSuchError"])
def test_a_stale_name_is_caught(name):
    assert not resolves(name)


PACKAGES = "core|config|models|tooluse|data|runs|evaluation|plan|training|export|reporting|api|cli"
BARE = re.compile(rf"(?<![\w./`-])((?:{PACKAGES})\.[a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
FILE_SUFFIXES = ("md", "json", "jsonl", "yaml", "yml", "py", "txt", "html")
NOT_NAMES = {"plan.peak": "a PlanResult's field in docs/python-api.md", "plan.fits": "the same",
             "training.learnig_rate": "the misspelt key the docs show refused",
             "training.methods.cpo": "docs/adding-a-method.md's example", "training.trainers.cpo": "the same"}


def recipe_key(name: str) -> bool:
    """section.field of the recipe (data.format, training.method), not a module."""
    import typing

    from pydantic import BaseModel

    from tunekit.config import schema

    section, field = name.split(".")[:2]
    annotation = getattr(schema.Recipe.model_fields.get(section), "annotation", None)
    models = [a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
    return any(field in m.model_fields for m in models)


def bare_names() -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for place, text in texts():
        for name in BARE.findall(text):
            name = name.rstrip(".")
            if name.rsplit(".", 1)[-1] not in FILE_SUFFIXES and name not in NOT_NAMES and not recipe_key(name):
                where.setdefault(name, []).append(place)
    return where


def test_every_name_written_from_a_package_down_resolves():
    names = bare_names()
    assert "data.chattemplate" in names and "data.format" not in names  # the scan reads what it should
    stale = {name: places[:3] for name, places in sorted(names.items()) if not resolves(f"tunekit.{name}")}
    assert not stale, f"module names in docs or docstrings that do not resolve: {stale}"
