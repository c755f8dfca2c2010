"""llama.cpp's own quantizer, for the k-quant types the gguf package cannot write (its numpy quantizers stop
at Q8_0/Q5_x/Q4_x): tunekit writes an f32 GGUF, and llama.cpp's `llama_model_quantize` (the function behind
its llama-quantize tool) turns it into Q4_K_M, Q5_K_M or Q6_K with llama.cpp's own per-tensor mix (for
Q4_K_M: attn_v and half of ffn_down at Q6_K, the rest Q4_K; rows not a multiple of 256 fall back to a
32-block type). It comes from the llama-cpp-python package (the `llama-cpp` extra), built from source."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

from tunekit.core.errors import TunekitError

PACKAGE = "llama-cpp-python==0.3.36"
INSTALL = f"pip install '{PACKAGE}' (or tunekit's `llama-cpp` extra; it builds llama.cpp from source, minutes)"


def require(flag: str) -> None:
    """Refuse, before any weight loads, a type that needs llama.cpp where llama-cpp-python is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise TunekitError(f"{flag}: this k-quant is written by llama.cpp's quantizer, "
                           f"which is not installed; {INSTALL}")


def quantize(source: Path, out: Path, ftype: str, threads: int = 0) -> None:
    """llama.cpp quantizes the GGUF `source` into `out` as `ftype` (a llama_cpp LLAMA_FTYPE_* name)."""
    import os

    import llama_cpp

    silent = llama_cpp.llama_log_callback(lambda level, text, data: None)  # its per-tensor log stays off the console
    llama_cpp.llama_log_set(silent, ctypes.c_void_p(0))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = threads or os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise TunekitError(f"export: llama.cpp could not quantize {source.name} to {ftype}; nothing written")
