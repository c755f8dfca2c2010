"""`tunekit push TARGET --repo OWNER/NAME`: a run's LoRA adapter, its merged weights or a file of a pushable export
format (export.writers: GGUF), with a model card (export.card) and the training curves (runs.curves), to the Hugging
Face Hub as ONE commit, so that the repo holds the whole upload or none of it. Everything that can be checked here
is checked before any network call, and the Hub before anything is merged; each failure is one line (TunekitError).
The order of the checks: docs/merge-export.md, "The Hub"."""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tunekit.config.recipefile import load as load_recipe
from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import read_json
from tunekit.evaluation.table import baseline_scores
from tunekit.export import card as cards
from tunekit.export.writers import ExportFormat, pushable, whats
from tunekit.models.hubclient import Hub, check_repo_id, token
from tunekit.runs import curves, history
from tunekit.runs.layout import (
    ADAPTER_DIR,
    MERGED_FIX,
    MERGED_MARKER,
    MODEL_DIR,
    RECIPE_FILE,
    RUN_FILE,
    RunRecord,
    completed_run,
    is_run,
)

log = logging.getLogger("tunekit")

PICKLES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}
# a merged directory's files that stay here: tunekit's marker (local paths), the recipe (in the card), its card
KEPT_HERE = {MERGED_MARKER, RECIPE_FILE, "README.md"}



@dataclass
class Upload:
    what: str  # adapter | merged | a pushable export format's name (export.writers.pushable)
    target: Path
    run: Path | None  # the run the card describes; None for a file or directory whose run is not here
    files: dict[str, Path] = field(default_factory=dict)  # path in the repo -> local file
    merge_run: Path | None = None  # a LoRA run merged on the fly (--what merged)
    merged_dir: Path | None = None  # the merged directory uploaded: its tunekit.json and recipe

    @property
    def name(self) -> str:
        """The run's name; a file's or directory's own where the run is not here."""
        if self.run is not None:
            return self.run.resolve().name
        return self.target.stem if self.target.is_file() else self.target.resolve().name


# ---------------------------------------------------------------- here, before any network call


def _files(folder: Path, skip: set[str] = frozenset()) -> dict[str, Path]:
    """Every file under `folder` (hidden ones and `skip` at its top left out) by its path inside it;
    safetensors only: a pickle file is refused."""
    found = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel in skip or any(part.startswith(".") for part in Path(rel).parts):
            continue
        if path.suffix in PICKLES:
            raise TunekitError(f"{path}: a pickle file ({path.suffix}); tunekit pushes safetensors only: remove it")
        found[rel] = path
    return found


def _one_written(folder: Path, fmt: ExportFormat) -> dict[str, Path]:
    """The one file of `fmt` in `folder`, with the files beside it."""
    found = sorted(p for p in folder.iterdir() if p.is_file() and fmt.is_written(p))
    if not found:
        raise TunekitError(f"{folder}: no {fmt.label} file here; write one with `tunekit export {folder} --format "
                           f"{fmt.name}` first, or push --what adapter or --what merged")
    if len(found) > 1:
        raise TunekitError(f"{folder}: {len(found)} {fmt.label} files ({', '.join(p.name for p in found)}); give the "
                           "one to push as TARGET")
    return fmt.files(found[0])


def _run_of(folder: Path) -> Path | None:
    """The run a file or merged directory in `folder` came from, where it is still here."""
    if is_run(folder):
        return folder
    marker = folder / MERGED_MARKER
    source = read_json(marker, MERGED_FIX).get("source_run") if marker.is_file() else None
    return Path(source) if source and is_run(Path(source)) else None


def _from_run(path: Path, what: str | None) -> Upload:
    record = RunRecord.load(path)
    if record.status != "completed":
        raise TunekitError(f"{path}: the run did not complete (status {record.status!r}); nothing to push")
    lora = not (path / MODEL_DIR).is_dir()
    what = what or ("adapter" if lora else "merged")
    if what in pushable():
        return Upload(what, path, path, _one_written(path, pushable()[what]))
    completed_run(path, "push target")  # the weights pushed, or merged to push
    if not lora:
        if what == "adapter":
            raise TunekitError(f"{path}: a full fine-tuning run has no adapter; push --what merged (its weights in "
                               f"{MODEL_DIR}/) or --what " + " or --what ".join(pushable()))
        return Upload("merged", path, path, _files(path / MODEL_DIR, {"README.md"}))
    if what == "merged":
        return Upload("merged", path, path, merge_run=path)
    return Upload("adapter", path, path, _files(path / ADAPTER_DIR, {"README.md"}))  # PEFT's own card: ours replaces it


