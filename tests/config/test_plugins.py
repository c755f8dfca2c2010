"""Plugins (config.plugins, docs/extending.md): the page's own toy plugin, built from its code blocks and installed
with pip into a site directory, adds a data format, a metric, a reward kind, a training method and an export format
that a run trains, evaluates, exports and pushes (to a stand-in Hub) with; a plugin that fails to import is named in
one line and tunekit goes on without it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, reverse_rows, tiny_recipe, training_rows, write_jsonl, write_recipe
from hub_standin import StandInHub
from tunekit.config import plugins

pytestmark = pytest.mark.slow
FILE = re.compile(r"```\w+\n# FILE: (\S+)\n(.*?)```", re.S)


def build_from_docs(where: Path) -> Path:
    """The package docs/extending.md shows, file by file."""
    blocks = FILE.findall((ROOT / "docs" / "extending.md").read_text(encoding="utf-8"))
    assert {name for name, _ in blocks} == {"pyproject.toml", "tunekit_toy/__init__.py"}, blocks
    for name, body in blocks:
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(body, encoding="utf-8")
    return where


def install(package: Path, site: Path) -> None:
    """pip, offline, into `site` (a directory put on PYTHONPATH), with the venv's setuptools."""
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), str(package)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def python(site: Path, code: str, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}, "PYTHONPATH": str(site), **env}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=900)


USE_EVERY_KIND = """
import json, sys
import tunekit
from tunekit.config.methodsettings import RewardSpec
from tunekit.evaluation import rewards

recipe, grpo = json.loads(sys.argv[1]), json.loads(sys.argv[2])
run = tunekit.train(recipe)
exported = tunekit.export_model(run.run_dir, format="recipe")
tunekit.push(run.run_dir, "alice/toy-recipe", what="recipe")
tunekit.validate(grpo)
score = rewards.build([RewardSpec(reward="shorter")], 16, "grpo")[0]
sample = lambda text: rewards.Sample("p", text, "abc", 1, {}, "line 1")
print(json.dumps({"scores": run.scores, "exported": str(exported.out), "method": run.recipe.training.method,
                  "rewards": [score.score(sample("ab")), score.score(sample("abcd"))]}))
"""


def test_the_documented_plugin_adds_one_of_each_kind_and_a_run_uses_them(tmp_path, tiny_model):
    site = tmp_path / "site"
    install(build_from_docs(tmp_path / "tunekit-toy"), site)
    rows = [{"q": f"{r['instruction']} {r['input']}", "a": r["output"]} for r in reverse_rows(24)]
    train, held = write_jsonl(tmp_path / "qa.jsonl", rows[:16]), write_jsonl(tmp_path / "qa_eval.jsonl", rows[16:])
    recipe = tiny_recipe(tiny_model, train, tmp_path / "run", data={"format": "qa", "eval": str(held)},
                         training={"method": "sft_toy", "max_steps": 4},
                         eval={"metrics": ["loss", "first_word"], "max_new_tokens": 8})
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", reverse_rows(8))  # GRPO takes prompts from formats it knows
    grpo = tiny_recipe(tiny_model, alpaca, tmp_path / "grpo", training={"method": "grpo", "max_steps": 2},
                       grpo={"rewards": [{"reward": "shorter"}], "max_completion_length": 8})
    with StandInHub({"hf_good": {"name": "alice", "orgs": [], "role": "write"}}) as hub:
        res = python(site, USE_EVERY_KIND, json.dumps(recipe), json.dumps(grpo), cwd=tmp_path, HF_ENDPOINT=hub.url,
                     HF_TOKEN="hf_good", HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf"))
        assert res.returncode == 0, res.stderr[-3000:]
        pushed = hub.files("alice/toy-recipe")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["method"] == "sft_toy" and 0 <= out["scores"]["first_word"] <= 100, out
    assert "eval_loss" in out["scores"] or "loss" in out["scores"], out
    assert Path(out["exported"]).read_text() == (tmp_path / "run" / "recipe.yaml").read_text()
    exported = Path(out["exported"]).name
    assert pushed[exported] == Path(out["exported"]).read_bytes() and "README.md" in pushed, sorted(pushed)
    head, body = pushed["README.md"].decode().removeprefix("---\n").split("\n---\n", 1)
    assert "sft_toy" in yaml.safe_load(head)["tags"], head
    assert "# recipe model: run" in body and f"Weights: recipe file `{exported}`" in body, body
    assert out["rewards"] == [1.0, 0.0]
    assert [r["step"] for r in training_rows(tmp_path / "run")] == [1, 2, 3, 4]


BROKEN = {
    "pyproject.toml": '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
                      '[project]\nname = "tunekit-broken"\nversion = "0.1.0"\n'
                      f'[project.entry-points."{plugins.GROUP}"]\nbroken = "tunekit_broken"\n',
    "tunekit_broken/__init__.py": "import no_such_module_anywhere\n",
}


def test_a_plugin_that_fails_to_import_is_named_in_one_line_and_left_out(tmp_path, tiny_model):
    for name, body in BROKEN.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(body)
    install(tmp_path / "pkg", tmp_path / "site")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, write_jsonl(tmp_path / "d.jsonl",
                                                                                   reverse_rows(8)), tmp_path / "run"))
    res = python(tmp_path / "site", "from tunekit.cli.main import main; raise SystemExit(main(['validate', "
                                     f"{str(recipe)!r}]))", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    named = [line for line in res.stderr.splitlines() if "plugin " in line]
    assert named == ["tunekit: plugin broken (tunekit_broken): import failed (ModuleNotFoundError: No module named "
                     "'no_such_module_anywhere'); it is left out: fix or uninstall the package that provides it"], \
        res.stderr[-3000:]
