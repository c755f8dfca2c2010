"""Experiment trackers (training.report_to) through the integrations transformers already has.

transformers' callbacks send the Trainer's logs (loss, learning rate, gradient norm, eval loss and the
generation metrics), the run name and the TrainingArguments; `SendRecipe` adds the resolved recipe,
which they do not know about, and closes the runs they leave open. TensorBoard writes into the run directory.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from transformers import TrainerCallback
from transformers.integrations.integration_utils import (
    MLflowCallback,
    TensorBoardCallback,
    TrackioCallback,
    WandbCallback,
)

from tunekit.core.errors import TunekitError

TENSORBOARD_DIR = "tensorboard"

# backend -> (module it needs, transformers' callback)
BACKENDS = {
    "tensorboard": ("tensorboard", TensorBoardCallback),
    "wandb": ("wandb", WandbCallback),
    "mlflow": ("mlflow", MLflowCallback),
    "trackio": ("trackio", TrackioCallback),
}


def check(report_to: list[str]) -> None:
    """A backend that is not installed is one line, before anything is loaded or written."""
    for name in report_to:
        module = BACKENDS[name][0]
        if importlib.util.find_spec(module) is None:
            raise TunekitError(f"training.report_to: {name} is not installed; pip install 'tunekit[{name}]' "
                               f"(or remove {name} from report_to)")


def callbacks(report_to: list[str], run_dir: Path, recipe: dict) -> list[TrainerCallback]:
    """transformers' callback for each backend, then the one that sends the recipe."""
    check(report_to)
    out: list[TrainerCallback] = []
    for name in report_to:
        callback = BACKENDS[name][1]()
        if isinstance(callback, TensorBoardCallback):
            callback.logging_dir = str(run_dir / TENSORBOARD_DIR)
        out.append(callback)
    return out + [SendRecipe(recipe, out)] if out else []


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class SendRecipe(TrainerCallback):
    """Sends the resolved recipe to each tracker once its own callback has started the run: W&B and
    trackio as config["recipe"], MLflow as params recipe.<section>.<key> and a recipe.json artifact,
    TensorBoard as the text "recipe". Closes the W&B and trackio runs at the end of training, which
    transformers leaves open (an offline W&B run writes its summary and config only when closed)."""

    def __init__(self, recipe: dict, trackers: list[TrainerCallback]):
        self.recipe, self.trackers, self.sent = recipe, trackers, False

    def on_train_begin(self, args, state, control, **kwargs):
        if self.sent or not state.is_world_process_zero:
            return
        self.sent = True
        for t in self.trackers:
            if isinstance(t, TensorBoardCallback) and t.tb_writer is not None:
                text = json.dumps(self.recipe, indent=2)
                t.tb_writer.add_text("recipe", "    " + text.replace("\n", "\n    "))  # markdown code block
                t.tb_writer.flush()
            elif isinstance(t, (WandbCallback, TrackioCallback)):
                module = t._wandb if isinstance(t, WandbCallback) else t._trackio
                module.config.update({"recipe": self.recipe}, allow_val_change=True)
            elif isinstance(t, MLflowCallback) and t._ml_flow.active_run() is not None:
                params = {k: json.dumps(v) if isinstance(v, (list, dict)) else v
                          for k, v in flatten(self.recipe, "recipe.").items()}
                items = list(params.items())
                for i in range(0, len(items), t._MAX_PARAMS_TAGS_PER_BATCH):
                    t._ml_flow.log_params(dict(items[i:i + t._MAX_PARAMS_TAGS_PER_BATCH]))
                t._ml_flow.log_dict(self.recipe, "recipe.json")

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        for t in self.trackers:
            if isinstance(t, WandbCallback) and t._wandb.run is not None:
                t._wandb.finish()
            elif isinstance(t, TrackioCallback) and t._initialized:
                t._trackio.finish()
