"""Recipe schema: every class of error is one line naming the key; overrides; shipped recipes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_cli, write_jsonl, write_recipe
from tunekit import recipe as recipe_mod
from tunekit.errors import TunekitError


@pytest.fixture()
def base(tmp_path, tiny_model) -> dict:
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])
    return {"model": {"name_or_path": str(tiny_model)}, "data": {"train": str(data)},
            "output_dir": str(tmp_path / "run")}


def error_for(tmp_path: Path, raw: dict, overrides=()) -> str:
    path = write_recipe(tmp_path / "r.yaml", raw)
    with pytest.raises(TunekitError) as e:
        recipe_mod.load(path, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_defaults_filled(tmp_path, base):
    r = recipe_mod.load(write_recipe(tmp_path / "r.yaml", base))
    assert r.adapter == "lora" and r.lora.r == 16 and r.lora.target_modules == "all-linear"
    assert r.quantization is None and r.training.precision == "auto" and r.data.mask_prompt is True


@pytest.mark.parametrize("section,key,expected", [
    ("training", "learnig_rate", "unknown key training.learnig_rate; did you mean training.learning_rate?"),
    ("lora", "rank", "unknown key lora.rank"),
    ("data", "fromat", "did you mean data.format?"),
    ("model", "trust_remote", "did you mean model.trust_remote_code?"),
])
def test_unknown_key_names_dotted_path_and_suggestion(tmp_path, base, section, key, expected):
    base.setdefault(section, {})[key] = 1
    assert expected in error_for(tmp_path, base)


def test_unknown_nested_and_top_level_keys(tmp_path, base):
    base["data"]["fields"] = {"instrucion": "q"}
    assert "unknown key data.fields.instrucion; did you mean data.fields.instruction?" in error_for(tmp_path, base)
    base["data"].pop("fields")
    base["trainng"] = {}
    assert "unknown key trainng; did you mean training?" in error_for(tmp_path, base)


@pytest.mark.parametrize("patch,expected", [
    ({"training": {"learning_rate": "fast"}}, "training.learning_rate: Input should be a valid number"),
    ({"training": {"micro_batch_size": 0}}, "training.micro_batch_size: Input should be greater than 0"),
    ({"lora": {"dropout": 1.5}}, "lora.dropout: Input should be less than 1"),
    ({"training": {"precision": "fp8"}}, "training.precision: Input should be 'auto', 'bf16', 'fp16' or 'fp32'"),
    ({"adapter": "qlora", "quantization": {"compute_dtype": "bf16"}, "training": {"precision": "fp16"}},
     "fp16 and bf16 both on"),
    ({"quantization": {"bits": 4}}, "quantization settings given but adapter is 'lora'; set adapter: qlora"),
    ({"adapter": "none", "lora": {"r": 4}}, "lora settings given but adapter is 'none'"),
    ({"data": {"eval_fraction": 0.1, "eval": "x"}}, "data.eval and data.eval_fraction are both set"),
    ({"training": {"warmup_ratio": 0.1, "warmup_steps": 3}}, "warmup_ratio and training.warmup_steps are both set"),
])
def test_bad_values_and_combinations(tmp_path, base, patch, expected):
    for key, value in patch.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    assert expected in error_for(tmp_path, base)


def test_missing_required_sections(tmp_path, base):
    base.pop("data")
    assert "missing required key data" in error_for(tmp_path, base)


def test_deepspeed_file_missing_or_invalid(tmp_path, base):
    base["training"] = {"deepspeed": str(tmp_path / "nope.json")}
    assert "training.deepspeed: file" in error_for(tmp_path, base)
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2,}}')
    base["training"] = {"deepspeed": str(bad)}
    msg = error_for(tmp_path, base)
    assert "training.deepspeed" in msg and "not valid JSON" in msg and "line 1" in msg


def test_missing_files_and_models(tmp_path, base):
    base["data"]["train"] = "missing.jsonl"
    assert "data.train: file 'missing.jsonl' not found" in error_for(tmp_path, base)
    base["data"]["train"] = str(tmp_path / "d.jsonl")
    base["model"]["name_or_path"] = "./no/such/model"
    assert "model.name_or_path: no such model directory" in error_for(tmp_path, base)
    base["model"]["name_or_path"] = "nopkg/model.gguf"
    assert "GGUF file 'nopkg/model.gguf' not found" in error_for(tmp_path, base)


def test_invalid_yaml_names_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model:\n  name_or_path: x\n data: [\n")
    with pytest.raises(TunekitError, match=r"r.yaml line \d+: invalid YAML"):
        recipe_mod.load(path)


def test_overrides_set_any_field_and_are_validated(tmp_path, base):
    path = write_recipe(tmp_path / "r.yaml", base)
    r = recipe_mod.load(path, ["training.learning_rate=1e-4", "lora.r=4", "adapter=qlora",
                               "quantization.quant_type=fp4", "lora.target_modules=[q_proj, v_proj]"])
    assert r.training.learning_rate == 1e-4 and r.lora.r == 4 and r.adapter == "qlora"
    assert r.quantization.quant_type == "fp4" and r.lora.target_modules == ["q_proj", "v_proj"]
    with pytest.raises(TunekitError, match="unknown key training.learning_rat; did you mean training.learning_rate"):
        recipe_mod.load(path, ["training.learning_rat=1"])
    with pytest.raises(TunekitError, match="unknown key training.lr; valid keys: precision, epochs"):
        recipe_mod.load(path, ["training.lr=1"])
    with pytest.raises(TunekitError, match="expected dotted.key=value"):
        recipe_mod.load(path, ["training.learning_rate"])


def test_validate_cli_prints_resolved_recipe_and_exits_2_on_error(tmp_path, base):
    path = write_recipe(tmp_path / "r.yaml", base)
    ok = run_cli("validate", str(path), "--set", "training.seed=7")
    assert ok.returncode == 0, ok.stderr
    resolved = yaml.safe_load(ok.stdout)
    assert resolved["training"]["seed"] == 7 and resolved["lora"]["alpha"] == 32
    assert resolved["data"]["fields"]["instruction"] == "instruction"
    bad = run_cli("validate", str(path), "--set", "training.learnig_rate=1")
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == (
        f"tunekit: error: {path}: unknown key training.learnig_rate; did you mean training.learning_rate?")


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    r = recipe_mod.load(path)
    assert r.output_dir


def test_help_is_fast_and_does_not_import_torch():
    code = ("import sys, tunekit.cli as c\n"
            "try: c.main(['--help'])\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "train" in out.stdout and "validate" in out.stdout
    for verb in ("train", "validate"):
        res = run_cli(verb, "--help")
        assert res.returncode == 0 and "recipe" in res.stdout
