"""DeepSpeed config resolution against the recipe: "auto" filled, contradictions refused before launch."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, run_cli, write_jsonl, write_recipe
from tunekit.config import dsconfig, recipefile
from tunekit.core.errors import TunekitError
from tunekit.core.hardware import Precision
from tunekit.training import arguments


@pytest.fixture()
def make(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])

    def _make(ds: dict | str, **training):
        if isinstance(ds, dict):
            path = tmp_path / "ds.json"
            path.write_text(json.dumps(ds))
        else:
            path = ROOT / "ds_configs" / ds
        raw = {"model": {"name_or_path": str(tiny_model)}, "data": {"train": str(data)},
               "training": {"precision": "fp32", "micro_batch_size": 8, "gradient_accumulation_steps": 2,
                            "deepspeed": str(path), **training}, "output_dir": str(tmp_path / "run")}
        return write_recipe(tmp_path / "r.yaml", raw)
    return _make


@pytest.mark.parametrize("name", ["zero1.json", "zero2.json", "zero2_offload.json", "zero3.json", "zero3_offload.json"])
def test_shipped_configs_resolve_every_auto(make, name):
    path = make(name, learning_rate=3e-4, max_grad_norm=0.5)
    ds = arguments.deepspeed_config(recipefile.load(path), Precision("fp32", "test"), world_size=2)
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    if "optimizer" in ds:
        assert ds["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert "auto" not in json.dumps(ds)  # the tiny model is a local dir: its hidden size is known too
    assert ds["zero_optimization"].get("reduce_bucket_size", 64 * 64) == 64 * 64


@pytest.mark.parametrize("ds,expected", [
    ({"train_micro_batch_size_per_gpu": 4},
     "train_micro_batch_size_per_gpu = 4 contradicts training.micro_batch_size = 8"),
    ({"gradient_accumulation_steps": 4},
     "gradient_accumulation_steps = 4 contradicts training.gradient_accumulation_steps = 2"),
    ({"gradient_clipping": 0.3}, "gradient_clipping = 0.3 contradicts training.max_grad_norm = 1.0"),
    ({"bf16": {"enabled": True}}, "bf16.enabled = true contradicts training.precision=fp32 = false"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
     "optimizer.params.lr = 0.1 contradicts training.learning_rate"),
])
def test_hand_set_contradictions_are_refused_naming_both(make, ds, expected):
    with pytest.raises(TunekitError, match="training.deepspeed") as e:
        recipefile.load(make({"zero_optimization": {"stage": 2}, **ds}))
    assert expected in str(e.value)


def test_train_batch_size_checked_against_world_size(make):
    path = make({"zero_optimization": {"stage": 2}, "train_batch_size": 32})
    assert arguments.deepspeed_config(recipefile.load(path), Precision("fp32", "test"), world_size=2)
    with pytest.raises(TunekitError, match="train_batch_size = 32 contradicts"):
        arguments.deepspeed_config(recipefile.load(path), Precision("fp32", "test"), world_size=1)


@pytest.mark.slow
def test_validate_prints_the_resolved_config_and_refuses_a_contradiction(make):
    path = make({"zero_optimization": {"stage": 2}, "train_batch_size": 32})
    ok = run_cli("validate", str(path), "--world-size", "2")
    assert ok.returncode == 0, ok.stderr
    ds = json.loads(ok.stdout.split("# DeepSpeed config for world size 2")[1].split("\n", 1)[1])
    assert ds["train_batch_size"] == 32 and ds["zero_optimization"] == {"stage": 2}
    res = run_cli("validate", str(path), "--world-size", "1")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert ("train_batch_size = 32 contradicts training.micro_batch_size x training.gradient_accumulation_steps "
            "x world size 1 = 16") in res.stderr


def test_precision_contradiction_with_fp16_recipe(make):
    with pytest.raises(TunekitError, match="fp16.enabled = false contradicts training.precision=fp16"):
        recipefile.load(make({"zero_optimization": {"stage": 2}, "fp16": {"enabled": False}}, precision="fp16"))


def test_describe():
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "train_batch_size": 16,
          "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    assert dsconfig.describe(ds).startswith("ZeRO stage 2, optimizer offloaded to CPU, train_batch_size 16")
