"""Training state (optimizer, scheduler, RNG, DeepSpeed shards) as safetensors files.

Why our own code: the Trainer and DeepSpeed write this state with torch.save, a pickle, and DeepSpeed
reads it back with torch.load(weights_only=False), which runs whatever code the file names. Here the
tensors go into a safetensors file and the structure around them (nested dicts, lists, tuples, numbers,
strings) into its header as JSON, so loading a checkpoint reads data and never executes any.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "tunekit.state/1"
_TAG = "$"  # key of a tagged value in the JSON structure; a real dict holding it is stored as pairs
_ALLOWED: dict[str, type] = {}  # plain-attribute classes that may be rebuilt on load


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def allow(*classes: type) -> None:
    """Let instances of these classes be stored and rebuilt on load: plain objects as their attributes
    (no code of theirs runs), namedtuples from their fields. DeepSpeed keeps both kinds in its state."""
    for cls in classes:
        _ALLOWED[_name(cls)] = cls


class _Encoder:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.seen: dict[int, str] = {}
        self.storages: set[tuple[int, int]] = set()

    def tensor(self, original: torch.Tensor) -> str:
        if id(original) in self.seen:
            return self.seen[id(original)]
        t = original.detach().cpu()
        storage = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        whole = t.is_contiguous() and t.numel() * t.element_size() == storage[1]
        if not whole or storage in self.storages:
            t = t.clone()  # a view, or memory another entry holds: safetensors stores each tensor alone
            storage = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        self.storages.add(storage)
        key = str(len(self.tensors))
        self.tensors[key] = t
        self.seen[id(original)] = key
        return key

    def __call__(self, x: Any, where: str) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return int(x)  # IntEnum members (DeepSpeed's ZeRO stage) compare equal to their value
        if isinstance(x, float):
            return x if math.isfinite(x) else {_TAG: "float", "v": repr(x)}
        if isinstance(x, torch.Tensor):
            return {_TAG: "tensor", "k": self.tensor(x)}
        if isinstance(x, np.ndarray):
            return {_TAG: "ndarray", "k": self.tensor(torch.from_numpy(np.ascontiguousarray(x)))}
        if isinstance(x, np.generic):
            return self(x.item(), where)
        if isinstance(x, torch.Size):
            return {_TAG: "size", "v": list(x)}
        if isinstance(x, torch.dtype):
            return {_TAG: "dtype", "v": str(x).removeprefix("torch.")}
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x) and _TAG not in x:
                return {k: self(v, f"{where}.{k}") for k, v in x.items()}
            return {_TAG: "pairs", "v": [[self(k, where), self(v, f"{where}[{k!r}]")] for k, v in x.items()]}
        if isinstance(x, list):
            return [self(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, tuple):
            items = [self(v, f"{where}[{i}]") for i, v in enumerate(x)]
            if type(x) is tuple:
                return {_TAG: "tuple", "v": items}
            if _name(type(x)) in _ALLOWED:  # a namedtuple
                return {_TAG: "namedtuple", "cls": _name(type(x)), "v": items}
        if isinstance(x, (set, frozenset)):
            return {_TAG: "set", "v": [self(v, where) for v in sorted(x, key=repr)]}
        if _name(type(x)) in _ALLOWED:
            return {_TAG: "object", "cls": _name(type(x)), "v": self(vars(x), f"{where}.__dict__")}
        raise TypeError(f"training state at {where} is a {_name(type(x))}, which tunekit does not store")


def _decode(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    tag = x.get(_TAG)
    if tag is None:
        return {k: _decode(v, tensors) for k, v in x.items()}
    if tag == "tensor":
        return tensors[x["k"]]
    if tag == "ndarray":
        return tensors[x["k"]].numpy()
    if tag == "float":
        return float(x["v"])
    if tag == "size":
        return torch.Size(x["v"])
    if tag == "dtype":
        return getattr(torch, x["v"])
    if tag == "pairs":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in x["v"]}
    if tag == "tuple":
        return tuple(_decode(v, tensors) for v in x["v"])
    if tag == "set":
        return {_decode(v, tensors) for v in x["v"]}
    if tag in ("object", "namedtuple"):
        if x["cls"] not in _ALLOWED:
            raise ValueError(f"a tunekit state file holds a {x['cls']}, which is not allowed here")
        cls = _ALLOWED[x["cls"]]
        if tag == "namedtuple":
            return cls(*_decode(x["v"], tensors))
        obj = object.__new__(cls)
        vars(obj).update(_decode(x["v"], tensors))
        return obj
    raise ValueError(f"unknown entry {tag!r} in a tunekit state file")


def save(obj: Any, path: str | os.PathLike) -> None:
    """Write obj to path (a .safetensors file), atomically: a kill leaves the old file or none."""
    path = Path(path)
    enc = _Encoder()
    structure = enc(obj, path.name)
    tmp = path.with_name(f".{path.name}.partial")
    save_file(enc.tensors, str(tmp), metadata={"format": FORMAT, "structure": json.dumps(structure)})
    os.replace(tmp, path)


def load(path: str | os.PathLike, device: str | torch.device = "cpu") -> Any:
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a tunekit state file (format {meta.get('format')!r})")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(json.loads(meta["structure"]), tensors)
