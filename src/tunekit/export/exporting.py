"""`tunekit export TARGET --format FORMAT`: a run directory (merged first, exactly as `tunekit merge` merges,
parity check included), a merged directory or a base model, written in one of the registered formats
(export.writers.FORMATS): `gguf`, one GGUF file for llama.cpp, Ollama and LM Studio checked against the
model it came from before it is kept (export.gguf, export.readback, export.modelfile); `safetensors`, a directory
AutoModelForCausalLM.from_pretrained loads. The options a format does not take are refused before any
weight loads."""

from __future__ import annotations

from pathlib import Path

from tunekit.export import source as export_source
from tunekit.export.license import license_of
from tunekit.export.writers import resolve_options

# torch, transformers and gguf are imported where they are used: the CLI reads the formats' options


def export(target: str, quant: str | None = None, out: Path | None = None, force: bool = False,
           format: str = "gguf", dtype: str | None = None) -> Path:
    fmt, options = resolve_options(format, {"quant": quant, "dtype": dtype})
    source = export_source.resolve(target)
    source.facts.license = license_of(source.facts.base_model)
    out = Path(out) if out else fmt.default_out(source, options)
    fmt.check(source, out, options, target)
    return fmt.write(source, out, options, force)
