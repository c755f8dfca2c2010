"""The run directory that `tunekit train` writes, in one place: its layout, the typed record kept in
run.json (written only by `RunRecord.save`), when a run may be resumed, and what a path given to eval or
merge is (a run, a merged model, a base model). Files only: no torch, transformers or peft here, so that
`tunekit runs` and `tunekit report` stay light; loading the model a run trained is runs.trained's job."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import MISSING, dataclass, field
from pathlib import Path

import yaml

from tunekit.config.modelsource import resolve_model
from tunekit.config.recipefile import load as load_recipe
from tunekit.config.recipefile import to_yaml, yaml_value
from tunekit.config.schema import Recipe
from tunekit.core import outputs
from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import DamagedFile, read_json
from tunekit.runs import checkpoints

RUN_FILE = "run.json"
RECIPE_FILE = "recipe.yaml"
ADAPTER_DIR = "adapter"  # LoRA / QLoRA runs
INITIAL_ADAPTER_DIR = "adapter_initial"  # lora.init pissa/olora: the adapter as initialised, for conversion
MODEL_DIR = "model"  # full fine-tuning runs
EVAL_DIR = "eval"  # end-of-training eval: metrics.json, predictions.jsonl
BENCHMARKS_DIR = "benchmarks"  # standard benchmarks (lm-eval) before and after: benchmarks.json
CHECKPOINTS_DIR = "checkpoints"
HISTORY_FILE = "loss_history.jsonl"
EXPERT_LOAD_FILE = "expert_load.jsonl"  # a mixture of experts: each evaluation's tokens per expert, per layer
SAMPLES_FILE = "samples.jsonl"  # each evaluation during training: its held-out generations (and GRPO's rewards)
DEEPSPEED_FILE = "deepspeed.json"
MERGED_MARKER = "tunekit.json"  # in a directory written by `tunekit merge`

# What to do about a damaged file, for the one-line errors below. tunekit replaces run.json, metrics.json and
# tunekit.json whole (outputs.write_json), so a damaged one was damaged after it was written.
RUN_FILE_FIX = ("restore it from a copy of the run directory, or delete the run (tunekit writes run.json whole: "
                "a cut copy, a full disk or an edit damaged it)")
METRICS_FIX = ("delete it and run the end-of-training eval again (`tunekit train RECIPE --resume`), or "
               "`tunekit eval RUN --out DIR` to a new DIR")
MERGED_FIX = "merge again: `tunekit merge RUN --force`"


@dataclass
class RunRecord:
    """What run.json says about a run. Unknown keys in an older or newer file are ignored."""

    status: str  # running | completed | failed
    started: str
    command: list[str]
    versions: dict[str, str]
    precision: dict[str, str]  # name, reason
    adapter: str
    base_model: str
    parameters: dict[str, int]  # total, trainable
    world_size: int
    effective_batch: int
    data: dict
    resumed_from: str | None = None
    finished: str | None = None
    global_step: int | None = None
    train_loss: float | None = None
    first_logged_loss: float | None = None
    last_logged_loss: float | None = None
    eval_loss: float | None = None
    eval_scores: dict = field(default_factory=dict)  # the last evaluation during training: loss, BLEU, ...
    best: dict | None = None  # with training.metric_for_best: the metric, its best value and step
    output: str | None = None  # ADAPTER_DIR or MODEL_DIR once complete
    throughput: dict = field(default_factory=dict)
    peak_memory_gb: dict = field(default_factory=dict)
    error: str | None = None
    failed_at_step: int | None = None
    eval: str | None = None  # pending | completed, for runs whose recipe has an eval section
    training_method: str = "sft"  # sft | dpo | kto | orpo
    adapter_from: dict | None = None  # model.adapter_from: the run whose adapter training started from
    learning_rate: dict | None = None  # training.learning_rate: auto: value, steps, rule, curve (lrfind.Found)

    def save(self, run_dir: Path) -> None:
        outputs.write_json(run_dir / RUN_FILE, dataclasses.asdict(self))

    def update(self, run_dir: Path, **changes) -> None:
        for key, value in changes.items():
            if not hasattr(self, key):
                raise AttributeError(f"RunRecord has no field {key!r}")
            setattr(self, key, value)
        self.save(run_dir)

    def fail(self, run_dir: Path, error: BaseException, step: int) -> None:
        """Record the run as failed at `step` with the error's first line (kept in memory if the disk is full)."""
        self.status = "failed"
        self.error = str(error).splitlines()[0] if str(error) else type(error).__name__
        self.failed_at_step = step
        with contextlib.suppress(OSError):
            self.save(run_dir)

    @classmethod
    def load(cls, run_dir: Path) -> "RunRecord":
        """run.json read; a damaged one, or one lacking a field every run.json has, is one line naming it."""
        path = run_dir / RUN_FILE
        raw = read_json(path, RUN_FILE_FIX)
        fields = dataclasses.fields(cls)
        missing = [f.name for f in fields if f.name not in raw and f.default is MISSING
                   and f.default_factory is MISSING]
        if missing:
            raise DamagedFile(path, f"lacks {', '.join(missing)}", RUN_FILE_FIX)
        known = {f.name for f in fields}
        return cls(**{k: v for k, v in raw.items() if k in known})


