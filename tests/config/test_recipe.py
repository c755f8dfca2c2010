"""Recipe schema: defaults, overrides, the resolved recipe `validate` prints, shipped recipes.
Every class of bad recipe is in test_bad_input.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, run_cli, write_jsonl, write_recipe
from tunekit.config import recipefile, schema
from tunekit.core.errors import TunekitError


@pytest.fixture()
def base(tmp_path, tiny_model) -> dict:
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])
    return {"model": {"name_or_path": str(tiny_model)}, "data": {"train": str(data)},
            "output_dir": str(tmp_path / "run")}


def test_defaults_filled(tmp_path, base):
    r = recipefile.load(write_recipe(tmp_path / "r.yaml", base))
    assert r.adapter == "lora" and r.lora.r == 16 and r.lora.target_modules == "all-linear"
    assert r.quantization is None and r.training.precision == "auto" and r.data.mask_prompt is True


def test_method_and_quantization_are_separate_and_the_old_qlora_spelling_still_reads(tmp_path, base, caplog):
    path = write_recipe(tmp_path / "r.yaml", base)
    assert recipefile.load(path).adapter_kind == "lora"
    assert recipefile.load(path, ["quantization.bits=4"]).adapter_kind == "qlora"
    assert recipefile.load(path, ["adapter=none"]).adapter_kind == "full"
    with caplog.at_level("INFO", logger="tunekit"):
        old = recipefile.load(path, ["adapter=qlora"])
    assert old.adapter == "lora" and old.quantization == schema.QuantizationConfig()
    assert "adapter: qlora is now written adapter: lora with a quantization section" in caplog.text
    assert "adapter: lora" in recipefile.to_yaml(old)  # saved in the new spelling


def test_overrides_set_any_field_and_are_validated(tmp_path, base):
    path = write_recipe(tmp_path / "r.yaml", base)
    r = recipefile.load(path, ["training.learning_rate=1e-4", "lora.r=4",
                            "quantization.quant_type=fp4", "lora.target_modules=[q_proj, v_proj]"])
    assert r.training.learning_rate == 1e-4 and r.lora.r == 4 and r.adapter_kind == "qlora"
    assert r.quantization.quant_type == "fp4" and r.lora.target_modules == ["q_proj", "v_proj"]
    with pytest.raises(TunekitError, match="unknown key training.learning_rat; did you mean training.learning_rate"):
        recipefile.load(path, ["training.learning_rat=1"])


@pytest.mark.slow  # seconds: make test-fast leaves it out
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
    r = recipefile.load(path)
    assert r.output_dir == f"runs/{path.stem}"


def test_help_is_fast_and_does_not_import_torch():
    code = ("import sys, tunekit.cli.main as c\n"
            "try: c.main(['--help'])\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "train" in out.stdout and "validate" in out.stdout
    for verb in ("train", "validate"):
        res = run_cli(verb, "--help")
        assert res.returncode == 0 and "recipe" in res.stdout


def test_a_recipe_breaking_two_rules_is_told_of_the_first_in_their_order(tmp_path, base):
    """The rules across sections run in config.rules.RULES' order whatever loads the recipe: the reference rule
    (lora.init rewrites the base KTO compares with) comes before the batch rule (KTO's KL term needs two)."""
    pairs = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "p", "completion": "c", "label": True}])
    raw = {**base, "data": {"train": str(pairs), "format": "unpaired_preference"}, "lora": {"init": "pissa"},
           "training": {"method": "kto", "micro_batch_size": 1}}
    path = write_recipe(tmp_path / "r.yaml", raw)
    with pytest.raises(TunekitError, match="training.method: kto takes the base model as its reference"):
        recipefile.load(path)
    with pytest.raises(TunekitError, match="training.micro_batch_size: KTO's loss kto estimates its KL term"):
        recipefile.load(path, ["lora.init=default"])
