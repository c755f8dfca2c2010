"""Faults and bad input: resume after SIGKILL, no half-written outputs, NaN stops, one-line errors
for bad data and bad recipes, pre-flight checks, safe defaults."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from shutil import _ntuple_diskusage as shutil_usage

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, assert_no_pickles, cut_after_checkpoint, reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit import checkpoints, models, preflight, recipe as recipe_mod, statefile, train
from tunekit.errors import TunekitError

RESUME_ARGS = ["--set", "training.max_steps=8", "--set", "training.save_steps=2", "--set", "training.save_total_limit=10",
               "--set", "lora.dropout=0.1"]  # dropout: the RNG state must be restored too


@pytest.fixture(scope="module")
def resume_recipe(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("resume")
    data = write_jsonl(root / "train.jsonl", reverse_rows(32))
    return write_recipe(root / "r.yaml", tiny_recipe(tiny_model, data, root / "unused"))


@pytest.fixture(scope="module")
def uninterrupted(resume_recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *RESUME_ARGS)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def history(run_dir):
    return [json.loads(line).get("loss") for line in (run_dir / "loss_history.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def start_and_kill(recipe_file, out, wait_for: Path):
    cmd = [sys.executable, "-m", "tunekit", "train", str(recipe_file), "--set", f"output_dir={out}", *RESUME_ARGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not wait_for.exists():
        assert proc.poll() is None, "training ended before the kill point"
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("kill_point", ["checkpoint-2/tunekit-complete", "checkpoint-4/tunekit-complete",
                                        "checkpoint-6/tunekit-complete", "checkpoint-6"])
def test_resume_after_sigkill_matches_an_uninterrupted_run(resume_recipe, uninterrupted, tmp_path, kill_point):
    """The last point kills as soon as checkpoint-6 appears, while its files are being written."""
    out = tmp_path / "run"
    start_and_kill(resume_recipe, out, out / "checkpoints" / kill_point)
    assert json.loads((out / "run.json").read_text())["status"] == "running"
    assert not (out / "adapter").exists()
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *RESUME_ARGS, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.search(r"resuming from checkpoint-[246]\b", res.stderr)
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "completed" and info["global_step"] == 8
    # exactly the same: data order, optimizer, scheduler and RNG state all restored
    assert history(out) == history(uninterrupted)
    a = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(uninterrupted / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_refuses_a_checkpoint_without_readable_optimizer_state(tmp_path):
    ckpt = tmp_path / "checkpoints" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoints.MARKER).write_text("{}")
    (ckpt / "optimizer.pt").write_bytes(b"PK\x03\x04")  # torch.save format, which tunekit never loads
    with pytest.raises(TunekitError, match="no optimizer state tunekit can read"):
        checkpoints.resume_point(tmp_path)


def test_resume_restores_8bit_optimizer_state(resume_recipe, tmp_path):
    # Full fine-tuning, so the larger matrices get bitsandbytes' uint8 moments with their scales.
    args = ["--set", "training.optimizer=paged_adamw_8bit", "--set", "adapter=none", "--set", "lora=null",
            "--set", "training.learning_rate=1e-3", "--set", "training.max_steps=6", "--set", "training.save_steps=2",
            "--set", "training.save_total_limit=10"]
    full = tmp_path / "full"
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={full}", *args)
    assert res.returncode == 0, res.stderr[-2000:]
    state = statefile.load(full / "checkpoints" / "checkpoint-2" / "optimizer.safetensors")
    assert any(t.dtype == torch.uint8 for s in state["state"].values() for t in s.get("__bnb_optimizer_quant_state__", {}).values())
    cut = cut_after_checkpoint(full, tmp_path / "cut", 2)
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={cut}", *args, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert history(cut) == history(full)
    a, b = load_file(str(full / "model" / "model.safetensors")), load_file(str(cut / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_ignores_a_half_written_checkpoint(resume_recipe, uninterrupted, tmp_path):
    """The on-disk state of a kill in the middle of writing checkpoint-6 and the final adapter."""
    out = tmp_path / "run"
    start_and_kill(resume_recipe, out, out / "checkpoints" / "checkpoint-4" / checkpoints.MARKER)
    half = out / "checkpoints" / "checkpoint-6"
    half.mkdir()
    (half / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    (out / ".adapter.partial").mkdir()
    assert checkpoints.newest_complete(out / "checkpoints").name == "checkpoint-4"
    # nothing treats the interrupted run as finished
    assert run_cli("merge", str(out)).returncode == 2
    assert run_cli("eval", str(out)).returncode == 2
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={out}", *RESUME_ARGS, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "removed incomplete checkpoint checkpoint-6" in res.stderr and "resuming from checkpoint-4" in res.stderr
    assert history(out) == history(uninterrupted)
    assert not (out / ".adapter.partial").exists()


def test_resume_refuses_other_recipe_or_missing_run(resume_recipe, uninterrupted, tmp_path):
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={tmp_path / 'none'}", "--resume")
    assert res.returncode == 2 and "not a tunekit run directory" in res.stderr
    res = run_cli("train", str(resume_recipe), "--set", f"output_dir={uninterrupted}", *RESUME_ARGS, "--resume")
    assert res.returncode == 2 and "already completed" in res.stderr


def test_a_run_writes_only_safetensors_and_text(uninterrupted):
    ckpts = sorted((uninterrupted / "checkpoints").glob("checkpoint-*"))
    assert ckpts and all((c / checkpoints.MARKER).is_file() for c in ckpts)
    names = {p.name for p in assert_no_pickles(uninterrupted)}
    assert {"adapter_model.safetensors", "optimizer.safetensors", "scheduler.safetensors",
            "rng_state.safetensors"} <= names


def test_non_finite_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(tmp_path, tiny_model, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(32))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"max_steps": 10, "save_steps": 2})
    recipe = recipe_mod.load(write_recipe(tmp_path / "r.yaml", raw))
    real = models.load_for_training
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        model = real(*args, **kwargs)

        def hook(module, inputs, output):
            calls["n"] += 1
            if calls["n"] >= 5:  # the 5th training forward pass, i.e. step 5
                output.loss = output.loss * float("nan")
            return output
        model.register_forward_hook(hook)
        return model

    monkeypatch.setattr(models, "load_for_training", poisoned)
    with pytest.raises(TunekitError, match=r"at step 5"):
        train.run(recipe)
    run_dir = tmp_path / "run"
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "failed" and "step 5" in info["error"]
    assert checkpoints.newest_complete(run_dir / "checkpoints").name == "checkpoint-4"
    good = load_file(str(run_dir / "checkpoints" / "checkpoint-4" / "adapter_model.safetensors"))
    assert all(v.isfinite().all() for v in good.values())
    assert not (run_dir / "adapter").exists()


# ---------------------------------------------------------------- bad data

BAD_DATA = {
    "malformed": ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "b"}\n{"instruction": "a" "output": "b"}\n',
                  r"bad.jsonl line 3: malformed JSON"),
    "missing_field": ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "answer": "b"}\n',
                      r"bad.jsonl line 2: missing field 'output' \(fields present: instruction, answer\)"),
    "wrong_type": ('{"instruction": "a", "output": ["b"]}\n', r"bad.jsonl line 1: field 'output' must be text, got list"),
    "not_object": ('["a", "b"]\n', r"bad.jsonl line 1: expected a JSON object, got list"),
    "non_utf8": (b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n',
                 r"bad.jsonl line 2: not UTF-8 text \(byte 0xe9\)"),
    "empty": ("\n\n", r"data.train: .*bad.jsonl holds no examples"),
    "all_dropped": ('{"instruction": "' + "word " * 200 + '", "output": "b"}\n',
                    r"no example has a trained token left after truncation to 64 tokens; raise data.max_length"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_one_line_error_names_file_and_line(case, tmp_path, tiny_model):
    content, expected = BAD_DATA[case]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "run"
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, bad, out))))
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("tunekit: error: ") and re.search(expected, last), last
    assert "Traceback" not in res.stderr
    assert not out.exists()


def test_eval_split_larger_than_data(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(3))
    out = tmp_path / "run"
    raw = tiny_recipe(tiny_model, data, out, data={"eval_fraction": 0.9})
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode == 2 and "data.eval_fraction=0.9 of 3 examples leaves 3 for eval and 0 for training" in res.stderr
    assert not out.exists()


def test_bad_data_with_force_keeps_the_previous_run(tmp_path, tiny_model):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, bad, out))), "--force")
    assert res.returncode == 2 and (out / "run.json").read_text() == "{}"


# ---------------------------------------------------------------- bad recipes


def _corpus(tmp: Path, model: Path, data: Path) -> list[tuple[str, object, str]]:
    bad_json = tmp / "bad_ds.json"
    bad_json.write_text('{"zero_optimization": {"stage": 2,,}}')
    list_json = tmp / "list_ds.json"
    list_json.write_text("[1, 2]")
    hand_set = tmp / "hand_set.json"
    hand_set.write_text('{"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}')
    ok = {"model": {"name_or_path": str(model)}, "data": {"train": str(data)}}

    def with_(**sections):
        raw = json.loads(json.dumps(ok))
        for key, value in sections.items():
            raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
        return raw

    return [
        ("unknown top-level key", with_(trainig={}), "unknown key trainig; did you mean training?"),
        ("unknown model key", with_(model={"nme_or_path": "x"}), "unknown key model.nme_or_path"),
        ("unknown lora key", with_(lora={"rank": 4}), "unknown key lora.rank"),
        ("unknown quantization key", with_(adapter="qlora", quantization={"bit": 4}), "unknown key quantization.bit"),
        ("unknown data key", with_(data={"fromat": "chat"}), "did you mean data.format?"),
        ("unknown fields key", with_(data={"fields": {"promt": "q"}}), "did you mean data.fields.prompt?"),
        ("unknown training key", with_(training={"learnig_rate": 1}), "did you mean training.learning_rate?"),
        ("unknown eval key", with_(eval={"max_new_token": 3}), "did you mean eval.max_new_tokens?"),
        ("not a mapping", ["a", "b"], "must be a YAML mapping"),
        ("empty recipe", None, "missing required key model"),
        ("missing data", {"model": ok["model"]}, "missing required key data"),
        ("missing model path", with_(model={"name_or_path": None}), "model.name_or_path: Input should be a valid string"),
        ("lr not a number", with_(training={"learning_rate": "fast"}), "training.learning_rate: Input should be a valid number"),
        ("lr negative", with_(training={"learning_rate": -1}), "training.learning_rate: Input should be greater than 0"),
        ("lr too large", with_(training={"learning_rate": 5}), "training.learning_rate: Input should be less than or equal to 1"),
        ("batch zero", with_(training={"micro_batch_size": 0}), "training.micro_batch_size: Input should be greater than 0"),
        ("batch float", with_(training={"micro_batch_size": 2.5}), "training.micro_batch_size: Input should be a valid integer"),
        ("bad precision", with_(training={"precision": "fp8"}), "training.precision: Input should be"),
        ("bad scheduler", with_(training={"lr_scheduler": "zigzag"}), "training.lr_scheduler: Input should be"),
        ("bad optimizer", with_(training={"optimizer": "adam9"}), "training.optimizer: Input should be"),
        ("bad adapter", with_(adapter="dora"), "adapter: Input should be 'lora', 'qlora' or 'none'"),
        ("bad format", with_(data={"format": "sharegpt"}), "data.format: Input should be"),
        ("dropout out of range", with_(lora={"dropout": 1.5}), "lora.dropout: Input should be less than 1"),
        ("rank zero", with_(lora={"r": 0}), "lora.r: Input should be greater than 0"),
        ("bits 3", with_(adapter="qlora", quantization={"bits": 3}), "quantization.bits: Input should be 4 or 8"),
        ("max_length tiny", with_(data={"max_length": 2}), "data.max_length: Input should be greater than or equal to 8"),
        ("eval fraction 1", with_(data={"eval_fraction": 1.0}), "data.eval_fraction: Input should be less than 1"),
        ("bool as string", with_(training={"gradient_checkpointing": "maybe"}), "training.gradient_checkpointing: Input should be a valid boolean"),
        ("quantization without qlora", with_(quantization={"bits": 4}), "quantization settings given but adapter is 'lora'"),
        ("lora with adapter none", with_(adapter="none", lora={"r": 4}), "lora settings given but adapter is 'none'"),
        ("fp16 and bf16 both on", with_(adapter="qlora", quantization={"compute_dtype": "bf16"}, training={"precision": "fp16"}),
         "fp16 and bf16 both on"),
        ("eval and eval_fraction", with_(data={"eval": str(data), "eval_fraction": 0.1}), "data.eval and data.eval_fraction are both set"),
        ("warmup twice", with_(training={"warmup_ratio": 0.1, "warmup_steps": 5}), "both set; keep one"),
        ("chat with alpaca template", with_(data={"format": "chat", "template": "alpaca"}), "cannot render format chat"),
        ("missing data file", with_(data={"train": "nope/missing.jsonl"}), "data.train: file 'nope/missing.jsonl' not found"),
        ("missing eval file", with_(data={"eval": "missing_eval.jsonl"}), "data.eval: file 'missing_eval.jsonl' not found"),
        ("missing model dir", with_(model={"name_or_path": "./models/none"}), "model.name_or_path: no such model directory"),
        ("missing gguf", with_(model={"name_or_path": "nopkg/none.gguf"}), "GGUF file 'nopkg/none.gguf' not found"),
        ("model dir without config", with_(model={"name_or_path": str(tmp)}), "has no config.json"),
        ("missing deepspeed file", with_(training={"deepspeed": "ds_configs/zero9.json"}), "training.deepspeed: file 'ds_configs/zero9.json' not found"),
        ("invalid deepspeed JSON", with_(training={"deepspeed": str(bad_json)}), "not valid JSON"),
        ("deepspeed not an object", with_(training={"deepspeed": str(list_json)}), "must hold a JSON object"),
        ("deepspeed contradiction", with_(training={"deepspeed": str(hand_set)}),
         "gradient_clipping = 0.3 contradicts training.max_grad_norm = 1.0"),
        ("qlora with zero3", with_(adapter="qlora", training={"deepspeed": "ds_configs/zero3.json"}), "adapter qlora with ZeRO-3 is refused"),
        ("unwritable output dir", with_(output_dir="/proc/tunekit-run"), "output_dir /proc/tunekit-run: /proc is not writable"),
        ("output dir under a file", with_(output_dir=str(data / "run")), "is a file, not a directory"),
    ]


def test_bad_recipe_corpus_each_exits_2_with_one_line_and_writes_nothing(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(4))
    corpus = _corpus(tmp_path, tiny_model, data)
    assert len(corpus) >= 30
    for i, (name, raw, expected) in enumerate(corpus):
        path = tmp_path / f"r{i}.yaml"
        if raw is not None and not (isinstance(raw, dict) and "output_dir" in raw):
            raw = {**raw, "output_dir": str(tmp_path / f"out{i}")} if isinstance(raw, dict) else raw
        path.write_text("" if raw is None else __import__("yaml").safe_dump(raw))
        before = sorted(p.name for p in tmp_path.iterdir())
        res = run_cli("train", str(path))
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2, (name, res.stderr[-1500:])
        assert len(lines) == 1 and lines[0].startswith("tunekit: error: "), (name, res.stderr[-1500:])
        assert expected in lines[0], (name, lines[0])
        assert "Traceback" not in res.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == before, name  # wrote nothing


def test_recipes_cannot_execute_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "r.yaml"
    path.write_text(f'model: !!python/object/apply:os.system ["touch {marker}"]\ndata: {{train: x.jsonl}}\n')
    res = run_cli("validate", str(path))
    assert res.returncode == 2 and "invalid YAML" in res.stderr and not marker.exists()


# ---------------------------------------------------------------- pre-flight and safety


def test_preflight_warns_when_disk_looks_too_small(tmp_path, tiny_model, monkeypatch, caplog):
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(4))
    recipe = recipe_mod.load(write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, data, tmp_path / "run")),
                             ["adapter=none", "lora=null"])
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: shutil_usage(total=10**6, used=10**6 - 1000, free=1000))
    with caplog.at_level(logging.WARNING, logger="tunekit"):
        preflight.warn_if_disk_short(recipe, tmp_path / "run")
    assert "free disk" in caplog.text and "lower training.save_total_limit" in caplog.text
    caplog.clear()
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: shutil_usage(total=10**12, used=0, free=10**12))
    with caplog.at_level(logging.WARNING, logger="tunekit"):
        preflight.warn_if_disk_short(recipe, tmp_path / "run")
    assert "free disk" not in caplog.text


def test_trust_remote_code_is_off_by_default_and_logged_when_on(tiny_model, caplog, tmp_path):
    cfg = recipe_mod.ModelConfig(name_or_path=str(tiny_model))
    assert cfg.trust_remote_code is False
    with caplog.at_level(logging.WARNING, logger="tunekit"):
        models.load_base(cfg.model_copy(update={"trust_remote_code": True}), torch.float32)
    assert "trust_remote_code is ON" in caplog.text


def test_the_source_never_pickles_and_loads_weights_only():
    for path in (ROOT / "src" / "tunekit").rglob("*.py"):
        code = re.sub(r'""".*?"""|#[^\n]*', "", path.read_text(), flags=re.S)  # docstrings and comments
        assert not re.search(r"torch\.save\(|import pickle|pickle\.dump", code), path
        for call in re.findall(r"torch\.load\([^)]*\)", code):
            assert "weights_only=True" in call, f"{path}: {call}"