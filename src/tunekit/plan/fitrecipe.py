"""`tunekit init`: a recipe that fits, written from a model, a data file and a target (GPU memory, GPUs per node,
nodes, or this CPU). The data format comes from the file's first record; the planner (plan.estimate) then tries the
cheapest settings first, as `tunekit plan`'s fixes do: LoRA, then gradient checkpointing, then 4-bit weights
(QLoRA), then ZeRO-3 across the GPUs, then ZeRO-3 offloading to CPU memory, each at the largest micro-batch of 8, 4,
2, 1 that fits with 10% to spare. Every choice is written with a comment that cites the plan's figure."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tunekit.config import recipefile
from tunekit.config.schema import FieldMap
from tunekit.core.errors import TunekitError
from tunekit.plan.sizes import parse_size

GIB = 1024**3
HEADROOM = 0.9  # the plan within ~9% of measured memory (docs/plan.md): a choice must fit in 90% of the budget
MICRO_BATCHES = (8, 4, 2, 1)
CHARS_PER_TOKEN = 3.0  # conservative for English text with a BPE vocabulary: lengths come out longer, not shorter
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
# the data formats a first record's keys tell apart (data.fields' default names), most specific first
_KEYS = FieldMap()  # the data formats' default column names
FORMATS = [({_KEYS.messages}, "chat", "sft"), ({_KEYS.prompt, _KEYS.chosen, _KEYS.rejected}, "preference", "dpo"),
           ({_KEYS.prompt, _KEYS.completion, _KEYS.label}, "unpaired_preference", "kto"),
           ({_KEYS.instruction, _KEYS.output}, "alpaca", "sft"),
           ({_KEYS.prompt, _KEYS.completion}, "prompt_completion", "sft"), ({_KEYS.text}, "text", "sft")]


@dataclass(frozen=True)
class Target:
    memory: int | None  # bytes per GPU; None: this machine's CPU and memory
    gpus: int = 1
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    def words(self) -> str:
        if self.memory is None:
            return "this CPU"
        each = f"{'GPU' if self.gpus == 1 else 'GPUs'} of {self.memory / GIB:g} GiB"
        return f"{self.nodes} nodes x {self.gpus} {each}" if self.nodes > 1 else f"{self.gpus} {each}"


def parse_target(text: str) -> Target:
    """cpu | MEMORY | GPUSxMEMORY | NODESxGPUSxMEMORY, e.g. 24GiB, 8x80GiB, 2x8x80GiB."""
    if text.strip().lower() == "cpu":
        return Target(None)
    *counts, memory = text.strip().split("x")
    try:
        if len(counts) > 2 or not all(re.fullmatch(r"[1-9]\d*", c) for c in counts):
            raise ValueError
        size = parse_size(memory)
    except ValueError:
        raise TunekitError(f"--target {text}: give cpu, the memory of one GPU (24GiB), GPUs x memory (8x80GiB) or "
                           "nodes x GPUs x memory (2x8x80GiB)") from None
    gpus, nodes = (int(counts[-1]) if counts else 1), (int(counts[0]) if len(counts) == 2 else 1)
    return Target(size, gpus, nodes)


def detect_format(data: str) -> tuple[str, str, list]:
    """(data.format, training.method, the first records) from the file's first record's keys."""
    from tunekit.data.reading import file_records

    records = list(itertools.islice(file_records(data, "--data"), 2000))
    if not records:
        raise TunekitError(f"--data {data}: no records")
    keys = set(records[0].values)
    for wanted, fmt, method in FORMATS:
        if wanted <= keys:
            return fmt, method, records
    raise TunekitError(f"--data {data}: the first record's keys {sorted(keys)} name no data format tunekit knows "
                       "(messages; instruction/output; prompt/completion; prompt/chosen/rejected; text): rename them, "
                       "or write the recipe with data.fields (docs/data.md)")


def estimated_length(records: list, max_positions: int | None) -> tuple[int, str]:
    """data.max_length: the longest of the first records at CHARS_PER_TOKEN, rounded up to a multiple of 256."""
    longest = max(len(json.dumps(r.values, ensure_ascii=False)) for r in records)
    tokens = max(256, math.ceil(longest / CHARS_PER_TOKEN / 256) * 256)
    why = (f"the longest of the first {len(records)} records, {longest:,} characters at ~{CHARS_PER_TOKEN:g} a "
           "token; `tunekit data` shows the real lengths")
    if max_positions and tokens > max_positions:
        return max_positions, f"the model's longest context (the data's would be {tokens:,})"
    return tokens, why


@dataclass(frozen=True)
class Choice:
    label: str
    raw: dict  # recipe changes: dotted key -> value


def ladder(target: Target) -> list[Choice]:
    """The settings tried, cheapest first."""
    ckpt = {"training.gradient_checkpointing": True}
    four_bit = {**ckpt, "quantization.bits": 4}
    if target.memory is None:  # bitsandbytes' 4-bit on a CPU trains, slowly and unfused: LoRA only
        return [Choice("LoRA", {}), Choice("LoRA with gradient checkpointing", ckpt)]
    zero3 = {"training.deepspeed": "ds_configs/zero3.json"}
    offload = {"training.deepspeed": "ds_configs/zero3_offload.json"}
    return [Choice("LoRA", {}), Choice("LoRA with gradient checkpointing", ckpt),
            Choice("QLoRA (4-bit weights) with gradient checkpointing", four_bit),
            *([Choice("LoRA with checkpointing, ZeRO-3 across the GPUs", {**ckpt, **zero3}),
               Choice("QLoRA with checkpointing, ZeRO-3 across the GPUs", {**four_bit, **zero3})]
              if target.world > 1 else []),
            Choice("LoRA with checkpointing, ZeRO-3 offloading weights and optimizer to CPU memory",
                   {**ckpt, **offload})]


def _set(raw: dict, changes: dict) -> dict:
    """A copy of `raw` with dotted keys set, as --set sets them (JSON values read as YAML)."""
    return recipefile.apply_overrides(json.loads(json.dumps(raw)), [f"{k}={json.dumps(v)}" for k, v in changes.items()])


@dataclass
class Planner:
    """Plans of one recipe's variants on the meta-device model built once."""

    raw: dict
    precision: str
    cfg: object = None
    model: object = None

    def __post_init__(self):
        from tunekit.plan import estimate

        self.cfg, self.model = estimate.meta_model(self.recipe(self.raw))

    @staticmethod
    def recipe(raw: dict):
        return recipefile.from_dict(raw, source="tunekit init", base=Path.cwd())

    def peak(self, changes: dict, world: int) -> tuple[dict, int]:
        from tunekit.plan import estimate

        raw = _set(self.raw, changes)
        recipe = self.recipe(raw)
        plan = estimate.make(recipe, estimate.settings_from(recipe, world, self.precision), self.cfg, self.model,
                             versus=False)
        return raw, plan.peak


