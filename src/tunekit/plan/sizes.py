"""Memory sizes as written on the command line (`tunekit plan --gpu-memory 24GiB`), and the bytes of quantized
weights; imports no torch, so that the argument is checked as it is parsed."""

from __future__ import annotations

import math

GiB = 1024**3


def parse_size(text: str) -> int:
    """'24GiB', '24G', '512MB', '1e9' -> bytes (binary units); ValueError for anything else."""
    units = {"k": 1024, "m": 1024**2, "g": GiB, "t": 1024**4}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = 1
    if t and t[-1] in units:
        t, scale = t[:-1], units[t[-1]]
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"{text!r} is not a size; write e.g. 24GiB, 80G or 512MiB") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} is not a positive size; write e.g. 24GiB")
    return int(value * scale)


QLORA_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax per 64 weights
DOUBLE_QUANT_BLOCK = 256  # double quantization: the absmaxes quantized to 8 bit in blocks of 256


def quantized_bytes(n: int, bits: int, double_quant: bool) -> float:
    """Bytes of n weights stored in 4 or 8 bits by bitsandbytes, their quantization constants included."""
    if bits == 8:
        return n * 1.0 + n / 4096 * 4  # int8 weights + one fp32 scale per row (approx.)
    constants = (n / QLORA_BLOCK) * (1 + 4 / DOUBLE_QUANT_BLOCK) if double_quant else (n / QLORA_BLOCK) * 4
    return n / 2 + constants


def size_words(n: float) -> str:
    """Bytes in the unit that suits them: GiB from 1 GiB, MiB from 1 MiB, else KiB."""
    for unit, name in ((GiB, "GiB"), (2**20, "MiB")):
        if abs(n) >= unit:
            return f"{n / unit:.2f} {name}"
    return f"{n / 1024:.1f} KiB"
