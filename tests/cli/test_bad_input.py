"""Bad input of every kind, each case its own test: the command exits 2 with one line that names the
key, argument, file or line and the cause, prints no traceback, and writes nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import run_cli, tiny_recipe, write_jsonl, write_recipe


def assert_refused(res, expected: str, where: Path | None = None, before: list[str] | None = None,
                   progress: bool = False) -> str:
    """`progress`: errors found while reading data may follow progress lines; the error is still one line."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    errors = [line for line in lines if re.match(r"tunekit( \w+)?: error: ", line)]
    assert len(errors) == 1 and lines[-1] == errors[0], res.stderr[-2000:]
    assert progress or len(lines) == 1, res.stderr[-2000:]
    assert expected in errors[0], errors[0]
    if where is not None:
        assert sorted(p.name for p in where.iterdir()) == before, "wrote something"
    return errors[0]


@pytest.fixture()
def ctx(tmp_path, tiny_model):
    """A valid recipe's parts, and the odd files some cases point at."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a b", "output": "c d"}] * 4)
    (tmp_path / "bad_ds.json").write_text('{"zero_optimization": {"stage": 2,,}}')
    (tmp_path / "list_ds.json").write_text("[1, 2]")
    (tmp_path / "hand_set.json").write_text('{"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}')
    (tmp_path / "stage7.json").write_text('{"zero_optimization": {"stage": 7}}')
    (tmp_path / "disk.json").write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}')
    (tmp_path / "dup_ds.json").write_text('{"zero_optimization": {"stage": 2, "overlap_comm": true, "stage": 3}}')
    return {"model": str(tiny_model), "data": str(data), "tmp": tmp_path}


def _with(c, **sections) -> dict:
    raw = {"model": {"name_or_path": c["model"]}, "data": {"train": c["data"]}}
    for key, value in sections.items():
        raw[key] = ({**raw.get(key, {}), **value} if isinstance(value, dict) and isinstance(raw.get(key), dict)
                    else value)
    return raw


def _text(c, body: str) -> str:
    return f"model:\n  name_or_path: {c['model']}\ndata:\n  train: {c['data']}\n" + body


# name -> (recipe as a dict, YAML text or None (empty file), from the context; expected part of the message)
RECIPES = {
    "unknown top-level key": (lambda c: _with(c, trainig={}), "unknown key trainig; did you mean training?"),
    "unknown model key": (lambda c: _with(c, model={"trust_remote": True}), "did you mean model.trust_remote_code?"),
    "unknown lora key": (lambda c: _with(c, lora={"rank": 4}), "unknown key lora.rank"),
    "unknown quantization key": (lambda c: _with(c, quantization={"bit": 4}),
                                 "unknown key quantization.bit"),
    "unknown data key": (lambda c: _with(c, data={"fromat": "chat"}), "did you mean data.format?"),
    "unknown fields key": (lambda c: _with(c, data={"fields": {"instrucion": "q"}}),
                           "unknown key data.fields.instrucion; did you mean data.fields.instruction?"),
    "unknown training key": (lambda c: _with(c, training={"learnig_rate": 1}),
                             "unknown key training.learnig_rate; did you mean training.learning_rate?"),
    "unknown key without a close match": (lambda c: _with(c, training={"lr": 1}),
                                          "unknown key training.lr; valid keys: precision, epochs"),
    "unknown eval key": (lambda c: _with(c, eval={"max_new_token": 3}), "did you mean eval.max_new_tokens?"),
    "not a mapping": (lambda c: ["a", "b"], "must be a YAML mapping"),
    "empty recipe": (lambda c: None, "missing required key model"),
    "missing data": (lambda c: {"model": {"name_or_path": c["model"]}}, "missing required key data"),
    "missing model path": (lambda c: _with(c, model={"name_or_path": None}),
                           "model.name_or_path: Input should be a valid string"),
    "lr not a number": (lambda c: _with(c, training={"learning_rate": "fast"}),
                        "training.learning_rate: Input should be a valid number"),
    "lr negative": (lambda c: _with(c, training={"learning_rate": -1}),
                    "training.learning_rate: Input should be greater than 0"),
    "lr too large": (lambda c: _with(c, training={"learning_rate": 5}),
                     "training.learning_rate: Input should be less than or equal to 1"),
    "batch zero": (lambda c: _with(c, training={"micro_batch_size": 0}),
                   "training.micro_batch_size: Input should be greater than 0"),
    "batch float": (lambda c: _with(c, training={"micro_batch_size": 2.5}),
                    "training.micro_batch_size: Input should be a valid integer"),
    "bad precision": (lambda c: _with(c, training={"precision": "fp8"}),
                      "training.precision: Input should be 'auto', 'bf16', 'fp16' or 'fp32'"),
    "bad scheduler": (lambda c: _with(c, training={"lr_scheduler": "zigzag"}),
                      "training.lr_scheduler: Input should be"),
    "bad optimizer": (lambda c: _with(c, training={"optimizer": "adam9"}), "training.optimizer: Input should be"),
    "bad adapter": (lambda c: _with(c, adapter="dora"), "adapter: Input should be 'lora' or 'none'"),
    "bad format": (lambda c: _with(c, data={"format": "sharegpt"}), "data.format: Input should be"),
    "dropout out of range": (lambda c: _with(c, lora={"dropout": 1.5}), "lora.dropout: Input should be less than 1"),
    "rank zero": (lambda c: _with(c, lora={"r": 0}), "lora.r: Input should be greater than 0"),
    "bits 3": (lambda c: _with(c, quantization={"bits": 3}), "quantization.bits: Input should be 4 or 8"),
    "max_length tiny": (lambda c: _with(c, data={"max_length": 2}),
                        "data.max_length: Input should be greater than or equal to 8"),
    "max_length beyond the context window": (lambda c: _with(c, data={"max_length": 100000}),  # read from config.json
                                             "data.max_length=100000 is beyond the model's context window of 512 "
                                             "tokens (max_position_embeddings in the config of"),
    "eval fraction 1": (lambda c: _with(c, data={"eval_fraction": 1.0}),
                        "data.eval_fraction: Input should be less than 1"),
    "bool as string": (lambda c: _with(c, training={"gradient_checkpointing": "maybe"}),
                       "training.gradient_checkpointing: Input should be a valid boolean"),
    "quantization with full fine-tuning": (lambda c: _with(c, adapter="none", quantization={"bits": 4}),
                                           "quantization settings given but adapter is 'none': full fine-tuning trains "
                                           "every weight"),
    "pissa on a quantized base": (lambda c: _with(c, lora={"init": "pissa"}, quantization={"bits": 4}),
                                  "lora.init=pissa rewrites base weights, which a quantized base cannot hold"),
    "olora under ZeRO-3": (lambda c: _with(c, lora={"init": "olora"}, training={"deepspeed": "ds_configs/zero3.json"}),
                           "lora.init=olora needs whole base weights at initialisation, which ZeRO-3"),
    "LoRA+ with DeepSpeed's own optimizer": (
        lambda c: _with(c, lora={"lr_ratio": 16}, training={"deepspeed": "ds_configs/zero2_offload.json"}),
        "lora.lr_ratio (LoRA+) needs the Trainer's optimizer"),
    "group_by_length under DPO": (
        lambda c: _with(c, training={"method": "dpo", "group_by_length": True}, data={"format": "preference"}),
        "training.group_by_length does not apply to training.method: dpo, which samples in its own order; remove it"),
    "packing under KTO": (
        lambda c: _with(c, training={"method": "kto"}, data={"format": "unpaired_preference", "packing": True}),
        "data.packing: true does not apply to training.method: kto, which pads its batches; remove it"),
    "varlen attention with packing off": (
        lambda c: _with(c, model={"attn_implementation": "varlen"}, data={"packing": False}),
        "model.attn_implementation: varlen reads the boundaries of packed batches, and data.packing is false; set "
        "model.attn_implementation: sdpa"),
    "varlen attention under DPO": (
        lambda c: _with(c, model={"attn_implementation": "varlen"}, training={"method": "dpo"},
                        data={"format": "preference"}),
        "model.attn_implementation: varlen reads the boundaries of packed batches, and training.method: dpo pads its "
        "batches"),
    "prompt tokens trained under DPO": (
        lambda c: _with(c, training={"method": "dpo"}, data={"format": "preference", "mask_prompt": False}),
        "data.mask_prompt: false does not apply to training.method: dpo, which trains the answers only"),
    "label smoothing the sigmoid DPO loss ignores": (
        lambda c: _with(c, training={"method": "dpo"}, data={"format": "preference"}, dpo={"label_smoothing": 0.1}),
        "dpo.label_smoothing applies to loss_type robust, exo_pair, aot, aot_unpaired; TRL's sigmoid loss takes none"),
    "cispo without its ratio cap": (
        lambda c: _with(c, training={"method": "grpo"}, data={"format": "prompt"},
                        grpo={"rewards": [{"reward": "length"}], "loss_type": "cispo"}),
        "grpo.epsilon_high: loss_type cispo caps the probability ratio at epsilon_high"),
    "GRPO best by a loss its evaluations do not log": (
        lambda c: _with(c, training={"method": "grpo", "metric_for_best": "eval_loss"}, data={"format": "prompt"},
                        grpo={"rewards": [{"reward": "length"}]}, eval={"metrics": ["chrf"]}),
        "training.metric_for_best: eval_loss is not logged at evaluations; logged: chrf"),
    "deepspeed and fsdp both": (lambda c: _with(c, training={"deepspeed": "ds_configs/zero3.json", "fsdp": {}}),
                                "training.deepspeed and training.fsdp are both set"),
    "fsdp activation checkpointing beside gradient checkpointing": (
        lambda c: _with(c, training={"gradient_checkpointing": True, "fsdp": {"activation_checkpointing": True}}),
        "under FSDP keep training.fsdp.activation_checkpointing"),
    "fsdp activation checkpointing without auto wrap": (
        lambda c: _with(c, training={"fsdp": {"activation_checkpointing": True, "auto_wrap": False}}),
        "set training.fsdp.auto_wrap: true, or use training.gradient_checkpointing"),
    "8-bit base under fsdp": (lambda c: _with(c, quantization={"bits": 8}, training={"fsdp": {}}),
                              "quantization.bits 8 with training.fsdp"),
    "unknown fsdp key": (lambda c: _with(c, training={"fsdp": {"shard": "full"}}), "training.fsdp.shard"),
    "lora with adapter none": (lambda c: _with(c, adapter="none", lora={"r": 4}),
                               "lora settings given but adapter is 'none'"),
    "fp16 and bf16 both on": (lambda c: _with(c, quantization={"compute_dtype": "bf16"},
                                              training={"precision": "fp16"}), "fp16 and bf16 both on"),
    "eval and eval_fraction": (lambda c: _with(c, data={"eval": c["data"], "eval_fraction": 0.1}),
                               "data.eval and data.eval_fraction are both set"),
    "warmup twice": (lambda c: _with(c, training={"warmup_ratio": 0.1, "warmup_steps": 5}),
                     "training.warmup_ratio and training.warmup_steps are both set; keep one"),
    "chat with alpaca template": (lambda c: _with(c, data={"format": "chat", "template": "alpaca"}),
                                  "cannot render format chat"),
    "infinite epochs": (lambda c: _text(c, "training:\n  epochs: .inf\n"),
                        "training.epochs: Input should be a finite number (got inf)"),
    "nan learning rate": (lambda c: _text(c, "training:\n  learning_rate: .nan\n"),
                          "training.learning_rate: Input should be a finite number"),
    "inf as a string": (lambda c: _text(c, "training:\n  max_grad_norm: inf\n"),
                        "training.max_grad_norm: Input should be a finite number"),
    "duplicate top-level key": (lambda c: _text(c, "adapter: lora\nadapter: none\n"),
                                "line 6: duplicate key adapter (first set on line 5); keep one"),
    "duplicate section key": (lambda c: _text(c, "training:\n  epochs: 1\n  seed: 3\n  epochs: 2\n"),
                              "line 8: duplicate key training.epochs (first set on line 6); keep one"),
    "duplicate deeply nested key": (lambda c: _text(c, "  fields:\n    prompt: q\n    prompt: p\n"),
                                    "line 7: duplicate key data.fields.prompt (first set on line 6)"),
    "duplicate section": (lambda c: _text(c, "data:\n  train: x.jsonl\n"), "duplicate key data (first set on line 3)"),
    "missing data file": (lambda c: _with(c, data={"train": "nope/missing.jsonl"}),
                          "data.train: file 'nope/missing.jsonl' not found"),
    "missing eval file": (lambda c: _with(c, data={"eval": "missing_eval.jsonl"}),
                          "data.eval: file 'missing_eval.jsonl' not found"),
    "missing model dir": (lambda c: _with(c, model={"name_or_path": "./models/none"}),
                          "model.name_or_path: no such model directory"),
    "missing gguf": (lambda c: _with(c, model={"name_or_path": "nopkg/none.gguf"}),
                     "GGUF file 'nopkg/none.gguf' not found"),
    "model dir without config": (lambda c: _with(c, model={"name_or_path": str(c["tmp"])}), "has no config.json"),
    "missing deepspeed file": (lambda c: _with(c, training={"deepspeed": "ds_configs/zero9.json"}),
                               "training.deepspeed: file 'ds_configs/zero9.json' not found"),
    "invalid deepspeed JSON": (lambda c: _with(c, training={"deepspeed": str(c["tmp"] / "bad_ds.json")}),
                               "bad_ds.json line 1: not valid JSON"),
    "deepspeed not an object": (lambda c: _with(c, training={"deepspeed": str(c["tmp"] / "list_ds.json")}),
                                "must hold a JSON object"),
    "deepspeed contradiction": (lambda c: _with(c, training={"deepspeed": str(c["tmp"] / "hand_set.json")}),
                                "gradient_clipping = 0.3 contradicts training.max_grad_norm = 1.0"),
    "deepspeed ZeRO stage that does not exist": (
        lambda c: _with(c, training={"deepspeed": str(c["tmp"] / "stage7.json")}),
        "zero_optimization.stage: DeepSpeed rejects 7: Input should be 0, 1, 2, 3"),
    "deepspeed offload device that does not exist": (
        lambda c: _with(c, training={"deepspeed": str(c["tmp"] / "disk.json")}),
        "zero_optimization.offload_param.device: DeepSpeed rejects \"disk\""),
    "deepspeed duplicate key": (lambda c: _with(c, training={"deepspeed": str(c["tmp"] / "dup_ds.json")}),
                                "dup_ds.json: duplicate key 'stage'; keep one"),
    "unwritable output dir": (lambda c: _with(c, output_dir="/proc/tunekit-run"),
                              "output_dir /proc/tunekit-run: /proc is not writable"),
    "output dir under a file": (lambda c: _with(c, output_dir=str(Path(c["data"]) / "run")),
                                "is a file, not a directory"),
    "invalid YAML": (lambda c: "model:\n  name_or_path: x\n data: [\n", "line 3: invalid YAML"),
    "python tag": (lambda c: 'model: !!python/object/apply:os.system ["true"]\n', "invalid YAML"),
}


SLOW_RECIPES = {"deepspeed contradiction", "deepspeed ZeRO stage that does not exist",
                "deepspeed offload device that does not exist"}  # seconds each (DeepSpeed's own check imports it)


def _recipe_file(case: str, ctx) -> Path:
    raw = RECIPES[case][0](ctx)
    if isinstance(raw, dict) and "output_dir" not in raw:
        raw["output_dir"] = str(ctx["tmp"] / "out")
    path = ctx["tmp"] / "r.yaml"
    path.write_text("" if raw is None else raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


# through the command line (a process each, ~10 s of imports): a few cases, so that the boundary itself (one line on
# stderr, exit 2, no traceback) is held; every case runs in-process below, for train and validate
THROUGH_THE_CLI = ["invalid YAML", "unknown top-level key", "missing data file", "deepspeed contradiction"]


@pytest.mark.slow
@pytest.mark.parametrize("case", THROUGH_THE_CLI)
def test_bad_recipe(case, ctx):
    path = _recipe_file(case, ctx)
    before = sorted(p.name for p in ctx["tmp"].iterdir())
    assert_refused(run_cli("train", str(path)), RECIPES[case][1], ctx["tmp"], before)


def _in_process(argv: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
    """A command run in this process (the library's import is paid once): its exit code and stderr lines."""
    import logging

    from tunekit.cli import main

    monkeypatch.setattr(logging.getLogger("tunekit"), "handlers", [])  # its log lines on this test's stderr
    capsys.readouterr()
    code = main.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_RECIPES else c for c in RECIPES])
