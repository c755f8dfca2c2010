"""Several CPU processes (gloo): torchrun and accelerate launch, DDP and DeepSpeed ZeRO 1/2/3 with and
without offload, LoRA and full fine-tuning, and equivalence with a single process."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    assert_no_pickles,
    cut_after_checkpoint,
    history,
    in_full,
    launch,
    logged,
    reverse_rows,
    run_cli,
    tiny_recipe,
    write_jsonl,
    write_recipe,
)
from tunekit.runs.layout import RunRecord

pytestmark = pytest.mark.slow

# Same examples per optimizer step, same seed, fp32: only the order of floating-point reductions
# differs. Logged losses agree to RTOL (measured: identical to 5 decimals). Weights agree to
# WEIGHT_ATOL, a tenth of one Adam step at lr 5e-3: Adam divides each gradient by its own running
# size, so where a gradient is ~0 rounding noise moves the step (measured: 1.3e-4 after 6 steps).
RTOL = 1e-4
WEIGHT_ATOL = 5e-4


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("mp")
    data = write_jsonl(root / "train.jsonl", reverse_rows(32))
    raw = tiny_recipe(tiny_model, data, root / "unused", training={"max_steps": 6})
    return write_recipe(root / "r.yaml", raw)


def weights(run_dir):
    sub = "adapter/adapter_model.safetensors" if (run_dir / "adapter").is_dir() else "model/model.safetensors"
    return load_file(str(run_dir / sub))


def assert_same_run(a, b):
    assert logged(a, "loss") == pytest.approx(logged(b, "loss"), rel=RTOL)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key].float(), wb[key].float(), rtol=0, atol=WEIGHT_ATOL)


@pytest.fixture(scope="module")
def single(recipe_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    res = run_cli("train", str(recipe_file), "--set", f"output_dir={out}", "--set", "training.micro_batch_size=16")
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def ddp(recipe_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "run"
    res = launch(recipe_file, out)
    assert "world size 2 x micro-batch 8 x accumulation 1 = 16 examples per optimizer step" in res.stderr
    return out


def test_two_process_ddp_equals_one_process_with_the_same_effective_batch(single, ddp):
    assert RunRecord.load(ddp).world_size == 2
    losses = logged(ddp, "loss")
    assert losses[-1] < losses[0] - 0.2
    assert_same_run(single, ddp)


ZERO2_LORA = ["training.deepspeed=ds_configs/zero2.json", "adapter=lora", "training.save_steps=2",
              "training.save_total_limit=10"]


@pytest.fixture(scope="module")
def zero2(recipe_file, tmp_path_factory):
    """One ZeRO-2 LoRA run (chunked loss, the default; a checkpoint every 2 steps), shared by the DDP
    comparison, the chunked-loss comparison and the resume test: (run directory, stderr)."""
    out = tmp_path_factory.mktemp("zero2") / "run"
    return out, launch(recipe_file, out, 2, *ZERO2_LORA).stderr


def test_zero2_equals_ddp(zero2, ddp):
    out, stderr = zero2
    assert "ZeRO stage 2" in stderr
    ds = json.loads((out / "deepspeed.json").read_text())
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 8
    assert_same_run(ddp, out)


def test_accelerate_launch_runs_two_processes(recipe_file, ddp, tmp_path):
    out = tmp_path / "run"
    launch(recipe_file, out, 2, launcher="accelerate")
    assert RunRecord.load(out).world_size == 2
    assert_same_run(ddp, out)


def test_cpu_deepspeed_runs_do_not_compile_deepspeeds_inference_all_reduce(monkeypatch):
    """deepspeed_shm_comm (C++, ~100 s on a machine's first CPU DeepSpeed launch) serves only DeepSpeed-inference's
    tensor-parallel all-reduce; ZeRO's collectives are torch.distributed's."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    from tunekit.core import distributed

    table = deepspeed.ops.__compatible_ops__
    monkeypatch.setitem(table, "deepspeed_shm_comm", table["deepspeed_shm_comm"])  # restored afterwards
    distributed._skip_shm_comm_build()
    assert build_shm_op() is None


# zero2 and zero3 without offload: LoRA in test_zero2_equals_ddp and test_zero3_run_merges_and_evaluates, QLoRA in
# test_qlora_under_zero3_and_fsdp2_equals_qlora_under_ddp, full fine-tuning in the ZeRO-3 resume test below (and every
# shipped recipe on the real model in test_shipped_recipes.py); here the other configs, with weight checks. Offload
# to CPU: make test runs each offloading config once (ZeRO-2 fully fine-tuning, ZeRO-3 with LoRA), the other pairs are
# `full` (the first of them builds DeepSpeed's CPU Adam, about a minute of one core, wherever it falls); ZeRO-1 fully
# fine-tuning is `full` too (tests/moved2-full-last-run.json)
@pytest.mark.parametrize("config, adapter", [
    pytest.param("zero1", "lora", id="lora-zero1"), in_full("zero1", "none", id="none-zero1"),
    in_full("zero2_offload", "lora", id="lora-zero2_offload"),
    pytest.param("zero2_offload", "none", id="none-zero2_offload"),
    pytest.param("zero3_offload", "lora", id="lora-zero3_offload"),
    in_full("zero3_offload", "none", id="none-zero3_offload")])
def test_zero_stages_train_lora_and_full_finetuning(recipe_file, tmp_path, tiny_model, config, adapter):
    out = tmp_path / "run"
    overrides = [f"training.deepspeed=ds_configs/{config}.json", f"adapter={adapter}", "training.max_steps=4"]
    if adapter == "none":
        overrides += ["lora=null", "training.learning_rate=1e-3"]
    launch(recipe_file, out, 2, *overrides)
    losses = logged(out, "loss")
    assert losses[-1] < losses[0] - 0.1, losses
    shards = [p.name for p in assert_no_pickles(out) if p.parent.name.startswith("global_step")]
    assert any(n.endswith("optim_states.safetensors") for n in shards), shards
    # the saved weights are ordinary, gathered tensors of full size
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    if adapter == "none":
        model = AutoModelForCausalLM.from_pretrained(out / "model")
        assert all(p.numel() > 0 for p in model.parameters())
        assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)
    else:
        adapter_weights = weights(out)
        assert all(v.numel() > 0 for v in adapter_weights.values())
        assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter_weights.items())


