"""The typed recipe: schema with defaults and descriptions, YAML loading, dotted overrides,
and one-line errors that name the dotted key and suggest the closest valid one."""

from __future__ import annotations

import difflib
import logging
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, model_validator

from tunekit.training import methods
from tunekit.core.errors import TunekitError
from tunekit.data.formats import FORMATS
from tunekit.evaluation.metrics import METRICS
from tunekit.config.section import Section

PrecisionName = Literal["auto", "bf16", "fp16", "fp32"]  # as written; hardware.Precision is the resolved one
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class ModelConfig(Section):
    name_or_path: str = Field(
        description="Hub id, local Hugging Face directory, GGUF file, or 'package/file.gguf' inside an installed package."
    )
    tokenizer: str | None = Field(None, description="Tokenizer source if it differs from the model (hub id or directory).")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of a hub model.")
    trust_remote_code: bool = Field(False, description="Run modelling code shipped with a hub model. Off unless you trust it.")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = Field(
        None, description="Attention kernel; null lets transformers choose."
    )
    adapter_from: str | None = Field(
        None, description="A completed tunekit LoRA/QLoRA run directory whose adapter training starts from (an SFT "
        "run before DPO, say); its base must be name_or_path. To start from a merged model, set name_or_path to it.")


class LoraConfig(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="'all-linear' (every linear layer but the output head) or a list of module names."
    )
    modules_to_save: list[str] = Field(default_factory=list, description="Modules trained fully and saved with the adapter.")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases to train.")
    use_dora: bool = Field(False, description="DoRA: train each weight's magnitude and direction separately "
                           "(better at low rank, slower steps; merges like LoRA).")
    use_rslora: bool = Field(False, description="rsLoRA: scale by alpha/sqrt(r) instead of alpha/r, "
                             "so that higher ranks keep learning.")
    init: Literal["default", "pissa", "olora"] = Field(
        "default", description="Adapter initialisation: default (B = 0), pissa (the weights' principal singular "
        "vectors, fast SVD) or olora (QR). pissa and olora move part of each base weight into the adapter; the "
        "saved adapter is converted back to apply to the original base.")
    lr_ratio: float | None = Field(None, ge=1.0, description="LoRA+: the B matrices learn at learning_rate x lr_ratio "
                                   "(16 in the LoRA+ paper); null trains A and B at one rate.")


