"""training.ray: the recipe as a Ray Train job. In-process: the section's rules, the resource arithmetic, the
reports' metrics, the world size plan and validate take from it, and what is refused before a cluster starts.
On a local Ray cluster (2 CPU workers, gloo; each starts its own cluster, two in `make test`): a run equals
torchrun's 2 processes and a request the cluster cannot meet is refused in one line at once; in `make test-full`
ZeRO-3 and FSDP2 recipes under Ray equal torchrun, a killed worker is restarted and resumes from the last checkpoint
to the same adapter, and a busy cluster is refused after training.ray.start_timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import (
    ROOT,
    launch,
    logged,
    refused_in_process,
    reverse_rows,
    start_cli,
    tiny_recipe,
    write_jsonl,
    write_recipe,
)
from tunekit import api
from tunekit.config import recipefile
from tunekit.core import outputs
from tunekit.core.errors import TunekitError
from tunekit.runs import layout
from tunekit.training import raylaunch, rayreport

# the controller polls its workers every 2 s by default, and each report waits for a poll: 0.1 s keeps a test short
RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "RAY_AUTH_MODE": "disabled"}
RUN = ["training.max_steps=6", "training.save_steps=2", "training.save_total_limit=10"]


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("ray")
    data = write_jsonl(root / "train.jsonl", reverse_rows(32))
    return write_recipe(root / "r.yaml", tiny_recipe(tiny_model, data, root / "unused"))


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


# ------------------------------------------------------------------ in process: no cluster


@pytest.mark.parametrize("ray, message", [
    ({}, "training.ray.workers"),
    ({"workers": 2, "resources_per_worker": {"GPU": 2}}, "drives one GPU"),
    ({"workers": 2, "resources_per_worker": {"CPU": 0}}, "every amount is 0"),
    ({"workers": 2, "address": "ray://head:10001"}, "ray job submit"),
    ({"workers": 2, "storage": "s3://bucket/runs"}, "mount the bucket"),
])
def test_bad_ray_sections_are_refused_naming_the_key(recipe_file, tmp_path, ray, message):
    raw = yaml.safe_load(recipe_file.read_text())
    raw["training"]["ray"] = ray
    with pytest.raises(TunekitError, match=message) as e:
        recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    assert "training.ray" in str(e.value)


def test_worker_slots_count_whole_workers_per_node():
    nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 3.0, "GPU": 4.0}]
    assert raylaunch.worker_slots(nodes, {"CPU": 1, "GPU": 1}) == 5  # 2 on the first node, 3 (CPU-bound) on the next
    assert raylaunch.worker_slots(nodes, {"CPU": 4}) == 2
    assert raylaunch.worker_slots(nodes, {"CPU": 1, "TPU": 1}) == 0
    raylaunch.check_fits(5, {"CPU": 1, "GPU": 1}, nodes)
    with pytest.raises(TunekitError, match=r"6 workers x \{CPU: 1, GPU: 1\} do not fit the Ray cluster \(2 nodes, "
                       r"\{CPU: 11, GPU: 6\} in all: room for 5\)"):
        raylaunch.check_fits(6, {"CPU": 1, "GPU": 1}, nodes)


def test_default_resources_take_a_gpu_where_the_cluster_has_them(recipe_file, tmp_path):
    ray_cfg = recipefile.load(recipe_file, ["training.ray.workers=2"]).training.ray
    assert raylaunch.per_worker(ray_cfg, {"CPU": 16.0, "GPU": 4.0}) == {"CPU": 1.0, "GPU": 1.0}
    assert raylaunch.per_worker(ray_cfg, {"CPU": 16.0}) == {"CPU": 1.0}
    given = recipefile.load(recipe_file, ["training.ray.workers=2", "training.ray.resources_per_worker={CPU: 4, "
                                          "GPU: 0}"]).training.ray
    assert raylaunch.per_worker(given, {"CPU": 16.0, "GPU": 4.0}) == {"CPU": 4.0}


def test_the_run_directory_moves_under_storage(recipe_file, tmp_path):
    cfg = recipefile.load(recipe_file, ["training.ray.workers=2", f"training.ray.storage={tmp_path}/shared"])
    assert raylaunch.run_dir_of(cfg.output_dir, cfg.training.ray) == tmp_path / "shared" / "unused"


def test_reported_metrics_are_the_latest_of_each_logged_number():
    history = [{"loss": 3.0, "learning_rate": 0.1, "step": 1}, {"eval_loss": 2.5, "step": 2},
               {"loss": 2.0, "grad_norm": 0.5, "note": "text", "step": 2}]
    assert rayreport.metrics_of(history, 2) == {"loss": 2.0, "learning_rate": 0.1, "eval_loss": 2.5,
                                                "grad_norm": 0.5, "step": 2}


def test_a_new_start_keeps_rays_files_in_the_run_directory(tmp_path):
    """Ray's storage marker and checkpoint list stay when a restarted worker starts the run again (--force)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in (".validate_storage_marker", "checkpoint_manager_snapshot.json", "run.json"):
        (run / name).write_text("x")
    with pytest.raises(TunekitError, match="already exists"):
        outputs.check_free(run, False, "output_dir", raylaunch.RAY_FILES)
    outputs.claim(run, True, "output_dir", raylaunch.RAY_FILES)
    assert sorted(p.name for p in run.iterdir()) == [".validate_storage_marker", "checkpoint_manager_snapshot.json"]
    outputs.check_free(run, False, "output_dir", raylaunch.RAY_FILES)  # only Ray's files: free
    raylaunch.forget(run)  # the driver's: an earlier run's checkpoint list is not restored
    assert not any(run.iterdir())


