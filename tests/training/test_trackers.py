"""training.report_to: what TensorBoard, MLflow (a local file: store) and W&B (offline) received, read back
from what they wrote; a tracker that is not installed is one line before training."""

from __future__ import annotations

import json
import struct

import pytest

from conftest import history, reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.core.errors import TunekitError
from tunekit.training import runner

STEPS, EVERY = 4, 2


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_model):
    """One run logged to all three, with an eval section (generation metrics at every evaluation)."""
    for name in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(name, reason=f"{name} is a test dependency: pip install -e '.[test]'")
    tmp_path = tmp_path_factory.mktemp("trackers")
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    raw = tiny_recipe(tiny_model, data, tmp_path / "tracked", training={
        "max_steps": STEPS, "eval_steps": EVERY, "report_to": ["tensorboard", "mlflow", "wandb"]},
        eval={"limit": 4, "batch_size": 2, "max_new_tokens": 4})
    raw["data"]["eval"] = str(data)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(tmp_path))
        env.setenv("WANDB_SILENT", "true")
        env.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database; the issue asks for file:
        runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    return tmp_path, history(tmp_path / "tracked")


def logged(history, key):
    return {r["step"]: r[key] for r in history if key in r}


@pytest.mark.slow
def test_tensorboard_event_files_hold_the_metrics_and_the_recipe(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp_path, history = tracked_run
    events = EventAccumulator(str(tmp_path / "tracked" / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert scalars["train/loss"] == pytest.approx(logged(history, "loss"), rel=1e-6)
    assert scalars["eval/loss"] == pytest.approx(logged(history, "eval_loss"), rel=1e-6)
    assert set(scalars["eval/chrf"]) == {EVERY, STEPS}
    assert scalars["eval/chrf"] == pytest.approx(logged(history, "eval_chrf"), rel=1e-6)
    assert "train/learning_rate" in scalars and "train/grad_norm" in scalars
    (recipe_text,) = [e for e in events.Tensors("recipe/text_summary")]
    text = recipe_text.tensor_proto.string_val[0].decode()
    assert json.loads(text)["training"]["report_to"] == ["tensorboard", "mlflow", "wandb"]


@pytest.mark.slow
def test_mlflow_file_store_holds_the_run_name_metrics_and_recipe(tracked_run):
    from mlflow.tracking import MlflowClient

    tmp_path, history = tracked_run
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_name == "tracked"
    for ours, theirs in (("loss", "loss"), ("eval_loss", "eval_loss"), ("eval_bleu", "eval_bleu")):
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, theirs)}
        assert got == pytest.approx(logged(history, ours), rel=1e-6), ours
    assert run.data.params["recipe.training.max_steps"] == str(STEPS)
    assert run.data.params["recipe.output_dir"].endswith("tracked")


def wandb_records(path):
    """The records of an offline W&B run file: LevelDB's log format (32 KiB blocks, each record split into
    fragments with a 7-byte header: crc32, length, type FULL=1/FIRST/MIDDLE/LAST=4) after a 7-byte file
    header. wandb 0.31 ships no reader of its own."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, block, fragment = path.read_bytes(), 7, 32768, b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        fragment += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(fragment)
            fragment = b""
            yield record


@pytest.mark.slow
def test_wandb_offline_run_holds_the_config_and_the_metrics(tracked_run):
    tmp_path, history = tracked_run
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    (run,) = [r.run for r in records if r.HasField("run")]
    assert run.display_name == "tracked"
    config = {item.key: json.loads(item.value_json)
              for r in records if r.HasField("config") for item in r.config.update}
    assert config["recipe"]["training"]["max_steps"] == STEPS
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.HasField("history")]
    step = {key: {row["train/global_step"]: row[key] for row in rows if key in row}
            for key in ("train/loss", "eval/loss")}
    assert step["train/loss"] == pytest.approx(logged(history, "loss"), rel=1e-6)
    assert step["eval/loss"] == pytest.approx(logged(history, "eval_loss"), rel=1e-6)
    assert any(r.HasField("exit") for r in records)  # the run was closed


def test_a_tracker_that_is_not_installed_is_one_line_before_training(tmp_path, tiny_model, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(4))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"report_to": ["trackio"]})
    with pytest.raises(TunekitError, match=r"training.report_to: trackio is not installed; "
                                           r"pip install 'tunekit\[trackio\]'"):
        runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    assert not (tmp_path / "run").exists()


def test_an_unknown_tracker_is_a_recipe_error(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(4))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"report_to": ["tensorbord"]})
    res = run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "training.report_to" in res.stderr and "tensorboard" in res.stderr
