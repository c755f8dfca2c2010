"""merge, export, push: a trained run turned into deployable weights, a GGUF file or safetensors directory, and
an upload to the Hugging Face Hub. Each checks what it reads before torch is imported."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tunekit.api import arguments
from tunekit.api.pipeline import _files
from tunekit.core import console


@dataclass
class Written:
    """An output: a directory (merge, export --format safetensors) or a file (a GGUF file, with its Ollama
    Modelfile beside it)."""

    out: Path

    @property
    def files(self) -> list[Path]:
        found = _files(self.out)
        modelfile = self.out.with_name(f"{self.out.stem}.Modelfile")
        return found + ([modelfile] if self.out.is_file() and modelfile.is_file() else [])


MERGE_DTYPES = ("bf16", "fp16", "fp32")


def merge(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, dtype: str | None = None,
          force: bool = False, tolerance: float = 1e-3) -> Written:
    """Merge a LoRA run's adapter into its base model and save it (default RUN_DIR/merged), after checking that
    the merged model's logits match the adapter's within `tolerance`. `dtype`: bf16, fp16 or fp32 (default: the
    base model's)."""
    arguments.path("run_dir", run_dir)
    arguments.path("out", out, optional=True)
    arguments.choice("dtype", dtype, MERGE_DTYPES, optional=True)
    arguments.flag("force", force)
    arguments.number("tolerance", tolerance)
    console.attach(when_unconfigured=True)  # progress and log lines in a notebook or script
    from tunekit.config.recipefile import load
    from tunekit.data import precheck
    from tunekit.runs.layout import RECIPE_FILE, adapter_run

    run, _ = adapter_run(Path(run_dir))  # the run and its base model, before torch
    precheck.check_model(load(run / RECIPE_FILE).model)
    from tunekit.export import merge as merging

    return Written(Path(merging.merge(run, Path(out) if out else None, dtype, force, tolerance)))


def export(target: str | os.PathLike, format: str = "gguf", quant: str | None = None, dtype: str | None = None,
           out: str | os.PathLike | None = None, force: bool = False) -> Written:
    """Write a GGUF file checked against its source, with an Ollama Modelfile beside it (`format` gguf, `quant`
    q8_0 by default), or a safetensors directory (`format` safetensors, `dtype`). `target`: a run directory
    (merged on the fly), a merged directory or a base model."""
    arguments.path("target", target)
    arguments.text("format", format)
    arguments.text("quant", quant, optional=True)
    arguments.text("dtype", dtype, optional=True)
    arguments.path("out", out, optional=True)
    arguments.flag("force", force)
    from tunekit.export.writers import resolve_options

    resolve_options(format, {"quant": quant, "dtype": dtype})  # the format and its options, before the target
    console.attach(when_unconfigured=True)  # progress and log lines in a notebook or script
    from tunekit.export import source

    source.check_first(str(target))  # before torch
    from tunekit.export import exporting

    return Written(Path(exporting.export(str(target), quant, Path(out) if out else None, force, format, dtype)))


@dataclass
class Pushed:
    repo: str
    url: str  # the repo's address


def push(target: str | os.PathLike, repo: str, what: str | None = None, private: bool = False,
         revision: str | None = None, force: bool = False, baseline: str | os.PathLike | None = None,
         base_model: str | None = None) -> Pushed:
    """Upload a run's adapter, merged weights or a GGUF file to the Hub repo `repo` as one commit, with a model
    card. `what`: adapter, merged, gguf or another pushable export format (default: what the target is).
    `baseline`: a base-model eval directory, for the card's before/after table. The token comes from HF_TOKEN or
    `huggingface-cli login`."""
    arguments.path("target", target)
    arguments.text("repo", repo)
    from tunekit.export.writers import whats

    arguments.choice("what", what, whats(), optional=True)
    arguments.flag("private", private)
    arguments.text("revision", revision, optional=True)
    arguments.flag("force", force)
    arguments.path("baseline", baseline, optional=True)
    arguments.text("base_model", base_model, optional=True)
    console.attach(when_unconfigured=True)  # progress and log lines in a notebook or script
    from tunekit.export import push as pushing  # imports no torch: a LoRA run is merged only once all is checked

    url = pushing.push(str(target), repo, what, private, revision, force,
                       None if baseline is None else str(baseline), base_model)
    return Pushed(repo, url)
