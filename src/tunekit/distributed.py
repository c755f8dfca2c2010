"""Launch-environment facts and the few settings CPU multi-process and DeepSpeed runs need."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Launch:
    world_size: int
    rank: int
    local_rank: int
    cuda: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current() -> Launch:
    return Launch(
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        cuda=torch.cuda.is_available(),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(deepspeed: bool) -> dict:
    """Extra TrainingArguments for this launch; sets up process-group state where the defaults fail.

    Without a GPU, accelerate and DeepSpeed assume one process when they fill "auto" batch sizes and
    ZeRO-3 init fails; creating the gloo process group ourselves and telling the Trainer to use that
    state fixes both (measured on CPU, see the README's multi-process section)."""
    launch = current()
    extra: dict = {}
    if launch.cuda:
        return extra
    extra["use_cpu"] = True
    if launch.world_size > 1:
        extra["ddp_backend"] = "gloo"
    if deepspeed:
        # DeepSpeed always wants a process group, even for a single process.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        from accelerate import PartialState

        PartialState(backend="gloo")
        extra["ddp_backend"] = "gloo"
        extra["accelerator_config"] = {"use_configured_state": True}
    return extra
