"""A run given as an input (a distillation teacher, a GRPO model reward, what `tunekit chat`, `eval`, `export`,
`merge` and `push` take) whose weights or tokenizer were deleted is named as such, in one line, by every consumer,
from its files, before any weight loads (runs.layout.completed_run); a reward model's run is refused by chat with
what to use instead; a teacher directory without a tokenizer is refused under distill.teacher (issue 70, point 3).
The runs are trained for one step, then copied and damaged."""

from __future__ import annotations

import shutil

import pytest

from conftest import refused_in_process, reverse_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit import api
from tunekit.config import recipefile
from tunekit.core.errors import TunekitError
from tunekit.training import runner

PAIRS = [{"prompt": f"Say {w}.", "chosen": w, "rejected": w[::-1] + "?"} for w in ("cat", "dog", "owl", "bee")] * 4
FIX = "train it again or point at another run"


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Completed one-step runs: LoRA SFT, full fine-tuning SFT, and a LoRA reward model."""
    root = tmp_path_factory.mktemp("inputs")
    data = write_jsonl(root / "d.jsonl", reverse_rows(8))
    pairs = write_jsonl(root / "p.jsonl", PAIRS)
    made = {"lora": tiny_recipe(tiny_model, data, root / "lora", training={"max_steps": 1}),
            "full": tiny_recipe(tiny_model, data, root / "full", adapter="none", lora=None, training={"max_steps": 1}),
            "reward": tiny_recipe(tiny_model, pairs, root / "reward", data={"format": "preference"},
                                  training={"max_steps": 1, "method": "reward"})}
    for name, raw in made.items():
        runner.run(recipefile.load(write_recipe(root / f"{name}.yaml", raw)))
    return {name: root / name for name in made}


@pytest.fixture()
def no_weights_load(monkeypatch):
    """Any weight load fails the test: the refusals come from files alone."""
    from tunekit.models import loader

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded")
    for name in ("load_base", "load_adapter_model", "load_for_training"):
        monkeypatch.setattr(loader, name, refuse)


def _tokenizer_files(folder):
    return [p for p in folder.iterdir() if p.name.startswith("tokenizer") or p.name == "chat_template.jinja"]


def _delete(*parts):
    def damage(run):
        target = run.joinpath(*parts)
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return damage


def _delete_tokenizer(run):
    for path in _tokenizer_files(run / "adapter"):
        path.unlink()


# name -> (the run it damages: lora or full, the damage, what the line says is gone)
DAMAGE = {
    "adapter/ deleted": ("lora", _delete("adapter"), "weights are gone (no adapter/ in it)"),
    "adapter weights deleted": ("lora", _delete("adapter", "adapter_model.safetensors"),
                                "weights are gone (no .safetensors file in adapter/)"),
    "adapter config deleted": ("lora", _delete("adapter", "adapter_config.json"),
                               "weights are gone (no adapter_config.json in adapter/)"),
    "tokenizer deleted": ("lora", _delete_tokenizer,
                          "tokenizer is gone (no tokenizer.json or tokenizer_config.json in adapter/)"),
    "model/ deleted": ("full", _delete("model"), "weights are gone (no model/ in it)"),
    "model weights deleted": ("full", _delete("model", "model.safetensors"),
                              "weights are gone (no .safetensors file in model/)"),
}


def _distill(run, tmp_path, tiny_model):
    raw = tiny_recipe(tiny_model, write_jsonl(tmp_path / "a.jsonl", reverse_rows(8)), tmp_path / "out",
                      training={"method": "distill", "max_steps": 1})
    raw["distill"] = {"teacher": str(run), "max_completion_length": 4}
    return str(write_recipe(tmp_path / "distill.yaml", raw))


def _grpo(run, tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Say cat."}] * 8)
    raw = tiny_recipe(tiny_model, data, tmp_path / "out", data={"format": "prompt"},
                      training={"method": "grpo", "max_steps": 1})
    raw["grpo"] = {"rewards": [{"reward": "model", "run": str(run)}], "completions": 2, "max_completion_length": 4}
    return str(write_recipe(tmp_path / "grpo.yaml", raw))


# name -> (argv given the damaged run, tmp_path and the base model; what names the run; which run kinds it takes)
CONSUMERS = {
    "distill.teacher, validate": (lambda r, t, m: ["validate", _distill(r, t, m)], "distill.teacher: {run}: ",
                                  ("lora", "full")),
    "distill.teacher, train": (lambda r, t, m: ["train", _distill(r, t, m)], "distill.teacher: {run}: ",
                               ("lora", "full")),
    "grpo model reward, validate": (lambda r, t, m: ["validate", _grpo(r, t, m)], "grpo.rewards[0] (model): run: "
                                    "{run}: ", ("reward",)),
    "grpo model reward, train": (lambda r, t, m: ["train", _grpo(r, t, m)], "grpo.rewards[0] (model): run: {run}: ",
                                 ("reward",)),
    "chat": (lambda r, t, m: ["chat", str(r), "--once", "hello"], "{run}: ", ("lora", "full", "reward")),
    "eval": (lambda r, t, m: ["eval", str(r)], "{run}: ", ("lora", "full", "reward")),
    "export": (lambda r, t, m: ["export", str(r)], "export target: {run}: ", ("lora", "full", "reward")),
    "merge": (lambda r, t, m: ["merge", str(r)], "{run}: ", ("lora", "reward")),  # a full run has nothing to merge
    "push": (lambda r, t, m: ["push", str(r), "--repo", "me/model"], "push target: {run}: ", ("lora", "full")),
}

CASES = [(d, c) for d in DAMAGE for c in CONSUMERS
         if DAMAGE[d][0] in CONSUMERS[c][2] or (DAMAGE[d][0] == "lora" and "reward" in CONSUMERS[c][2])]


def _damaged(runs, damage, consumer, tmp_path):
    kind, harm, _ = DAMAGE[damage]
    source = "reward" if "reward" in CONSUMERS[consumer][2] and kind not in CONSUMERS[consumer][2] else kind
    run = tmp_path / f"{source}-run"
    shutil.copytree(runs[source], run)
    harm(run)
    return run


@pytest.mark.parametrize("damage, consumer", CASES)
def test_a_run_whose_weights_are_gone_is_named_by_every_consumer(damage, consumer, runs, tmp_path, tiny_model,
                                                                 capsys, monkeypatch, no_weights_load):
    run = _damaged(runs, damage, consumer, tmp_path)
    argv, where, _ = CONSUMERS[consumer]
    line = refused_in_process(argv(run, tmp_path, tiny_model), tmp_path, capsys, monkeypatch)
    expected = where.format(run=run) + f"a tunekit run whose {DAMAGE[damage][2]}; {FIX}"
    assert line.endswith(expected), line


# name -> (the Python API call given the damaged run, tmp_path and the base model; the CLI's argv)
API = {
    "validate a teacher": (lambda r, t, m: api.validate(_distill(r, t, m)), CONSUMERS["distill.teacher, validate"]),
    "validate a model reward": (lambda r, t, m: api.validate(_grpo(r, t, m)),
                                CONSUMERS["grpo model reward, validate"]),
    "evaluate": (lambda r, t, m: api.evaluate(str(r)), CONSUMERS["eval"]),
    "export": (lambda r, t, m: api.export(str(r)), CONSUMERS["export"]),
    "merge": (lambda r, t, m: api.merge(str(r)), CONSUMERS["merge"]),
    "push": (lambda r, t, m: api.push(str(r), "me/model"), CONSUMERS["push"]),
}


@pytest.mark.parametrize("call", API)
def test_the_python_api_raises_the_same_line(call, runs, tmp_path, tiny_model, capsys, monkeypatch,
                                             no_weights_load):
    source = "reward" if "reward" in call else "lora"
    cli_run, api_run = tmp_path / "cli" / source, tmp_path / "api" / source
    for run in (cli_run, api_run):
        shutil.copytree(runs[source], run)
        _delete("adapter", "adapter_model.safetensors")(run)
    argv, _, _ = API[call][1]
    line = refused_in_process(argv(cli_run, tmp_path / "cli", tiny_model), tmp_path / "cli", capsys, monkeypatch)
    with pytest.raises(TunekitError) as e:
        API[call][0](api_run, tmp_path / "api", tiny_model)
    assert str(e.value) == line.split(": error: ", 1)[1].replace(str(cli_run), str(api_run)), (str(e.value), line)


def test_chat_refuses_a_reward_model_with_what_to_use_instead(runs, tmp_path, capsys, monkeypatch, no_weights_load):
    from tunekit.evaluation import conversation

    run = runs["reward"]
    line = refused_in_process(["chat", str(run), "--once", "hello"], tmp_path, capsys, monkeypatch)
    assert line.endswith(f"{run}: a reward model (training.method: reward) scores text with one number and "
                         "generates none, so it cannot chat; use it as a model reward (grpo.rewards: [{reward: model, "
                         f"run: {run}}}]) or score pairs with `tunekit eval {run}`; to chat, give its base model "
                         f"({recipefile.load(run / 'recipe.yaml').model.name_or_path}) or an SFT run"), line
    with pytest.raises(TunekitError) as e:
        conversation.chat(str(run), once="hello")
    assert str(e.value) == line.split(": error: ", 1)[1]


def _model_without_tokenizer(runs, tmp_path, tiny_model):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_model, folder)
    for path in _tokenizer_files(folder):
        path.unlink()
    return folder, f"distill.teacher: {folder} has no tokenizer (none of tokenizer.json, tokenizer_config.json, " \
                   "tokenizer.model); distillation compares the teacher's next-token probabilities with the " \
                   "student's over one vocabulary: save the teacher's tokenizer there (tokenizer.save_pretrained) " \
                   "or name another teacher"


def _run_without_tokenizer(runs, tmp_path, tiny_model):
    run = tmp_path / "teacher"
    shutil.copytree(runs["full"], run)
    for path in _tokenizer_files(run / "model"):
        path.unlink()
    return run, f"distill.teacher: {run}: a tunekit run whose tokenizer is gone (no tokenizer.json or " \
                f"tokenizer_config.json in model/); {FIX}"


TEACHERS = {"a model directory without a tokenizer": _model_without_tokenizer,
            "a run whose tokenizer was deleted": _run_without_tokenizer}


@pytest.mark.parametrize("verb", ["validate", "plan", "train"])
@pytest.mark.parametrize("teacher", TEACHERS)
def test_a_teacher_without_a_tokenizer_is_refused_under_distill_teacher(teacher, verb, runs, tmp_path, tiny_model,
                                                                        capsys, monkeypatch, no_weights_load):
    folder, expected = TEACHERS[teacher](runs, tmp_path, tiny_model)
    line = refused_in_process([verb, _distill(folder, tmp_path, tiny_model)], tmp_path, capsys, monkeypatch)
    assert line.endswith(expected), line
