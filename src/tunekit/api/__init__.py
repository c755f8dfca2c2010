"""tunekit as a library: one function per command, each taking a recipe (a YAML file's path, a dict of sections or
a loaded Recipe) and overrides (`--set` lines or a dict of dotted keys), returning a dataclass and raising
tunekit.core.errors.TunekitError for anything the command would refuse. The command line (tunekit.cli.main) is
argv -> one of these -> printing. docs/python-api.md shows them.

`import tunekit` gives them at the top (tunekit.train, tunekit.evaluate, ...), but `plan`, `data` and `export`
are also the names of tunekit's subpackages, so at the top they are `tunekit.make_plan`,
`tunekit.preview_data` and `tunekit.export_model`; here they keep the commands' names."""

from __future__ import annotations

from tunekit.api.artifacts import Pushed, Written, export, merge, push
from tunekit.api.benchmarking import Benchmarks, benchmark
from tunekit.api.pipeline import Evaluation, Evaluations, TrainingRun, Validated, evaluate, train, validate
from tunekit.api.previews import DataPreview, PlanResult, data, plan
from tunekit.api.recipeargs import load as load_recipe

__all__ = ["Benchmarks", "DataPreview", "Evaluation", "Evaluations", "PlanResult", "Pushed", "TrainingRun",
           "Validated", "Written", "benchmark", "data", "evaluate", "export", "load_recipe", "merge", "plan", "push",
           "train", "validate"]
