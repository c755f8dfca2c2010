"""tunekit: fine-tune causal language models from one YAML recipe.

The commands as Python functions (tunekit.api, imported on first use so that `import tunekit` stays light):
tunekit.train, tunekit.evaluate, tunekit.benchmark, tunekit.merge, tunekit.push, tunekit.validate; and, since
tunekit.plan, tunekit.data and tunekit.export are subpackages, tunekit.make_plan, tunekit.preview_data and
tunekit.export_model (tunekit.api.plan, .data and .export under the commands' own names)."""

from tunekit.core.version import VERSION as __version__  # noqa: E402

# name here -> name in tunekit.api
API = {"train": "train", "evaluate": "evaluate", "benchmark": "benchmark", "merge": "merge", "push": "push",
       "validate": "validate",
       "make_plan": "plan", "preview_data": "data", "export_model": "export", "load_recipe": "load_recipe",
       "TunekitError": None}

__all__ = ["__version__", *API]


def __getattr__(name: str):
    if name not in API:
        raise AttributeError(f"module 'tunekit' has no attribute {name!r}")
    if name == "TunekitError":
        from tunekit.core.errors import TunekitError

        return TunekitError
    from tunekit import api

    value = getattr(api, API[name])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(API))
