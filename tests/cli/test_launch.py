"""tunekit launch's own parts (torchrun's parser, the rendezvous port check), the FSDP2 arguments a recipe
gives the Trainer, --resume's rule for another number of processes, and the stacks a stuck process prints:
no training here."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import refused_in_process, reverse_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit.cli import launch
from tunekit.config import fsdpconfig, recipefile
from tunekit.config.recipefile import to_yaml
from tunekit.config.trainingschema import FsdpConfig
from tunekit.core.errors import TunekitError
from tunekit.runs import layout


def test_the_command_after_torchruns_options_is_tunekits():
    args = launch._parse(["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "1", "--rdzv-endpoint",
                          "10.0.0.1:29511", "train", "r.yaml", "--set", "a=b"])
    assert (args.training_script, args.module, args.training_script_args) == ("tunekit", True,
                                                                              ["train", "r.yaml", "--set", "a=b"])
    assert launch._rendezvous_address(args) is None  # node 1 does not serve the rendezvous
    args = launch._parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29511", "train", "r"])
    assert launch._rendezvous_address(args) == ("10.0.0.1", 29511)
    with pytest.raises(TunekitError, match="tunekit launch: .*training_script.*; give torchrun options, then a "
                                           "tunekit command"):
        launch._parse(["--nnodes", "2"])


def test_a_port_in_use_is_refused_and_a_free_one_or_another_hosts_is_not():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(TunekitError, match=f"--rdzv-endpoint 127.0.0.1:{port}: the port is already in use"):
            launch.check_port("127.0.0.1", port)
    launch.check_port("127.0.0.1", port)  # free again
    launch.check_port("192.0.2.1", port)  # not an address of this machine: another node serves it
    with pytest.raises(TunekitError, match="the host does not resolve"):
        launch.check_port("no-such-host.invalid", port)


def test_fsdp_settings_become_the_trainers_fsdp2_arguments():
    f = FsdpConfig(reshard_after_forward=False, cpu_offload=True, auto_wrap=False, reduce_dtype="param")
    gpu, cpu = fsdpconfig.trainer_arguments(f, cuda=True), fsdpconfig.trainer_arguments(f, cuda=False)
    assert gpu["fsdp"] is True and gpu["fsdp_config"] == {
        "version": 2, "reshard_after_forward": False, "cpu_offload": True, "auto_wrap_policy": "NO_WRAP",
        "activation_checkpointing": False, "state_dict_type": "FULL_STATE_DICT"}
    assert cpu["fsdp_config"]["cpu_offload"] is False  # nothing to offload from without a GPU
    assert "cpu_offload skipped" in fsdpconfig.describe(f, cuda=False)
    assert fsdpconfig.trainer_arguments(None, cuda=True) == {}
    assert fsdpconfig.mixed_precision_policy(f, "fp32") is None
    assert fsdpconfig.mixed_precision_policy(f, "bf16") == {"param_dtype": torch.bfloat16,
                                                            "reduce_dtype": torch.bfloat16,
                                                            "output_dtype": torch.bfloat16}
    assert fsdpconfig.mixed_precision_policy(FsdpConfig(), "fp16")["reduce_dtype"] == torch.float32


@pytest.fixture
def started(tmp_path, tiny_model):
    """A run directory as `tunekit train` leaves it when killed: its recipe and run.json (2 processes x 8)."""
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    run = tmp_path / "run"
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, data, run)))
    run.mkdir()
    (run / "recipe.yaml").write_text(to_yaml(recipe))
    layout.RunRecord(status="running", started="", command=[], versions={}, precision={}, adapter="lora",
                     base_model="", parameters={}, world_size=2, effective_batch=16, data={}).save(run)
    (run / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoints" / "checkpoint-2" / "tunekit-complete").write_text("{}")
    (run / "checkpoints" / "checkpoint-2" / "optimizer.safetensors").write_bytes(b"")
    return recipe, run


def test_resume_on_another_number_of_processes_keeps_the_examples_per_step(started):
    recipe, run = started
    assert layout.check_resume(recipe, run, world_size=2).name == "checkpoint-2"
    twice = recipe.model_copy(
        update={"training": recipe.training.model_copy(update={"gradient_accumulation_steps": 2})})
    assert layout.check_resume(twice, run, world_size=1).name == "checkpoint-2"  # 1 x 8 x 2 = 16
    with pytest.raises(TunekitError, match=r"1 process\(es\) x .* = 8 examples per step, but the run trained with 16 "
                                           r"\(2 process\(es\)\); set training.gradient_accumulation_steps"):
        layout.check_resume(recipe, run, world_size=1)
    other = recipe.model_copy(update={"training": recipe.training.model_copy(update={"learning_rate": 1e-3})})
    with pytest.raises(TunekitError, match="the recipe differs from"):
        layout.check_resume(other, run, world_size=2)


def test_a_stuck_process_prints_every_threads_stack_on_sigusr1(tmp_path):
    """`kill -USR1 PID` on a tunekit process (a rank waiting in a collective, say) prints where each thread is."""
    code = ("import sys, time\nfrom tunekit.cli.main import main\nmain(['runs', sys.argv[1]])\n"
            "def waiting_here():\n    print('ready', flush=True)\n    time.sleep(60)\nwaiting_here()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        while proc.stdout.readline().strip() != "ready":
            pass
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
    finally:
        proc.kill()
    err = proc.communicate()[1]
    assert "most recent call first" in err and "waiting_here" in err, err[-2000:]


NODE = ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "10.0.0.1:29511"]
LAUNCH_CASES = {  # argv after `tunekit launch` -> the one line's cause
    "zero nodes": (["--nnodes", "0", "train", "r.yaml"], "--nnodes 0: expected a number of nodes of at least 1"),
    "a node range upside down": (["--nnodes", "3:2", "train", "r.yaml"], "--nnodes 3:2: expected a number of nodes"),
    "a node count that is no number": (["--nnodes", "two", "train", "r.yaml"], "--nnodes two: expected"),
    "zero processes": (["--nproc-per-node", "0", "train", "r.yaml"],
                       "--nproc-per-node 0: expected a number of processes of at least 1"),
    "a node rank past the count": (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "10.0.0.1:29511",
                                    "train", "r.yaml"], "--node-rank 2: with --nnodes 2 the nodes are numbered 0 to 1"),
    "an endpoint with a word for a port": ([*NODE[:-1], "10.0.0.1:port", "train", "r.yaml"],
                                           "--rdzv-endpoint 10.0.0.1:port: expected HOST:PORT"),
    "an endpoint past the last port": ([*NODE[:-1], "10.0.0.1:70000", "train", "r.yaml"],
                                       "--rdzv-endpoint 10.0.0.1:70000: expected HOST:PORT"),
    "an endpoint with no host": ([*NODE[:-1], ":29511", "train", "r.yaml"], "--rdzv-endpoint :29511: expected"),
    "a command tunekit does not have": ([*NODE, "trian", "r.yaml"], "invalid choice: 'trian'"),
    "an option train does not have": ([*NODE, "train", "RECIPE", "--epochs", "2"], "unrecognized arguments: --epochs"),
    "a recipe that is not there": ([*NODE, "train", "missing.yaml"], "missing.yaml"),
    "a recipe that train refuses": ([*NODE, "train", "RECIPE", "--set", "training.epochs=0"], "training.epochs"),
    "parallel sizes the processes cannot hold": (
        ["--nnodes", "1", "--nproc-per-node", "3", "train", "RECIPE", "--set", "training.parallelism.cp=2",
         "--set", "training.fsdp={}"],
        "training.parallelism: tp x sp x cp = 2 does not divide --nnodes x --nproc-per-node 3; give --nnodes x "
        "--nproc-per-node a multiple of 2"),
}


@pytest.mark.parametrize("case", LAUNCH_CASES)
def test_launch_refuses_what_cannot_run_before_starting_anything(case, tmp_path, tiny_model, capsys, monkeypatch):
    """In-process (the parse, the checks and the recipe's need no process): exit 2, one line naming the option
    and the fix, no traceback, nothing written, within seconds and without waiting for any other node."""
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, write_jsonl(tmp_path / "d.jsonl",
                                                                                   reverse_rows(8)),
                                                           tmp_path / "run"))
    argv, expected = LAUNCH_CASES[case]
    started = time.monotonic()
    line = refused_in_process(["launch", *[str(recipe) if a == "RECIPE" else a for a in argv]], tmp_path, capsys,
                              monkeypatch)
    assert expected in line, line
    assert time.monotonic() - started < 30