def test_validate_refuses_what_train_refuses_before_loading_weights(case, ctx, capsys, monkeypatch):
    """Each recipe above breaks one rule that `tunekit train` refuses before loading weights: `tunekit validate`
    refuses it too, with the same one line and exit code 2 (both run the checks of tunekit.api.checks), and
    writes nothing."""
    expected, tmp = RECIPES[case][1], ctx["tmp"]
    path = _recipe_file(case, ctx)
    before = sorted(p.name for p in tmp.iterdir())
    trained = _in_process(["train", str(path)], capsys, monkeypatch)
    assert len(trained[1]) == 1, trained  # train says the one line and nothing else
    validated = _in_process(["validate", str(path)], capsys, monkeypatch)
    assert trained[0] == validated[0] == 2, (trained, validated)
    # validate may say first what it fitted (data.max_length to a model's window); the error is the one line after
    errors = [line for line in validated[1] if line.startswith("tunekit: error: ")]
    assert errors == validated[1][-1:] == trained[1][-1:], (trained, validated)
    assert expected in errors[0]
    assert sorted(p.name for p in tmp.iterdir()) == before, "wrote something"


def test_duplicate_key_in_an_override_value(ctx):
    path = write_recipe(ctx["tmp"] / "r.yaml", _with(ctx))
    assert_refused(run_cli("validate", str(path), "--set", "training={epochs: 1, epochs: 2}"),
                   "line 1: duplicate key epochs (first set on line 1); keep one")