def resolve(target: str, what: str | None) -> Upload:
    """What TARGET holds and which of it --what pushes (default: a LoRA run's adapter, a full fine-tuning run's
    or merged directory's weights, a file's own format)."""
    path = Path(target).expanduser()
    files = " or ".join(f"{fmt.suffix} file" for fmt in pushable().values())
    if not path.exists():
        raise TunekitError(f"push target {target}: does not exist; give a run directory, a merged directory or a "
                           f"{files}")
    if path.is_file():
        fmt = next((f for f in pushable().values() if f.is_written(path)), None)
        if fmt is None:
            raise TunekitError(f"push target {target}: not a file tunekit pushes; give a run directory, a merged "
                               f"directory or a {files}")
        if what not in (None, fmt.name):
            raise TunekitError(f"push target {target}: a {fmt.label} file pushes as --what {fmt.name}, not {what}; "
                               f"for the {what} give the run directory")
        return Upload(fmt.name, path, _run_of(path.parent), fmt.files(path), merged_dir=_merged(path.parent))
    if is_run(path):
        return _from_run(path, what)
    if not (path / MERGED_MARKER).is_file():
        raise TunekitError(f"push target {target}: not a tunekit run directory ({RUN_FILE}), merged directory "
                           f"({MERGED_MARKER}) or {files}")
    if what == "adapter":
        raise TunekitError(f"push target {target}: a merged directory holds no adapter; push its run directory "
                           "with --what adapter")
    if what in pushable():
        return Upload(what, path, _run_of(path), _one_written(path, pushable()[what]), merged_dir=path)
    written = tuple(s for fmt in pushable().values() for s in (fmt.suffix, *fmt.beside))  # pushed on their own
    weights = {k: v for k, v in _files(path, KEPT_HERE).items() if not k.endswith(written)}
    return Upload("merged", path, _run_of(path), weights, merged_dir=path)


def _merged(folder: Path) -> Path | None:
    return folder if (folder / MERGED_MARKER).is_file() else None


# ---------------------------------------------------------------- the card


def _weights(upload: Upload, files: dict[str, Path]) -> str:
    if upload.what == "adapter":
        return "LoRA adapter, safetensors (adapter_model.safetensors)"
    if upload.what in pushable():
        return pushable()[upload.what].weights(files)
    config = files.get("config.json")
    dtype = json.loads(config.read_text(encoding="utf-8")).get("dtype") if config else None
    return f"{dtype}, safetensors" if dtype else "safetensors"


def _notes(merged_dir: Path | None) -> list[str]:
    """What `tunekit merge` recorded of the merge: its parity with the adapter model."""
    marker = merged_dir / MERGED_MARKER if merged_dir is not None else None
    parity = read_json(marker, MERGED_FIX).get("parity") if marker is not None and marker.is_file() else None
    if not isinstance(parity, dict):
        return []
    scores = parity.get("measure") == "scores"  # a reward model's: one score per sequence (export.merge.Parity)
    return [f"Merged from the adapter in fp32; parity with the adapter model: max |{'score' if scores else 'logit'} "
            f"diff| {parity.get('max_abs_diff', float('nan')):.2e}, "
            f"{'pair order' if scores else 'top-1'} agreement {100 * parity.get('top1_agreement', float('nan')):.2f}% "
            f"over {parity.get('positions')} {'sequences' if scores else 'positions'}"]