@dataclass
class Fitted:
    raw: dict
    choice: Choice
    micro: int
    peak: int
    tried: list[tuple[str, int, int]]  # (label, micro-batch, peak bytes) of what did not fit, in order
    budget: int
    max_length_why: str


def _name(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model).name.removesuffix(".gguf"))


def budget_of(target: Target) -> int:
    if target.memory is not None:
        return target.memory
    from tunekit.core.hardware import available_memory

    return available_memory()  # a CPU run holds everything in the machine's memory


def fit(model: str, data: str, target: Target, tokens_per_step: int = 65536) -> Fitted:
    """The first settings of the ladder that fit the target, at the largest micro-batch; TunekitError (one line)
    when none does, naming what would."""
    from tunekit.core.hardware import cpu_has_bf16

    fmt, method, records = detect_format(data)
    precision = ("bf16" if cpu_has_bf16() else "fp32") if target.memory is None else "bf16"
    raw = {"model": {"name_or_path": model}, "adapter": "lora", "lora": dict(LORA),
           "data": {"train": str(Path(data).resolve()), "format": fmt, "max_length": 2048},
           "training": {"method": method, "precision": precision, "max_steps": 1000, "learning_rate": 2.0e-4,
                        "lr_scheduler": "cosine", "warmup_steps": 20, "save_steps": 200},
           "output_dir": f"runs/{_name(model)}-{method}"}
    planner = Planner(raw, precision)
    length, why = estimated_length(records, getattr(planner.cfg, "max_position_embeddings", None))
    planner.raw = _set(raw, {"data.max_length": length})
    budget, tried = budget_of(target), []
    for choice, micro in itertools.product(ladder(target), MICRO_BATCHES):
        accumulation = max(1, round(tokens_per_step / (micro * length * target.world)))
        candidate, peak = planner.peak({**choice.raw, "training.micro_batch_size": micro,
                                        "training.gradient_accumulation_steps": accumulation}, target.world)
        if peak <= HEADROOM * budget:
            return Fitted(candidate, choice, micro, peak, tried, budget, why)
        tried.append((choice.label, micro, peak))
    raise TunekitError(_nothing_fits(target, tried, budget))


