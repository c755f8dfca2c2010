"""checkpointfile: training state round-trips through safetensors exactly, and nothing else gets in or out."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tunekit.core import checkpointfile


def test_adamw_state_round_trips_and_training_continues_identically(tmp_path):
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return model, opt, sched

    def step(model, opt, sched, seed):
        torch.manual_seed(seed)
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    model, opt, sched = make()
    for s in range(3):
        step(model, opt, sched, s)
    checkpointfile.save(opt.state_dict(), tmp_path / "optimizer.safetensors")
    checkpointfile.save(sched.state_dict(), tmp_path / "scheduler.safetensors")
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    step(model, opt, sched, 3)

    other, opt2, sched2 = make()
    other.load_state_dict(saved_weights)
    loaded = checkpointfile.load(tmp_path / "optimizer.safetensors")
    assert set(loaded["state"]) == {0, 1, 2, 3}  # integer keys stay integers
    opt2.load_state_dict(loaded)
    sched2.load_state_dict(checkpointfile.load(tmp_path / "scheduler.safetensors"))
    step(other, opt2, sched2, 3)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_rng_states_round_trip(tmp_path):
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    checkpointfile.save(state, tmp_path / "rng.safetensors")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    back = checkpointfile.load(tmp_path / "rng.safetensors")
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    torch.random.set_rng_state(back["cpu"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_structures_views_and_special_values(tmp_path):
    base = torch.arange(12, dtype=torch.float32)
    obj = {"view": base[2:5], "whole": base, "same": base, "bf16": torch.ones(2, dtype=torch.bfloat16),
           "nested": [{"a": (1, 2.5, None)}, {3, 1}], "inf": math.inf, "nan": math.nan, "size": torch.Size([2, 3]),
           "dtype": torch.float16, 7: "int key", "$": "reserved key", "flag": True, "empty": torch.zeros(0)}
    checkpointfile.save(obj, tmp_path / "s.safetensors")
    back = checkpointfile.load(tmp_path / "s.safetensors")
    assert torch.equal(back["view"], base[2:5]) and torch.equal(back["whole"], base)
    assert back["bf16"].dtype == torch.bfloat16 and back["empty"].shape == (0,)
    assert back["nested"] == [{"a": (1, 2.5, None)}, {1, 3}]
    assert back["inf"] == math.inf and math.isnan(back["nan"])
    assert back["size"] == torch.Size([2, 3]) and back["dtype"] is torch.float16
    assert back[7] == "int key" and back["$"] == "reserved key" and back["flag"] is True


def test_objects_it_cannot_store_are_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match=r"s.safetensors.outer\[0\] is a .*Linear"):
        checkpointfile.save({"outer": [torch.nn.Linear(1, 1)]}, tmp_path / "s.safetensors")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_other_safetensors_files_are_not_taken_for_state(tmp_path):
    save_file({"w": torch.zeros(1)}, str(tmp_path / "weights.safetensors"))
    with pytest.raises(ValueError, match="not a tunekit state file"):
        checkpointfile.load(tmp_path / "weights.safetensors")
