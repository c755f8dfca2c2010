"""Standard benchmarks through lm-evaluation-harness: tunekit's own loaded model (adapter, 4-bit base, precision and
device as the run has them) handed to lm-eval's HF wrapper (HFLM takes a model object), scored on lm-eval's tasks by
name or on local task YAML. lm-eval does the prompting, few-shot sampling, scoring and standard errors; what this
adds: local YAML read with its data files relative to the YAML (lm-eval resolves them against the working folder),
a task whose data is neither cached nor reachable refused in one line before any model loads, and the scores as
rows of (task, metric, value, stderr)."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tunekit.core.errors import TunekitError, first_line

log = logging.getLogger("tunekit")
CPU_BATCH = 8  # lm-eval's "auto" batch size only shrinks after an out-of-memory error, which a CPU seldom raises


@dataclass(frozen=True)
class Settings:
    num_fewshot: int | None = None  # None: each task's own count (its YAML's num_fewshot, 0 where it has none)
    limit: int | None = None  # the first N examples of each task
    seed: int = 0  # lm-eval's four seeds (python, numpy, torch, few-shot sampling)
    batch_size: int | str | None = None  # None: "auto" on a GPU (the largest that fits, lm-eval's search), else 8


@dataclass(frozen=True)
class Score:
    task: str
    metric: str  # lm-eval's metric, with its filter where the task has one (exact_match/strict-match)
    value: float
    stderr: float | None  # None where lm-eval has none ("N/A": one example, or a metric without one)
    higher_is_better: bool
    n: int  # examples scored

    def as_dict(self) -> dict:
        return asdict(self)


def import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError:
        raise TunekitError("benchmarks need lm-evaluation-harness, which is not installed; pip install "
                           "'tunekit[benchmarks]'") from None
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = lambda: None  # it runs `git describe` in the working folder and prints
    return lm_eval


def is_file_spec(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml"))


def _absolute(value, folder: Path):
    if isinstance(value, str):
        return value if "://" in value or Path(value).is_absolute() else str((folder / value).resolve())
    if isinstance(value, list):
        return [_absolute(v, folder) for v in value]
    if isinstance(value, dict):
        return {k: _absolute(v, folder) for k, v in value.items()}
    return value


def task_config(path: Path, key: str = "--benchmarks") -> dict:
    """A local task YAML as lm-eval reads it (its `include:` and `!function` as lm-eval resolves them), with its
    data files, and a dataset_path naming a folder, relative to the YAML's folder."""
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval's own reader of a task file

    if not path.is_file():
        raise TunekitError(f"{key} {path}: " + ("is a directory; give a task YAML file" if path.is_dir()
                                                      else "no such task file"))
    try:
        cfg = load_yaml(path)
    except Exception as e:  # YAML syntax, a missing include or function file
        raise TunekitError(f"{key} {path}: not a task file lm-eval can read ({type(e).__name__}: "
                           f"{first_line(e)}); see lm-eval's task guide") from None
    if "group" in cfg or "tag" in cfg or not isinstance(cfg.get("task"), str):
        raise TunekitError(f"{key} {path}: a group or tag file, or no `task:` name; give the task files themselves "
                           "(each with task: NAME), or a group's name where lm-eval ships it")
    local = path.parent / str(cfg.get("dataset_path", ""))
    if cfg.get("dataset_path") and local.exists():  # a dataset folder beside the YAML (not a builder or Hub name)
        cfg["dataset_path"] = str(local.resolve())
    kwargs = cfg.get("dataset_kwargs") or {}
    if "data_files" in kwargs:
        cfg["dataset_kwargs"] = {**kwargs, "data_files": _absolute(kwargs["data_files"], path.parent)}
    for name in _local_files(cfg):
        if not Path(name).is_file():
            raise TunekitError(f"{key} {path}: dataset_kwargs.data_files {name}: no such file (paths are "
                               "relative to the task file's folder)")
    return cfg


def _local_files(cfg: dict) -> list[str]:
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    flat = files.values() if isinstance(files, dict) else [files] if files is not None else []
    out = []
    for f in flat:
        out += f if isinstance(f, list) else [f]
    return [f for f in out if isinstance(f, str) and "://" not in f]


