"""Training behaviour on a tiny random Llama: loss falls, LoRA leaves the base alone, full
fine-tuning changes it, QLoRA keeps learning after generate(), the run directory is complete."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, logged, reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.core.errors import TunekitError
from tunekit.core.hardware import Precision
from tunekit.models import loader
from tunekit.runs.layout import RunRecord
from tunekit.training import arguments, runner

pytestmark = pytest.mark.slow  # every test here trains, merges or evaluates a model


@pytest.fixture()
def data_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))


def load(tmp_path, raw, *overrides):
    return recipefile.load(write_recipe(tmp_path / "r.yaml", raw), list(overrides))


def base_state(model_dir):
    return load_file(str(model_dir / "model.safetensors"))


def test_lora_lowers_loss_and_leaves_base_weights_unchanged(tmp_path, tiny_model, data_file):
    recipe = load(tmp_path, tiny_recipe(tiny_model, data_file, tmp_path / "run", training={"learning_rate": 1e-2}))
    result = runner.run(recipe)
    history = logged(result.run_dir, "loss")
    assert history[-1] < history[0] - 0.5, history

    before = base_state(tiny_model)
    model = result.trainer.model
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
            for k, v in model.state_dict().items() if "lora_" not in k}
    for name, tensor in before.items():
        assert torch.equal(base[name].cpu(), tensor), f"base weight {name} changed"
    adapter = load_file(str(result.run_dir / "adapter" / "adapter_model.safetensors"))
    assert adapter and any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())


@pytest.mark.parametrize("variant", ["use_dora", "use_rslora", "lr_ratio"])
def test_lora_variants_train_keep_the_base_and_merge_to_the_adapter(variant, tmp_path, tiny_model, data_file):
    """DoRA, rsLoRA and LoRA+ end to end: train, base unchanged, merged logits equal adapter logits."""
    lora = {"use_dora": True} if variant == "use_dora" else {"use_rslora": True} if variant == "use_rslora" else {
        "lr_ratio": 16.0}
    raw = tiny_recipe(tiny_model, data_file, tmp_path / "run", lora=lora,
                      training={"learning_rate": 5e-3, "max_steps": 12, "save_steps": 12})
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode == 0, res.stderr[-2000:]
    run_dir = tmp_path / "run"
    history = logged(run_dir, "loss")
    assert history[-1] < history[0] - 0.3, history
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    if variant == "use_dora":
        assert config["use_dora"] and any("lora_magnitude_vector" in k for k in adapter)
    if variant == "use_rslora":
        assert config["use_rslora"]
    if variant == "lr_ratio":  # LoRA+: the optimizer's groups, as checkpointed
        from tunekit.core import checkpointfile

        state = checkpointfile.load(run_dir / "checkpoints" / "checkpoint-12" / "optimizer.safetensors")
        rates = sorted({g["lr"] for g in state["param_groups"] if g["params"]})  # constant schedule
        assert rates == pytest.approx([5e-3, 16 * 5e-3]), state["param_groups"]
    merged = run_cli("merge", str(run_dir))
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert json.loads((run_dir / "merged" / "tunekit.json").read_text())["parity"]["max_abs_diff"] < 1e-4


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_pissa_and_olora_adapters_are_saved_against_the_original_base(init, tmp_path, tiny_model, data_file):
    """These inits move part of each base weight into the adapter and train W_res + BA; the saved
    adapter is converted so that the original base plus it is the model that was trained."""
    from tunekit.export import merge
    from tunekit.runs import layout
    from tunekit.runs import trained as trained_mod

    raw = tiny_recipe(tiny_model, data_file, tmp_path / "run", lora={"init": init},
                      training={"learning_rate": 5e-3, "max_steps": 8, "save_steps": 8})
    result = runner.run(load(tmp_path, raw))
    history = logged(result.run_dir, "loss")
    assert history[-1] < history[0] - 0.3, history
    recipe = recipefile.load(result.run_dir / "recipe.yaml")
    tok = loader.load_tokenizer(recipe.model, result.run_dir / "adapter")
    batch = merge.parity_batch(recipe, tok)
    trained = merge.logits(result.trainer.model.float(), batch)
    reloaded = merge.logits(trained_mod.load_trained(layout.resolve_target(str(result.run_dir)), torch.float32),
                            batch)
    mask = batch["attention_mask"].bool()
    assert (trained[mask] - reloaded[mask]).abs().max().item() < 1e-4
    config = json.loads((result.run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 2 * 8 and config["init_lora_weights"] is True
    merged = run_cli("merge", str(result.run_dir))
    assert merged.returncode == 0, merged.stderr[-2000:]


def test_run_directory_contents_and_no_overwrite_without_force(tmp_path, tiny_model, data_file):
    raw = tiny_recipe(tiny_model, data_file, tmp_path / "run", training={"max_steps": 4},
                      data={"eval_fraction": 0.25})
    path = write_recipe(tmp_path / "r.yaml", raw)
    res = run_cli("train", str(path))
    assert res.returncode == 0, res.stderr
    run_dir = tmp_path / "run"
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (run_dir / "adapter" / "tokenizer.json").is_file()
    assert not list(run_dir.rglob("adapter/*.bin"))
    info = RunRecord.load(run_dir)
    assert info.status == "completed" and info.versions["transformers"]
    assert info.command[1:] == ["train", str(path)] and info.precision["name"] == "fp32"
    assert info.data["eval"]["examples"] == 8 and info.eval_loss is not None
    assert recipefile.load(run_dir / "recipe.yaml").training.max_steps == 4
    assert len(logged(run_dir, "loss")) >= 4
    assert (run_dir / "checkpoints" / "checkpoint-4").is_dir()
    assert "precision: fp32" in res.stderr and "= 8 examples per optimizer step" in res.stderr
    page = (run_dir / "report.html").read_text()  # written at the end of `tunekit train`
    assert f"report: {run_dir / 'report.html'}" in res.stderr and '"loss": [[1,' in page

    stamp = (run_dir / "run.json").stat().st_mtime_ns
    again = run_cli("train", str(path))
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "already exists; pass --force" in again.stderr.strip().splitlines()[-1]
    assert (run_dir / "run.json").stat().st_mtime_ns == stamp
    forced = run_cli("train", str(path), "--force", "--set", "training.max_steps=2")
    assert forced.returncode == 0, forced.stderr
    assert not (run_dir / "checkpoints" / "checkpoint-4").exists()


def test_full_finetuning_changes_base_weights(tmp_path, tiny_model, data_file):
    raw = tiny_recipe(tiny_model, data_file, tmp_path / "run", adapter="none", lora=None,
                      training={"max_steps": 10, "learning_rate": 1e-3})
    result = runner.run(load(tmp_path, raw))
    history = logged(result.run_dir, "loss")
    assert history[-1] < history[0] - 0.5, history
    before = base_state(tiny_model)
    after = load_file(str(result.run_dir / "model" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), set(before) - set(changed)


def _lora_grads(recipe, call_generate: bool, tokenizer):
    torch.manual_seed(0)
    model = loader.load_for_training(recipe, Precision("fp32", "test"))
    batch = tokenizer(["Reverse the word: catdog"], return_tensors="pt")
    if call_generate:
        model.eval()
        with torch.no_grad():
            model.generate(**batch, max_new_tokens=3, do_sample=False)
        model.train()
    # non-zero B so that the gradient of the lower A matrices depends on flow through the base layers
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.constant_(p, 0.01)
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def test_qlora_still_learns_after_generate(tmp_path, tiny_model, tiny_tokenizer, data_file):
    raw = tiny_recipe(tiny_model, data_file, tmp_path / "run", adapter="qlora", quantization={"quant_type": "nf4"})
    recipe = load(tmp_path, raw)
    clean = _lora_grads(recipe, False, tiny_tokenizer)
    after_generate = _lora_grads(recipe, True, tiny_tokenizer)
    first_layer_a = [n for n in clean if "layers.0." in n and "lora_A" in n]
    assert first_layer_a and all(clean[n].abs().sum() > 0 for n in first_layer_a)
    for name, grad in clean.items():
        torch.testing.assert_close(after_generate[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    # and through the Trainer, with an eval pass (no-grad forwards) before training steps
    result = runner.run(load(tmp_path, {**raw, "data": {**raw["data"], "eval_fraction": 0.25},
                                        "training": {**raw["training"], "eval_steps": 5, "learning_rate": 1e-2}}))
    history = logged(result.run_dir, "loss")
    assert history[-1] < history[0] - 0.5, history


def test_flagship_recipe_settings_run_on_cpu_with_a_local_model(tmp_path, tiny_model, data_file):
    """recipes/llama_qlora.yaml as shipped (QLoRA nf4, bf16, ZeRO-2, accumulation, checkpointing,
    paged 8-bit AdamW), with only the model, data and length swapped for local, small ones."""
    overrides = [
        f"model.name_or_path={tiny_model}", f"data.train={data_file}", "data.eval_fraction=0.25",
        "data.max_length=64", "training.max_steps=2", "training.logging_steps=1", "training.eval_steps=2",
        "training.save_steps=2", f"output_dir={tmp_path / 'run'}", "model.attn_implementation=null",
    ]
    recipe = recipefile.load(ROOT / "recipes" / "llama_qlora.yaml", overrides)
    assert recipe.adapter_kind == "qlora" and recipe.training.deepspeed.endswith("ds_configs/zero2.json")
    assert recipe.training.gradient_checkpointing and recipe.training.gradient_accumulation_steps == 8
    # through the CLI, as users run it: DeepSpeed sets up process-wide state
    res = run_cli("train", "recipes/llama_qlora.yaml", *[a for o in overrides for a in ("--set", o)])
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "run"
    info = RunRecord.load(run_dir)
    assert info.status == "completed" and info.precision["name"] == "bf16"
    assert info.effective_batch == 16 and info.global_step == 2
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_fp16_on_cpu_is_refused_with_a_clear_message(tmp_path, tiny_model, data_file):
    recipe = load(tmp_path, tiny_recipe(tiny_model, data_file, tmp_path / "run", training={"precision": "fp16"}))
    with pytest.raises(TunekitError, match="training.precision=fp16 needs a CUDA GPU"):
        runner.run(recipe)


@pytest.mark.parametrize("training, has_eval, expected", [
    ({"max_steps": 20, "save_steps": 5, "eval_steps": 4}, True,
     {"save_strategy": "steps", "save_steps": 5, "eval_strategy": "steps", "eval_steps": 4}),
    ({"max_steps": 20}, True, {"save_strategy": "steps", "save_steps": 20, "eval_strategy": "steps", "eval_steps": 20}),
    ({"max_steps": None, "epochs": 2}, True, {"save_strategy": "epoch", "eval_strategy": "epoch"}),
    ({"max_steps": 20, "eval_steps": 4}, False, {"save_strategy": "steps", "save_steps": 20, "eval_strategy": "no"}),
])
def test_save_and_eval_schedules(tmp_path, tiny_model, data_file, training, has_eval, expected):
    recipe = load(tmp_path, tiny_recipe(tiny_model, data_file, tmp_path / "run", training=training))
    args = arguments.training_arguments(recipe, Precision("fp32", "test"), tmp_path / "run", has_eval)
    for key, value in expected.items():
        got = getattr(args, key)
        assert (got.value if hasattr(got, "value") else got) == value, key


@pytest.mark.slow
def test_a_run_that_ends_before_its_first_step_is_marked_failed_and_retried_without_force(tmp_path, tiny_model,
                                                                                          monkeypatch):
    """The Trainer cannot be built (run.json already written "running"): run.json says failed with the cause,
    and the same command again starts over without --force; a run with a step done still needs --force."""
    from tunekit.runs.layout import RunRecord

    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, write_jsonl(tmp_path / "d.jsonl",
                                                                                 reverse_rows(16)),
                                                         tmp_path / "run", training={"max_steps": 2}))

    def no_trainer(*args, **kwargs):
        raise RuntimeError("no trainer today")

    monkeypatch.setattr(runner, "build_trainer", no_trainer)
    with pytest.raises(RuntimeError, match="no trainer today"):
        runner.run(recipefile.load(path))
    record = RunRecord.load(tmp_path / "run")
    assert (record.status, record.error, record.failed_at_step) == ("failed", "no trainer today", 0)
    monkeypatch.undo()
    res = run_cli("train", str(path))  # the same command: no --force
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ended before its first step (no trainer today); starting it again" in res.stderr
    assert RunRecord.load(tmp_path / "run").status == "completed"
    again = run_cli("train", str(path))
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr


@pytest.mark.parametrize("overrides, cuda, ds, expected", [
    ((), True, None, "adamw_torch_fused"),  # AdamW left at its default runs fused
    ((), False, None, "adamw_torch_fused"),
    ((), True, {"zero_optimization": {"stage": 2}}, "adamw_torch"),  # DeepSpeed's engine steps the optimizer
    (("training.fsdp={}",), False, None, "adamw_torch"),  # sharded over CPU processes: as set
    (("training.fsdp={}",), True, None, "adamw_torch_fused"),
    (("training.optimizer=adamw_torch",), True, None, "adamw_torch"),  # set in the recipe: kept
    (("training.optimizer=paged_adamw_8bit",), True, None, "paged_adamw_8bit"),
])
def test_adamw_left_at_its_default_runs_fused(tmp_path, tiny_model, data_file, overrides, cuda, ds, expected):
    recipe = load(tmp_path, tiny_recipe(tiny_model, data_file, tmp_path / "run"), *overrides)
    assert arguments.optimizer_name(recipe.training, ds, cuda) == expected
