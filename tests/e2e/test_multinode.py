"""Two nodes simulated on one host: one process per node, a c10d rendezvous on 127.0.0.1. ZeRO-3 (torchrun) and
FSDP2 (the shipped SLURM batch script, and accelerate launch) train as one node with two processes does; a run
whose second node is killed stops in bounded time and resumes; launch failures are one line each.

On one host both nodes could serve the rendezvous, so node 0 is started first and node 1 once node 0 listens
(on a cluster the rendezvous host is the first node by its address)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_multiprocess import assert_same_run

from conftest import ROOT, in_full, launch, logged, reverse_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit.runs.layout import RunRecord

pytestmark = pytest.mark.slow

SAVE = ["training.save_steps=2", "training.save_total_limit=10"]
SHARDING = {"zero3": "training.deepspeed=ds_configs/zero3.json", "fsdp2": "training.fsdp={}"}


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("mn")
    data = write_jsonl(root / "train.jsonl", reverse_rows(32))
    return write_recipe(root / "r.yaml", tiny_recipe(tiny_model, data, root / "unused", training={"max_steps": 6}))


class OneNode(dict):
    """The one-node, two-process run each two-node run is compared with, by sharding; each run once, when first
    asked for."""

    def __init__(self, recipe_file, tmp_path_factory):
        super().__init__()
        self.recipe_file, self.tmp = recipe_file, tmp_path_factory

    def __missing__(self, sharding: str) -> Path:
        run = self[sharding] = self.tmp.mktemp(f"one-{sharding}") / "run"
        launch(self.recipe_file, run, 2, SHARDING[sharding], *SAVE)
        return run


@pytest.fixture(scope="module")
def one_node(recipe_file, tmp_path_factory):
    return OneNode(recipe_file, tmp_path_factory)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, procs, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert all(p.poll() is None for p in procs), "node 0 ended before it served the rendezvous"
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port}")


def sets(out: Path, overrides) -> list[str]:
    return [a for o in (f"output_dir={out}", *overrides) for a in ("--set", o)]


def node_command(launcher: str, rank: int, port: int, recipe: Path, out: Path, overrides, flags=()) -> list[str]:
    """Node `rank`'s command, as docs/multi-gpu.md's "Several nodes" writes it."""
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job", "--rdzv-conf", "join_timeout=60"]
    train = ["train", str(recipe), *sets(out, overrides), *flags]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *rdzv, "-m", "tunekit", *train]
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "ds_configs/accelerate/fsdp2.yaml",
                "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip",
                "127.0.0.1", "--main_process_port", str(port), "--rdzv_backend", "c10d", "-m", "tunekit", *train]
    return [sys.executable, "-m", "tunekit", "launch", *rdzv, *train]


def start_nodes(commands: list[list[str]], port: int, env=None) -> list[subprocess.Popen]:
    """Each node in its own session (so that killing one kills its launcher and its worker), its output in a
    file (a pipe nobody reads would stall it)."""
    procs = []
    for i, cmd in enumerate(commands):
        node_env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **((env or {}).get(i, {}))}
        log = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=node_env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        proc.log = log
        procs.append(proc)
        if i == 0:
            wait_listening(port, procs)
    return procs


def output(proc) -> str:
    proc.log.seek(0)
    return proc.log.read()


def finish(procs, timeout: float = 600) -> list[tuple[int, str]]:
    return [(p.wait(timeout), output(p)) for p in procs]


def two_nodes(launcher, recipe, out, overrides, flags=(), env=None) -> list[tuple[int, str]]:
    port = free_port()
    return finish(start_nodes([node_command(launcher, r, port, recipe, out, overrides, flags) for r in (0, 1)],
                              port, env))


# make test runs the launch failures; the two-node training runs are in make test-full (their last run is
# recorded in tests/multinode-full-last-run.json)
@pytest.mark.full
@pytest.mark.parametrize("sharding, launcher", [("zero3", "torchrun"), ("fsdp2", "accelerate")])
def test_two_nodes_train_as_one_node_with_two_processes(recipe_file, one_node, tmp_path, sharding, launcher):
    out = tmp_path / "run"
    results = two_nodes(launcher, recipe_file, out, [SHARDING[sharding], *SAVE])
    assert all(code == 0 for code, _ in results), [err[-3000:] for _, err in results]
    assert RunRecord.load(out).world_size == 2
    assert_same_run(one_node[sharding], out)


SLURM = """#!/bin/bash
# srun for one host: runs the task once per node with SLURM_NODEID set, node 0 first
set -u
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i "$@" &
  pids[$i]=$!
  if [ "$i" = 0 ]; then
    until (exec 3<>/dev/tcp/127.0.0.1/$TUNEKIT_PORT) 2>/dev/null; do sleep 0.1; done
  fi
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.full
def test_the_slurm_batch_script_trains_fsdp2_on_two_nodes(recipe_file, one_node, tmp_path):
    """ds_configs/slurm/multinode.sbatch as shipped, with srun and scontrol standing in for SLURM's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SLURM.replace("#!/bin/bash\n", "#!/bin/bash\n[ \"$1\" = --kill-on-bad-exit=1 ] "
                                                                  "&& shift\n", 1))
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    port, out = free_port(), tmp_path / "run"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_GPUS_ON_NODE": "1", "TUNEKIT_PORT": str(port),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run(["bash", "ds_configs/slurm/multinode.sbatch", str(recipe_file), *sets(out, [SHARDING["fsdp2"],
                                                                                                      *SAVE])],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "fsdp: FSDP2" in res.stderr and RunRecord.load(out).world_size == 2
    assert_same_run(one_node["fsdp2"], out)


@pytest.mark.full
def test_a_killed_node_stops_the_other_in_bounded_time_and_the_run_resumes(recipe_file, one_node, tmp_path):
    """Node 1 (its launcher and its worker, as a lost machine would be) is killed right after checkpoint-2; node 0
    stops within a minute with one line saying what happened; relaunching both nodes with --resume ends where one node's
    uninterrupted run ends."""
    out, port = tmp_path / "run", free_port()
    overrides = [SHARDING["fsdp2"], *SAVE]
    procs = start_nodes([node_command("tunekit", r, port, recipe_file, out, overrides) for r in (0, 1)], port)
    marker = out / "checkpoints" / "checkpoint-2" / "tunekit-complete"
    deadline = time.time() + 300
    while not marker.exists():
        assert all(p.poll() is None for p in procs) and time.time() < deadline, "no checkpoint-2 to kill after"
        time.sleep(0.01)
    for pid in [*descendants(procs[1].pid), procs[1].pid]:  # the node's worker (its own session) and launcher
        os.kill(pid, signal.SIGKILL)
    killed = time.time()
    code, stderr = procs[0].wait(120), output(procs[0])
    assert time.time() - killed < 60
    procs[1].wait()
    assert code != 0
    assert "lost contact with another process at step" in stderr and "relaunch every node with --resume" in stderr
    assert "rank 0 on this node" in stderr and "Traceback" not in stderr
    assert not (out / "adapter").exists() and RunRecord.load(out).status == "failed"

    results = two_nodes("tunekit", recipe_file, out, overrides, flags=["--resume"])
    assert all(code == 0 for code, _ in results), [err[-3000:] for _, err in results]
    assert "resuming from checkpoint-" in results[0][1]
    assert logged(out, "loss") == pytest.approx(logged(one_node["fsdp2"], "loss"), rel=1e-4)
    assert_same_run(one_node["fsdp2"], out)


def descendants(pid: int) -> list[int]:
    """Every process started by `pid`, children first found, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tunekit: error:")]