def is_run(path: Path) -> bool:
    return path.is_dir() and (path / RUN_FILE).is_file()


def is_trained(path: Path) -> bool:
    """A run directory or a merged one: what resolve_target loads with its own recipe."""
    return is_run(path) or (path.is_dir() and (path / MERGED_MARKER).is_file())


def weights_dir(run_dir: Path) -> Path:
    """adapter/ of a LoRA or QLoRA run, model/ of a full fine-tuning run."""
    return run_dir / (MODEL_DIR if (run_dir / MODEL_DIR).is_dir() else ADAPTER_DIR)


# The files from_pretrained builds a tokenizer from (one suffices); a run saves its tokenizer beside its weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES) or any(directory.glob("*.tiktoken"))


def weights_gone(run_dir: Path, record: RunRecord) -> str | None:
    """What a completed run's output lacks (its adapter/ or model/, the config, the safetensors weights, the
    tokenizer saved beside them: files deleted or never copied), in words; None when all are there."""
    expected = record.output or (MODEL_DIR if record.adapter == "full" else ADAPTER_DIR)
    found = [d for d in (expected, ADAPTER_DIR, MODEL_DIR) if (run_dir / d).is_dir()]
    if not found:
        return f"weights are gone (no {expected}/ in it)"
    weights = run_dir / found[0]
    config = "adapter_config.json" if weights.name == ADAPTER_DIR else "config.json"
    if not (weights / config).is_file():
        return f"weights are gone (no {config} in {weights.name}/)"
    if not any(weights.glob("*.safetensors")):
        return f"weights are gone (no .safetensors file in {weights.name}/)"
    if not has_tokenizer(weights):
        return f"tokenizer is gone (no tokenizer.json or tokenizer_config.json in {weights.name}/)"
    return None


def completed_run(spec, key: str | None = None, what: str = "run") -> tuple[Path, RunRecord]:
    """A run given as an input (a teacher, a model reward, what chat, eval, export, merge or push takes): it
    completed and its weights are all there, checked from files before anything loads; else one line naming
    `key` (the setting or argument that gave it) and what to do. `what`: how a run of the kind wanted is called."""
    run_dir = Path(spec)
    where = f"{key}: {spec}" if key else str(spec)
    record = RunRecord.load(run_dir)
    if record.status != "completed":
        raise TunekitError(f"{where}: the {what} did not complete (status {record.status!r}); finish it first "
                           "(tunekit train RECIPE --resume)")
    gone = weights_gone(run_dir, record)
    if gone:
        raise TunekitError(f"{where}: a tunekit run whose {gone}; train it again or point at another run")
    return run_dir, record


def adapter_run(spec: Path) -> tuple[Path, RunRecord]:
    """A completed LoRA/QLoRA run directory and its record, as `tunekit merge` takes it (imports no torch,
    so the command checks it first); otherwise one line saying what it is instead."""
    run_dir = outputs.require_dir(Path(spec), "run directory")
    if not is_run(run_dir):
        raise TunekitError(f"{run_dir}: not a tunekit run directory (no {RUN_FILE})")
    record = RunRecord.load(run_dir)
    if record.adapter == "full" or (run_dir / MODEL_DIR).is_dir():
        raise TunekitError(f"{run_dir}: a full fine-tuning run; its weights in {MODEL_DIR}/ are already merged")
    return completed_run(run_dir)  # completed, and its adapter all there