class QuantizationConfig(Section):
    bits: Literal[4, 8] = Field(4, description="Load the frozen base in 4-bit (QLoRA) or 8-bit.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="Quantize the quantization constants too (saves ~0.4 bit/param).")
    compute_dtype: PrecisionName = Field("auto", description="dtype of 4-bit matmuls; 'auto' follows training.precision.")


class FieldMap(Section):
    instruction: str = Field("instruction", description="alpaca: instruction column.")
    input: str = Field("input", description="alpaca: optional input column.")
    output: str = Field("output", description="alpaca: answer column.")
    messages: str = Field("messages", description="chat: column holding the list of messages.")
    role: str = Field("role", description="chat: role key inside each message.")
    content: str = Field("content", description="chat: text key inside each message.")
    prompt: str = Field("prompt", description="prompt_completion, preference, unpaired_preference: prompt column.")
    completion: str = Field("completion", description="prompt_completion, unpaired_preference: completion column.")
    text: str = Field("text", description="text: column of raw text.")
    chosen: str = Field("chosen", description="preference: the preferred answer's column.")
    rejected: str = Field("rejected", description="preference: the dispreferred answer's column.")
    label: str = Field("label", description="unpaired_preference: column saying whether the completion is "
                       "desirable (true/false or 1/0).")


class DataConfig(Section):
    train: str = Field(description="Training data: a .jsonl/.json/.csv/.parquet file or a `datasets` hub name.")
    train_split: str = Field("train", description="Split to read from a hub dataset.")
    eval: str | None = Field(None, description="Eval data file or hub name; otherwise see eval_fraction.")
    eval_split: str = Field("validation", description="Split to read when `eval` is a hub dataset.")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Hold out this seeded fraction of train for eval.")
    format: Literal[tuple(FORMATS)] = Field(  # type: ignore[valid-type]  # names from the registry
        "alpaca", description="Record layout: " + ", ".join(FORMATS) + " (see formats.py).")
    fields: FieldMap = Field(default_factory=FieldMap, description="Column names, when they differ from the defaults.")
    template: Literal["auto", "chat", "alpaca", "raw"] = Field(
        "auto",
        description="How prompts are rendered: the tokenizer's chat template, the Alpaca prompt, or raw "
        "concatenation. 'auto' uses the chat template when the tokenizer has one.",
    )
    system_prompt: str | None = Field(None, description="System message added to chat-rendered prompts.")
    max_length: int = Field(1024, ge=8, description="Tokens per example; longer examples are truncated and counted.")
    mask_prompt: bool = Field(True, description="Train only on completion/assistant tokens (prompt labels = -100).")
    max_examples: int | None = Field(None, gt=0, description="Use only the first N training examples.")
    packing: Union[Literal["auto"], bool] = Field(
        "auto",
        description="Padding-free packing: each micro-batch becomes one row of concatenated examples with position ids "
        "restarting per example and attention kept inside each example. auto: on where the model keeps packed "
        "examples apart (transformers' attention interface), else padded batches.",
    )

    @model_validator(mode="after")
    def _rules(self) -> "DataConfig":
        if self.eval is not None and self.eval_fraction > 0:
            raise ValueError("data.eval and data.eval_fraction are both set; keep one")
        if FORMATS[self.format].needs_chat and self.template in ("alpaca", "raw"):
            raise ValueError(f"data.template={self.template} cannot render format {self.format}; "
                             "use template: chat or auto")
        return self


class TrainingConfig(Section):
    precision: PrecisionName = Field("auto", description="'auto' picks bf16 where the hardware supports it, else fp16 on GPU, else fp32.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    micro_batch_size: int = Field(4, gt=0, description="Examples per device per forward pass.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    chunked_loss: bool = Field(True, description="Run the output head and cross-entropy only on trained positions, in chunks "
                               "(the full logits tensor never exists); false uses the stock full-logits loss.")
    group_by_length: bool = Field(False, description="Batch examples of similar length together (less padding, unpacked runs).")
    learning_rate: float = Field(2e-4, gt=0, le=1.0, description="Peak learning rate.")
    lr_scheduler: Literal[
        "linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt"
    ] = Field("cosine", description="Learning-rate schedule after warmup.")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Warmup as a fraction of all steps.")
    warmup_steps: int = Field(0, ge=0, description="Warmup steps (overrides warmup_ratio when > 0).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0.0, description="Gradient clipping norm (0 disables).")
    optimizer: Literal[
        "adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor", "sgd"
    ] = Field("adamw_torch", description="Optimizer, by its transformers name.")
    logging_steps: int = Field(10, gt=0, description="Log loss every N optimizer steps.")
    eval_steps: int | None = Field(None, gt=0, description="Evaluate loss every N steps; null evaluates once per epoch.")
    save_steps: int | None = Field(None, gt=0, description="Checkpoint every N steps; null checkpoints once per epoch.")
    save_total_limit: int | None = Field(2, gt=0, description="Keep at most this many checkpoints.")
    seed: int = Field(42, description="Seed for initialisation, data order and the eval split.")
    deepspeed: str | None = Field(None, description="DeepSpeed JSON config, e.g. ds_configs/zero2.json.")
    metric_for_best: str | None = Field(
        None, description="Keep the checkpoint with the best value of this evaluation metric (eval_loss, or with an "
        "eval section bleu, chrf, rouge1, rougeL, exact_match, ...): the run's final adapter/model is that one. "
        "A checkpoint is saved at every evaluation.")
    greater_is_better: bool | None = Field(
        None, description="Direction of metric_for_best; null: lower is better for losses and perplexity, higher "
        "for everything else.")
    early_stopping_patience: int | None = Field(
        None, gt=0, description="Stop after this many evaluations in a row without a better metric_for_best.")
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=list, description="Experiment trackers that receive the metrics, the run name (the run "
        "directory's name) and the resolved recipe; each is an optional extra: pip install 'tunekit[tensorboard]'. "
        "TensorBoard writes into the run directory's tensorboard/; W&B, MLflow and trackio read their usual "
        "environment variables (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, ...).")
    method: Literal[tuple(methods.METHODS)] = Field(  # type: ignore[valid-type]  # names from the registry
        methods.DEFAULT, description="; ".join(f"{m.name}: {m.summary}" for m in methods.METHODS.values())
        + " (tunekit.training.methods).")

    @model_validator(mode="after")
    def _rules(self) -> "TrainingConfig":
        if self.warmup_ratio > 0 and self.warmup_steps > 0:
            raise ValueError("training.warmup_ratio and training.warmup_steps are both set; keep one")
        if self.metric_for_best is None and (self.early_stopping_patience or self.greater_is_better is not None):
            raise ValueError("training.early_stopping_patience and training.greater_is_better need "
                             "training.metric_for_best, e.g. metric_for_best: eval_loss")
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError("training.report_to names a tracker twice; list each once")
        if self.metric_for_best and self.save_steps and self.save_steps != self.eval_steps:
            raise ValueError("training.metric_for_best saves a checkpoint at every evaluation; remove "
                             "training.save_steps or set it equal to training.eval_steps")
        return self

    @property
    def best_is_greater(self) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        name = (self.metric_for_best or "").removeprefix("eval_")
        return not (name.endswith("loss") or name == "perplexity")


class EvalConfig(Section):
    data: str | None = Field(None, description="Eval file; null uses the recipe's eval split.")
    limit: int | None = Field(None, gt=0, description="Score only the first N examples.")
    batch_size: int = Field(8, gt=0, description="Prompts per generate() call.")
    max_new_tokens: int = Field(64, gt=0, description="Generation length cap.")
    metrics: list[Literal[tuple(METRICS)]] = Field(  # type: ignore[valid-type]  # names from the registry
        default_factory=lambda: list(METRICS), description="Built-in metrics: " + ", ".join(METRICS) + "."
    )
    extra_metrics: list[str] = Field(
        default_factory=list, description="`evaluate` metrics by Hub name or local script path (needs `evaluate`)."
    )
    during_training: bool = Field(
        True, description="Also generate and score at every evaluation during training (training.eval_steps, or "
        "once per epoch), on the first `limit` examples, logged beside eval_loss.")


class RecipeBase(Section):
    """The sections every recipe has; `Recipe` adds each training method's section (tunekit.training.methods)."""

    model: ModelConfig = Field(description="Base model.")
    adapter: Literal["lora", "none"] = Field(
        "lora", description="lora: train LoRA adapters (with a quantization section: QLoRA); none: full fine-tuning. "
        "The older spelling 'qlora' reads as lora plus a default quantization section.")
    lora: LoraConfig | None = Field(None, description="LoRA settings (adapter lora).")
    quantization: QuantizationConfig | None = Field(
        None, description="Load the frozen base quantized (QLoRA when the adapter is lora).")
    data: DataConfig = Field(description="Training and eval data.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Optimisation settings.")
    eval: EvalConfig | None = Field(None, description="Generate and score at the end of training.")

    @model_validator(mode="before")
    @classmethod
    def _adapter_sections(cls, data: Any) -> Any:
        """The adapter (lora | none) and the base's quantization are separate settings; 'qlora', their old
        single spelling, is read as lora plus a quantization section. A method section written by its earlier
        name (preference: for dpo:) is read as the new one (from_dict notes it)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in methods.renamed_sections(data):
            if data.get(new) is not None and data[old] is not None:
                raise ValueError(f"{old} is the earlier name of the {new} section and both are set; keep {new}")
            value = data.pop(old)
            data[new] = data.get(new) if value is None else value
        if data.get("adapter") == "qlora":
            data["adapter"] = "lora"
            if data.get("quantization") is None:
                data["quantization"] = {}
        adapter = data.get("adapter", "lora")
        if adapter == "none" and data.get("lora") is not None:
            raise ValueError("lora settings given but adapter is 'none'; remove the lora section or set adapter: lora")
        if adapter == "none" and data.get("quantization") is not None:
            raise ValueError("quantization settings given but adapter is 'none': full fine-tuning trains every weight, "
                             "which cannot stay quantized; set adapter: lora (QLoRA) or remove the quantization section")
        if adapter == "lora" and data.get("lora") is None:
            data["lora"] = {}
        lora = data.get("lora") if isinstance(data.get("lora"), dict) else {}
        init = lora.get("init", "default")
        if init != "default" and data.get("quantization") is not None:
            raise ValueError(f"lora.init={init} rewrites base weights, which a quantized base cannot hold exactly; "
                             "use lora.init: default with quantization, or drop the quantization section")
        if init != "default" and lora.get("use_dora"):
            raise ValueError(f"lora.init={init} with lora.use_dora is not supported; keep one")
        return data

    @property
    def full_finetuning(self) -> bool:
        return self.adapter == "none"

    @property
    def adapter_kind(self) -> str:
        """qlora | lora | full, for people to read (logs, run.json, plans); training.method is sft, dpo, ..."""
        return "full" if self.full_finetuning else "qlora" if self.quantization is not None else "lora"

    @model_validator(mode="after")
    def _method_settings(self) -> "Recipe":
        """The training method's rules (tunekit.training.methods): no section or data format of another method, the
        method's own data format and checks; its section takes its defaults when left out."""
        methods.check_others(self)
        if self.model.adapter_from and (self.full_finetuning or (self.lora and self.lora.init != "default")):
            raise ValueError("model.adapter_from continues a LoRA adapter: use adapter: lora with lora.init: default")
        methods.check(self)
        return self

    @model_validator(mode="after")
    def _best_metric_is_logged(self) -> "Recipe":
        """metric_for_best names eval_loss or a generation metric the eval section logs during training."""
        name = self.training.metric_for_best
        if name is None:
            return self
        key = name.removeprefix("eval_")
        generated = []
        if self.eval is not None and self.eval.during_training:
            generated = [k for m in self.eval.metrics if METRICS[m].score is not None for k, _ in METRICS[m].rows]
        if key != "loss" and key not in generated and not (self.eval and "/" in key):
            hint = ("add an eval section (it logs " + ", ".join(k for m in METRICS.values() if m.score for k, _ in
                                                           m.rows) + " during training)") if not generated else \
                "logged: eval_loss, " + ", ".join(generated)
            raise ValueError(f"training.metric_for_best: {name} is not logged at evaluations; {hint}")
        return self

    @model_validator(mode="after")
    def _precision_agrees(self) -> "Recipe":
        q, p = self.quantization, self.training.precision
        if q is not None and q.compute_dtype != "auto" and p not in ("auto", "fp32") and q.compute_dtype != p:
            raise ValueError(
                f"training.precision is {p} but quantization.compute_dtype is {q.compute_dtype}: "
                f"{p} and {q.compute_dtype} both on; make them agree"
            )
        return self


def _method_sections() -> dict:
    """One optional section per training method that has settings, named after the method."""
    return {m.section: (m.settings | None, Field(None, description=f"{m.name} settings (training.method: {m.name})."))
            for m in methods.METHODS.values() if m.section is not None}


Recipe = create_model(
    "Recipe", __base__=RecipeBase, __module__=__name__, __doc__="A validated recipe (the schema above).",
    **_method_sections(),
    output_dir=(str | None, Field(None, description="Run directory; defaults to runs/<recipe name>.")),
)


# ---------------------------------------------------------------- errors


def _unwrap(annotation: Any) -> Any:
    """Optional[X] / X | None -> X, for walking the schema by dotted path."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0] if len(inner) == 1 else annotation
    return annotation


def _section_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = Recipe
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[part].annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _dotted(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def _describe(error: dict) -> str:
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
    key = _dotted(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        section = _section_at(loc[:-1])
        valid = list(section.model_fields) if section else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        prefix = _dotted(loc[:-1])
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else (
            f"; valid keys: {', '.join(valid)}" if valid else "")
        return f"unknown key {key}{hint}"
    if kind == "missing":
        return f"missing required key {key}"
    msg = error["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        return msg if not key else f"{key}: {msg}"
    return f"{key}: {msg} (got {error.get('input')!r})" if key else msg


def format_validation_error(exc: ValidationError, source: str) -> str:
    errors = exc.errors()
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source}: {_describe(errors[0])}{more}"


# ---------------------------------------------------------------- loading


def parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip() or any(not p for p in key.strip().split(".")):
        raise TunekitError(f"--set {item!r}: expected dotted.key=value, e.g. --set training.learning_rate=1e-4")
    try:
        value = safe_load_unique(raw, f"--set {item!r}") if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        parts, value = parse_override(item)
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise TunekitError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _resolve_file(value: str, base: Path) -> Path | None:
    """A relative path is looked up in the current directory first, then beside the recipe."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    for root in (Path.cwd(), base):
        if (root / p).exists():
            return (root / p).resolve()
    return None


def _check_files(recipe: Recipe, base: Path, source: str) -> Recipe:
    """Existence checks for local files, rewriting them to absolute paths so runs are reproducible
    from any directory."""
    updates: dict[str, dict[str, Any]] = {"data": {}, "training": {}, "eval": {}}
    for section, key, value in (
        ("data", "train", recipe.data.train),
        ("data", "eval", recipe.data.eval),
        ("eval", "data", recipe.eval.data if recipe.eval else None),
    ):
        if value is None:
            continue
        found = _resolve_file(value, base)
        if found is not None:
            updates[section][key] = str(found)
        elif value.endswith(DATA_SUFFIXES) or value.startswith(("/", "./", "../", "~")):
            raise TunekitError(f"{source}: {section}.{key}: file {value!r} not found")
    ds = recipe.training.deepspeed
    if ds is not None:
        found = _resolve_file(ds, base)
        if found is None or not found.is_file():
            raise TunekitError(f"{source}: training.deepspeed: file {ds!r} not found (see ds_configs/)")
        from tunekit.config import deepspeed as dsconfig

        where = f"{source}: training.deepspeed {ds}"
        parsed = dsconfig.read(found, where)
        if recipe.lora is not None and recipe.lora.init != "default" and dsconfig.zero_stage(parsed) == 3:
            raise TunekitError(f"{source}: lora.init={recipe.lora.init} needs whole base weights at initialisation, "
                               f"which ZeRO-3 ({ds}) partitions; use ZeRO-2 or lora.init: default")
        if recipe.lora is not None and recipe.lora.lr_ratio is not None and "optimizer" in parsed:
            raise TunekitError(f"{source}: lora.lr_ratio (LoRA+) needs the Trainer's optimizer, but training.deepspeed "
                               f"{ds} defines DeepSpeed's own; use a config without an optimizer section "
                               "(ds_configs/zero2.json, zero3.json) or drop lora.lr_ratio")
        precision = None if recipe.training.precision == "auto" else recipe.training.precision
        dsconfig.check_with_deepspeed(parsed, where)  # first: resolve() reads values DeepSpeed may refuse
        dsconfig.resolve(parsed, recipe, None, precision, where)
        updates["training"]["deepspeed"] = str(found)
    return recipe.model_copy(
        update={
            name: getattr(recipe, name).model_copy(update=changes)
            for name, changes in updates.items()
            if changes
        }
    )


def from_dict(raw: Any, source: str = "recipe", base: Path | None = None, name: str = "run") -> Recipe:
    if not isinstance(raw, dict):
        raise TunekitError(f"{source}: a recipe must be a YAML mapping of sections (model, data, training, ...)")
    for old, new in methods.renamed_sections(raw):
        if raw[old] is not None:
            logging.getLogger("tunekit").info("%s: the %s section is now named %s; read as %s (rename it)",
                                              source, old, new, new)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise TunekitError(format_validation_error(e, source)) from None
    recipe = _check_files(recipe, base or Path.cwd(), source)
    if recipe.output_dir is None:
        recipe = recipe.model_copy(update={"output_dir": str(Path("runs") / name)})
    from tunekit.models.sources import resolve_model

    try:
        resolve_model(recipe.model.name_or_path)
    except TunekitError as e:
        raise TunekitError(f"{source}: {e}") from None
    if raw.get("adapter") == "qlora":
        logging.getLogger("tunekit").info("%s: adapter: qlora is now written adapter: lora with a quantization "
                                          "section; read that way", source)
    return recipe


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise TunekitError(f"recipe {str(path)!r} is a directory; give a YAML recipe file, e.g. recipes/smollm2_lora.yaml")
    if not path.is_file():
        raise TunekitError(f"recipe file {str(path)!r} not found")
    try:
        raw = safe_load_unique(path.read_text(encoding="utf-8"), str(path))
    except UnicodeDecodeError:
        raise TunekitError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise TunekitError(f"{path}{where}: invalid YAML ({problem})") from None
    return {} if raw is None else raw


def safe_load_unique(text: str, where: str) -> Any:
    """yaml.safe_load, refusing a key given twice in one mapping at any depth."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, where)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, where: str, prefix: str = "") -> None:
    """PyYAML lets a repeated key silently replace the first; a recipe must say each thing once.
    Walks the composed node tree, so the error can name the dotted key and both lines."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            dotted = f"{prefix}.{key}" if prefix else key
            line = key_node.start_mark.line + 1
            if key in seen:
                raise TunekitError(f"{where} line {line}: duplicate key {dotted} (first set on line {seen[key]}); "
                                   "keep one")
            seen[key] = line
            _refuse_duplicate_keys(value_node, where, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, where, f"{prefix}[{i}]")


def load(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe, apply `--set` overrides, validate, and check referenced files."""
    path = Path(path)
    raw = read_yaml(path)
    if isinstance(raw, dict):
        raw = apply_overrides(raw, overrides or [])
    return from_dict(raw, source=str(path), base=path.parent.resolve(), name=path.stem)


def to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