@pytest.fixture(scope="module")
def qlora_ddp(recipe_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora-ddp") / "run"
    launch(recipe_file, out, 2, "adapter=qlora", "training.max_steps=4")
    return out


@pytest.mark.parametrize("sharding", ["training.deepspeed=ds_configs/zero3.json", "training.fsdp={}"])
def test_qlora_under_zero3_and_fsdp2_equals_qlora_under_ddp(recipe_file, qlora_ddp, tmp_path, sharding):
    """ZeRO-3 and FSDP2 need the packed 4-bit weights stored in the dtype of the other weights; the quantized
    values, and so the training, are the same as with DDP's uint8 storage."""
    runs = {"ddp": qlora_ddp, "sharded": tmp_path / "sharded"}
    launch(recipe_file, runs["sharded"], 2, "adapter=qlora", sharding, "training.max_steps=4")
    info = RunRecord.load(runs["sharded"])
    assert info.parameters == RunRecord.load(runs["ddp"]).parameters
    assert logged(runs["sharded"], "loss")[-1] < logged(runs["sharded"], "loss")[0]
    assert_same_run(runs["ddp"], runs["sharded"])


def test_chunked_loss_under_zero2_equals_the_stock_loss(recipe_file, zero2, tmp_path):
    chunked, stderr = zero2  # training.chunked_loss defaults to true
    assert "trained positions only" in stderr
    stock = tmp_path / "stock"
    res = launch(recipe_file, stock, 2, *ZERO2_LORA, "training.chunked_loss=false")
    assert "trained positions only" not in res.stderr
    assert logged(chunked, "loss")[-1] < logged(chunked, "loss")[0]
    assert_same_run(chunked, stock)


@pytest.mark.parametrize("config,adapter", [("zero2", "lora"), ("zero3", "none")])
def test_deepspeed_checkpoints_are_safetensors_and_resume_exactly(recipe_file, request, tmp_path, config, adapter):
    overrides = [f"training.deepspeed=ds_configs/{config}.json", f"adapter={adapter}", "training.save_steps=2",
                 "training.save_total_limit=10"]
    if adapter == "none":
        overrides += ["lora=null", "training.learning_rate=1e-3"]
    if overrides == ZERO2_LORA:
        full = request.getfixturevalue("zero2")[0]  # the uninterrupted run is the shared ZeRO-2 one
    else:
        full = tmp_path / "full"
        launch(recipe_file, full, 2, *overrides)
    assert_no_pickles(full)
    cut = cut_after_checkpoint(full, tmp_path / "cut", 2)
    res = launch(recipe_file, cut, 2, *overrides, flags=["--resume"])
    assert "resuming from checkpoint-2" in res.stderr
    assert_no_pickles(cut)
    assert logged(cut, "loss") == logged(full, "loss")
    wa, wb = weights(full), weights(cut)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_zero3_run_merges_and_evaluates(recipe_file, tmp_path):
    """Two ZeRO-3 processes with data.max_examples and data.eval_fraction: generation during training and the
    end-of-training eval score exactly the records the split held out, on every rank alike."""
    from tunekit.config import recipefile
    from tunekit.data import split

    out = tmp_path / "run"
    res = launch(recipe_file, out, 2, "training.deepspeed=ds_configs/zero3.json", "data.max_examples=24",
                 "data.eval_fraction=0.25", "eval.max_new_tokens=2", "eval.batch_size=2")
    assert "data split: 24 records of data.train (the first 24, data.max_examples): 18 train; 6 held out" in res.stderr
    merged = run_cli("merge", str(out))
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert json.loads((out / "merged" / "tunekit.json").read_text())["parity"]["max_abs_diff"] < 1e-4
    record = RunRecord.load(out)
    assert record.status == "completed" and record.data["split"]["held_out"] == record.data["eval"]["examples"] == 6
    recipe = recipefile.load(out / "recipe.yaml")
    held = [r.where for r in split.held_out(recipe.data, recipe.training.seed)]
    predictions = [json.loads(x) for x in (out / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert [p["where"] for p in predictions] == held
    evals = history(out, "eval_bleu")
    assert evals and evals[-1]["step"] == 6
    ev = run_cli("eval", str(out), "--data", str(recipe_file.parent / "train.jsonl"), "--limit", "4",
                 "--max-new-tokens", "4", "--out", str(tmp_path / "ev"))
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["scores"]["examples"] == 4


# FSDP2 (training.fsdp) on the same data: the same guarantees as ZeRO. Tolerances as above (RTOL, WEIGHT_ATOL);
# measured: losses and adapter identical to the DDP run (max weight difference 0.0).
FSDP_LORA = ["training.fsdp={}", "training.save_steps=2", "training.save_total_limit=10"]


@pytest.fixture(scope="module")
def fsdp2(recipe_file, tmp_path_factory):
    """One two-process FSDP2 LoRA run with a checkpoint every 2 steps: (run directory, stderr)."""
    out = tmp_path_factory.mktemp("fsdp2") / "run"
    return out, launch(recipe_file, out, 2, *FSDP_LORA).stderr


def test_fsdp2_equals_one_process_and_writes_no_pickles(fsdp2, single):
    out, stderr = fsdp2
    assert "fsdp: FSDP2, parameters, gradients and optimizer state sharded, one unit per decoder layer" in stderr
    units = int(re.search(r"fsdp: (\d+) units sharded over 2 processes", stderr).group(1))
    assert units >= 3  # at least the 2 decoder layers and the root: FSDP ran
    assert RunRecord.load(out).world_size == 2
    assert logged(out, "loss")[-1] < logged(out, "loss")[0] - 0.2
    assert_same_run(single, out)
    saved = {p.name for p in assert_no_pickles(out)}
    assert {"optimizer.safetensors", "adapter_model.safetensors", "rng_state_1.safetensors"} <= saved


def test_fsdp2_resumes_on_one_process_after_a_kill(fsdp2, recipe_file, tmp_path):
    """Cut after checkpoint-2 of the two-process run and resumed by one process with twice the accumulation
    (the same 16 examples per step): it ends where the uninterrupted run ends."""
    full, _ = fsdp2
    cut = cut_after_checkpoint(full, tmp_path / "cut", 2)
    res = run_cli("train", str(recipe_file), "--set", f"output_dir={cut}",
                  *(a for o in FSDP_LORA for a in ("--set", o)),
                  "--set", "training.gradient_accumulation_steps=2", "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from checkpoint-2" in res.stderr
    assert "world size 1 x micro-batch 8 x accumulation 2 = 16 examples" in res.stderr
    assert logged(cut, "loss") == pytest.approx(logged(full, "loss"), rel=RTOL)
    assert_same_run(full, cut)
    # the same split on resume is required: a different number of examples per step is refused
    res = run_cli("train", str(recipe_file), "--set", f"output_dir={cut}",
                  *(a for o in FSDP_LORA for a in ("--set", o)), "--resume")
    assert res.returncode == 2 and "= 8 examples per step, but the run trained with 16" in res.stderr


@pytest.mark.full  # make test-full (tests/multinode-full-last-run.json); make test runs FSDP2 LoRA, QLoRA and resume
@pytest.mark.parametrize("fsdp", ["{auto_wrap: false, cpu_offload: true}",
                                  "{reshard_after_forward: false, activation_checkpointing: true}"])
def test_fsdp2_full_finetuning_settings_equal_ddp(recipe_file, tmp_path, fsdp):
    """Full fine-tuning under FSDP2 as one unit, and with parameters kept gathered from forward to backward and
    activation checkpointing: each trains the same weights as plain DDP; the saved model is whole. (CPU offload
    needs a GPU to offload from: on CPU processes it is skipped, and said; make gpu-check runs it.)"""
    runs = {}
    for name, setting in (("ddp", "null"), ("fsdp", fsdp)):
        runs[name] = tmp_path / name
        stderr = launch(recipe_file, runs[name], 2, f"training.fsdp={setting}", "adapter=none", "lora=null",
                        "training.learning_rate=1e-3", "training.max_steps=3").stderr
    assert ("cpu_offload skipped: no GPU" in stderr) == ("cpu_offload" in fsdp)
    assert re.search(r"fsdp: \d+ units sharded over 2 processes", stderr)
    assert logged(runs["fsdp"], "loss")[-1] < logged(runs["fsdp"], "loss")[0]
    assert_same_run(runs["ddp"], runs["fsdp"])


@pytest.mark.full
def test_fsdp2_run_merges_and_evaluates_as_the_run_without_it(fsdp2, ddp, recipe_file, tmp_path):
    out, _ = fsdp2
    scores = {}
    for name, run in (("fsdp", out), ("ddp", ddp)):
        merged = run_cli("merge", str(run), "--out", str(tmp_path / name / "merged"))
        assert merged.returncode == 0, merged.stderr[-2000:]
        ev = run_cli("eval", str(run), "--data", str(recipe_file.parent / "train.jsonl"), "--limit", "4",
                     "--max-new-tokens", "4", "--out", str(tmp_path / name / "eval"))
        assert ev.returncode == 0, ev.stderr[-2000:]
        scores[name] = {k: v for k, v in json.loads((tmp_path / name / "eval" / "metrics.json").read_text())["scores"]
                        .items() if not k.endswith("_seconds")}  # all but the timing
    a, b = (load_file(str(tmp_path / n / "merged" / "model.safetensors")) for n in ("fsdp", "ddp"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=WEIGHT_ATOL)
    predictions = [(tmp_path / n / "eval" / "predictions.jsonl").read_text() for n in ("fsdp", "ddp")]
    assert predictions[0] == predictions[1] and scores["fsdp"] == scores["ddp"]


@pytest.mark.parametrize("launches", [pytest.param(("ddp", "zero3"), id="ddp-zero3"), in_full(("zero2",), id="zero2")])
def test_a_vision_language_model_under_ddp_and_zero2_and_zero3_equals_one_process(tmp_path, tiny_vision_model,
                                                                                   launches):
    """Image batches split over two processes: DDP, ZeRO-2 and ZeRO-3 give one process's run (its micro-batches
    accumulated). ZeRO-3's partitioned init draws from the RNG while a vision-language model loads: the adapter is
    seeded as it is made, or its LoRA matrices differ. ZeRO-2 (the text path's, tested above) is make test-full's."""
    from conftest import colour_rows

    data = write_jsonl(tmp_path / "train.jsonl", colour_rows(tmp_path / "img", 32))
    raw = tiny_recipe(tiny_vision_model, data, tmp_path / "unused", data={"format": "chat"},
                      vision={"train_projector": True}, training={"max_steps": 4})
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    one = tmp_path / "one"
    res = run_cli("train", str(recipe), "--set", f"output_dir={one}", "--set", "training.micro_batch_size=4",
                  "--set", "training.gradient_accumulation_steps=2")
    assert res.returncode == 0, res.stderr[-3000:]
    sets = {"ddp": [], "zero2": ["training.deepspeed=ds_configs/zero2.json"],
            "zero3": ["training.deepspeed=ds_configs/zero3.json"]}
    for name in launches:
        launch(recipe, tmp_path / name, 2, "training.micro_batch_size=4", *sets[name])
        assert_same_run(one, tmp_path / name)
