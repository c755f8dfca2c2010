"""The training methods: declared in tunekit.config.methods (the recipe's allowed training.method values, the
method sections, the facts the recipe rules and the planner read) and implemented in tunekit.training.methods,
registered under the declared names; no module outside methods/ compares method names. A method declared
before the schema is built is a valid training.method, with its section."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import tunekit
from conftest import ROOT, history, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import methods as declared
from tunekit.config import recipefile, rules, schema, trainingschema
from tunekit.core.errors import TunekitError
from tunekit.runs.layout import RunRecord
from tunekit.training import methods

PACKAGE = Path(tunekit.__file__).parent


def test_the_allowed_methods_and_sections_are_the_registry():
    allowed = typing.get_args(trainingschema.TrainingConfig.model_fields["method"].annotation)
    assert allowed == tuple(declared.DECLARED) == tuple(methods.METHODS) and allowed[0] == declared.DEFAULT
    sections = {m.section for m in methods.METHODS.values() if m.section}
    assert sections == {m.name for m in declared.DECLARED.values() if m.settings is not None}
    assert sections <= set(schema.Recipe.model_fields) and "dpo" in sections and "sft" not in sections
    for m in methods.METHODS.values():
        assert m.name in trainingschema.TrainingConfig.model_fields["method"].description


def test_an_unknown_method_is_refused_naming_the_registered_ones(tmp_path, tiny_model):
    raw = tiny_recipe(tiny_model, write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}]),
                      tmp_path / "run", training={"method": "ppo"})
    with pytest.raises(TunekitError,
                       match="training.method: .*'sft', 'dpo', 'kto', 'orpo', 'reward', 'grpo', 'rloo' or 'distill'"):
        recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    with pytest.raises(TunekitError, match="unknown method 'ppo'; registered: sft, dpo, kto, orpo, reward, grpo"):
        methods.get("ppo")


FAKE = '''
import logging, sys, yaml
from pydantic import Field
from tunekit.config.methods import MethodSpec, declare
from tunekit.config.methodsettings import MethodSettings

class ToySettings(MethodSettings):
    alpha: float = Field(1.0, gt=0)

declare(MethodSpec("toy", "a method declared by a test", settings=ToySettings, data_formats=("alpaca",),
                   data_description="alpaca rows", sequences=3))
from tunekit.training.methods import METHODS, Method, register

class Toy(Method):
    name = "toy"

register(Toy())
assert METHODS["toy"].summary == "a method declared by a test" and METHODS["toy"].section == "toy"
from tunekit.config import recipefile
from tunekit.plan import estimate  # the schema is built after the declaration
raw = yaml.safe_load(open(sys.argv[1]))
raw["training"]["method"] = "toy"
r = recipefile.from_dict(raw)
assert r.toy.alpha == 1.0 and r.training.method == "toy"
assert estimate.settings_from(r, 1, "fp32").sequences == 3
raw["dpo"] = {"beta": 0.2}
try:
    recipefile.from_dict(raw)
except Exception as e:
    print("refused:", e)
raw.pop("dpo"); raw["training"]["method"] = "sft"; raw["toy"] = {"alpha": 2.0}
try:
    recipefile.from_dict(raw)
except Exception as e:
    print("refused:", e)
'''


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_a_registered_method_is_a_training_method_with_its_section(tmp_path, tiny_model):
    """What docs/adding-a-method.md describes: a declaration is all the schema needs, and the implementation
    registered under its name is the method the planner and training find."""
    raw = tiny_recipe(tiny_model, write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}]),
                      tmp_path / "run")
    path = write_recipe(tmp_path / "r.yaml", raw)
    out = subprocess.run([sys.executable, "-c", FAKE, str(path)], capture_output=True, text=True, check=True).stdout
    assert "refused: recipe: dpo: these settings belong to training.method dpo" in out
    assert "refused: recipe: toy: these settings belong to training.method toy" in out


def test_the_recipe_imports_no_torch():
    code = "import sys, tunekit.config.recipefile; print(sorted({'torch', 'trl', 'transformers'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_the_recipe_imports_nothing_above_config():
    """The schema reads the declarations beside it, not the registries' implementations."""
    code = ("import sys, tunekit.config.recipefile; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('tunekit.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "['config', 'core']\n"


def test_the_rules_across_sections_run_in_one_order():
    """Every rule that spans sections is one function of config.rules, run in RULES' order by the schema, so a
    recipe breaking two is told of the first."""
    assert [r.__name__ for r in rules.RULES] == [
        "method_sections", "starting_adapter", "data_formats", "learning_rate", "settings_apply", "reference",
        "grpo_rewards", "episode_settings", "installed", "batch", "distillation", "best_metric_is_logged",
        "eval_metrics", "sharding_fits_the_quantization", "precision_agrees", "attention", "parallelism"]


def dpo_raw(tmp_path, tiny_model, **sections):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"method": "dpo"}, **sections)
    raw["data"]["format"] = "preference"
    return raw


