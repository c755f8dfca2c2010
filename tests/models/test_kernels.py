"""training.kernels (models.kernels): the recipe key, the refusal on a machine without a CUDA GPU, and which loss
path the SFT trainer takes with each setting. The kernels themselves need Triton on a GPU; here their packages
are stood in for where a test needs them imported."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from conftest import reverse_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit.config.recipefile import from_dict
from tunekit.core.errors import TunekitError
from tunekit.models import kernels, losspath
from tunekit.training.trainer import loss_head


@pytest.fixture()
def data_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))


@pytest.mark.parametrize("written, read", [("none", "none"), ("liger", "liger"),
                                           ("cut_cross_entropy", "cut_cross_entropy"), ("cce", "cut_cross_entropy")])
def test_the_recipe_takes_each_setting(tmp_path, tiny_model, data_file, written, read):
    recipe = from_dict(tiny_recipe(tiny_model, data_file, tmp_path / "run", training={"kernels": written}))
    assert recipe.training.kernels == read


def test_the_default_is_none(tmp_path, tiny_model, data_file):
    assert from_dict(tiny_recipe(tiny_model, data_file, tmp_path / "run")).training.kernels == "none"


@pytest.mark.parametrize("training, message", [
    ({"kernels": "triton"}, "training.kernels: Input should be 'none', 'liger' or 'cut_cross_entropy'"),
    ({"kernels": True}, "training.kernels: Input should be 'none', 'liger' or 'cut_cross_entropy'"),
])
def test_a_bad_value_is_one_line(tmp_path, tiny_model, data_file, training, message):
    with pytest.raises(TunekitError) as e:
        from_dict(tiny_recipe(tiny_model, data_file, tmp_path / "run", training=training))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_method_with_its_own_loss_refuses_it(tmp_path, tiny_model):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 4)
    raw = tiny_recipe(tiny_model, pairs, tmp_path / "run", training={"kernels": "liger", "method": "dpo"},
                      data={"format": "preference"})
    with pytest.raises(TunekitError, match="training.kernels does not apply to training.method: dpo, whose trainer "
                                           "computes its own loss; remove it"):
        from_dict(raw)


CPU_REFUSAL = ("training.kernels: {} runs Triton kernels, which need a CUDA GPU, and this machine has none; "
               "remove training.kernels or set it to none")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA GPU")
@pytest.mark.parametrize("setting", ["liger", "cce"])
def test_train_refuses_it_without_a_gpu_before_loading_and_writes_nothing(tmp_path, tiny_model, data_file, capsys,
                                                                        monkeypatch, setting):
    from tunekit.cli import main
    from tunekit.models import loader

    monkeypatch.setattr(main, "_setup_logging", lambda verbose: None)  # no handler left on the captured stderr
    monkeypatch.setattr(loader, "load_base", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, data_file, out,
                                                           training={"kernels": setting}))
    assert main.main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    name = "cut_cross_entropy" if setting == "cce" else setting
    assert err[-1] == "tunekit: error: " + CPU_REFUSAL.format(name)
    assert not out.exists() or not any(out.iterdir())


def test_none_needs_nothing(tmp_path, tiny_model, data_file):
    kernels.require(from_dict(tiny_recipe(tiny_model, data_file, tmp_path / "run")))  # no GPU, no package: fine


@pytest.fixture()
def on_a_gpu(monkeypatch):
    """As on a CUDA machine with the kernels extra installed: Liger's family table and patch, CCE's function
    (a stand-in computing the plain sum, recording its calls)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = {"liger": [], "cce": []}
    liger = types.ModuleType("liger_kernel")
    transformers = types.ModuleType("liger_kernel.transformers")
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None, "qwen2": None}
    transformers._apply_liger_kernel_to_instance = lambda model, **kw: calls["liger"].append((model, kw))
    cce = types.ModuleType("cut_cross_entropy")

    def linear_cross_entropy(e, c, targets, reduction="mean"):
        calls["cce"].append((e.shape[0], e.dtype, c.dtype, reduction))
        return torch.nn.functional.cross_entropy(e @ c.t(), targets, reduction=reduction)

    cce.linear_cross_entropy = linear_cross_entropy
    for name, module in {"liger_kernel": liger, "liger_kernel.transformers": transformers,
                         "liger_kernel.transformers.monkey_patch": monkey_patch, "cut_cross_entropy": cce}.items():
        module.__spec__ = types.SimpleNamespace(name=name)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr("importlib.metadata.version", lambda dist: "0.8.5")
    return calls


