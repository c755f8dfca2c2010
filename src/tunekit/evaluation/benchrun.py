"""A target's benchmarks, and a base's beside them: the tasks loaded first (a task that cannot be had is refused
before any model loads), the target loaded as tunekit loads it for eval (evaluation.benchmarks scores it), the base
the same way or, for the run's own base under an adapter, the same loaded model with the adapter switched off (so
a QLoRA run's before and after share one 4-bit base); benchmarks.json written whole (BENCHMARKS_DIR of a run)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path

from tunekit.config.schema import ModelConfig, Recipe
from tunekit.core import outputs
from tunekit.core.errors import TunekitError
from tunekit.evaluation import benchmarks, benchtable
from tunekit.runs.layout import BENCHMARKS_DIR, Target, is_trained, resolve_target

log = logging.getLogger("tunekit")
BENCH_FILE = "benchmarks.json"
OWN_BASE = "base"  # --compare base: the target's own base model


@dataclass(frozen=True)
class Scorable:
    """Something to score: a run or merged directory (its recipe says how to load it) or a model alone."""

    label: str
    target: Target | None = None
    model: ModelConfig | None = None

    @property
    def has_adapter(self) -> bool:
        from tunekit.runs.layout import ADAPTER_DIR

        return self.target is not None and self.target.kind == "run" and (self.target.location / ADAPTER_DIR).is_dir()


def scorable(spec: str, like: Scorable | None = None) -> Scorable:
    """A run, a merged directory, or a model (hub id, directory, GGUF) loaded with `like`'s model settings."""
    path = Path(spec)
    if is_trained(path):
        target = resolve_target(spec)
        return Scorable(target.label, target=target)
    from tunekit.config.modelsource import resolve_model

    resolve_model(spec, "benchmark target")
    trained = like.target.recipe.model if like is not None and like.target is not None else None
    if trained is not None and trained.name_or_path == spec:  # the run's own base: as the run loaded it
        return Scorable(f"base:{spec}", model=trained)
    # another model: its own tokenizer and revision; only what the run's recipe allowed to run carries over
    carried = {k: getattr(trained, k) for k in ("trust_remote_code", "attn_implementation")} if trained else {}
    return Scorable(f"base:{spec}", model=ModelConfig(name_or_path=spec, **carried))


def own_base(target: Scorable) -> Scorable:
    """The model `target` was trained from."""
    if target.target is None:
        raise TunekitError(f"--compare {OWN_BASE}: {target.label} is a model, not a run; give the base model to "
                           "compare with")
    return scorable(target.target.recipe.model.name_or_path, target)


def default_out(target: Scorable) -> Path:
    if target.target is not None:
        return target.target.location / BENCHMARKS_DIR
    return Path("runs") / f"benchmarks-{Path(target.label.removeprefix('base:')).stem.replace('/', '_')}"


def _load(s: Scorable, dtype):
    from tunekit.models import loader
    from tunekit.runs.trained import load_trained, on_device

    if s.target is not None:
        return load_trained(s.target, dtype), loader.load_tokenizer(s.target.recipe.model, s.target.tokenizer_dir)
    return on_device(loader.load_base(s.model, dtype)), loader.load_tokenizer(s.model)


def _score(s: Scorable, model, tokenizer, tasks: list[str], settings: benchmarks.Settings, shots: dict) -> list[dict]:
    fewshot = "each task's own few-shot count" if settings.num_fewshot is None else f"{settings.num_fewshot}-shot"
    log.info("benchmarks: scoring %s on %s (%s%s, seed %d, batch %s)", s.label, ", ".join(tasks), fewshot,
             f", first {settings.limit}" if settings.limit else "", settings.seed, settings.batch_size)
    scores, counts = benchmarks.score(model, tokenizer, tasks, settings)
    shots.update(counts)
    return [r.as_dict() for r in scores]


def run(target: Scorable, tasks: list[str], base: Scorable | None, settings: benchmarks.Settings, out: Path,
        dtype: str = "auto", force: bool = False) -> dict:
    """Score `target` (and `base`) on `tasks`; benchmarks.json in `out`, and the result."""
    import torch

    from tunekit.evaluation.evaluator import eval_dtype

    benchmarks.import_lm_eval()
    torch_dtype = eval_dtype(dtype)
    with outputs.exclusive(out, "benchmarks output"):
        outputs.check_free(out, force, "benchmarks output")
        benchmarks.load_tasks(tasks)  # every task's data at hand before a model loads
        settings = dataclasses.replace(settings, batch_size=benchmarks.batch_size(settings.batch_size,
                                                                                  torch.cuda.is_available()))
        model, tokenizer = _load(target, torch_dtype)
        same_model = base is not None and target.has_adapter and base.model is not None and \
            base.model.name_or_path == target.target.recipe.model.name_or_path
        before, shots = None, {}
        if same_model:  # the base as the run loads it: its adapter switched off
            with model.disable_adapter():
                before = _score(base, model, tokenizer, tasks, settings, shots)
        after = _score(target, model, tokenizer, tasks, settings, shots)
        if base is not None and not same_model:
            del model
            gc.collect()
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
            before = _score(base, *_load(base, torch_dtype), tasks, settings, shots)
        table = benchtable.rows(after, before)
        result = {
            "tasks": list(tasks),
            "tuned": {"label": target.label, "scores": after},
            "base": {"label": base.label, "scores": before} if base is not None else None,
            "table": table,
            "settings": {**dataclasses.asdict(settings), "n_shot": shots,
                         "dtype": str(torch_dtype).removeprefix("torch."),
                         "lm_eval": importlib.metadata.version("lm_eval"),
                         "base_loaded": "the same model, adapter off" if same_model else "on its own"},
        }
        with outputs.atomic_dir(out) as tmp:
            outputs.write_json(tmp / BENCH_FILE, result)
    log.info("benchmarks written to %s", out / BENCH_FILE)
    return result


def text(result: dict) -> str:
    base = result["base"]
    return benchtable.text(result["table"], base["label"] if base else None, result["tuned"]["label"])


def end_of_training(recipe: Recipe, run_dir: Path) -> dict:
    """eval.benchmarks of a finished run, with its base (eval.benchmarks.compare_base), into run_dir/benchmarks."""
    from tunekit.runs.layout import RunRecord

    cfg = recipe.eval.benchmarks
    record = RunRecord.load(run_dir)
    record.update(run_dir, eval="pending")  # --resume finishes them
    target = scorable(str(run_dir))
    settings = benchmarks.Settings(cfg.num_fewshot, cfg.limit, cfg.seed, cfg.batch_size)
    result = run(target, cfg.tasks, own_base(target) if cfg.compare_base else None, settings,
                 run_dir / BENCHMARKS_DIR, force=True)
    record.update(run_dir, eval="completed")
    print(text(result))
    return result