# ---------------------------------------------------------------- command-line arguments

# name -> (argv, expected); RECIPE and TMP are filled in
ARGS = {
    "plan world size 0": (["plan", "RECIPE", "--world-size", "0"], "argument --world-size: must be at least 1, got 0"),
    "plan world size not a number": (["plan", "RECIPE", "--world-size", "two"],
                                     "argument --world-size: expected a whole number, got 'two'"),
    "plan malformed gpu memory": (["plan", "RECIPE", "--gpu-memory", "24XB"],
                                  "argument --gpu-memory: '24XB' is not a size; write e.g. 24GiB"),
    "plan negative gpu memory": (["plan", "RECIPE", "--gpu-memory=-1G"], "'-1G' is not a positive size"),
    "plan utilization above 1": (["plan", "RECIPE", "--utilization", "2"], "argument --utilization: must be in (0, 1]"),
    "plan peak tflops nan": (["plan", "RECIPE", "--peak-tflops", "nan"],
                             "argument --peak-tflops: must be a finite number"),
    "validate world size 0": (["validate", "RECIPE", "--world-size", "0"], "argument --world-size: must be at least 1"),
    "override without =": (["validate", "RECIPE", "--set", "training.seed"],
                           "argument --set: expected dotted.key=value"),
    "override with an empty key part": (["validate", "RECIPE", "--set", "training..seed=1"],
                                        "argument --set: expected dotted.key=value"),
    "override of an unknown key": (["validate", "RECIPE", "--set", "training.learnig_rate=1"],
                                   "unknown key training.learnig_rate; did you mean training.learning_rate?"),
    "override into a value": (["validate", "RECIPE", "--set", "model.name_or_path.x=4"],
                              "model.name_or_path is a value, not a section"),
    "merge tolerance inf": (["merge", "TMP", "--tolerance", "inf"], "argument --tolerance: must be a finite number"),
    "merge tolerance 0": (["merge", "TMP", "--tolerance", "0"], "argument --tolerance: must be greater than 0"),
    "merge bad dtype": (["merge", "TMP", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    "eval limit 0": (["eval", "TMP", "--limit", "0"], "argument --limit: must be at least 1, got 0"),
    "eval batch size not a number": (["eval", "TMP", "--batch-size", "x"],
                                     "argument --batch-size: expected a whole number"),
    "eval max new tokens negative": (["eval", "TMP", "--max-new-tokens", "-3"],
                                     "argument --max-new-tokens: must be at least 1"),
    "train without a recipe": (["train"], "the following arguments are required: recipe"),
    "unknown command": (["fit", "RECIPE"], "invalid choice: 'fit'"),
    # a wrong path is named as what it is, not as some later symptom
    "recipe that does not exist": (["train", "TMP/nope.yaml"], "recipe file"),
    "recipe that is a directory": (["train", "TMP"], "is a directory; give a YAML recipe file"),
    "merge of a path that does not exist": (["merge", "TMP/nope"], "run directory TMP/nope: no such directory"),
    "merge of a file": (["merge", "RECIPE"], "is a file, not a directory"),
    "merge of a directory that is no run": (["merge", "TMP"], "not a tunekit run directory (no run.json)"),
    "eval of a path that does not exist": (["eval", "TMP/nope/run"], "eval target: no such model directory"),
    "eval of a relative path that does not exist": (["eval", "runs/nope"], "runs/nope: no such directory here"),
    "eval of a directory that is no run or model": (["eval", "TMP"], "neither a run directory"),
    "eval with a missing data file": (["eval", "TMP", "--data", "TMP/nope.jsonl"],
                                      "--data TMP/nope.jsonl: file not found"),
    "eval with a directory as recipe": (["eval", "TMP", "--recipe", "TMP"], "--recipe TMP: is a directory"),
    "resume of a path that does not exist": (["train", "RECIPE", "--resume"], "--resume: output_dir"),
}


# refused only after torch and transformers are imported (seconds each): run with the slow tests. None now:
# every command checks its arguments, recipe, data and model first (tests/cli/test_first_answers.py)
SLOW_ARGS: set[str] = set()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_ARGS else c for c in ARGS])
def test_bad_argument(case, ctx):
    tmp = ctx["tmp"]
    recipe = write_recipe(tmp / "r.yaml", _with(ctx, output_dir=str(tmp / "never" / "run")))
    argv, expected = ARGS[case]

    def fill(s):
        return s.replace("RECIPE", str(recipe)).replace("TMP", str(tmp))

    before = sorted(p.name for p in tmp.iterdir())
    line = assert_refused(run_cli(*map(fill, argv)), fill(expected), tmp, before)
    if case == "resume of a path that does not exist":
        assert "no such directory" in line