def card_for(upload: Upload, repo: str, base_id: str | None, baseline: dict | None) -> cards.Card:
    """The card's facts: from the run where it is here, else the merged directory's recipe, else the file."""
    from tunekit.export.license import license_of

    fmt = pushable().get(upload.what)
    fields = {"repo": repo, "baseline": baseline, "weights": _weights(upload, upload.files), "format": fmt,
              "notes": _notes(upload.merged_dir), **({"base_model_id": base_id} if base_id else {})}
    if upload.run is not None:
        return cards.from_run(upload.run, upload.what, **fields)
    recipe_file = upload.merged_dir / RECIPE_FILE if upload.merged_dir is not None else None
    recipe = load_recipe(recipe_file) if recipe_file is not None and recipe_file.is_file() else None
    named = fmt.base_model(upload.target) if fmt is not None and upload.target.is_file() else None
    base = recipe.model.name_or_path if recipe is not None else named or "not recorded"
    fields.setdefault("base_model_id", cards.hub_id(base))
    return cards.Card(name=upload.name, what=upload.what, base_model=base, recipe=recipe, license=license_of(base),
                      **fields)


# ---------------------------------------------------------------- the Hub


# ---------------------------------------------------------------- push


def _adapter_config(path: Path, base_id: str) -> bytes:
    """adapter_config.json naming the base model by its hub id, so that peft loads it from the Hub."""
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("base_model_name_or_path") == base_id:
        return path.read_bytes()
    return (json.dumps({**config, "base_model_name_or_path": base_id}, indent=2, sort_keys=True) + "\n").encode()


def _files_to_send(upload: Upload, card: cards.Card, staging: Path) -> dict[str, Path | bytes]:
    """The files of the one commit: the weights (a LoRA run merged now, for --what merged), the card and curves."""
    files: dict[str, Path | bytes] = dict(upload.files)
    if upload.merge_run is not None:
        from tunekit.export import merge  # torch: only now, every check done

        upload.merged_dir = merge.merge(upload.merge_run, staging / "merged")
        upload.files = _files(upload.merged_dir, KEPT_HERE)
        files = dict(upload.files)
        card.weights, card.notes = _weights(upload, upload.files), card.notes + _notes(upload.merged_dir)
    if upload.what == "adapter" and card.base_model_id:
        files["adapter_config.json"] = _adapter_config(upload.files["adapter_config.json"], card.base_model_id)
    if upload.run is not None:
        svg = curves.svg(history.series(history.rows(upload.run), RunRecord.load(upload.run).effective_batch or 1))
        if svg is not None:
            (staging / cards.CURVES_FILE).write_text(svg, encoding="utf-8")
            files[cards.CURVES_FILE], card.curves = staging / cards.CURVES_FILE, True
    (staging / "README.md").write_text(cards.render(card), encoding="utf-8")
    files["README.md"] = staging / "README.md"
    return files


def push(target: str, repo: str, what: str | None = None, private: bool = False, revision: str | None = None,
         force: bool = False, baseline: str | None = None, base_model: str | None = None) -> str:
    """Push TARGET to hub repo `repo` as one commit; returns the repo's address."""
    if what is not None and what not in whats():
        raise TunekitError(f"--what {what}: choose one of {', '.join(whats())}")
    upload = resolve(target, what)
    check_repo_id(repo)
    if base_model:
        check_repo_id(base_model, "--base-model")
    card = card_for(upload, repo, base_model, baseline_scores(Path(baseline), "--baseline") if baseline else None)
    if upload.merge_run is not None:  # the base model the merge loads can be had here, before the Hub is asked
        from tunekit.data import precheck

        precheck.check_model(load_recipe(upload.merge_run / RECIPE_FILE).model)
    hub = Hub(token(), repo)
    exists = hub.check(private, force)
    if card.license is None and card.base_model_id:
        card.license = hub.license_of(card.base_model_id)
    if not card.base_model_id:  # said once the checks passed: a refusal stays one line
        log.warning("the base model %s is not a hub id: the card names it as given%s; --base-model OWNER/NAME "
                    "names it by its hub id", card.base_model,
                    " and adapter_config.json keeps the local path" if upload.what == "adapter" else "")
    with tempfile.TemporaryDirectory(prefix=".push-", dir=upload.merge_run) as tmp:
        files = _files_to_send(upload, card, Path(tmp))
        size = sum(len(v) if isinstance(v, bytes) else v.stat().st_size for v in files.values())
        log.info("pushing %s: %d files, %.1f MB, to %s%s as one commit", upload.what, len(files), size / 1e6, repo,
                 f" (branch {revision})" if revision else "")
        url = hub.commit(files, exists, private, revision, f"tunekit push: {upload.what} of {upload.name}")
    log.info("pushed: %s", url)
    return f"{hub.endpoint}/{repo}"
