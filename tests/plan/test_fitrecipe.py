"""`tunekit init` (plan.fitrecipe): from a model, a data file and a target it writes a recipe whose plan fits, each
choice commented with the plan's figures, or says in one line that nothing fits and what would; the data format comes
from the file's first record, and a recipe written for this CPU trains as written."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import ROOT, in_full, refused_in_process, reverse_rows, write_jsonl
from tunekit import api
from tunekit.config import recipefile
from tunekit.core.errors import TunekitError
from tunekit.plan import fitrecipe

pytestmark = pytest.mark.slow  # plans of 1B to 405B models on the meta device
DATA = str(ROOT / "recipes" / "data" / "extract_train.jsonl")
SHAPES = {"1b": "meta-llama/Llama-3.2-1B", "8b": "meta-llama/Llama-3.1-8B", "70b": "meta-llama/Llama-3.1-70B"}
TARGETS = ["8GiB", "24GiB", "80GiB", "8x8GiB", "8x24GiB", "8x80GiB"]
# make test: one case per rung of the ladder, and the choice each must make; the rest of the shapes x targets are
# make test-full's (a 70B plan takes seconds each)
KEPT = {("1b", "8GiB"): "LoRA", ("8b", "8GiB"): "QLoRA (4-bit weights) with gradient checkpointing",
        ("70b", "8x24GiB"): "LoRA with checkpointing, ZeRO-3 across the GPUs",
        ("8b", "3GiB"): "LoRA with checkpointing, ZeRO-3 offloading weights and optimizer to CPU memory"}


@pytest.mark.parametrize("shape, target", [(s, t) if (s, t) in KEPT else in_full(s, t) for s in SHAPES
                                           for t in TARGETS] + [("8b", "3GiB")])
def test_the_written_recipe_validates_and_its_plan_fits(tmp_path, monkeypatch, shape, target):
    monkeypatch.chdir(tmp_path)
    out, fitted, where = fitrecipe.write(SHAPES[shape], DATA, target, tmp_path / "r.yaml")
    if (shape, target) in KEPT:
        assert fitted.choice.label == KEPT[shape, target]
    planned = api.plan(out, world_size=where.world, gpu_memory=where.memory)  # as `tunekit plan` plans it
    assert planned.fits and planned.peak <= fitrecipe.HEADROOM * where.memory
    text = out.read_text()
    assert f"The plan: {planned.peak / fitrecipe.GIB:.1f} GiB a device" in text, text
    raw = yaml.safe_load(text)
    t = raw["training"]
    assert t["micro_batch_size"] * raw["data"]["max_length"] * where.world * t["gradient_accumulation_steps"] \
        == pytest.approx(65536, rel=0.5)
    assert ("deepspeed" in t) == ("ZeRO-3" in fitted.choice.label)
    assert ("quantization" in raw) == ("QLoRA" in fitted.choice.label)
    for rejected, micro, peak in fitted.tried:  # what was passed over did not fit
        assert peak > fitrecipe.HEADROOM * where.memory, (rejected, micro, peak)


def test_nothing_fits_is_one_line_naming_the_smallest_plan_and_what_would_and_nothing_is_written(tmp_path):
    with pytest.raises(TunekitError) as e:
        fitrecipe.write(SHAPES["1b"], DATA, "0.5GiB", tmp_path / "r.yaml")
    line = str(e.value)
    assert "\n" not in line and re.match(
        r"nothing fits 1 GPU of 0.5 GiB: the smallest plan, LoRA with checkpointing, ZeRO-3 offloading .+ at "
        r"micro-batch 1, needs \d+\.\d GiB a device, over the \d\.\d GiB that leaves 10% spare; a GPU of \d+ GiB "
        r"would hold it", line), line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("record, fmt, method", [
    ({"messages": [{"role": "user", "content": "a"}]}, "chat", "sft"),
    ({"instruction": "a", "input": "", "output": "b"}, "alpaca", "sft"),
    ({"prompt": "a", "completion": "b"}, "prompt_completion", "sft"),
    ({"text": "a"}, "text", "sft"),
    ({"prompt": "a", "chosen": "b", "rejected": "c"}, "preference", "dpo"),
    ({"prompt": "a", "completion": "b", "label": True}, "unpaired_preference", "kto"),
])
def test_the_data_format_comes_from_the_first_records_keys(tmp_path, record, fmt, method):
    assert fitrecipe.detect_format(str(write_jsonl(tmp_path / "d.jsonl", [record])))[:2] == (fmt, method)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    write_jsonl(tmp_path / "odd.jsonl", [{"question": "a", "answer": "b"}])
    (tmp_path / "taken.yaml").write_text("mine\n")
    cases = {("--target", "24GB!"): "--target 24GB!: give cpu, the memory of one GPU (24GiB)",
             ("--target", "0x24GiB"): "--target 0x24GiB: give cpu",
             ("--data", "odd.jsonl"): "the first record's keys ['answer', 'question'] name no data format",
             ("--out", "taken.yaml"): "--out taken.yaml exists; pass --force to replace it"}
    for (flag, value), expected in cases.items():
        argv = {"--model": SHAPES["1b"], "--data": DATA, "--target": "24GiB", "--out": "new.yaml", flag: value}
        line = refused_in_process(["init", *[w for kv in argv.items() for w in kv]], tmp_path, capsys, monkeypatch)
        assert expected in line, line
    assert (tmp_path / "taken.yaml").read_text() == "mine\n"


def test_targets_parse():
    assert fitrecipe.parse_target("cpu") == fitrecipe.Target(None)
    assert fitrecipe.parse_target("24GiB") == fitrecipe.Target(24 * fitrecipe.GIB)
    assert fitrecipe.parse_target("2x8x80GiB") == fitrecipe.Target(80 * fitrecipe.GIB, 8, 2)
    assert fitrecipe.parse_target("2x8x80GiB").words() == "2 nodes x 8 GPUs of 80 GiB"


def test_a_recipe_written_for_this_cpu_trains_as_written(tmp_path, monkeypatch, tiny_model):
    """On the tiny model and reversal data: precision as this CPU computes, LoRA, and a run of the written recipe
    (two steps) that completes."""
    from tunekit.core.hardware import cpu_has_bf16
    from tunekit.training import runner

    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(16))
    out, fitted, _ = fitrecipe.write(str(tiny_model), str(data), "cpu", tmp_path / "r.yaml", tokens_per_step=512)
    raw = yaml.safe_load(out.read_text())
    assert raw["training"]["precision"] == ("bf16" if cpu_has_bf16() else "fp32") and fitted.choice.label == "LoRA"
    assert "this CPU" in out.read_text()
    result = runner.run(recipefile.load(out, ["training.max_steps=2", f"output_dir={tmp_path / 'run'}"]))
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "completed", result
