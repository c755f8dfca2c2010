"""What third-party output tunekit hides, in one place, each with the reason it needs no action.

A run shows tunekit's own lines, its progress bars (core.console) and every warning that asks something
of the user; the messages and bars below are dropped unless `--verbose` is given. Each message is matched
by the logger or warning category that emits it and a pattern on its text, so a new or changed message of
the same library is still shown; each bar by its exact title. Where progress is shown as lines (no
terminal), the libraries draw no bars at all: theirs are redrawn in place with carriage returns."""

from __future__ import annotations

import builtins
import importlib.abc
import logging
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from tunekit.core import console


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
    Hidden("lm_eval.models.huggingface", r"`pretrained` model kwarg is not of type `str`|Passed an already-"
           r"initialized model through `pretrained`",
           "lm-eval's note that it was handed a loaded model, which is how tunekit scores benchmarks (its adapter, "
           "quantization and device as the run has them; evaluation.benchmarks), in one process"),
)


@dataclass(frozen=True)
class HiddenBar:
    title: str  # the `desc` transformers gives its bar (transformers.utils.logging.tqdm)
    reason: str


HIDDEN_BARS = (
    HiddenBar("Loading weights", "transformers 5 draws it at every model load (training, merge, eval, export); it "
                                 "counts tensors, and tunekit's own lines name the model in use"),
    HiddenBar("Writing model shards", "drawn at every save of a full model (full fine-tuning, merge, export); "
                                      "tunekit's own line names the directory written"),
)


class _Drop(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.regex = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.regex.search(record.getMessage())


def install(verbose: bool = False) -> None:
    """Hide the messages in HIDDEN and the bars in HIDDEN_BARS (all libraries' bars where progress is
    shown as lines) for this process; a no-op with `verbose`. Filters are set on the loggers by name, so
    they hold for libraries imported later."""
    if verbose:
        return
    _hide_bars(console.mode() == "lines")
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


def _hide_bars(every: bool) -> None:
    """transformers' bars in HIDDEN_BARS; with `every`, all bars of transformers, the Hub client and datasets.
    Done when each library is imported (at once if it already is), so that commands that never load it
    do not pay for importing it."""
    def transformers_bars(module) -> None:
        if every:
            module.disable_progress_bar()
            return
        titles = {b.title for b in HIDDEN_BARS}

        def hook(factory, args, kwargs):
            return (module.EmptyTqdm if kwargs.get("desc") in titles else factory)(*args, **kwargs)

        module.set_tqdm_hook(hook)

    after_import("transformers.utils.logging", transformers_bars)
    if every:
        after_import("huggingface_hub.utils", lambda module: module.disable_progress_bars())
        after_import("datasets", lambda module: module.disable_progress_bars())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs actions right after a module's first import (installed once, at the front of sys.meta_path)."""

    def __init__(self):
        self.actions: dict[str, Callable] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.actions:
            return None
        finders = (f for f in sys.meta_path if f is not self and hasattr(f, "find_spec"))
        spec = next((s for s in (f.find_spec(fullname, path, target) for f in finders) if s is not None), None)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            action = self.actions.pop(fullname, None)  # a spec may be looked up without being loaded
            if action is not None:
                action(module)

        spec.loader.exec_module = exec_module
        return spec


_after = _AfterImport()


def after_import(name: str, action: Callable) -> None:
    """`action(module)` once `name` is imported: now if it is, else right after its first import."""
    if name in sys.modules:
        action(sys.modules[name])
        return
    _after.actions[name] = action
    if _after not in sys.meta_path:
        sys.meta_path.insert(0, _after)