def _tiny(tiny_model, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, **config)


def test_liger_patches_the_model_and_turns_the_chunked_loss_off(tiny_model, on_a_gpu, caplog):
    model = _tiny(tiny_model)
    kernels.apply(model, "liger")
    (patched, options), = on_a_gpu["liger"]
    assert patched is model and options == dict(fused_linear_cross_entropy=True, cross_entropy=False,
                                                 rms_norm=True, rope=True, swiglu=True)
    with caplog.at_level(logging.INFO, logger="tunekit"):
        assert loss_head(model, chunked=True, stock_only=False) is None
    assert "loss: Liger's fused linear cross-entropy in the model's forward (training.kernels: liger)" in caplog.text


def test_liger_refuses_a_family_it_does_not_cover(tiny_model, on_a_gpu):
    model = _tiny(tiny_model)
    model.config.model_type = "gpt_bigcode"
    with pytest.raises(TunekitError, match=r"^training.kernels: liger has no kernels for model family 'gpt_bigcode' "
                                           r"\(liger-kernel 0.8.5\); set training.kernels: cut_cross_entropy or none$"):
        kernels.apply(model, "liger")
    assert not on_a_gpu["liger"]


def test_liger_refuses_the_family_before_loading(tmp_path, tiny_model, data_file, on_a_gpu):
    import json

    config = json.loads((tiny_model / "config.json").read_text())
    other = tmp_path / "model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt_bigcode"}))
    recipe = from_dict(tiny_recipe(other, data_file, tmp_path / "run", training={"kernels": "liger"}))
    with pytest.raises(TunekitError, match="liger has no kernels for model family 'gpt_bigcode'"):
        kernels.require(recipe)


def test_cut_cross_entropy_computes_the_loss_on_trained_positions(tiny_model, on_a_gpu, caplog):
    model = _tiny(tiny_model)
    kernels.apply(model, "cut_cross_entropy")
    with caplog.at_level(logging.INFO, logger="tunekit"):
        head = loss_head(model, chunked=False, stock_only=False)  # the kernel's path whatever chunked_loss says
    assert isinstance(head, losspath.TrainedPositionsHead) and head.loss_sum is kernels.cce_loss_sum
    assert "loss: Cut Cross-Entropy on trained positions only (training.kernels: cut_cross_entropy)" in caplog.text
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    labels = ids.clone()
    labels[:, :5] = -100
    stock = model(input_ids=ids, labels=labels).loss
    ours = losspath.mean_loss(model, {"input_ids": ids, "labels": labels}, head)
    torch.testing.assert_close(ours, stock)
    # position t is trained on label t + 1: positions 4 to 10 of each row
    assert on_a_gpu["cce"] == [(2 * 7, torch.float32, torch.float32, "sum")]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # both operands in the autocast dtype
        losspath.mean_loss(model, {"input_ids": ids, "labels": labels}, head)
    assert on_a_gpu["cce"][-1][1:3] == (torch.bfloat16, torch.bfloat16)


def test_cut_cross_entropy_refuses_a_head_it_cannot_serve(tiny_model, on_a_gpu):
    model = _tiny(tiny_model)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
    with pytest.raises(TunekitError, match=r"^training.kernels: cut_cross_entropy computes the loss from the output "
                                           r"head of LlamaForCausalLM, and its output head has a bias"):
        kernels.apply(model, "cut_cross_entropy")


def test_the_chunked_loss_stays_without_kernels(tiny_model):
    model = _tiny(tiny_model)
    assert kernels.applied(model) is None
    head = loss_head(model, chunked=True, stock_only=False)
    assert isinstance(head, losspath.TrainedPositionsHead) and head.loss_sum is None
    assert loss_head(model, chunked=False, stock_only=False) is None


def test_a_trainer_with_its_own_loss_refuses_kernels(tiny_model, on_a_gpu):
    model = _tiny(tiny_model)
    kernels.apply(model, "liger")
    with pytest.raises(TunekitError, match="this trainer computes its own loss"):
        loss_head(model, chunked=True, stock_only=True)


def test_the_package_missing_is_named_with_the_extra(tmp_path, tiny_model, data_file, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    recipe = from_dict(tiny_recipe(tiny_model, data_file, tmp_path / "run", training={"kernels": "cce"}))
    with pytest.raises(TunekitError, match=r"^training.kernels: cut_cross_entropy needs cut-cross-entropy, which is "
                                           r"not installed: pip install 'tunekit\[kernels\]'$"):
        kernels.require(recipe)
