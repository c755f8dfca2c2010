"""The Python API checks its own arguments as the command line checks its options (tunekit.api.arguments): every
public function given a value of the wrong type or out of range raises TunekitError in one line naming the
argument, never a raw TypeError or KeyError, before anything is read or written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import reverse_rows, tiny_recipe, write_jsonl
from tunekit import api
from tunekit.api import arguments
from tunekit.core.errors import TunekitError


class Unpicklable:
    def __deepcopy__(self, memo):
        raise TypeError("cannot pickle")


# case -> (call(recipe dict, tmp_path), what the one line says: the argument's name and what it takes)
CASES = {
    # validate
    "validate world_size 0": (lambda r, t: api.validate(r, world_size=0), "world_size: must be at least 1, got 0"),
    "validate world_size a string": (lambda r, t: api.validate(r, world_size="2"),
                                     "world_size: expected a whole number of at least 1 or None, got '2'"),
    "validate world_size a bool": (lambda r, t: api.validate(r, world_size=True), "world_size: expected a whole"),
    # plan
    "plan world_size 0": (lambda r, t: api.plan(r, world_size=0), "world_size: must be at least 1, got 0"),
    "plan world_size negative": (lambda r, t: api.plan(r, world_size=-2), "world_size: must be at least 1, got -2"),
    "plan world_size a float": (lambda r, t: api.plan(r, world_size=1.5), "world_size: expected a whole number"),
    "plan gpu_memory negative": (lambda r, t: api.plan(r, gpu_memory=-1), "gpu_memory: must be at least 1, got -1"),
    "plan gpu_memory a list": (lambda r, t: api.plan(r, gpu_memory=[24]), "gpu_memory: expected a whole number"),
    "plan gpu_memory not a size": (lambda r, t: api.plan(r, gpu_memory="24XB"), "gpu_memory: '24XB' is not a size"),
    "plan peak_tflops 0": (lambda r, t: api.plan(r, peak_tflops=0), "peak_tflops: must be greater than 0, got 0"),
    "plan peak_tflops nan": (lambda r, t: api.plan(r, peak_tflops=math.nan), "peak_tflops: expected a finite number"),
    "plan peak_tflops a string": (lambda r, t: api.plan(r, peak_tflops="989"),
                                  "peak_tflops: expected a finite number, got '989'"),
    "plan utilization above 1": (lambda r, t: api.plan(r, utilization=2), "utilization: must be in (0, 1], got 2"),
    "plan utilization 0": (lambda r, t: api.plan(r, utilization=0.0), "utilization: must be in (0, 1]"),
    "plan memory_bandwidth negative": (lambda r, t: api.plan(r, memory_bandwidth=-1),
                                       "memory_bandwidth: must be greater than 0"),
    "plan model_config an int": (lambda r, t: api.plan(r, model_config=5),
                                 "model_config: expected a path (str or os.PathLike) or None, got 5"),
    "plan model_config a directory": (lambda r, t: api.plan(r, model_config=t),
                                      "--model-config " + "{t}: is a directory; give its config.json"),
    # data
    "data show negative": (lambda r, t: api.data(r, show=-1), "show: must be 0 or more, got -1"),
    "data show a string": (lambda r, t: api.data(r, show="3"), "show: expected a whole number, 0 or more, got '3'"),
    "data show a float": (lambda r, t: api.data(r, show=1.0), "show: expected a whole number"),
    # recipes and overrides (every function that takes them loads them alike)
    "recipe an int": (lambda r, t: api.load_recipe(42), "recipe: expected a YAML file's path, a dict or a Recipe, "
                                                        "got int"),
    "recipe a list": (lambda r, t: api.train([r]), "recipe: expected a YAML file's path, a dict or a Recipe, got list"),
    "recipe a directory": (lambda r, t: api.validate(t), "is a directory; give a YAML recipe file"),
    "recipe a dict with a set": (lambda r, t: api.plan({**r, "training": {"seed": {1}}}),
                                 "recipe: training.seed: a set is not a recipe value"),
    "recipe a dict with an int key": (lambda r, t: api.data({**r, 1: 2}), "recipe: key 1 is an int; a recipe's keys "
                                                                          "are strings"),
    "recipe a dict that cannot be copied": (lambda r, t: api.validate({**r, "lora": Unpicklable()}),
                                            "recipe: lora: an Unpicklable is not a recipe value"),
    "recipe a section that is not a dict": (lambda r, t: api.validate({**r, "training": 5}), "recipe: training: "),
    "override an object": (lambda r, t: api.validate(r, {"training.seed": object()}),
                           "overrides['training.seed']: an object is not a recipe value; give a string, number"),
    "override a set": (lambda r, t: api.plan(r, {"lora.target_modules": {"q_proj"}}),
                       "overrides['lora.target_modules']: a set is not a recipe value"),
    "override a function": (lambda r, t: api.data(r, {"training.seed": len}),
                            "overrides['training.seed']: a builtin_function_or_method is not a recipe value"),
    "override a set in a list": (lambda r, t: api.load_recipe(r, {"lora.target_modules": ["q_proj", {1}]}),
                                 "overrides['lora.target_modules']: [1]: a set is not a recipe value"),
    "override nan": (lambda r, t: api.validate(r, {"training.learning_rate": math.nan}),
                     "overrides['training.learning_rate']: nan is not a finite number"),
    "override key an int": (lambda r, t: api.validate(r, {1: 2}), "overrides: key 1 is not a dotted key"),
    "overrides an int": (lambda r, t: api.train(r, 5), "overrides: expected a list of 'dotted.key=value' strings or "
                                                       "a dict of dotted keys to values, got int"),
    "overrides a set": (lambda r, t: api.validate(r, {"training.seed=1"}), "overrides: expected a list"),
    "overrides bytes": (lambda r, t: api.validate(r, b"training.seed=1"), "overrides: expected a list"),
    "override not a string": (lambda r, t: api.validate(r, [3]), "override 3: expected a 'dotted.key=value' string"),
    # train
    "train force a string": (lambda r, t: api.train(r, force="no"), "force: expected True or False, got 'no'"),
    "train resume an int": (lambda r, t: api.train(r, resume=1), "resume: expected True or False, got 1"),
    "train argv an int": (lambda r, t: api.train(r, argv=5), "argv: expected a list of strings"),
    "train argv of ints": (lambda r, t: api.train(r, argv=[1]), "argv: expected a list of strings"),
    # evaluate
    "evaluate target an int": (lambda r, t: api.evaluate(5), "target: expected a path (str or os.PathLike), got 5"),
    "evaluate target None": (lambda r, t: api.evaluate(None), "target: expected a path"),
    "evaluate recipe an int": (lambda r, t: api.evaluate(t, recipe=5), "recipe: expected a YAML file's path"),
    "evaluate data an int": (lambda r, t: api.evaluate(t, data=5), "data: expected a path"),
    "evaluate compare a list": (lambda r, t: api.evaluate(t, compare=[t]), "compare: expected a path"),
    "evaluate out an int": (lambda r, t: api.evaluate(t, out=5), "out: expected a path (str or os.PathLike) or None"),
    "evaluate limit 0": (lambda r, t: api.evaluate(t, limit=0), "limit: must be at least 1, got 0"),
    "evaluate batch_size a string": (lambda r, t: api.evaluate(t, batch_size="8"), "batch_size: expected a whole"),
    "evaluate max_new_tokens negative": (lambda r, t: api.evaluate(t, max_new_tokens=-1),
                                         "max_new_tokens: must be at least 1, got -1"),
    "evaluate dtype unknown": (lambda r, t: api.evaluate(t, dtype="int8"),
                               "dtype: choose one of auto, bf16, fp16, fp32, got 'int8'"),
    "evaluate force a string": (lambda r, t: api.evaluate(t, force="yes"), "force: expected True or False"),
    # merge
    "merge run_dir an int": (lambda r, t: api.merge(5), "run_dir: expected a path (str or os.PathLike), got 5"),
    "merge out an int": (lambda r, t: api.merge(t, out=5), "out: expected a path"),
    "merge dtype unknown": (lambda r, t: api.merge(t, dtype="int8"), "dtype: choose one of bf16, fp16, fp32 or None"),
    "merge tolerance negative": (lambda r, t: api.merge(t, tolerance=-1), "tolerance: must be greater than 0"),
    "merge tolerance nan": (lambda r, t: api.merge(t, tolerance=math.nan), "tolerance: expected a finite number"),
    "merge force an int": (lambda r, t: api.merge(t, force=1), "force: expected True or False, got 1"),
    # export
    "export target an int": (lambda r, t: api.export(5), "target: expected a path"),
    "export format a list": (lambda r, t: api.export(t, format=["gguf"]), "format: expected a non-empty string"),
    "export format unknown": (lambda r, t: api.export(t, format="onnx"), "--format onnx: choose one of gguf"),
    "export quant an int": (lambda r, t: api.export(t, quant=8), "quant: expected a non-empty string or None"),
    "export quant unknown": (lambda r, t: api.export(t, quant="q9"), "--quant q9: choose one of"),
    "export dtype for gguf": (lambda r, t: api.export(t, dtype="bf16"), "export --format gguf does not take --dtype"),
    "export out an int": (lambda r, t: api.export(t, out=5), "out: expected a path"),
    "export force a string": (lambda r, t: api.export(t, force="no"), "force: expected True or False"),
    # push
    "push target an int": (lambda r, t: api.push(5, "me/model"), "target: expected a path"),
    "push repo an int": (lambda r, t: api.push(t, 5), "repo: expected a non-empty string, got 5"),
    "push repo empty": (lambda r, t: api.push(t, ""), "repo: expected a non-empty string, got ''"),
    "push what unknown": (lambda r, t: api.push(t, "me/model", what="weights"),
                          "what: choose one of adapter, merged, gguf or None, got 'weights'"),
    "push private a string": (lambda r, t: api.push(t, "me/model", private="no"), "private: expected True or False"),
    "push revision an int": (lambda r, t: api.push(t, "me/model", revision=2), "revision: expected a non-empty"),
    "push force an int": (lambda r, t: api.push(t, "me/model", force=0), "force: expected True or False"),
    "push baseline an int": (lambda r, t: api.push(t, "me/model", baseline=5), "baseline: expected a path"),
    "push base_model an int": (lambda r, t: api.push(t, "me/model", base_model=5), "base_model: expected a non-empty"),
}


@pytest.fixture()
def recipe_dict(tmp_path, tiny_model) -> dict:
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    return tiny_recipe(tiny_model, data, tmp_path / "run")


def tree(where: Path) -> list[str]:
    return sorted(str(p.relative_to(where)) for p in where.rglob("*"))


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_argument_is_one_line_naming_it_and_nothing_is_written(case, recipe_dict, tmp_path, monkeypatch):
    call, expected = CASES[case]
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(TunekitError) as e:
        call(recipe_dict, tmp_path)
    line = str(e.value)
    assert "\n" not in line and expected.format(t=tmp_path) in line, line
    assert tree(tmp_path) == before, "wrote something"


def test_what_a_recipe_value_may_be():
    for value in ("x", 1, 1.5, True, None, [1, "a"], ("a", "b"), {"a": [1, {"b": None}]}):
        arguments.yaml_value("v", value)
    for value, said in ((math.inf, "v: inf is not a finite number"), ({"a": {"b": [0, {2}]}}, "v: a.b[1]: a set"),
                        ({"data": {"train": Path("x")}}, "v: data.train: a PosixPath"), ({"a": {3: 1}}, "v: a: key 3")):
        with pytest.raises(TunekitError) as e:
            arguments.yaml_value("v", value)
        assert str(e.value).startswith(said.replace("PosixPath", type(Path("x")).__name__)), str(e.value)
