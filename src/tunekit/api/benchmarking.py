"""benchmark: standard benchmarks (lm-evaluation-harness) on a run, a merged model or a base model, and with a
second model to compare, before and after (tunekit.evaluation.benchrun)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tunekit.api import arguments
from tunekit.core import console
from tunekit.core.errors import TunekitError


@dataclass
class Benchmarks:
    """benchmarks.json's content (tasks, each model's scores, the comparison table, the settings) and where it is."""

    result: dict
    out: Path

    @property
    def table(self) -> list[dict]:
        return self.result["table"]

    def text(self) -> str:
        from tunekit.evaluation import benchrun

        return benchrun.text(self.result)


def benchmark(target: str | os.PathLike, tasks: str | list[str], compare: str | os.PathLike | None = None,
              out: str | os.PathLike | None = None, num_fewshot: int | None = None, limit: int | None = None,
              seed: int = 0,
              batch_size: int | None = None, dtype: str = "auto", force: bool = False) -> Benchmarks:
    """Score `target` (a run directory, a merged directory or a model: hub id, directory, GGUF) on lm-eval `tasks`
    (names, or paths to local task YAML; a list or one comma-separated string), and with `compare` a second
    model on the same tasks, few-shot count (None: each task's own), limit and seed: `compare="base"` is the
    target's own base (for a LoRA or QLoRA run, its loaded model with the adapter off). `out`: where
    benchmarks.json goes (default TARGET/benchmarks for a run)."""
    from tunekit.api.pipeline import DTYPES

    arguments.path("target", target)
    arguments.path("compare", compare, optional=True)
    arguments.path("out", out, optional=True)
    for name, value in (("limit", limit), ("batch_size", batch_size)):
        arguments.whole(name, value, optional=True)
    arguments.whole("num_fewshot", num_fewshot, least=0, optional=True)
    arguments.whole("seed", seed, least=0)
    if seed >= 2**32:
        raise TunekitError(f"seed: {seed} is beyond lm-eval's seeds (numpy's); give a number below 2**32")
    arguments.choice("dtype", dtype, DTYPES)
    arguments.flag("force", force)
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks)]
    if not names or not all(isinstance(t, str) and t for t in names):
        raise TunekitError(f"--benchmarks {tasks!r}: expected task names or task YAML paths, comma-separated, e.g. "
                           "--benchmarks arc_easy,my_task.yaml")
    console.attach(when_unconfigured=True)
    from tunekit.evaluation import benchmarks, benchrun

    benchmarks.import_lm_eval()  # before anything loads
    scored = benchrun.scorable(str(target))
    base = None
    if compare is not None:
        base = benchrun.own_base(scored) if str(compare) == benchrun.OWN_BASE else benchrun.scorable(str(compare),
                                                                                                    scored)
    where = Path(out) if out is not None else benchrun.default_out(scored)
    settings = benchmarks.Settings(num_fewshot, limit, seed, batch_size)
    result = benchrun.run(scored, names, base, settings, where, dtype, force)
    return Benchmarks(result, where)
