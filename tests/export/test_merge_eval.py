"""Merge parity for LoRA and QLoRA, atomic merge output, and eval of runs, merged and base models."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.core.errors import TunekitError
from tunekit.data import split
from tunekit.data.rendering import Renderer
from tunekit.export import merge
from tunekit.models import loader
from tunekit.runs import layout, trained

pytestmark = pytest.mark.slow  # every test here trains, merges or evaluates a model


def _train(tmp_path_factory, tiny_model, name, **sections):
    root = tmp_path_factory.mktemp(name)
    data = write_jsonl(root / "train.jsonl", reverse_rows(40))
    sections["training"] = {"max_steps": 12, "learning_rate": 1e-2, **sections.get("training", {})}
    raw = tiny_recipe(tiny_model, data, root / "run", data={"eval_fraction": 0.2}, **sections)
    res = run_cli("train", str(write_recipe(root / "r.yaml", raw)))
    assert res.returncode == 0, res.stderr[-2000:]
    return root / "run"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model):
    return _train(tmp_path_factory, tiny_model, "lora", eval={"batch_size": 4, "max_new_tokens": 8})


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tiny_model):
    # trained in bf16 like the flagship recipe: the merge must re-quantize from bf16 weights
    return _train(tmp_path_factory, tiny_model, "qlora", adapter="qlora", quantization={"quant_type": "nf4"},
                  training={"precision": "bf16"})


def _inputs(run_dir):
    recipe = recipefile.load(run_dir / "recipe.yaml")
    tok = loader.load_tokenizer(recipe.model, run_dir / "adapter")
    return recipe, merge.parity_batch(recipe, tok)


def _adapter_logits(run_dir, batch):
    """The adapter model as trained (QLoRA: re-quantized from the training dtype), computing in fp32."""
    model = trained.load_trained(layout.resolve_target(str(run_dir)), torch.float32)
    return merge.logits(model, batch)


@pytest.mark.parametrize("which", ["lora_run", "qlora_run"])
def test_merged_directory_reloads_with_adapter_logits(which, request):
    run_dir = request.getfixturevalue(which)
    res = run_cli("merge", str(run_dir))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "parity: max |logit diff|" in res.stderr
    merged = run_dir / "merged"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "chat_template.jinja", "README.md", "recipe.yaml", "tunekit.json"):
        assert (merged / name).is_file(), name
    assert not list(merged.glob("*.bin")) and not list(merged.glob("adapter_*"))
    card = (merged / "README.md").read_text()
    assert "Base model:" in card and "## Recipe" in card
    info = json.loads((merged / "tunekit.json").read_text())
    assert info["parity"]["max_abs_diff"] <= 1e-3 and info["parity"]["top1_agreement"] == 1.0

    _, batch = _inputs(run_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(merged)  # plain transformers, no tunekit, no peft
    assert getattr(reloaded.config, "quantization_config", None) is None
    got = merge.logits(reloaded, batch)
    want = _adapter_logits(run_dir, batch)
    mask = batch["attention_mask"].bool()
    assert (got[mask] - want[mask]).abs().max().item() < 1e-4
    assert (got[mask].argmax(-1) == want[mask].argmax(-1)).all()


def test_qlora_merge_into_original_weights_would_differ(qlora_run):
    """Why QLoRA is merged into the dequantized base: the original weights give another model."""
    recipe, batch = _inputs(qlora_run)
    base = loader.load_base(recipe.model, torch.float32)
    from peft import PeftModel

    naive = PeftModel.from_pretrained(base, str(qlora_run / "adapter")).merge_and_unload()
    want = _adapter_logits(qlora_run, batch)
    mask = batch["attention_mask"].bool()
    assert (merge.logits(naive, batch)[mask] - want[mask]).abs().max().item() > 1e-3


def test_failed_parity_or_crash_leaves_nothing_at_target(lora_run, tmp_path, monkeypatch):
    target = tmp_path / "out"
    res = run_cli("merge", str(lora_run), "--out", str(target), "--tolerance", "1e-12")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "merge refused: parity" in res.stderr and "nothing written" in res.stderr
    assert not target.exists() and list(tmp_path.iterdir()) == []

    def crash(self, path, *args, **kwargs):
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    from pathlib import Path

    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        merge.merge(lora_run, target)
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_merge_refuses_to_overwrite_without_force(lora_run, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(TunekitError, match="already exists; pass --force"):
        merge.merge(lora_run, target)
    assert (target / "keep.txt").read_text() == "mine"


def test_train_with_eval_section_scores_the_run(lora_run):
    result = json.loads((lora_run / "eval" / "metrics.json").read_text())
    scores = result["scores"]
    assert scores["examples"] == 8
    for key in ("bleu", "chrf", "rouge1", "rouge2", "rougeL", "rougeLsum", "exact_match", "eval_loss", "perplexity"):
        assert key in scores
    assert "tok:13a" in result["settings"]["bleu_signature"]
    rows = [json.loads(line) for line in (lora_run / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and set(rows[0]) == {"where", "prompt", "reference", "prediction"}
    # prompts are built exactly as in training: the held-out split, rendered with the chat template
    recipe = recipefile.load(lora_run / "recipe.yaml")
    tok = loader.load_tokenizer(recipe.model, lora_run / "adapter")
    held = split.held_out(recipe.data, recipe.training.seed)
    rendered = [Renderer(recipe.data, tok).render(r) for r in held]
    assert [r["prompt"] for r in rows] == [r.prompt for r in rendered]
    assert [r["reference"] for r in rows] == [r.values["output"] for r in held]
    assert [r["where"] for r in rows] == [r.where for r in held]


def test_eval_base_model_adapter_run_and_compare(lora_run, tiny_model, tmp_path):
    recipe_file = lora_run / "recipe.yaml"
    base = run_cli("eval", str(tiny_model), "--recipe", str(recipe_file), "--out", str(tmp_path / "base"),
                   "--max-new-tokens", "4", "--batch-size", "3")
    assert base.returncode == 0, base.stderr[-2000:]
    base_metrics = json.loads((tmp_path / "base" / "metrics.json").read_text())
    assert base_metrics["kind"] == "base" and base_metrics["scores"]["examples"] == 8

    both = run_cli("eval", str(lora_run), "--compare", str(tiny_model), "--recipe", str(recipe_file),
                   "--out", str(tmp_path / "cmp"), "--max-new-tokens", "4")
    assert both.returncode == 0, both.stderr[-2000:]
    header = both.stdout.splitlines()[0]
    assert "run:run" in header and f"base:{tiny_model}" in header and "change" in header
    run_loss = json.loads((tmp_path / "cmp" / "target" / "metrics.json").read_text())["scores"]["eval_loss"]
    assert run_loss < base_metrics["scores"]["eval_loss"]  # the adapter learned the task


def test_eval_of_merged_matches_adapter_run(lora_run, tmp_path):
    merged = tmp_path / "merged"
    assert run_cli("merge", str(lora_run), "--out", str(merged)).returncode == 0
    res = run_cli("eval", str(merged), "--out", str(tmp_path / "m"), "--max-new-tokens", "8", "--batch-size", "4")
    assert res.returncode == 0, res.stderr[-2000:]
    merged_rows = (tmp_path / "m" / "predictions.jsonl").read_text()
    run_rows = (lora_run / "eval" / "predictions.jsonl").read_text()
    assert merged_rows == run_rows


def test_batched_generation_matches_one_at_a_time(lora_run):
    recipe = recipefile.load(lora_run / "recipe.yaml")
    from tunekit.evaluation import evaluator

    target = layout.resolve_target(str(lora_run))
    tok = loader.load_tokenizer(recipe.model, lora_run / "adapter")
    model = trained.load_trained(target, torch.float32)
    prompts = [r.prompt for r in (Renderer(recipe.data, tok).render(x)
                                  for x in split.held_out(recipe.data, 0))]
    batched = evaluator.generate(model, tok, prompts, False, batch_size=8, max_new_tokens=6)
    single = evaluator.generate(model, tok, prompts, False, batch_size=1, max_new_tokens=6)
    assert batched == single
