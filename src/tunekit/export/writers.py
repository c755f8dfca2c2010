"""The formats `tunekit export --format` writes, in one registry (FORMATS: name -> format object). A format
names the options it takes (each one a CLI flag with its choices and default), checks the target and
output path before any weight loads, and writes. Adding a format is one class here plus its tests; the
CLI's flags and `export.export`'s refusals of an option a format does not take come from the registry."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tunekit.config import plugins
from tunekit.core import outputs
from tunekit.core.errors import TunekitError
from tunekit.core.jsonfiles import read_json
from tunekit.export.gguf import QUANTS

if TYPE_CHECKING:
    from tunekit.export.source import Source

# the sources (recipes) and the models are imported where used: the CLI reads FORMATS for its flags, instantly

log = logging.getLogger("tunekit")


@dataclass(frozen=True)
class Option:
    flag: str  # the CLI flag, e.g. --quant; the keyword export.export takes is its name without dashes
    choices: tuple[str, ...]
    default: str | None  # None: the format decides from the source (e.g. the base model's dtype)
    help: str

    @property
    def key(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


class ExportFormat:
    """One output format. `options` are all it takes; a value for any other option is refused."""
    name: str
    help: str
    options: tuple[Option, ...] = ()

    def default_out(self, source: Source, options: dict) -> Path:
        raise NotImplementedError

    def check(self, source: Source, out: Path, options: dict, target: str) -> None:
        """Refuse what can be told before any weight loads (output name, architecture)."""

    def write(self, source: Source, out: Path, options: dict, force: bool) -> Path:
        raise NotImplementedError

    # Pushable (`tunekit push --what NAME`) when `suffix` is set: the file written ends in it, files ending in
    # `beside` in place of it go along, and `label`, `library`, `tags` and `usage` make the model card.
    suffix: str | None = None
    beside: tuple[str, ...] = ()
    label: str = ""  # what the file is called in a sentence: "GGUF"
    library: str | None = None  # the card's library_name, where one library loads the file
    tags: tuple[str, ...] = ()  # the card's tags beside tunekit's own

    def is_written(self, path: Path) -> bool:
        """`path` is a file of this format (by its name; a format may read its header too)."""
        return path.name.endswith(self.suffix or "\0")

    def files(self, path: Path) -> dict[str, Path]:
        """The files a push uploads for the written file `path`: it and those beside it, by name."""
        found = [path, *(path.with_name(path.name.removesuffix(self.suffix or "") + s) for s in self.beside)]
        return {f.name: f for f in found if f.is_file()}

    def weights(self, files: dict[str, Path]) -> str:
        """The card's line on what the files are."""
        return f"{self.label} file `{next(iter(files))}`"

    def usage(self, repo: str | None) -> str:
        """The card's section on how to run the file, pushed to `repo` (None: a local copy)."""
        return ""

    def base_model(self, path: Path) -> str | None:
        """The base model the file names, for the card of a file whose run is not here."""
        return None


