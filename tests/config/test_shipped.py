"""The shipped recipes and configs (config.shipped, `tunekit recipes`): the package reaches the repository's recipes/
and ds_configs/, a recipe's recipes/... and ds_configs/... paths resolve to them from any directory, `tunekit
recipes` lists them and copies some out without replacing a file; and a wheel built from the repository, installed
into a fresh virtual environment outside it, carries them and validates a copied recipe."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT, refused_in_process
from tunekit.config import recipefile, shipped


def test_the_package_reaches_every_shipped_recipe_and_config():
    assert [p.name for p in shipped.recipes()] == sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    assert {shipped.name_of(p) for p in shipped.configs()} == {
        p.relative_to(ROOT / "ds_configs").as_posix() for p in (ROOT / "ds_configs").rglob("*") if p.is_file()}
    assert all(shipped.summary(p) for p in shipped.recipes()), "every recipe opens with a comment saying what it is"


def test_a_recipe_elsewhere_resolves_recipes_and_ds_configs_paths_to_the_shipped_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ or ds_configs/ here
    (tmp_path / "r.yaml").write_text((ROOT / "recipes" / "smollm2_lora.yaml").read_text())
    recipe = recipefile.load(tmp_path / "r.yaml", ["training.deepspeed=ds_configs/zero3.json"])
    assert Path(recipe.data.train) == (ROOT / "recipes" / "data" / "extract_train.jsonl").resolve()
    assert Path(recipe.training.deepspeed) == (ROOT / "ds_configs" / "zero3.json").resolve()
    (tmp_path / "ds_configs").mkdir()  # a file beside the recipe wins over the shipped one
    (tmp_path / "ds_configs" / "zero3.json").write_text((ROOT / "ds_configs" / "zero3.json").read_text())
    recipe = recipefile.load(tmp_path / "r.yaml", ["training.deepspeed=ds_configs/zero3.json"])
    assert Path(recipe.training.deepspeed) == tmp_path / "ds_configs" / "zero3.json"
    assert shipped.find("ds_configs/../pyproject.toml") is None and shipped.find("src/tunekit/__init__.py") is None


def test_recipes_copies_out_and_replaces_nothing_without_force(tmp_path, capsys, monkeypatch):
    from tunekit.cli.main import main

    mine = tmp_path / "mine"
    assert main(["recipes", "smollm2_dpo", "accelerate/fsdp2.yaml", "--out", str(mine)]) == 0
    assert (mine / "smollm2_dpo.yaml").read_text() == (ROOT / "recipes" / "smollm2_dpo.yaml").read_text()
    assert (mine / "fsdp2.yaml").read_text() == (ROOT / "ds_configs" / "accelerate" / "fsdp2.yaml").read_text()
    (mine / "smollm2_dpo.yaml").write_text("mine\n")
    line = refused_in_process(["recipes", "zero2.json", "smollm2_dpo.yaml", "--out", "."], mine, capsys, monkeypatch)
    assert "smollm2_dpo.yaml exists; pass --force to replace it" in line and (mine / "smollm2_dpo.yaml").read_text() \
        == "mine\n"
    line = refused_in_process(["recipes", "smollm2_lroa"], mine, capsys, monkeypatch)
    assert line.endswith("no shipped recipe or config of that name; did you mean smollm2_lora.yaml, "
                         "smollm2_grpo.yaml, smollm2_qlora.yaml?"), line
    assert main(["recipes", "smollm2_dpo.yaml", "--out", ".", "--force"]) == 0
    assert (mine / "smollm2_dpo.yaml").read_text() == (ROOT / "recipes" / "smollm2_dpo.yaml").read_text()
    capsys.readouterr()
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    assert "smollm2_lora.yaml" in listed and "zero3.json" in listed and "LoRA on SmolLM2-135M-Instruct" in listed


@pytest.mark.slow  # a wheel and a virtual environment
def test_a_wheel_installed_outside_the_repository_carries_the_recipes_and_validates_one(tmp_path):
    """Built from the repository, installed with pip into a fresh venv that sees the installed dependencies (a .pth
    file, no index) but not the repository: `tunekit recipes` copies a recipe out, and it validates with its data
    and DeepSpeed config resolved inside the installed package."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "wheel").glob("tunekit-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # not processed: no repo src
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    work = tmp_path / "elsewhere"
    work.mkdir()

    def tunekit(*args):
        res = subprocess.run([venv / "bin" / "tunekit", *args], cwd=work, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout

    where = subprocess.run([venv / "bin" / "python", "-c", "import tunekit; print(tunekit.__file__)"], cwd=work,
                           capture_output=True, text=True, check=True).stdout
    assert Path(where.strip()).is_relative_to(site), where
    assert "smollm2_lora.yaml" in tunekit("recipes")
    tunekit("recipes", "smollm2_lora.yaml")
    shown = tunekit("validate", "smollm2_lora.yaml", "--set", "training.deepspeed=ds_configs/zero3.json")
    packaged = site / "tunekit" / "config" / "shipped"
    assert f"train: {packaged / 'recipes' / 'data' / 'extract_train.jsonl'}" in shown, shown
    assert f"deepspeed: {packaged / 'ds_configs' / 'zero3.json'}" in shown, shown