def _nothing_fits(target: Target, tried: list[tuple[str, int, int]], budget: int) -> str:
    label, micro, peak = min(tried, key=lambda t: t[2])
    device = "GPU" if target.memory is not None else "machine"
    return (f"nothing fits {target.words()}: the smallest plan, {label} at micro-batch {micro}, needs "
            f"{peak / GIB:.1f} GiB a device, over the {HEADROOM * budget / GIB:.1f} GiB that leaves 10% spare; a "
            f"{device} of {math.ceil(peak / HEADROOM / GIB)} GiB would hold it, as would a smaller model or a shorter "
            "data.max_length")

ORDER = ("model", "adapter", "quantization", "lora", "data", "training", "output_dir")


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def notes(f: Fitted, target: Target, tokens_per_step: int) -> dict[str, list[str]]:
    """Why each choice, by section, with the plan's figures."""
    t, d = f.raw["training"], f.raw["data"]
    worse = {label: peak for label, micro, peak in f.tried if micro == 1}
    why_not = "; ".join(f"{label} needs {_gib(peak)}" for label, peak in worse.items())
    bigger = [peak for label, micro, peak in f.tried if label == f.choice.label and micro == f.micro * 2]
    precision = {"bf16": "bf16: GPUs from Ampere on (A100, H100, RTX 30xx) compute it; on an older one set fp16",
                 "fp32": "fp32: this CPU has no native bf16"} if target.memory is not None else {
        "bf16": "bf16: this CPU computes it natively (avx512_bf16/AMX)", "fp32": "fp32: this CPU has no native bf16"}
    tokens = t["micro_batch_size"] * d["max_length"] * target.world * t["gradient_accumulation_steps"]
    return {
        "adapter": [f"{f.choice.label}: the cheapest setting that fits" + (f" (at micro-batch 1, {why_not})"
                                                                          if why_not else "")],
        "lora": ["rank 16 on every linear layer, alpha 32: tunekit's defaults (docs/recipes.md)"],
        "data": [f"format {d['format']}: from the first record's keys", f"max_length {d['max_length']}: "
                 f"{f.max_length_why}"],
        "training": [f"method {t['method']}: what the {d['format']} format trains", precision[t["precision"]],
                     f"micro_batch_size {f.micro}: the largest of {', '.join(map(str, MICRO_BATCHES))} that fits"
                     + (f" (micro-batch {f.micro * 2} needs {_gib(bigger[0])})" if bigger else ""),
                     f"gradient_accumulation_steps {t['gradient_accumulation_steps']}: {f.micro} x {d['max_length']} "
                     f"tokens x {target.world} device{'s' if target.world > 1 else ''} x "
                     f"{t['gradient_accumulation_steps']} = {tokens:,} tokens a step (asked: {tokens_per_step:,})"],
    }


def render(f: Fitted, target: Target, model: str, data: str, tokens_per_step: int) -> str:
    import textwrap

    import yaml

    head = [f"tunekit init: {model}, {data}, on {target.words()}.",
            f"The plan: {_gib(f.peak)} a device at the step's peak, within the {_gib(HEADROOM * f.budget)} that "
            f"leaves 10% of {_gib(f.budget)} spare; `tunekit plan` shows it whole"
            + (f" (--world-size {target.world})." if target.world > 1 else ".")]
    said = notes(f, target, tokens_per_step)
    out = ["\n".join(textwrap.wrap(line, 116, initial_indent="# ", subsequent_indent="#   ")) for line in head]
    for key in sorted(f.raw, key=ORDER.index):
        out += ["\n".join(textwrap.wrap(line, 116, initial_indent="# ", subsequent_indent="#   "))
                for line in said.get(key, [])]
        out.append(yaml.safe_dump({key: f.raw[key]}, sort_keys=False, allow_unicode=True).rstrip())
    return "\n".join(out) + "\n"


def write(model: str, data: str, target: str, out: str | os.PathLike | None = None, tokens_per_step: int = 65536,
          force: bool = False) -> tuple[Path, Fitted, Target]:
    """Plan, then write the recipe to `out` (default MODEL-TARGET.yaml here; nothing replaced without `force`) and
    read it back as train would."""
    where = parse_target(target)
    out = Path(out) if out else Path(f"{_name(model)}-{target.strip()}.yaml")
    if out.exists() and not force:
        raise TunekitError(f"--out {out} exists; pass --force to replace it, or --out another file")
    if tokens_per_step < 1:
        raise TunekitError(f"--tokens-per-step {tokens_per_step}: give a positive number of tokens")
    fitted = fit(model, data, where, tokens_per_step)
    tmp = out.with_name(f".{out.name}.tmp")  # read back before it stands where the recipe belongs
    try:
        tmp.write_text(render(fitted, where, model, data, tokens_per_step), encoding="utf-8")
        recipefile.load(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out, fitted, where
