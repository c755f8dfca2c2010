"""training.parallelism: the layouts refused before any weight loads, each in one line with its reason; the sizes
at a world size; what accelerate and transformers are handed; the batches a sequence-parallel group splits.
Runs that split work across processes: tests/e2e/test_parallel_runs.py."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT, refused_in_process, reverse_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import parallelconfig
from tunekit.config.trainingschema import ParallelismConfig
from tunekit.core.errors import TunekitError

ZERO2 = str(ROOT / "ds_configs" / "zero2.json")


@pytest.fixture
def raw(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    return tiny_recipe(tiny_model, data, tmp_path / "run")


def validate_refuses(raw, tmp_path, capsys, monkeypatch, **training) -> str:
    raw = {**raw, "training": {**raw["training"], **training}}
    path = write_recipe(tmp_path / "r.yaml", raw)
    return refused_in_process(["validate", str(path)], tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("training,expected", [
    ({"parallelism": {"sp": 2}}, "training.parallelism.sp splits sequences with DeepSpeed's Ulysses"),
    ({"parallelism": {"sp": 2, "cp": 2}}, "training.parallelism.sp and training.parallelism.cp both split"),
    ({"parallelism": {"cp": 2}}, "training.parallelism.cp is torch's context parallel, which accelerate runs under "
                                 "FSDP2 only: add `fsdp: {}` under training"),
    ({"parallelism": {"tp": 2}}, "training.parallelism.tp trains the whole model (adapter: none)"),
    ({"parallelism": {"sp": 2}, "deepspeed": ZERO2, "chunked_loss": False},
     "set training.chunked_loss: true"),
    ({"parallelism": {"dp_shard": 2}}, "dp_shard and dp_replicate size the sharding beside tp or cp"),
    ({"parallelism": {"cp": 2, "dp_shard": 1, "dp_replicate": 2}, "fsdp": {}},
     "dp_replicate > 1 with dp_shard 1 is plain data parallelism"),
    ({"parallelism": {"sp": 0}}, "training.parallelism.sp"),
    ({"parallelism": {"tp": 2, "dp_shard": 2, "dp_replicate": 2}}, "dp_replicate with tp"),
    ({"parallelism": {"tp": 2}, "metric_for_best": "eval_loss"}, "tp with training.metric_for_best"),
])
def test_layouts_the_engines_cannot_run_are_refused_in_one_line(raw, tmp_path, capsys, monkeypatch, training,
                                                                 expected):
    assert expected in validate_refuses(raw, tmp_path, capsys, monkeypatch, **training)


def test_packing_and_the_sharding_engine_are_refused_where_they_break_the_split(raw, tmp_path, capsys, monkeypatch):
    packed = {**raw, "data": {**raw["data"], "packing": True}}
    line = validate_refuses(packed, tmp_path, capsys, monkeypatch, parallelism={"sp": 2},
                            deepspeed=ZERO2)
    assert "DeepSpeed's Ulysses takes rows of training.micro_batch_size" in line and "data.packing: false" in line
    line = validate_refuses(packed, tmp_path, capsys, monkeypatch, parallelism={"cp": 2}, fsdp={})
    assert "packed examples would see each other" in line
    full = {**raw, "adapter": "none", "lora": None}
    line = validate_refuses(full, tmp_path, capsys, monkeypatch, parallelism={"tp": 2}, deepspeed=ZERO2)
    assert "transformers splits the layers as they load" in line and "remove training.deepspeed" in line


def test_a_method_with_trls_trainer_is_refused(tmp_path, tiny_model, capsys, monkeypatch):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", data={"format": "preference"},
                      training={"method": "dpo", "parallelism": {"sp": 2}, "deepspeed": ZERO2})
    line = refused_in_process(["validate", str(write_recipe(tmp_path / "r.yaml", raw))], tmp_path, capsys,
                              monkeypatch)
    assert "training.parallelism applies to training.method sft" in line and "dpo" in line


def test_the_models_heads_decide_the_sizes_before_weights_load(raw, tmp_path, capsys, monkeypatch):
    """The tiny Llama has 4 attention heads and 2 key/value heads."""
    full = {**raw, "adapter": "none", "lora": None}
    line = validate_refuses(full, tmp_path, capsys, monkeypatch, parallelism={"tp": 4})
    assert "training.parallelism.tp 4 must divide" in line and "4 attention heads and 2 key/value heads" in line
    assert line.endswith("use one of 2")
    line = validate_refuses(raw, tmp_path, capsys, monkeypatch, parallelism={"sp": 8},
                            deepspeed=ZERO2)
    assert "training.parallelism.sp 8 must divide" in line and "use one of 2, 4" in line
    eager = {**raw, "model": {**raw["model"], "attn_implementation": "eager"}}
    line = validate_refuses(eager, tmp_path, capsys, monkeypatch, parallelism={"cp": 2}, fsdp={})
    assert "set model.attn_implementation: sdpa (got eager)" in line
    line = validate_refuses(eager, tmp_path, capsys, monkeypatch, parallelism={"sp": 2}, deepspeed=ZERO2)
    assert "Ulysses leaves out the attention mask, which eager attention needs" in line


def test_sizes_at_a_world_size():
    sp = parallelconfig.layout(ParallelismConfig(sp=2), 4)
    assert (sp.split, sp.data) == (2, 2)
    tp = parallelconfig.layout(ParallelismConfig(tp=2), 8)
    assert (tp.dp_shard, tp.data) == (4, 4)
    assert parallelconfig.describe(tp) == ("tensor parallel 2 (layers split), FSDP2 over 4; 2 processes share each "
                                           "batch, 4 data-parallel groups")
    assert parallelconfig.data_world(None, 3) == 3 and parallelconfig.data_world(ParallelismConfig(sp=2), 4) == 2
    with pytest.raises(TunekitError, match="tp x sp x cp = 2 does not divide the 3 processes launched"):
        parallelconfig.layout(ParallelismConfig(tp=2), 3)
    with pytest.raises(TunekitError, match=r"dp_replicate 1 x dp_shard 2 x tp 2 x cp 1 = 4 processes, but 8"):
        parallelconfig.layout(ParallelismConfig(tp=2, dp_shard=2), 8)
    # plan and validate name their --world-size (tests/plan/test_splitting.py: the commands refuse alike)
    with pytest.raises(TunekitError, match=r"= 8 does not divide --world-size 1 \(a parallel group needs 8\); give "
                                           "--world-size a multiple of 8"):
        parallelconfig.layout(ParallelismConfig(sp=8), 1, "--world-size")
    with pytest.raises(TunekitError, match="= 4 processes, but --world-size is 8; make the product 8"):
        parallelconfig.layout(ParallelismConfig(tp=2, dp_shard=2), 8, "--world-size")


def test_context_parallel_is_refused_without_a_gpu():
    lay = parallelconfig.layout(ParallelismConfig(cp=2), 2)
    parallelconfig.require_device(lay, cuda=True)
    with pytest.raises(TunekitError, match="cp needs GPUs: torch's ring attention") as e:
        parallelconfig.require_device(lay, cuda=False)
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in str(e.value)


def test_what_accelerate_and_transformers_are_handed():
    assert parallelconfig.accelerate_config(parallelconfig.layout(ParallelismConfig(), 2), None) is None
    sp = parallelconfig.accelerate_config(parallelconfig.layout(ParallelismConfig(sp=2), 4), None)
    assert (sp.sp_size, sp.sp_backend, sp.tp_size, sp.dp_shard_size) == (2, "deepspeed", 1, 1)
    assert sp.sp_handler.sp_seq_length_is_variable and sp.sp_handler.sp_attn_implementation == "sdpa"
    tp_lay = parallelconfig.layout(ParallelismConfig(tp=2), 4)
    tp = parallelconfig.accelerate_config(tp_lay, None)
    assert (tp.tp_size, tp.dp_shard_size, tp.dp_replicate_size) == (2, 2, 1)
    split = parallelconfig.load_arguments(tp_lay, None)["distributed_config"]
    assert (split.tp_size, split.fsdp_size) == (2, 2)
    sp_lay = parallelconfig.layout(ParallelismConfig(sp=2), 2)
    assert parallelconfig.load_arguments(sp_lay, None) == {"attn_implementation": "sdpa"}  # what Ulysses is told
    assert parallelconfig.load_arguments(sp_lay, "flash_attention_2") == {}
    assert parallelconfig.load_arguments(None, None) == {}


def test_sequence_parallel_batches_carry_positions_and_split_evenly():
    """Rows padded to a multiple of the pieces (and on CPU to one length), position ids in every batch, the attention
    mask left out, an epoch's last batch filled with rows that train nothing."""
    from tunekit.data.collating import InPieces

    def inner(features):
        n = max(len(f) for f in features)
        return {"input_ids": torch.tensor([f + [0] * (n - len(f)) for f in features]),
                "attention_mask": torch.tensor([[1] * len(f) + [0] * (n - len(f)) for f in features]),
                "labels": torch.tensor([f + [-100] * (n - len(f)) for f in features])}

    batch = InPieces(inner, pieces=4, pad_id=9)([[5, 6, 7], [5, 6, 7, 8, 1]])
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0, 9, 9, 9], [5, 6, 7, 8, 1, 9, 9, 9]]
    assert batch["labels"][1].tolist() == [5, 6, 7, 8, 1, -100, -100, -100]
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    fixed = InPieces(inner, pieces=4, pad_id=9, length=10)([[5, 6, 7]])
    assert fixed["input_ids"].shape == (1, 12) and fixed["position_ids"][0].tolist() == list(range(12))
    last = InPieces(inner, pieces=2, pad_id=9, rows=3)([[5, 6, 7]])  # an epoch's last, smaller batch
    assert last["input_ids"].tolist() == [[5, 6, 7, 9], [9, 9, 9, 9], [9, 9, 9, 9]]
    assert last["labels"][1:].eq(-100).all() and last["position_ids"].tolist() == [[0, 1, 2, 3]] * 3


def test_the_accelerate_check_a_tensor_parallel_run_on_cpu_passes_is_still_there():
    """SafeState shows accelerate's ParallelismConfig check a tensor-parallel model's CPU processes as GPUs; the
    check it relies on (a refusal of anything but GPU-like devices, FSDP2 and DeepSpeed) must still be the one."""
    import inspect

    from accelerate.parallelism_config import ParallelismConfig

    source = inspect.getsource(ParallelismConfig._validate_accelerator)
    assert "accelerator.multi_device" in source and "DistributedType.DEEPSPEED" in source
