"""The recipes and DeepSpeed/accelerate configs tunekit ships: the repository's recipes/ and ds_configs/, which the
package reaches as tunekit/config/shipped/ (links in the repository, copies in the wheel: pyproject.toml). A path
under recipes/ or ds_configs/ that a recipe names and that is not found where it stands resolves here, so a shipped
recipe, or a copy of one, runs from any directory. `tunekit recipes` lists and copies them out."""

from __future__ import annotations

import difflib
import itertools
import shutil
from pathlib import Path

from tunekit.core.errors import TunekitError

HOME = Path(__file__).parent / "shipped"
FOLDERS = ("recipes", "ds_configs")


def find(value: str) -> Path | None:
    """The shipped file a relative path such as ds_configs/zero3.json or recipes/data/x.jsonl names, if any."""
    p = Path(value)
    if p.is_absolute() or p.parts[:1] not in [(f,) for f in FOLDERS] or ".." in p.parts:
        return None
    found = HOME / p
    return found.resolve() if found.exists() else None


def recipes() -> list[Path]:
    return sorted((HOME / "recipes").glob("*.yaml"))


def configs() -> list[Path]:
    folder = HOME / "ds_configs"
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def summary(recipe: Path) -> str:
    """The first sentence of a recipe's opening comment: what it trains, on what."""
    lines = recipe.read_text(encoding="utf-8").splitlines()
    opening = " ".join(line.lstrip("# ").strip() for line in itertools.takewhile(lambda s: s.startswith("#"), lines))
    first = opening.split(". ")[0].split(": runs as is")[0].rstrip(".")
    return first if len(first) <= 100 else first[:first.rfind(" ", 0, 97)] + " ..."


def name_of(path: Path) -> str:
    """How `tunekit recipes` names a file: a recipe by its file name, a config by its path under ds_configs/."""
    return path.name if path.parent == HOME / "recipes" else path.relative_to(HOME / "ds_configs").as_posix()


def lookup(name: str) -> Path:
    known = {name_of(p): p for p in [*recipes(), *configs()]}
    key = name.removeprefix("recipes/").removeprefix("ds_configs/")
    if key not in known and f"{key}.yaml" in known:
        key = f"{key}.yaml"
    if key not in known:
        close = difflib.get_close_matches(key, list(known), n=3)
        raise TunekitError(f"tunekit recipes {name}: no shipped recipe or config of that name"
                           + (f"; did you mean {', '.join(close)}?" if close else "; `tunekit recipes` lists them"))
    return known[key]


def copy_out(names: list[str], out_dir: Path, force: bool = False) -> list[Path]:
    """Copy shipped recipes or configs into `out_dir`, each under its own file name; every name is checked, and
    no file replaced without `force`, before any is written."""
    sources = [lookup(n) for n in names]
    targets = [out_dir / s.name for s in sources]
    taken = [str(t) for t in targets if t.exists()]
    if taken and not force:
        raise TunekitError(f"{', '.join(taken)} exists; pass --force to replace it, or --out another directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    for source, target in zip(sources, targets):
        shutil.copyfile(source, target)
    return targets
