"""Launch-environment facts and the few settings CPU multi-process and DeepSpeed runs need."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tunekit.core.errors import TunekitError


@dataclass(frozen=True)
class Launch:
    world_size: int
    rank: int
    cuda: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current() -> Launch:
    return Launch(
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        rank=int(os.environ.get("RANK", 0)),
        cuda=torch.cuda.is_available(),
    )


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the group's size while a process group is up, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj) -> list:
    """Every process's `obj` (picklable), in rank order, on every process."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def check_same_everywhere(facts: dict[str, str], hints: dict[str, str]) -> None:
    """Every process runs with the same `facts` (tunekit version, recipe, ...) as rank 0; checked once the process
    group is up, before training starts, so that nodes installed or configured apart fail at once and alike."""
    rank, world = rank_and_world()
    if world == 1:
        return
    everyone = gather_objects({**facts, "host": socket.gethostname()})
    first = everyone[0]
    for other, theirs in enumerate(everyone):
        for key in facts:
            if theirs[key] != first[key]:
                raise TunekitError(f"rank {other} (host {theirs['host']}) has {key} {theirs[key]} but rank 0 (host "
                                   f"{first['host']}) has {first[key]}; {hints[key]}")


def check_launcher(fsdp: bool) -> None:
    """The recipe decides the sharding: an accelerate FSDP launch config without training.fsdp is refused
    (accelerate would shard the model on GPUs, and silently not on CPU processes)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not fsdp:
        raise TunekitError("accelerate launch was given an FSDP config (distributed_type: FSDP) but the recipe has no "
                           "training.fsdp; add `fsdp: {}` under training, or launch with "
                           "ds_configs/accelerate/multi_process.yaml")


def lost_peer(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another process went away (gloo or NCCL)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
        mark in text for mark in ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL")))


def accelerate_cpu_request() -> int | None:
    """How many processes `accelerate launch --num_processes N` asked for, when it started only this one.

    Without a GPU (and without --multi_gpu), accelerate's simple launcher runs a single process and
    does not pass N on; its command line, our parent's, still says it."""
    if "WORLD_SIZE" in os.environ or "ACCELERATE_USE_CPU" not in os.environ or torch.cuda.is_available():
        return None
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any("accelerate" in a for a in argv):
        return None
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--num_processes=") else (
            argv[i + 1] if arg == "--num_processes" and i + 1 < len(argv) else None)
        if value is not None and value.isdigit() and int(value) > 1:
            return int(value)
    return None


def relaunch(n: int, argv: list[str]) -> int:
    """Start `n` CPU worker processes of the same tunekit command with torch's elastic launcher."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    # the cores shared out between the processes (torch's launcher would set 1 and warn that it did)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "tunekit", *argv]
    return subprocess.run(cmd, env=env).returncode


def finish() -> None:
    """Let every rank reach the end before any exits, then close the process group cleanly
    (a rank that exits while the group's threads still run aborts with SIGABRT).

    Also forget the training run's DeepSpeed config: transformers keeps it in a module-level weak
    reference that `from_pretrained` consults, so a model loaded afterwards in this process (the
    end-of-training eval) would otherwise be built under `deepspeed.zero.Init` with the training
    batch settings and fail DeepSpeed's batch-size assertion."""
    import torch.distributed as dist
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_one_process_group() -> None:
    """The launcher's environment for a process started without one (a process group of one)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def _skip_shm_comm_build() -> None:
    """DeepSpeed compiles its shared-memory all-reduce (deepspeed_shm_comm: C++ and OpenMP, ~100 s and a compiler)
    when a CPU process group first starts, and uses it only for inference's tensor-parallel all-reduce
    (deepspeed.comm inference_all_reduce); ZeRO's collectives go through torch.distributed (gloo). Marked
    incompatible in DeepSpeed's table of ops (a dict it keeps so that edits persist), it is not built."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def prepare(deepspeed: bool, fsdp: bool = False) -> dict:
    """Extra TrainingArguments for this launch; sets up process-group state where the defaults fail.

    Without a GPU, accelerate and DeepSpeed assume one process when they fill "auto" batch sizes and
    ZeRO-3 init fails; creating the gloo process group ourselves and telling the Trainer to use that
    state fixes both (measured on CPU; docs/multi-gpu.md). DeepSpeed and FSDP
    always want a process group, even for a single process."""
    launch = current()
    extra: dict = {}
    if launch.cuda:
        if fsdp:
            _as_one_process_group()  # the Trainer refuses FSDP outside a launcher's environment
        return extra
    extra["use_cpu"] = True
    if launch.world_size > 1:
        extra["ddp_backend"] = "gloo"
    if deepspeed or fsdp:
        _as_one_process_group()
        if deepspeed:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
            _skip_shm_comm_build()
        from accelerate import PartialState

        PartialState(cpu=fsdp, backend="gloo")  # cpu: a CPU process group (MULTI_CPU) for FSDP to build on
        extra["ddp_backend"] = "gloo"
        extra["accelerator_config"] = {"use_configured_state": True}
    return extra
