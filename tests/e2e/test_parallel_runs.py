"""training.parallelism on CPU processes (gloo): sequence parallel (DeepSpeed's Ulysses) and tensor parallel
(transformers' plan) runs equal one process, write no pickles and resume to the uninterrupted run's weights.
Context parallel needs GPUs (torch's ring attention has no CPU kernel to shard): tests/config/test_parallelism.py
has its refusal."""

from __future__ import annotations

import pytest
from test_multiprocess import assert_same_run

from conftest import (
    assert_no_pickles,
    cut_after_checkpoint,
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

SP = ["training.deepspeed=ds_configs/zero2.json", "training.parallelism={sp: 2}"]
TP = ["adapter=none", "lora=null", "training.parallelism={tp: 2}"]


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("par")
    data = write_jsonl(root / "train.jsonl", reverse_rows(32))
    # 4 steps an epoch: step 6 is inside the second
    raw = tiny_recipe(tiny_model, data, root / "unused", training={"max_steps": 8, "save_steps": 2,
                                                                   "save_total_limit": 10})
    return write_recipe(root / "r.yaml", raw)


def one_process(recipe_file, out, *overrides):
    sets = [a for o in overrides for a in ("--set", o)]
    res = run_cli("train", str(recipe_file), "--set", f"output_dir={out}", *sets)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def sequence_parallel(recipe_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "run"
    return out, launch(recipe_file, out, 2, *SP).stderr


def test_sequence_parallel_equals_one_process_and_writes_no_pickles(sequence_parallel, recipe_file, tmp_path):
    """Each row split in two along the sequence, attention heads exchanged: the losses and the adapter of one
    process with the same 8 examples a step (padded batches: Ulysses takes whole rows)."""
    out, stderr = sequence_parallel
    assert "parallelism: sequence parallel 2 (DeepSpeed Ulysses); 2 processes share each batch" in stderr
    assert "world size 2 (1 seeing different batches) x micro-batch 8 x accumulation 1 = 8 examples" in stderr
    assert "batches: padded" in stderr
    single = one_process(recipe_file, tmp_path / "one", "data.packing=false")
    assert logged(out, "loss")[-1] < logged(out, "loss")[0] - 0.2
    assert_same_run(single, out)
    assert logged(out, "grad_norm") == pytest.approx(logged(single, "grad_norm"), rel=1e-4)
    assert_no_pickles(out)
    assert RunRecord.load(out).effective_batch == 8


@pytest.mark.parametrize("step", [2, 6])
def test_sequence_parallel_resumes_to_the_uninterrupted_run(sequence_parallel, recipe_file, tmp_path, step):
    """Cut inside the first epoch and inside the second: the resumed run reads each epoch in the uninterrupted
    run's order, past the batches it trained (DeepSpeed's Ulysses loader is given the epoch: trainer.follow_epochs)."""
    full, _ = sequence_parallel
    cut = cut_after_checkpoint(full, tmp_path / "cut", step)
    res = launch(recipe_file, cut, 2, *SP, flags=["--resume"])
    assert f"resuming from checkpoint-{step}" in res.stderr
    assert logged(cut, "loss") == pytest.approx(logged(full, "loss"), rel=1e-4)
    assert_same_run(full, cut)


@pytest.mark.full  # make test-full: tests/moved2-full-last-run.json
def test_sequence_parallel_under_zero3_equals_one_process(recipe_file, tmp_path):
    """ZeRO-3 averages the sequence group's gradients where ZeRO-2 sums them: the loss is scaled to match, so the
    gradient norms are one process's too (Adam's steps alone would hide a constant factor)."""
    out = tmp_path / "z3"
    launch(recipe_file, out, 2, "training.deepspeed=ds_configs/zero3.json", "training.parallelism={sp: 2}")
    single = one_process(recipe_file, tmp_path / "one", "data.packing=false")
    assert_same_run(single, out)
    assert logged(out, "grad_norm") == pytest.approx(logged(single, "grad_norm"), rel=1e-4)


@pytest.fixture(scope="module")
def tensor_parallel(recipe_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "run"
    return out, launch(recipe_file, out, 2, *TP).stderr


def test_tensor_parallel_equals_one_process_and_writes_no_pickles(tensor_parallel, recipe_file, tmp_path):
    """Full fine-tuning with each layer's matrices split in two (transformers' plan for Llama): the losses and
    weights of one process; checkpoints hold the whole model and optimizer state, gathered."""
    out, stderr = tensor_parallel
    assert "parallelism: tensor parallel 2 (layers split); 2 processes share each batch" in stderr
    single = one_process(recipe_file, tmp_path / "one", *TP[:2])
    assert logged(out, "loss")[-1] < logged(out, "loss")[0] - 0.2
    assert_same_run(single, out)
    saved = {p.name for p in assert_no_pickles(out)}
    assert {"optimizer.safetensors", "model.safetensors", "rng_state_1.safetensors"} <= saved


def test_tensor_parallel_resumes_to_the_uninterrupted_run(tensor_parallel, recipe_file, tmp_path):
    full, _ = tensor_parallel
    cut = cut_after_checkpoint(full, tmp_path / "cut", 2)
    res = launch(recipe_file, cut, 2, *TP, flags=["--resume"])
    assert "resuming from checkpoint-2" in res.stderr
    assert_same_run(full, cut)