def test_the_old_preference_section_reads_as_dpo_with_a_note(tmp_path, tiny_model, caplog):
    path = write_recipe(tmp_path / "r.yaml", dpo_raw(tmp_path, tiny_model, preference={"beta": 0.3}))
    with caplog.at_level(logging.INFO, logger="tunekit"):
        r = recipefile.load(path)
    assert r.dpo.beta == 0.3 and "preference" not in schema.Recipe.model_fields
    notes = [rec.getMessage() for rec in caplog.records if "preference" in rec.getMessage()]
    assert notes == [f"{path}: the preference section is now named dpo; read as dpo (rename it)"]
    assert "preference" not in yaml_of(r) and recipefile.from_dict(yaml_of(r)).dpo.beta == 0.3


def yaml_of(r):
    import yaml

    return yaml.safe_load(recipefile.to_yaml(r))


def test_an_old_run_recipe_with_an_empty_preference_section_reads_silently(tmp_path, tiny_model, caplog):
    raw = dpo_raw(tmp_path, tiny_model, preference=None)
    raw["preference"] = None  # older runs' recipe.yaml wrote every method section, empty ones as null
    with caplog.at_level(logging.INFO, logger="tunekit"):
        r = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    assert r.dpo.beta == 0.1 and not [rec for rec in caplog.records if "preference" in rec.getMessage()]


def test_both_the_old_and_the_new_section_name_is_refused(tmp_path, tiny_model):
    raw = dpo_raw(tmp_path, tiny_model, preference={"beta": 0.3}, dpo={"beta": 0.2})
    with pytest.raises(TunekitError, match="preference is the earlier name of the dpo section and both are set"):
        recipefile.load(write_recipe(tmp_path / "r.yaml", raw))


