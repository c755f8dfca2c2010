"""The teacher of a distillation (distill.teacher): a hub name, a local model directory or GGUF file, a merged
directory, or a tunekit run (its adapter on its base, its full or merged weights). Resolved and its tokenizer
compared with the student's before any weight loads; loaded frozen, in inference mode, for the trainer
(training.methods.distill) and counted by `tunekit plan` from its model's config."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tunekit.config import methods
from tunekit.config.modelsource import resolve_model
from tunekit.config.schema import ModelConfig, Recipe
from tunekit.core.errors import TunekitError
from tunekit.runs.layout import (
    TOKENIZER_FILES,
    RunRecord,
    Target,
    has_tokenizer,
    is_run,
    is_trained,
    resolve_target,
    weights_dir,
)

log = logging.getLogger("tunekit")
KEY = "distill.teacher"


@dataclass(frozen=True)
class Teacher:
    spec: str
    model: ModelConfig  # the model it loads from: the run's base, or the teacher itself
    target: Target | None = None  # a tunekit run or merged directory

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.target.tokenizer_dir if self.target is not None else None

    @property
    def quantized_run(self) -> bool:
        """A QLoRA run: its base is re-quantized as it was trained."""
        return self.target is not None and self.target.kind == "run" and self.target.recipe.quantization is not None

    def describe(self) -> str:
        if self.target is None:
            return self.spec
        kind = "merged weights" if self.target.kind == "merged" else \
            f"tunekit run, {self.target.recipe.adapter_kind} on {self.model.name_or_path}"
        return f"{self.spec} ({kind})"


def resolve(recipe: Recipe) -> Teacher:
    """The recipe's teacher, from files only (no weights): a run must have completed and be a language model."""
    spec = recipe.distill.teacher
    path = Path(spec)
    if is_run(path):
        record = RunRecord.load(path)
        spec_of = methods.DECLARED.get(record.training_method)
        if spec_of is not None and spec_of.score_head:
            raise TunekitError(f"{KEY}: {spec} is a reward model (a score head), which predicts no next token; "
                               "name a run of a language model")
    if is_trained(path):
        target = resolve_target(spec, key=KEY)  # a run: completed, its weights and tokenizer there
        require_tokenizer(spec, target.tokenizer_dir)
        return Teacher(spec, target.recipe.model, target)
    source = resolve_model(spec, KEY)  # a missing local file or directory is named as such
    if source.kind == "dir":
        require_tokenizer(spec, Path(source.location))
    return Teacher(spec, ModelConfig(name_or_path=spec, trust_remote_code=recipe.model.trust_remote_code))


def require_tokenizer(spec: str, directory: Path) -> None:
    """The teacher's directory holds its tokenizer: its vocabulary is compared with the student's before any
    weight loads, and its ids are what the divergence reads."""
    if not has_tokenizer(directory):
        where = "" if directory == Path(spec) or directory == Path(spec).resolve() else f" in {directory}"
        raise TunekitError(f"{KEY}: {spec} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}{where}); "
                           "distillation compares the teacher's next-token probabilities with the student's over "
                           "one vocabulary: save the teacher's tokenizer there (tokenizer.save_pretrained) or name "
                           "another teacher")


def unavailable(teacher: Teacher, e) -> TunekitError:
    """A teacher named as a hub id that cannot be had here (hub.Unavailable `e`), said of distill.teacher: often a
    run directory not trained yet."""
    return type(e)(f"{KEY}: {teacher.spec} is no run or model directory here, and as a hub id it cannot be had "
                   f"({e.why}); train the teacher run first, or name a local model", e.why)


def tokenizer(teacher: Teacher):
    from tunekit.models import hub, loader

    try:
        return loader.load_tokenizer(teacher.model, teacher.tokenizer_dir)
    except hub.Unavailable as e:
        raise unavailable(teacher, e) from None


def check_vocabulary(student, teacher_tokenizer, student_name: str, teacher_name: str) -> None:
    """One line naming both tokenizers and where they differ, unless every token has the same id in both: the
    divergence compares the two models' probabilities token by token."""
    mine, theirs = student.get_vocab(), teacher_tokenizer.get_vocab()
    if mine == theirs:
        return
    by_id = ({i: t for t, i in vocab.items()} for vocab in (mine, theirs))
    mine_at, theirs_at = by_id
    differ = sorted(i for i in set(mine_at) | set(theirs_at) if mine_at.get(i) != theirs_at.get(i))
    first = differ[0]
    where = (f"id {first} is {theirs_at[first]!r} in the teacher's and {mine_at[first]!r} in the student's"
             if first in mine_at and first in theirs_at else
             f"id {first} is only in the {'teacher' if first in theirs_at else 'student'}'s")
    raise TunekitError(f"{KEY}: the teacher's tokenizer ({teacher_name}, {len(theirs)} tokens) and the student's "
                       f"({student_name}, {len(mine)} tokens) differ: {where} ({len(differ)} ids differ); "
                       "distillation compares next-token probabilities over one vocabulary: choose a teacher of the "
                       "student's family")


def check(recipe: Recipe, student_tokenizer=None) -> Teacher:
    """The teacher resolved and its vocabulary checked against the student's (loaded here unless given)."""
    from tunekit.models import loader

    teacher = resolve(recipe)
    student = student_tokenizer if student_tokenizer is not None else loader.load_tokenizer(recipe.model)
    check_vocabulary(student, tokenizer(teacher), recipe.model.tokenizer or recipe.model.name_or_path,
                     teacher.spec)
    return teacher


def four_bit(compute):
    """NF4 with double quantization, computing in `compute` (as QLoRA loads a base)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)


def load(teacher: Teacher, dtype, quantize: bool):
    """The teacher frozen in inference mode, computing in `dtype`; `quantize`: its base weights in 4 bits (a QLoRA
    run's base is re-quantized as it was trained, whatever this says)."""
    from tunekit.models import loader
    from tunekit.runs.trained import load_trained

    target, quant = teacher.target, four_bit(dtype) if quantize else None
    if target is None:
        model = loader.load_base(teacher.model, dtype, quant)
    elif quant is None or teacher.quantized_run:
        model = load_trained(target, dtype)
    elif target.kind == "merged":
        model = loader.load_base(teacher.model.model_copy(update={"name_or_path": str(target.location)}), dtype,
                                 quant)
    else:
        weights = weights_dir(target.location)
        model = loader.load_adapter_model(teacher.model, weights, dtype, quant) \
            if (weights / "adapter_config.json").is_file() else \
            loader.load_base(teacher.model.model_copy(update={"name_or_path": str(weights)}), dtype, quant)
    return model.eval().requires_grad_(False)