def ended_before_training(run_dir: Path) -> str | None:
    """Why the run in `run_dir` ended before its first optimizer step (run.json "failed", or "running" though no
    process holds the directory: callers hold its lock), when it did; a retry of the same command replaces such
    a run without --force, since nothing in it is worth keeping. None for anything else."""
    if not is_run(run_dir) or any((run_dir / CHECKPOINTS_DIR).glob("*")):
        return None
    try:
        record = RunRecord.load(run_dir)
    except TunekitError:
        return None
    if record.status not in ("failed", "running") or (record.failed_at_step or record.global_step or 0) > 0:
        return None
    return record.error or "the process ended"


def mark_ended(run_dir: Path, error: BaseException) -> None:
    """run.json says "failed" once its process ends by an error, wherever the error came from."""
    try:
        record = RunRecord.load(run_dir)
    except (TunekitError, OSError):
        return
    if record.status == "running":
        record.fail(run_dir, error, record.global_step or 0)


@dataclass
class StartingAdapter:
    path: Path  # the source run's adapter/
    source: dict  # what run.json records of the source run


def starting_adapter(recipe: Recipe) -> StartingAdapter | None:
    """model.adapter_from checked: a completed LoRA/QLoRA run on the recipe's base model with the recipe's rank,
    alpha, scaling (rsLoRA), DoRA and dropout."""
    spec = recipe.model.adapter_from
    if spec is None:
        return None
    where = f"model.adapter_from {spec}"
    run_dir = outputs.require_dir(Path(spec), "model.adapter_from")
    if not is_run(run_dir):
        raise TunekitError(f"{where}: not a tunekit run directory (no {RUN_FILE})")
    record = RunRecord.load(run_dir)
    adapter = run_dir / ADAPTER_DIR
    if record.status != "completed" or record.adapter == "full":
        raise TunekitError(f"{where}: not a completed LoRA/QLoRA run (status {record.status}, adapter "
                           f"{record.adapter}); finish it first or name a LoRA run")
    completed_run(run_dir, "model.adapter_from")
    ours, theirs = recipe.model.name_or_path, record.base_model
    same = Path(ours).resolve() == Path(theirs).resolve() if Path(ours).exists() else ours == theirs
    if not same:
        raise TunekitError(f"{where}: trained on {theirs}, but model.name_or_path is {ours}; use the same base")
    saved = read_json(adapter / "adapter_config.json", f"train the run in {run_dir} again")
    # the adapter is loaded with its own config: a recipe that says otherwise would be ignored, so it is refused
    for key, theirs_key in (("r", "r"), ("alpha", "lora_alpha"), ("use_rslora", "use_rslora"),
                            ("use_dora", "use_dora"), ("dropout", "lora_dropout")):
        if getattr(recipe.lora, key) != saved.get(theirs_key, False):
            shown = yaml_value(saved.get(theirs_key, False))
            raise TunekitError(f"lora.{key}={getattr(recipe.lora, key)} but the adapter in {run_dir} has "
                               f"{key} {shown}; set lora.{key}: {shown}")
    return StartingAdapter(adapter, {"run": str(run_dir.resolve()), "training_method": record.training_method,
                                     "global_step": record.global_step, "base_model": record.base_model,
                                     "adapter": record.adapter})


# ---------------------------------------------------------------- resume


BATCH_SPLIT = ("micro_batch_size", "gradient_accumulation_steps")  # may change on resume; their product x world may not