def method_name_literals(tree: ast.AST) -> list[str]:
    """Comparisons with a method name (==, !=, in, not in a tuple/list/set of them) and dict keys naming one."""
    names = set(methods.METHODS) | {"sft", "dpo", "kto", "orpo"}
    keys = names - {"reward"}  # also the key of GRPO's weighted reward sum in its scores (evaluation.rewards)

    def strings(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [s for e in node.elts for s in strings(e)]
        return []

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found += [f"line {node.lineno}: compares with {s!r}" for part in (node.left, *node.comparators)
                      for s in strings(part) if s in names]
        elif isinstance(node, ast.Dict):
            found += [f"line {node.lineno}: dict key {s!r}" for k in node.keys if k is not None
                      for s in strings(k) if s in keys]
    return found


def test_no_module_outside_methods_compares_method_names():
    wrong = {str(p.relative_to(PACKAGE)): hits for p in sorted(PACKAGE.rglob("*.py"))
             if "methods" not in p.relative_to(PACKAGE).parts[:-1]
             and (hits := method_name_literals(ast.parse(p.read_text(encoding="utf-8"))))}
    assert not wrong, f"method names compared outside tunekit/methods/ (ask the registry instead): {wrong}"


def test_the_name_check_catches_comparisons_and_tables():
    code = 'a == "sft"\nb in ("dpo", "x")\n"kto" != c\nd = {"orpo": 1}\ne == "lora"\n'
    assert len(method_name_literals(ast.parse(code))) == 4


def test_a_declaration_naming_an_undeclared_data_format_or_a_taken_section_fails():
    with pytest.raises(ValueError, match="names data format 'nope', which is not declared"):
        declared.declare(declared.MethodSpec("toy", "a toy", data_formats=("nope",)))
    with pytest.raises(ValueError, match="recipe section 'dpo' of 'toy' belongs to 'dpo'"):
        declared.declare(declared.MethodSpec("toy", "a toy", old_sections=("dpo",)))
    with pytest.raises(ValueError, match="'sft' is declared twice"):
        declared.declare(declared.MethodSpec("sft", "again"))
    assert "toy" not in declared.DECLARED


def test_the_method_page_names_every_declared_field_and_every_stage():
    """docs/adding-a-method.md's two tables: every MethodSpec field and every stage a Method may override."""
    import dataclasses

    from conftest import ROOT
    from tunekit.config.methods import MethodSpec
    from tunekit.training.methods import Method

    page = (ROOT / "docs" / "adding-a-method.md").read_text(encoding="utf-8")
    declares = page.split("## What a method declares")[1].split("\n## ")[0]
    implements = page.split("## What a method implements")[1].split("\n## ")[0]
    missing = [f.name for f in dataclasses.fields(MethodSpec) if f"`{f.name}`" not in declares]
    stages = [n for n, v in vars(Method).items() if callable(v) and not n.startswith("_")]
    missing += [n for n in stages if f"`{n}(" not in implements]
    assert not missing, f"docs/adding-a-method.md does not describe: {missing}"


BLOCK = re.compile(r"```python\n# (ADD TO|FILE|REPLACE IN): (\S+)\n(.*?)```", re.S)
TRAIN_CPO = """
import json, sys
from tunekit.config import recipefile
from tunekit.training import runner

result = runner.run(recipefile.load(sys.argv[1]))
print(json.dumps({"module": type(result.trainer).__module__, "method": result.trainer.args.__class__.__name__}))
"""


@pytest.mark.slow  # a training run in a fresh process
def test_the_pages_whole_example_is_all_a_method_needs(tmp_path, tiny_model):
    """docs/adding-a-method.md's example, block by block, applied to a copy of src/: the recipe takes the new
    method and its section, and a run trains with it through TRL's CPO trainer (held-out loss falls)."""
    src = shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    blocks = BLOCK.findall((ROOT / "docs" / "adding-a-method.md").read_text(encoding="utf-8"))
    assert [how for how, _, _ in blocks] == ["ADD TO", "ADD TO", "FILE", "FILE", "REPLACE IN"], blocks
    for how, path, body in blocks:
        target = src.parent / path
        if how == "FILE":
            assert not target.exists(), f"{path} exists: the example must add a module of its own"
            target.write_text(body, encoding="utf-8")
        elif how == "ADD TO":
            target.write_text(target.read_text(encoding="utf-8") + "\n\n" + body, encoding="utf-8")
        else:
            head = body.split(" import ")[0] + " import "
            lines = target.read_text(encoding="utf-8").splitlines(keepends=True)
            found = [k for k, line in enumerate(lines) if line.startswith(head)]
            assert len(found) == 1, f"{path}: no one line starting {head!r}"
            lines[found[0]] = body
            target.write_text("".join(lines), encoding="utf-8")
    pairs = [{"prompt": f"Reverse the word.\n\n{w}", "chosen": w[::-1], "rejected": w}
             for w in ["stone", "river", "planet", "garden", "window", "silver"] * 4]
    data = write_jsonl(tmp_path / "p.jsonl", pairs)
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"method": "cpo", "max_steps": 12,
                                                                     "learning_rate": 5e-3, "eval_steps": 6},
                      cpo={"beta": 0.2}, data={"format": "preference", "eval": str(data)})
    res = subprocess.run([sys.executable, "-c", TRAIN_CPO, str(write_recipe(tmp_path / "r.yaml", raw))],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(src)})
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"module": "tunekit.training.trainers.cpo", "method": "CPOConfig"}, out
    assert RunRecord.load(tmp_path / "run").training_method == "cpo"
    evals = history(tmp_path / "run", "eval_loss")
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] and evals[-1]["eval_nll_loss"] < evals[0]["eval_nll_loss"]
