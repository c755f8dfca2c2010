"""bench/gpu_check.py, the check prepared for an offline GPU machine: its set covers what it must, and its
plumbing (model shapes from the shipped configs, the real-text data, tunekit's run against the TRL script,
the JSON and the table) runs here on the CPU with --tiny."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_set_covers_the_paths_the_check_promises():
    g = gpu_check()
    by_name = {c.name: c for c in g.CHECKS}
    sets = {name: " ".join(c.overrides) for name, c in by_name.items()}
    assert "training.precision=bf16" in sets["lora-bf16"] and by_name["lora-bf16"].trl
    assert "training.precision=fp16" in sets["lora-fp16"]
    q = by_name["qlora-8b"]
    assert g.SHAPES[q.shape] == "meta-llama/Llama-3.1-8B" and "quantization.bits=4" in sets["qlora-8b"]
    assert "paged_adamw_8bit" in sets["qlora-8b"] and q.trl and q.trl["quant4"]
    assert by_name["flagship"].recipe == "llama_qlora.yaml" and by_name["flagship"].merge
    assert "training.fsdp={}" in sets["fsdp2"] and by_name["fsdp2"].torchrun
    assert "zero3.json" in sets["zero3"] and by_name["grpo"].recipe == "smollm2_grpo.yaml"
    assert "training.kernels=liger" in sets["liger"] and "training.kernels=cce" in sets["cce"]
    assert {g.SHAPES[c.shape] for c in g.CHECKS} == {"meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B",
                                                     "Qwen/Qwen2.5-7B"}
    for c in g.CHECKS:  # every recipe it starts from is a shipped one
        assert (ROOT / "recipes" / c.recipe).is_file()


def test_shapes_are_the_shipped_configs_with_the_check_tokenizer_ids():
    g = gpu_check()

    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    full = g.shape_config("llama-8b", Tok, tiny=False)
    assert (full["hidden_size"], full["num_hidden_layers"], full["vocab_size"]) == (4096, 32, 128256)
    assert (full["bos_token_id"], full["eos_token_id"]) == (1, 2)
    tiny = g.shape_config("qwen-7b", Tok, tiny=True)
    assert tiny["model_type"] == "qwen2" and tiny["num_hidden_layers"] == 2 and tiny["vocab_size"] == 152064


@pytest.mark.slow
def test_tiny_run_on_cpu_measures_tunekit_against_trl(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--only", "lora-bf16",
                           "--steps", "3", "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(out.read_text())["checks"][0]
    assert row["result"] == "ok" and row["status"] == "completed" and row["precision"] == "fp32"
    assert len(row["loss"]) == 3 and row["tokens_per_s"] > 0
    assert row["trl"]["tokens_per_s"] > 0 and row["speed_vs_trl"] == pytest.approx(
        row["tokens_per_s"] / row["trl"]["tokens_per_s"])
    assert "vs TRL tok/s" in proc.stdout and "lora-bf16" in proc.stdout
    chat = [json.loads(line) for line in (tmp_path / "work" / "chat.jsonl").read_text().splitlines()]
    assert len(chat) > 100 and {m["role"] for m in chat[0]["messages"]} == {"user", "assistant"}
