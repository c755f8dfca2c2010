"""The training methods' implementations (`training.method`): one module per method, registered here by name, each
declared in tunekit.config.methods; `tunekit train`, `plan` and `eval` read all of a method from here, so no other
module compares method names. At their top level method modules import only the standard library and tunekit's
config and core; torch, TRL and the rest load inside the functions that run a training. docs/adding-a-method.md
shows how to add one."""

from __future__ import annotations

from tunekit.config import plugins
from tunekit.config.methods import DEFAULT
from tunekit.training.methods.base import METHODS, Method, TrainerInputs, get, names, of, register

# The built-in methods register themselves on import, in the order they are declared (config.methods); a new
# method's module is imported here too.
# isort: off
from tunekit.training.methods import sft, dpo, kto, orpo, reward, grpo, rloo, distill  # noqa: F401
# isort: on

plugins.run("register_methods")  # installed plugins' methods (config.plugins)

__all__ = ["DEFAULT", "METHODS", "Method", "TrainerInputs", "get", "names", "of", "register"]