@functools.lru_cache(maxsize=2)
def _manager(standard: bool):
    """lm-eval's task manager; with `standard`, its index of its own ~15,000 tasks, which takes seconds to build:
    only when a name asks for one, and once per process (train checks the tasks, then scores them)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=standard)


def load_tasks(specs: list[str], key: str = "--benchmarks") -> dict:
    """lm-eval's tasks, data loaded: `specs` are task names (lm-eval's own) or paths to task YAML. A task whose
    data is not cached and cannot be fetched is refused in one line saying how to cache it."""
    configs = configs_of(specs, key)
    manager = _manager(any(isinstance(c, str) for c in configs))
    loaded = {}
    for spec, config in zip(specs, configs):
        if isinstance(config, str) and config not in manager.task_index:
            raise TunekitError(f"{key} {spec}: no such lm-eval task, group or tag; `lm-eval ls tasks` lists "
                               "them, or give a path to a task YAML (ending .yaml)")
        try:
            tasks = manager.load([config])["tasks"]
        except (ConnectionError, FileNotFoundError) as e:
            raise TunekitError(f"{key} {spec}: {_uncached(manager, spec, config, e)}") from None
        except Exception as e:  # a split the data lacks, a malformed data file, a template lm-eval cannot render
            raise TunekitError(f"{key} {spec}: lm-eval could not build the task ({type(e).__name__}: "
                               f"{first_line(e)}); check the task file and its data") from None
        for name, task in tasks.items():
            if getattr(task, "UNSAFE_CODE", False) or getattr(task, "MULTIMODAL", False):
                why = "runs the model's code" if getattr(task, "UNSAFE_CODE", False) else "needs images"
                raise TunekitError(f"{key} {spec}: task {name} {why}, which tunekit's benchmarks do not; leave it "
                                   "out (run it with lm-eval itself)")
        loaded.update(tasks)
    return loaded


def check_tasks(specs: list[str], key: str, data: bool) -> None:
    """With `data`, load_tasks; else only that each name is lm-eval's and each task file reads (no download)."""
    if data:
        load_tasks(specs, key)
        return
    configs = configs_of(specs, key)
    names = [c for c in configs if isinstance(c, str)]
    if names:
        index = _manager(True).task_index
        for name in names:
            if name not in index:
                raise TunekitError(f"{key} {name}: no such lm-eval task, group or tag; `lm-eval ls tasks` lists "
                                   "them, or give a path to a task YAML (ending .yaml)")


def configs_of(specs: list[str], key: str = "--benchmarks") -> list[str | dict]:
    """What lm-eval is given: a name as it is, a task file as its config (data files made absolute)."""
    return [task_config(Path(s), key) if is_file_spec(s) else s for s in specs]


def _uncached(manager, spec: str, config, error: Exception) -> str:
    """Why a task's data could not be had, and how to cache it where the Hub is reachable."""
    if isinstance(config, dict):
        return f"its data could not be read ({first_line(error)})"
    entry = manager.task_index.get(spec) if hasattr(manager, "task_index") else None
    cfg = getattr(entry, "cfg", None) or {}
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    args = ", ".join(repr(a) for a in (path, name) if a)
    how = (f"where the Hub is reachable, run python -c \"import datasets; datasets.load_dataset({args})\" and copy "
           "its datasets cache (~/.cache/huggingface/datasets, or HF_DATASETS_CACHE) here" if path else
           "run it once where the Hub is reachable and copy the datasets cache here")
    return (f"its data{f' ({path})' if path else ''} is not in the datasets cache and the Hub cannot be reached; "
            f"{how}, or give a local task YAML")


def batch_size(requested: int | str | None, cuda: bool) -> int | str:
    """`--batch-size` as given; else the largest that fits on a GPU (lm-eval's search), 8 on a CPU."""
    return requested if requested is not None else ("auto" if cuda else CPU_BATCH)


def score(model, tokenizer, specs: list[str], settings: Settings,
          key: str = "--benchmarks") -> tuple[list[Score], dict]:
    """Each task's (and group's) metrics on `model` (a transformers or peft model, as loaded), with their standard
    errors; and each task's few-shot count. `specs` as load_tasks took them (checked there)."""
    lm_eval = import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    configs = configs_of(specs, key)
    was_training = model.training
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
    seed = settings.seed
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=configs, task_manager=_manager(any(isinstance(c, str)
                                                                                        for c in configs)),
                                      num_fewshot=settings.num_fewshot, limit=settings.limit, log_samples=False,
                                      random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                      fewshot_random_seed=seed)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise TunekitError(f"{key}: lm-eval stopped ({type(e).__name__}: {first_line(e)})") from None
    finally:
        model.train(was_training)  # HFLM switches the model to eval mode
    return scores_of(out), dict(out.get("n-shot") or {})


def scores_of(out: dict) -> list[Score]:
    """lm-eval's results (`{task: {"metric,filter": value, "metric_stderr,filter": se}}`) as rows."""
    rows = []
    for task, metrics in sorted(out["results"].items()):
        n = (out.get("n-samples") or {}).get(task, {}).get("effective") or 0
        better = (out.get("higher_is_better") or {}).get(task, {})
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            se = metrics.get(f"{metric}_stderr,{filt}")
            rows.append(Score(task, metric if filt == "none" else f"{metric}/{filt}", float(value),
                              float(se) if isinstance(se, (int, float)) and math.isfinite(se) else None,
                              bool(better.get(metric, True)), int(n)))
    return rows