def test_plan_and_validate_take_the_workers_as_the_world_size(recipe_file):
    ray2 = ["training.ray.workers=2", "training.deepspeed=ds_configs/zero2.json"]
    validated = api.validate(recipe_file, ray2)
    assert validated.world_size == 2 and validated.deepspeed["train_batch_size"] == 2 * 8
    assert api.plan(recipe_file, ray2).plan.settings.world_size == 2
    with pytest.raises(TunekitError, match="--world-size 3 contradicts training.ray.workers 2"):
        api.validate(recipe_file, ray2, world_size=3)


def test_ray_runs_are_refused_under_another_launcher(recipe_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = refused_in_process(["train", str(recipe_file), *sets("training.ray.workers=2",
                                                                f"output_dir={tmp_path}/run")], tmp_path, capsys,
                              monkeypatch)
    assert "training.ray starts its own workers" in line


def test_an_address_nothing_answers_is_refused_at_once(recipe_file, tmp_path, monkeypatch, capsys):
    """ray.init would retry it for minutes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    line = refused_in_process(["train", str(recipe_file), *sets("training.ray.workers=2", f"output_dir={tmp_path}/run",
                                                                f"training.ray.address=127.0.0.1:{port}")],
                              tmp_path, capsys, monkeypatch)
    assert f"training.ray.address 127.0.0.1:{port}: nothing answers there" in line


def test_missing_ray_is_refused_in_one_line(recipe_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    line = refused_in_process(["train", str(recipe_file), *sets("training.ray.workers=2",
                                                                f"output_dir={tmp_path}/run")], tmp_path, capsys,
                              monkeypatch)
    assert "pip install 'tunekit[ray]'" in line


# ------------------------------------------------------------------ on a local Ray cluster

def ray_train(recipe_file, out, *pairs: str, timeout: int = 300):
    """`tunekit train` of the recipe as a 2-worker Ray job (its own local cluster); must exit 0: its stderr."""
    proc = start_cli("train", str(recipe_file), *sets(f"output_dir={out}", "training.ray.workers=2", *RUN, *pairs),
                     env=RAY_ENV)
    stdout, stderr = proc.communicate(timeout)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-6000:]
    return stderr


@pytest.fixture(scope="module")
def on_ray(recipe_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("on-ray") / "run"
    return out, ray_train(recipe_file, out)


@pytest.fixture(scope="module")
def torchrun(recipe_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun") / "run"
    launch(recipe_file, out, 2, *RUN)
    return out


def assert_same_run(a, b):
    """As the other multi-process tests: losses to relative 1e-4, adapters within a tenth of an Adam step."""
    assert logged(a, "loss") == pytest.approx(logged(b, "loss"), rel=1e-4)
    wa = load_file(str(a / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(b / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=5e-4)


@pytest.mark.slow
def test_a_ray_run_equals_torchrun_with_two_processes(on_ray, torchrun):
    out, stderr = on_ray
    assert "ray: 2 workers x {CPU: 1}" in stderr
    assert "world size 2 x micro-batch 8 x accumulation 1 = 16 examples per optimizer step" in stderr
    assert layout.RunRecord.load(out).world_size == 2
    assert_same_run(out, torchrun)


@pytest.mark.slow
@pytest.mark.full  # make test-full: tests/ray-full-last-run.json
@pytest.mark.parametrize("sharding, said", [("training.deepspeed=ds_configs/zero3.json", "ZeRO stage 3"),
                                            ("training.fsdp={}", "fsdp: 5 units sharded over 2 processes")])
def test_ray_workers_shard_as_the_recipe_says(recipe_file, torchrun, tmp_path, sharding, said):
    out = tmp_path / "run"
    assert said in ray_train(recipe_file, out, sharding.replace("ds_configs", str(ROOT / "ds_configs")))
    assert_same_run(out, torchrun)


@pytest.mark.slow
def test_the_run_directory_is_whole_and_ray_reports_its_checkpoints_in_place(on_ray):
    out, _ = on_ray
    record = layout.RunRecord.load(out)
    assert record.status == "completed" and record.global_step == 6
    for name in ("recipe.yaml", "loss_history.jsonl", "report.html", "adapter/adapter_model.safetensors"):
        assert (out / name).is_file(), name
    snapshot = json.loads((out / "checkpoint_manager_snapshot.json").read_text())
    reported = [r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]]
    assert reported == [f"checkpoints/checkpoint-{s}" for s in (2, 4, 6)]  # tunekit's, registered where they lie
    for result in snapshot["checkpoint_results"]:
        assert (out / result["checkpoint_dir_name"] / "tunekit-complete").is_file()
    assert [r["metrics"]["step"] for r in snapshot["checkpoint_results"]] == [2, 4, 6]
    losses = {row["step"]: row["loss"] for row in map(json.loads, (out / "loss_history.jsonl").open())
              if "loss" in row}
    assert [r["metrics"]["loss"] for r in snapshot["checkpoint_results"]] == [losses[s] for s in (2, 4, 6)]


@pytest.mark.slow
def test_resuming_a_completed_ray_run_is_refused_before_a_cluster_starts(recipe_file, on_ray, tmp_path, monkeypatch,
                                                                          capsys):
    out, _ = on_ray
    line = refused_in_process(["train", str(recipe_file), *sets(f"output_dir={out}", "training.ray.workers=2", *RUN),
                               "--resume"], tmp_path, capsys, monkeypatch)
    assert "already completed; nothing to resume" in line


def ray_workers() -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
@pytest.mark.full  # make test-full: tests/moved2-full-last-run.json
def test_a_killed_worker_is_restarted_and_resumes_to_the_uninterrupted_adapter(recipe_file, on_ray, tmp_path):
    out = tmp_path / "run"
    # Ray's queue holds one report, the next waits for the controller's poll: 0.5 s slows the steps after
    # checkpoint-2 (each checkpoint and the end report) so that the kill lands while training runs
    proc = start_cli("train", str(recipe_file), *sets(f"output_dir={out}", "training.ray.workers=2",
                                                      "training.ray.max_failures=1", *RUN),
                     env={**RAY_ENV, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"})
    deadline = time.time() + 240
    while not (out / "checkpoints" / "checkpoint-2" / "tunekit-complete").exists():
        assert proc.poll() is None and time.time() < deadline, "training ended before the kill point"
        time.sleep(0.01)
    workers = ray_workers()
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)
    stdout, stderr = proc.communicate(240)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-6000:]
    assert "resuming from checkpoint-" in stderr
    assert layout.RunRecord.load(out).global_step == 6
    uninterrupted = on_ray[0]
    assert logged(out, "loss") == logged(uninterrupted, "loss")
    a = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(uninterrupted / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_a_request_the_cluster_cannot_meet_is_refused_at_once(recipe_file, tmp_path):
    """...before anything is removed: the earlier run --force would replace is still there."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    proc = start_cli("train", str(recipe_file), *sets(f"output_dir={tmp_path}/run", "training.ray.workers=3",
                                                      "training.ray.resources_per_worker={CPU: 1}"), "--force",
                     env=RAY_ENV)
    stdout, stderr = proc.communicate(120)
    assert proc.returncode == 2
    errors = [line for line in stderr.splitlines() if line.startswith("tunekit: error:")]
    assert "Traceback" not in stderr and len(errors) == 1, stderr[-3000:]
    assert re.search(r"training.ray: 3 workers x \{CPU: 1\} do not fit the Ray cluster \(1 node, \{CPU: 2\} in all: "
                     r"room for 2\); lower training.ray.workers", errors[0]), errors[0]
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["run.json"]


@pytest.mark.slow
@pytest.mark.full  # make test-full: tests/ray-full-last-run.json
def test_a_busy_cluster_is_refused_after_the_start_timeout(recipe_file, tmp_path):
    """The CPUs exist but another job holds them: refused after training.ray.start_timeout, not waited on for ever."""
    import ray

    ray.init(num_cpus=2, object_store_memory=200_000_000, include_dashboard=False)
    try:
        @ray.remote(num_cpus=2)
        class Holder:
            def ready(self):
                return True

        holder = Holder.remote()
        ray.get(holder.ready.remote())
        started = time.time()
        with pytest.raises(TunekitError, match=r"did not give 1 workers x \{CPU: 1\} within 3 s, at the start or after "
                           r"a restart \(free now: \{CPU: 0\}\).*raise training.ray.start_timeout"):
            api.train(recipe_file, [f"output_dir={tmp_path}/run", "training.ray.workers=1",
                                    "training.ray.start_timeout=3"])
        assert time.time() - started < 60
    finally:
        ray.shutdown()
