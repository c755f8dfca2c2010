"""What the machine can do: device, and which precision 'auto' means on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tunekit.core.errors import TunekitError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    name: str  # bf16 | fp16 | fp32
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]


def available_memory() -> int:
    """Bytes of memory this machine has free (Linux's MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def cpu_has_bf16() -> bool:
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((probe and probe()) or (amx and amx()))


def resolve_precision(requested: str) -> Precision:
    """Turn the recipe's precision into a concrete one, refusing what the hardware cannot do."""
    cuda = torch.cuda.is_available()
    if requested == "auto":
        if cuda:
            if torch.cuda.is_bf16_supported():
                return Precision("bf16", "auto: CUDA device supports bf16")
            return Precision("fp16", "auto: CUDA device without bf16")
        if cpu_has_bf16():
            return Precision("bf16", "auto: CPU has native bf16 (avx512_bf16/AMX)")
        return Precision("fp32", "auto: CPU without native bf16")
    if requested == "fp16" and not cuda:
        raise TunekitError("training.precision=fp16 needs a CUDA GPU; use bf16 or fp32 (or auto) on CPU")
    if requested == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise TunekitError("training.precision=bf16: this GPU has no bf16 support; use fp16 or auto")
    return Precision(requested, "set in recipe")
