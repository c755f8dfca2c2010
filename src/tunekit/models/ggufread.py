"""One gguf.GGUFReader per file while transformers loads it."""

from __future__ import annotations

import contextlib
from pathlib import Path


@contextlib.contextmanager
def one_reader():
    """transformers' GGUF loader (load_gguf_checkpoint, for the families its newer reader does not cover) opens a
    gguf.GGUFReader for each of the config, model and tokenizer loads, and the reader parses every metadata array
    in Python (~25 s for Gemma 3's 262k-token vocabulary): inside this block the first reader of a file serves all."""
    import gguf

    opened, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = opened(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = opened