class Gguf(ExportFormat):
    name = "gguf"
    help = "one GGUF file (llama.cpp, Ollama, LM Studio) checked against its source, and an Ollama Modelfile"
    options = (Option("--quant", tuple(QUANTS), "q8_0", "weight type of the 2-D tensors (default q8_0; norms stay "
                      "f32); the k-quants q6_k, q5_k_m, q4_k_m are written by llama.cpp (llama-cpp-python)"),)

    suffix, beside, label, tags = ".gguf", (".Modelfile",), "GGUF", ("gguf",)  # the Hub tells GGUF apart itself

    def default_out(self, source: Source, options: dict) -> Path:
        return source.home / f"{source.facts.name}-{options['quant']}.gguf"

    def is_written(self, path: Path) -> bool:
        with open(path, "rb") as f:
            return path.suffix == self.suffix and f.read(4) == b"GGUF"

    def weights(self, files: dict[str, Path]) -> str:
        return "GGUF file `" + next(k for k in files if k.endswith(".gguf")) + "`" + (
            " and its Ollama Modelfile" if any(k.endswith(".Modelfile") for k in files) else "")

    def usage(self, repo: str | None) -> str:
        run = (f"ollama run hf.co/{repo}\nllama-cli -hf {repo}" if repo else
               "ollama create NAME -f NAME.Modelfile\nllama-cli -m NAME.gguf")
        return ("## How to run\n\nllama.cpp, Ollama and LM Studio read the GGUF file; the Ollama Modelfile beside it "
                f"holds the chat template, stop tokens and greedy settings.\n\n```bash\n{run}\n```\n")

    def base_model(self, path: Path) -> str | None:
        from tunekit.models.info import gguf_keys

        key = "general.base_model.0.name"
        return gguf_keys(path, lambda found: key in found, f"push target {path}").get(key)

    def check(self, source: Source, out: Path, options: dict, target: str) -> None:
        from tunekit.export import source as export_source
        from tunekit.export.architectures import architecture

        if export_source.scores_sequences(source):
            raise TunekitError(f"export target {target}: a reward model ends in a score head (one number per "
                               "sequence), not the language-model head llama.cpp generates with, so GGUF does not "
                               "apply; use tunekit merge or --format safetensors (AutoModelForSequenceClassification)")
        if not out.name.endswith(".gguf"):
            raise TunekitError(f"--out {out}: give a file name ending in .gguf")
        if QUANTS[options["quant"]].llama_cpp:
            from tunekit.export import llamacpp

            llamacpp.require(f"--quant {options['quant']}")
        architecture(export_source.config(source), target)

    def write(self, source: Source, out: Path, options: dict, force: bool) -> Path:
        from tunekit.export import source as export_source

        with outputs.exclusive(out, "export output"):
            if out.exists() and not (force and out.is_file()):
                raise TunekitError(f"export output {out} exists; pass --force to replace it, or --out another file")
            with export_source.model_dir(source) as model_dir:
                self._write_checked(source, model_dir, out, options["quant"])
        log.info("GGUF written to %s (%.1f MB); Ollama: %s", out, out.stat().st_size / 1e6, f"{out.stem}.Modelfile")
        return out

    @staticmethod
    def _write_checked(source: Source, model_dir: Path, out: Path, quant_name: str) -> None:
        """Write to a temporary file, read it back, and keep it only if it passes its type's tolerance."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tunekit.export import gguf, readback
        from tunekit.export.modelfile import modelfile

        quant = gguf.QUANTS[quant_name]
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        batch = readback.prompts(source.recipe, tokenizer)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.partial-", suffix=".gguf", dir=out.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            log.info("writing %s (%s) from %s", out.name, quant_name, model_dir)
            gguf.write_gguf(model, tokenizer, tmp, quant, source.facts)
            result = readback.check(model, tokenizer, tmp, batch)
            log.info(result.line())
            if not result.passes(quant):
                raise TunekitError(
                    f"export refused: {result.line()}; {quant_name} needs top-1 >= {100 * quant.min_top1:g}%"
                    + (f", max diff <= {quant.max_diff:g}" if quant.max_diff is not None else "")
                    + " and identical token ids; nothing written to " + str(out))
            tmp.chmod(0o644)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        (out.parent / f"{out.stem}.Modelfile").write_text(modelfile(out.name, tokenizer, source.recipe),
                                                          encoding="utf-8")


class Safetensors(ExportFormat):
    name = "safetensors"
    help = "a directory AutoModelForCausalLM.from_pretrained loads: sharded safetensors, tokenizer, model card"
    options = (Option("--dtype", ("bf16", "fp16", "fp32"), None, "saved dtype (default: the base model's)"),)

    def default_out(self, source: Source, options: dict) -> Path:
        return source.home / f"{source.facts.name}-safetensors"

    def check(self, source: Source, out: Path, options: dict, target: str) -> None:
        if out.is_file():
            raise TunekitError(f"--out {out}: a file; --format safetensors writes a directory")

    def write(self, source: Source, out: Path, options: dict, force: bool) -> Path:
        from tunekit.export import source as export_source
        from tunekit.runs import layout

        if source.kind == "run" and not (source.path / layout.MODEL_DIR).is_dir():
            from tunekit.export import (
                merge,  # an adapter run: merged exactly as `tunekit merge` does, parity check and card
            )

            return merge.merge(source.path, out, options["dtype"], force)
        with outputs.exclusive(out, "export output"):
            outputs.check_free(out, force, "export output")
            with export_source.model_dir(source) as model_dir:
                self._save(source, model_dir, out, options["dtype"])
        log.info("safetensors model written to %s", out)
        return out

    @staticmethod
    def _save(source: Source, model_dir: Path, out: Path, dtype: str | None) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        from tunekit.core.hardware import DTYPES
        from tunekit.models.loader import saved_with_score_head
        from tunekit.runs import layout

        auto = AutoModelForSequenceClassification if saved_with_score_head(model_dir) else AutoModelForCausalLM
        model = auto.from_pretrained(str(model_dir), dtype=DTYPES[dtype] if dtype else "auto")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        saved = str(model.dtype).removeprefix("torch.")
        with outputs.atomic_dir(out) as tmp:
            model.save_pretrained(tmp, max_shard_size="2GB")
            tokenizer.save_pretrained(tmp)
            if source.recipe is not None:  # a full fine-tuning run or a merged model: `tunekit eval OUT` works
                shutil.copy(source.path / layout.RECIPE_FILE, tmp / layout.RECIPE_FILE)
                marker = source.path / layout.MERGED_MARKER
                facts = read_json(marker, layout.MERGED_FIX) if marker.is_file() else {
                    "source_run": str(source.path.resolve()), "base_model": source.facts.base_model, "adapter": "none"}
                outputs.write_json(tmp / layout.MERGED_MARKER,
                                   {**facts, "dtype": saved, "exported_from": str(model_dir)})
            (tmp / "README.md").write_text(model_card(source, model_dir, saved), encoding="utf-8")


def model_card(source: Source, model_dir: Path, dtype: str) -> str:
    """The card of a model saved as it is: the source's own card where it has one (a merged model's), a full
    fine-tuning run's card from the run, else what is known of it (export.card)."""
    from tunekit.export import card

    own = model_dir / "README.md"
    if own.is_file():
        return own.read_text(encoding="utf-8")
    facts, weights = source.facts, f"{dtype}, safetensors"
    if source.kind == "run":
        return card.render(card.from_run(source.path, "merged", weights=weights, license=facts.license))
    notes = [f"Fine-tuning: `{json.dumps(facts.finetune, sort_keys=True)}`"] if facts.finetune else []
    return card.render(card.Card(name=facts.name, what="merged", base_model=facts.base_model, title=facts.name,
                                 base_model_id=card.hub_id(facts.base_model), recipe=source.recipe,
                                 license=facts.license, weights=weights, notes=notes))


