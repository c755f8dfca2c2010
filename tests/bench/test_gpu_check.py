"""bench/gpu_check.py, the check prepared for an offline GPU machine: its set covers what it must, and its
shapes are the shipped configs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    assert "training.kernels=liger" in sets["liger"] and "training.kernels=cut_cross_entropy" in sets["cce"]
    assert {g.SHAPES[c.shape] for c in g.CHECKS} == {"meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B",
                                                     "Qwen/Qwen2.5-7B", "Qwen/Qwen3-30B-A3B"}
    moe = by_name["moe-qlora"]
    assert g.SHAPES[moe.shape] == "Qwen/Qwen3-30B-A3B" and "quantization.bits=4" in sets["moe-qlora"]
    assert moe.trl and moe.trl["quant4"] and moe.needs == ""  # --tiny runs it on a CPU too
    vlm = by_name["vlm-qlora"]
    assert vlm.recipe == "qwen_vl_qlora.yaml" and vlm.shape in g.VISION_SHAPES and vlm.data == "vision"
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
    moe = g.shape_config("qwen3-moe", Tok, tiny=False)  # each layer as released, 8 of the 48
    assert (moe["num_hidden_layers"], moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"],
            moe["hidden_size"]) == (8, 128, 8, 768, 2048)
    assert g.shape_config("qwen3-moe", Tok, tiny=True)["num_experts"] == 8


def test_moe_flops_count_the_experts_a_token_reaches():
    """A mixture of experts costs a token its top-k experts, not all of them: the same model with one expert per
    token and dense layers of that expert's width cost the same."""
    g = gpu_check()
    moe = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16, vocab_size=100,
               tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    every_expert = 2 * 8 * 3 * 64 * 32
    reached = 2 * 2 * 3 * 64 * 32
    dense = {k: v for k, v in moe.items() if not k.startswith(("num_experts", "moe_"))}
    assert g.flops_per_token(moe, 10_000 + every_expert, False, 128) == g.flops_per_token(dense, 10_000 + reached,
                                                                                       False, 128)
    saved = {**{k: v for k, v in moe.items() if k != "num_experts"}, "num_local_experts": 8}  # config.json's name
    assert g.flops_per_token(saved, 10_000 + every_expert, False, 128) == g.flops_per_token(moe, 10_000 + every_expert,
                                                                                         False, 128)
    # DeepSeek-V3's names: routed experts in all but its first dense layer; the shared experts, in `parameters`, are
    # every token's
    deepseek = {**{k: v for k, v in moe.items() if k != "num_experts"}, "n_routed_experts": 8, "n_shared_experts": 1,
                "first_k_dense_replace": 1}
    one_layer = 8 * 3 * 64 * 32
    assert g.flops_per_token(deepseek, 10_000 + one_layer, False, 128) == g.flops_per_token(
        dense, 10_000 + one_layer // 4, False, 128)


# Its CPU run of a text row (--tiny, tunekit against the TRL script) is tests/bench/test_gpu_kit.py's, from the kit,
# as on a GPU machine (make test-full).


@pytest.mark.slow
@pytest.mark.full  # make test-full: tests/moved2-full-last-run.json
def test_the_moe_check_trains_4_bit_experts_beside_the_plan_and_trl_on_a_cpu(tmp_path):
    """--tiny: the Qwen3-30B-A3B architecture narrowed (8 experts, top-2), its experts stored in 4 bits and trained
    through LoRA, the plan beside it and TRL's script on the same model."""
    import json
    import subprocess

    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--only", "moe-qlora",
                          "--steps", "6", "--work", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (row,) = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert row["result"] == "ok" and row["plan"] and len(row["loss"]) == 6 and row["tokens_per_s"], row
    assert row["trl"]["steady_tokens_per_s"] and row["memory_vs_trl"], row["trl"]
    log = (tmp_path / "moe-qlora.log").read_text()
    assert "the experts' 3-D weights are stored in 4 bits too (nf4)" in log
    assert "experts run through transformers' grouped_mm path" in log and "train through LoRA on their 3-D" in log
    config = json.loads((tmp_path / "models" / "qwen3-moe" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 8


@pytest.mark.slow
@pytest.mark.full  # make test-full: tests/moved2-full-last-run.json
def test_the_vision_check_trains_on_image_batches_on_a_cpu(tmp_path):
    """--tiny: the LLaVA composition built from LlavaConfig's tower on the Llama shape, saved with its processor,
    trained with qwen_vl_qlora.yaml's settings on the shapes and planned beside it."""
    import json
    import subprocess

    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--only", "vlm-qlora",
                          "--steps", "3", "--work", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (row,) = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert row["result"] == "ok" and row["plan"] and len(row["loss"]) == 3, row
    log = (tmp_path / "vlm-qlora.log").read_text()
    assert "vision: training the language model" in log and "packing: off for a vision-language model" in log
    config = json.loads((tmp_path / "models" / "llava-1b" / "config.json").read_text())
    assert config["model_type"] == "llava" and config["vision_config"]["patch_size"] == 14


def test_steady_tokens_per_second_leaves_the_warm_up_out():
    g = gpu_check()
    # step 1 takes 10 s (start-up), then 100 tokens a second; an eval line (no loss) is not a step
    rows = [{"step": 1, "time": 10.0, "tokens_collated": 100, "loss": 3.0}, {"step": 1, "time": 11.0, "eval_loss": 2}]
    rows += [{"step": s, "time": 10.0 + s - 1, "tokens_collated": 100 * s, "loss": 3.0} for s in range(2, 9)]
    assert g.steady(rows, warm=3) == 100.0
    assert g.steady(rows[:5], warm=3) is None  # too few steps after the warm-up


def test_steady_leaves_profiled_steps_out_and_step_times_are_kept():
    g = gpu_check()
    rows = [{"step": s, "time": float(s), "tokens_collated": 100 * s, "loss": 3.0} for s in range(1, 9)]
    rows += [{"step": 9, "time": 30.0, "tokens_collated": 900, "loss": 3.0}]  # a profiled step, 22 s slower
    assert g.steady(rows, warm=3) < 50 and g.steady(rows, warm=3, until=8) == 100.0
    assert g.step_seconds(rows) == [1.0] * 7 + [22.0]


def test_flops_per_token_is_the_stated_formula():
    g = gpu_check()
    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 4, "vocab_size": 10,
           "tie_word_embeddings": False}
    # 1080 parameters, 80 of them the input embeddings (a lookup); attention 6 x 2 layers x 100 x (2 x 4)
    assert g.flops_per_token(cfg, 1080, False, 100.0) == 4 * 1000 + 6 * 2 * 100 * 8
    assert g.flops_per_token({**cfg, "tie_word_embeddings": True}, 1080, True, 100.0) == 6 * 1080 + 9600


def test_the_step_profile_counts_host_syncs_and_operators():
    import torch
    from torch.profiler import ProfilerActivity, profile

    spec = importlib.util.spec_from_file_location("step_profile", ROOT / "bench" / "step_profile.py")
    step_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_profile)
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):  # two "steps": a matmul and one .item() each
            (x @ x).sum().item()
    out = step_profile.summarize(prof, steps=2)
    assert out["host_syncs_per_step"]["aten::_local_scalar_dense"] == 1
    assert out["top_operators_ms_per_step"][0][0] and out["operators_per_step"] >= 3


@pytest.mark.slow
@pytest.mark.full  # make test-full: tests/moved2-full-last-run.json
def test_the_varlen_parity_check_runs_on_a_cpu(tmp_path):
    import json
    import subprocess

    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--only", "varlen-parity",
                          "--work", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (row,) = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    found = row["found"]
    assert row["result"] == "ok" and found["loss_varlen"] == pytest.approx(found["loss_sdpa"], rel=1e-5), row