def test_a_node_that_never_joins_is_one_line(recipe_file, tmp_path):
    port = free_port()
    cmd = node_command("tunekit", 0, port, recipe_file, tmp_path / "run", [])
    cmd[cmd.index("join_timeout=60")] = "join_timeout=5"
    start = time.time()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and time.time() - start < 60
    assert error_lines(res.stderr) == [f"tunekit: error: --rdzv-endpoint 127.0.0.1:{port}: not every node joined "
                                       "within 5 s (--nnodes 2); start the same command on every node, and check the "
                                       "address, the port and the firewall between them (--rdzv-conf join_timeout=S "
                                       "waits longer)"]
    assert "Traceback" not in res.stderr


def test_a_taken_port_is_one_line_before_anything_starts(recipe_file, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run(node_command("tunekit", 0, port, recipe_file, tmp_path / "run", []), cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"tunekit: error: --rdzv-endpoint 127.0.0.1:{port}: the port is already in use on this node (another run, or "
        "another service); choose a free port, the same on every node"]


@pytest.mark.parametrize("differs", ["recipe", in_full("tunekit")])
def test_nodes_that_differ_stop_at_start_saying_how(recipe_file, tmp_path, differs):
    """Node 1 with another recipe (an extra override), or with another tunekit installed (its metadata first on
    the path): both nodes stop before training, each with the same line, and no run directory is claimed."""
    out, port = tmp_path / "run", free_port()
    env = {}
    node1_extra = ["training.learning_rate=1e-3"] if differs == "recipe" else []
    if differs == "tunekit":
        other = tmp_path / "other" / "tunekit-0.0.1.dist-info"
        other.mkdir(parents=True)
        (other / "METADATA").write_text("Metadata-Version: 2.1\nName: tunekit\nVersion: 0.0.1\n")
        env = {1: {"PYTHONPATH": f"{other.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}}
    commands = [node_command("tunekit", r, port, recipe_file, out, node1_extra if r else []) for r in (0, 1)]
    results = finish(start_nodes(commands, port, env))
    expected = {"recipe": "has recipe (sha256 of it as loaded, overrides applied)",
                "tunekit": "has tunekit version 0.0.1"}
    for code, stderr in results:
        assert code == 2, stderr[-2000:]
        assert any(expected[differs] in line and "rank 1 (host" in line for line in error_lines(stderr)), stderr[-2000:]
    assert not (out / "run.json").exists()
