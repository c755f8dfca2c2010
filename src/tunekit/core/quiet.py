"""What third-party output tunekit hides, in one place, each with the reason it needs no action.

A run shows tunekit's own lines, the progress bars and every warning that asks something of the
user; the messages below are dropped unless `--verbose` is given. Each entry is matched by the
logger or warning category that emits it and a pattern on its text, so a new or changed message of
the same library is still shown."""

from __future__ import annotations

import builtins
import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Hidden:
    source: str  # a logger name, or "warnings:<Category>" for Python warnings
    pattern: str  # regular expression searched in the message
    reason: str


HIDDEN = (
    Hidden("DeepSpeed", r"Setting accelerator to CPU",
           "DeepSpeed's note on machines without a GPU, printed as soon as it is imported (recipes are "
           "checked with its config model); tunekit's own 'precision:' line already says what the run uses"),
    Hidden("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community",
           "an optional faster kernel from the `kernels` package, on CPUs with avx512_bf16; bitsandbytes falls "
           "back to its own, and training turns that inference path off anyway (models.keep_4bit_trainable_on_cpu)"),
    Hidden("warnings:FutureWarning", r"`is_gradient_checkpointing` is deprecated",
           "raised inside transformers and peft (their own calls to a renamed property), not by anything in a "
           "recipe or in tunekit"),
)


class _Drop(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.regex = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.regex.search(record.getMessage())


def install(verbose: bool = False) -> None:
    """Hide the messages in HIDDEN for this process (a no-op with `verbose`). Filters are set on the
    loggers by name, so they hold for libraries imported later."""
    if verbose:
        return
    by_logger: dict[str, list[str]] = {}
    for h in HIDDEN:
        if h.source.startswith("warnings:"):
            category = getattr(builtins, h.source.split(":", 1)[1])
            warnings.filterwarnings("ignore", message=f".*{h.pattern}", category=category)
        else:
            by_logger.setdefault(h.source, []).append(h.pattern)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(patterns))
