"""The non-finite stop: one check over every trained weight, the first non-finite one named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tunekit.core.errors import TunekitError
from tunekit.training import nonfinite


def test_all_finite_sees_a_nan_or_an_infinity_in_any_tensor_of_any_dtype():
    fine = [torch.randn(3, 4), torch.full((5,), 3e38), torch.randn(2, dtype=torch.bfloat16),
            torch.tensor([6e4, -6e4], dtype=torch.float16), torch.randn(1, 1, requires_grad=True)]
    assert nonfinite.all_finite(fine) and nonfinite.all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in range(len(fine)):
            for at in (0, -1):
                tensors = [t.detach().clone() for t in fine]
                tensors[i].view(-1)[at] = bad
                assert not nonfinite.all_finite(tensors), (bad, i, at)


def flow(**set_):
    """The Trainer's control after its flow callback: what this step does next."""
    flags = dict(should_log=False, should_save=False, should_evaluate=False, should_training_stop=False)
    return SimpleNamespace(**{**flags, **set_})


def test_a_non_finite_trained_weight_stops_the_run_naming_the_first_and_frozen_ones_are_not_checked():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    stop = nonfinite.StopOnNonFinite()
    stop.on_train_begin(None, None, None, model=model)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")  # frozen: not the run's to stop for
    stop.on_step_end(None, SimpleNamespace(global_step=6), flow(should_save=True))
    with torch.no_grad():
        model[2].weight[1, 1] = float("inf")
        model[1].bias[0] = float("nan")
    with pytest.raises(TunekitError, match=r"by step 7: weight 1\.bias is not finite"):
        stop.on_step_end(None, SimpleNamespace(global_step=7), flow(should_save=True))


@pytest.mark.parametrize("then", ["should_save", "should_evaluate", "should_training_stop"])
def test_weights_are_read_only_at_a_step_that_saves_evaluates_or_ends(then, monkeypatch):
    model = torch.nn.Linear(2, 2)
    stop = nonfinite.StopOnNonFinite()
    stop.on_train_begin(None, None, None, model=model)
    read = []
    monkeypatch.setattr(nonfinite, "all_finite", lambda tensors: read.append(len(tensors)) or True)
    for step in range(1, 4):  # plain and logged steps: no host sync of its own
        stop.on_step_end(None, SimpleNamespace(global_step=step), flow(should_log=step == 2))
    assert read == []
    stop.on_step_end(None, SimpleNamespace(global_step=4), flow(**{then: True}))
    assert read == [2]


@pytest.mark.parametrize("logs, says", [({"loss": float("nan")}, "training loss is nan at step 3"),
                                        ({"loss": 2.0, "grad_norm": float("inf")},
                                         "training diverged at step 3: the gradient norm is inf")])
def test_a_logged_step_is_judged_by_what_the_trainer_logs(logs, says):
    stop = nonfinite.StopOnNonFinite()
    stop.on_log(None, SimpleNamespace(global_step=3), None, logs={"loss": 2.0, "grad_norm": 0.5})
    with pytest.raises(TunekitError, match=says):
        stop.on_log(None, SimpleNamespace(global_step=3), None, logs=logs)
