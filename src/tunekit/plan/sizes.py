"""Memory sizes as written on the command line (`tunekit plan --gpu-memory 24GiB`); imports no torch, so
that the argument is checked as it is parsed."""

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