FORMATS: dict[str, ExportFormat] = {f.name: f for f in (Gguf(), Safetensors())}


def pushable() -> dict[str, ExportFormat]:
    """The formats `tunekit push --what` uploads, beside a run's adapter and merged weights (export.push)."""
    return {name: fmt for name, fmt in FORMATS.items() if fmt.suffix}


def whats() -> tuple[str, ...]:
    """`tunekit push --what`'s choices."""
    return ("adapter", "merged", *pushable())


def register(fmt: ExportFormat) -> ExportFormat:
    """Add an export format (a plugin's register_exports(): tunekit.config.plugins)."""
    if fmt.name in FORMATS:
        raise ValueError(f"export format {fmt.name!r} is registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


plugins.run("register_exports")  # installed plugins' export formats


def all_options() -> dict[str, Option]:
    """Every option any format takes, by keyword (the CLI adds one flag each)."""
    return {o.key: o for f in FORMATS.values() for o in f.options}


def resolve_options(format_name: str, given: dict[str, str | None]) -> tuple[ExportFormat, dict]:
    """The format and its options (keyword -> value) with defaults filled. A value given for an option the
    format does not take is a one-line error; `given` holds every format's keywords, None where not given."""
    if format_name not in FORMATS:
        raise TunekitError(f"--format {format_name}: choose one of {', '.join(FORMATS)}")
    fmt = FORMATS[format_name]
    takes = {o.key: o for o in fmt.options}
    wrong = [all_options()[k].flag for k, v in given.items() if v is not None and k not in takes]
    if wrong:
        it_takes = ", ".join(o.flag for o in fmt.options) or "no options"
        raise TunekitError(f"export --format {fmt.name} does not take {', '.join(wrong)} (it takes {it_takes})")
    for key, option in takes.items():
        if given.get(key) is not None and given[key] not in option.choices:
            raise TunekitError(f"{option.flag} {given[key]}: choose one of {', '.join(option.choices)}")
    return fmt, {k: given[k] if given.get(k) is not None else o.default for k, o in takes.items()}
