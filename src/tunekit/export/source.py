"""What an export's TARGET is: a run directory (merged on the fly, exactly as `tunekit merge` merges, parity
check included), a merged directory, or a base model; the config read before any weight loads; and
the facts the exported file records about where it came from."""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tunekit.config.modelsource import looks_like_path, resolve_model
from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import read_json
from tunekit.runs import layout

# models, merge and transformers are imported where they are used: they load torch


@dataclass
class Facts:
    """What the exported file says about where it came from (GGUF: general.* and tunekit.* keys)."""
    name: str
    base_model: str
    license: str | None = None
    finetune: dict | None = None  # training method, adapter, steps, data, from the run


@dataclass
class Source:
    kind: str  # run | merged | base
    path: Path  # the run directory, the merged directory, or the base model's directory
    recipe: object | None  # the recipe of a run or merged model
    facts: Facts

    @property
    def home(self) -> Path:
        """Where exported files go by default: beside the run or merged model, else the current directory."""
        return self.path if self.kind != "base" else Path.cwd()


def _finetune(run: Path, recipe) -> dict:
    record = layout.RunRecord.load(run)
    return {"run": run.resolve().name, "training_method": record.training_method, "adapter": record.adapter,
            "steps": record.global_step, "data": recipe.model_dump(mode="json")["data"]["train"]}


def _require_exists(target: str) -> None:
    """A TARGET written as a local path (as config.modelsource reads it) that is not there is named as missing,
    before anything else is tried. `org/name` stays a hub id (a missing one is named by the hub check), and so
    does a .gguf name (it may be packaged)."""
    if target.endswith(".gguf") or Path(target).expanduser().exists():
        return
    if looks_like_path(target):
        raise TunekitError(f"export target {target}: does not exist; give a run directory, a merged directory, "
                           "a model directory, a .gguf file or a hub id")


def check_first(target: str) -> None:
    """Before torch: TARGET is there, and the model export will load can be had here: for a completed LoRA
    run its base model (named by its recipe key), for a hub id the id itself ("export target"). Anything
    else about the target is checked by `resolve`, in its own terms."""
    from tunekit.config.recipefile import load
    from tunekit.data import precheck
    from tunekit.models import hub

    _require_exists(target)
    path = Path(target)
    if layout.is_run(path):
        if layout.RunRecord.load(path).status == "completed":
            layout.completed_run(path, "export target")
            if (path / layout.ADAPTER_DIR).is_dir() and (path / layout.RECIPE_FILE).is_file():
                precheck.check_model(load(path / layout.RECIPE_FILE).model)
        return
    if (path / layout.MERGED_MARKER).is_file():
        return
    try:
        source = resolve_model(target, "export target")
    except TunekitError:
        return  # a path that is not a model: resolve names it
    if source.kind == "hub":
        hub.require(target, None, "export target")


def resolve(target: str) -> Source:
    """What TARGET is (layout.resolve_target tells runs and merged directories apart), and what the file
    will say about it. A base model given as a GGUF file or hub id is materialized as a model directory."""
    path = Path(target)
    _require_exists(target)
    if not (layout.is_run(path) or (path / layout.MERGED_MARKER).is_file()):
        from tunekit.models import loader

        return Source("base", Path(loader.materialize(target, key="export target")), None, Facts(path.stem, target))
    t = layout.resolve_target(target, key="export target")
    if t.kind == "run":
        return Source("run", path, t.recipe, Facts(path.resolve().name, t.recipe.model.name_or_path, None,
                                                   _finetune(path, t.recipe)))
    marker = read_json(path / layout.MERGED_MARKER, layout.MERGED_FIX)
    run = Path(str(marker.get("source_run", "")))
    facts = _finetune(run, t.recipe) if marker.get("source_run") and layout.is_run(run) else {"merged_from": str(run)}
    name = path.resolve().parent.name if path.name == "merged" else path.resolve().name
    return Source("merged", path, t.recipe, Facts(name, t.recipe.model.name_or_path, None, facts))


def scores_sequences(source: Source) -> bool:
    """The source ends in a one-number score head (a reward model: training.method reward, or a saved
    ...ForSequenceClassification), read before any weight loads."""
    from tunekit.config.methods import DECLARED

    if source.recipe is not None:
        return DECLARED[source.recipe.training.method].score_head
    from tunekit.models.loader import saved_with_score_head

    return saved_with_score_head(source.path)


def config(source: Source):
    """The model's config, read before anything is merged or loaded."""
    if source.recipe is None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(source.path))
    from tunekit.models.info import model_config

    return model_config(source.recipe.model)


@contextlib.contextmanager
def model_dir(source: Source):
    """The directory holding the weights to export: a LoRA run is merged into a temporary directory
    (with `tunekit merge`'s parity check), a full fine-tuning run's model/ is used as it is."""
    if source.kind != "run":
        yield source.path
    elif (source.path / layout.MODEL_DIR).is_dir():
        yield source.path / layout.MODEL_DIR
    else:
        from tunekit.export import merge

        with tempfile.TemporaryDirectory(prefix=".export-merge-", dir=source.path) as tmp:
            yield merge.merge(source.path, Path(tmp) / "merged", dtype="fp32")