# ---------------------------------------------------------------- data files

def _agent_line(call: dict | None, after: list | None = None) -> str:
    """A good chat line, then one whose assistant message calls `call` (None: calls nothing)."""
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assistant = {"role": "assistant", "content": "" if call else "b"}
    if call:
        assistant["tool_calls"] = [{"id": "c1", "type": "function", "function": call}]
    bad = {"messages": [{"role": "user", "content": "weather?"}, assistant] + (after or [])
           + [{"role": "assistant", "content": "done"}]}
    return json.dumps(good) + "\n" + json.dumps(bad) + "\n"


BAD_DATA = {
    "malformed": ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "b"}\n'
                  '{"instruction": "a" "output": "b"}\n',
                  r"bad.jsonl line 3: malformed JSON"),
    "missing_field": ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "answer": "b"}\n',
                      r"bad.jsonl line 2: missing field 'output' \(fields present: instruction, answer\)"),
    "wrong_type": ('{"instruction": "a", "output": ["b"]}\n',
                   r"bad.jsonl line 1: field 'output' must be text, got list"),
    "not_object": ('["a", "b"]\n', r"bad.jsonl line 1: expected a JSON object, got list"),
    "non_utf8": (b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n',
                 r"bad.jsonl line 2: not UTF-8 text \(byte 0xe9\)"),
    "empty": ("\n\n", r"data.train: .*bad.jsonl holds no examples"),
    "all_dropped": ('{"instruction": "' + "word " * 200 + '", "output": "b"}\n',
                    r"no example has a trained token left after truncation to 64 tokens; raise data.max_length"),
    "chat_unknown_role": (json.dumps({"messages": [{"role": "user", "content": "a"},
                                                   {"role": "assistent", "content": "b"}]}) + "\n",
                          r"bad.jsonl line 1: message 1 has role 'assistent'; "
                          r"use one of system, user, assistant, tool"),
    "chat_no_assistant": (json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n",
                          r"bad.jsonl line 1: conversation has no assistant message to train on"),
    "chat_arguments_not_json": (_agent_line({"name": "f", "arguments": "{city: Paris}"}),
                                r"bad.jsonl line 2: message 1 tool call 0: the arguments of 'f' is not JSON "
                                r"\(Expecting property name enclosed in double quotes at column 2\)"),
    "chat_tool_result_without_call": (
        _agent_line(None, [{"role": "tool", "content": "21", "tool_call_id": "c1"}]),
        r"bad.jsonl line 2: message 2: a tool result without a call: the assistant message before it calls no tool"),
    "chat_tool_result_wrong_id": (
        _agent_line({"name": "f", "arguments": "{}"}, [{"role": "tool", "content": "21", "tool_call_id": "c9"}]),
        r"bad.jsonl line 2: message 2: tool_call_id 'c9' matches no call of the assistant message before it "
        r"\(ids: c1\)"),
    "chat_tools_not_json": ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], '
                            '"tools": "[{name: f}]"}\n', r"bad.jsonl line 1: field 'tools' is not JSON"),
    "chat_train_true_on_user": (json.dumps({"messages": [{"role": "user", "content": "a", "train": True},
                                                         {"role": "assistant", "content": "b"}]}) + "\n",
                                r"bad.jsonl line 1: message 0: 'train' is true on a user message; only assistant "
                                r"messages train"),
}


# found only once the tokenizer has rendered the data (seconds); the others before any heavy import
SLOW_DATA = {"all_dropped"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_DATA else c for c in BAD_DATA])
def test_bad_data(case, tmp_path, tiny_model):
    content, expected = BAD_DATA[case]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    fmt = {"format": "chat"} if case.startswith("chat") else {}
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, bad, tmp_path / "run", data=fmt))
    before = sorted(p.name for p in tmp_path.iterdir())
    line = assert_refused(run_cli("train", str(recipe)), "", tmp_path, before, progress=True)
    assert re.search(expected, line), line


@pytest.mark.slow
def test_eval_split_larger_than_data(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}] * 3)
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", data={"eval_fraction": 0.9})
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_refused(run_cli("train", str(recipe)),
                   "data.eval_fraction=0.9 of 3 examples leaves 3 for eval and 0 for training", tmp_path, before,
                   progress=True)


@pytest.mark.slow
def test_bad_data_with_force_keeps_the_previous_run(tmp_path, tiny_model):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, bad, out))), "--force")
    assert res.returncode == 2 and (out / "run.json").read_text() == "{}"