def check_resume(recipe: Recipe, run_dir: Path, world_size: int = 1) -> Path | None:
    """The checkpoint to resume from, or None when training finished and only the end-of-training
    eval is left (a run stopped during it). The recipe must be the one the run started with, except for
    how each optimizer step's examples are split (processes x micro-batch x accumulation), whose product
    must stay the same: a run may resume on another number of processes."""
    outputs.require_dir(run_dir, "--resume: output_dir")
    saved = run_dir / RECIPE_FILE
    if not saved.is_file() or not (run_dir / RUN_FILE).is_file():
        raise TunekitError(f"--resume: {run_dir} is not a tunekit run directory; train without --resume")
    text = saved.read_text(encoding="utf-8")
    before = (yaml.safe_load(text) or {}).get("training") or {}
    as_saved = recipe.model_copy(update={"training": recipe.training.model_copy(
        update={k: before[k] for k in BATCH_SPLIT if k in before})})
    if text != to_yaml(as_saved):
        raise TunekitError(f"--resume: the recipe differs from {saved}, the one this run started with; "
                           "resume with the same recipe and overrides")
    record = RunRecord.load(run_dir)
    t = recipe.training
    now = world_size * t.micro_batch_size * t.gradient_accumulation_steps
    if record.effective_batch and now != record.effective_batch:
        raise TunekitError(
            f"--resume: {world_size} process(es) x training.micro_batch_size {t.micro_batch_size} x "
            f"training.gradient_accumulation_steps {t.gradient_accumulation_steps} = {now} examples per step, but "
            f"the run trained with {record.effective_batch} ({record.world_size} process(es)); set "
            "training.gradient_accumulation_steps (or micro_batch_size) so that the product is the same")
    if record.status == "completed":
        if eval_pending(recipe, run_dir):
            return None
        raise TunekitError(f"--resume: the run in {run_dir} already completed; nothing to resume")
    return checkpoints.resume_point(run_dir / CHECKPOINTS_DIR)


def eval_scores(run_dir: Path) -> dict | None:
    """The end-of-training eval's scores (eval/metrics.json), None where it has not run."""
    path = run_dir / EVAL_DIR / "metrics.json"
    return read_json(path, METRICS_FIX).get("scores", {}) if path.is_file() else None


def eval_pending(recipe: Recipe, run_dir: Path) -> bool:
    if recipe.eval is None:
        return False
    return not (run_dir / EVAL_DIR / "metrics.json").is_file() or (
        recipe.eval.benchmarks is not None and not (run_dir / BENCHMARKS_DIR / "benchmarks.json").is_file())


# ---------------------------------------------------------------- targets for eval and merge


@dataclass
class Target:
    kind: str  # run | merged | base
    spec: str
    recipe: Recipe
    location: Path | None = None

    @property
    def label(self) -> str:
        return f"{self.kind}:{Path(self.spec).name if self.kind != 'base' else self.spec}"

    @property
    def tokenizer_dir(self) -> Path | None:
        if self.location is None:
            return None
        return self.location if self.kind == "merged" else weights_dir(self.location)


def resolve_target(spec: str, recipe_path: str | None = None, data: str | None = None,
                   key: str | None = None) -> Target:
    """A run (completed, its weights there), a merged directory or a base model; `key`: the setting that named
    it, for the errors (a teacher's, a model reward's)."""
    path = Path(spec)
    if is_run(path):
        completed_run(path, key)
        return Target("run", spec, load_recipe(path / RECIPE_FILE), path)
    if path.is_dir() and (path / MERGED_MARKER).is_file():
        return Target("merged", spec, load_recipe(path / RECIPE_FILE), path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise TunekitError(f"{spec}: neither a run directory ({RUN_FILE}) nor a merged one ({MERGED_MARKER}) "
                           "nor a model directory (config.json)")
    source = resolve_model(spec, "eval target")  # a missing local file or folder is named as such
    if recipe_path:
        recipe = load_recipe(recipe_path, [f"model.name_or_path={spec}"])
    elif data:
        from tunekit.config.recipefile import from_dict

        recipe = from_dict({"model": {"name_or_path": spec}, "data": {"train": data}}, source="eval")
    elif source.kind == "hub":
        raise TunekitError(f"{spec}: no such directory here; as a hub model id, a base model needs --recipe RECIPE "
                           "(for its data and prompt settings) or --data FILE")
    else:
        raise TunekitError(f"{spec}: a base model needs --recipe RECIPE "
                           "(for its data and prompt settings) or --data FILE")
    return Target("base", spec, recipe)

