"""tunekit push against a stand-in Hub (tests/hub_standin.py: the endpoints huggingface_hub calls, answered as the
Hub answers them): what arrives is the run's files byte for byte plus a model card the Hub can read and the
training curves, in ONE commit; --private reaches the repo's creation and --revision the commit; a missing or
rejected token, a repo that exists, an unreachable Hub and an interrupted upload each end in one line, exit
code 2, and leave nothing of the upload on the remote. Each push runs as users run it: `python -m tunekit push`
in a fresh process whose HF_ENDPOINT names the stand-in.

The fast tests push a run directory written here file by file as `tunekit train` writes one (run.json,
recipe.yaml, adapter/, eval/, loss_history.jsonl): pushing reads files only. The slow test trains a tiny run and
pushes its adapter and its merged weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ROOT, reverse_rows, run_watching_imports, tiny_recipe, write_jsonl
from hub_standin import StandInHub, free_port
from tunekit import __version__
from tunekit.cli import main

BASE = "tunekit-test/tiny-llama"  # the base model, as a hub id; the stand-in holds its card (license)
GOOD, BAD = "hf_good", "hf_bad"
SVG = "{http://www.w3.org/2000/svg}"
BEFORE = {"bleu": 2.0, "chrf": 12.5, "rouge1": 10.0, "rouge2": 1.0, "rougeL": 9.0, "rougeLsum": 9.0,
          "exact_match": 0.0, "eval_loss": 3.5, "perplexity": 33.1, "examples": 8}
AFTER = {"bleu": 40.0, "chrf": 61.25, "rouge1": 70.0, "rouge2": 40.0, "rougeL": 69.0, "rougeLsum": 69.0,
         "exact_match": 37.5, "eval_loss": 0.9, "perplexity": 2.46, "examples": 8}


def tunekit_push(hub_url: str, *args: str, token: str | None = GOOD, home: Path | None = None):
    """`python -m tunekit push ARGS` with HF_ENDPOINT at the stand-in (over LFS, see hub_standin)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    env.update({"HF_ENDPOINT": hub_url, "HF_HUB_DISABLE_XET": "1", "PYTHONWARNINGS": "ignore",
                "HF_HOME": str(home or ROOT / ".no-such-hf-home")})
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "tunekit", "push", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def assert_one_line_error(res, *expected: str) -> str:
    """Exit code 2, no traceback, the last stderr line the error, every other line one of tunekit's own."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert lines[-1].startswith("tunekit: error: ") and all(line.startswith("tunekit: ") for line in lines), lines
    assert all(e in lines[-1] for e in expected), lines[-1]
    return lines[-1]


# ---------------------------------------------------------------- a finished run, written file by file


def _adapter(folder: Path) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    save_file({f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight":
               rng.standard_normal((8, 64) if ab == "A" else (64, 8)).astype(np.float32)
               for i in range(2) for ab in "AB"}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": BASE, "peft_type": "LORA",
                                                            "r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"}))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (folder / "README.md").write_text("# PEFT's own card, which the pushed card replaces\n")


def _gguf(path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(path.stem)
    writer.add_base_model_count(1)
    writer.add_base_model_name(0, BASE)
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".Modelfile").write_text(f"FROM ./{path.name}\nPARAMETER temperature 0\n")


def _history(path: Path) -> None:
    lines = [{"step": s, "epoch": s / 6, "time": 1000.0 + 3 * s, "loss": 3.0 - 0.3 * s, "grad_norm": 1.0 / s,
              "learning_rate": 1e-3} for s in range(1, 7)]
    lines += [{"step": s, "eval_loss": 2.0 - 0.1 * s, "eval_bleu": 5.0 * s, "eval_chrf": 8.0 * s} for s in (3, 6)]
    write_jsonl(path, lines)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from tunekit.config.recipefile import from_dict, to_yaml
    from tunekit.runs.layout import RunRecord

    root = tmp_path_factory.mktemp("push")
    data = write_jsonl(root / "train.jsonl", reverse_rows(40))
    run = root / "tiny-sft"
    _adapter(run / "adapter")
    (run / "eval").mkdir()
    (run / "eval" / "metrics.json").write_text(json.dumps({"target": str(run), "kind": "run", "scores": AFTER}))
    raw = tiny_recipe(BASE, data, run, data={"eval_fraction": 0.2, "decontaminate": True})
    (run / "recipe.yaml").write_text(to_yaml(from_dict(raw)))
    _history(run / "loss_history.jsonl")
    contamination = {"train_examples": 32, "eval_examples": 8, "duplicates": 20, "eval_exact": 8, "eval_ngram": 0,
                     "dropped": 13, "dedup": False, "decontaminate": True, "line": "contamination: ..."}
    RunRecord(status="completed", started="2026-11-24T10:00:00+0000", command=["tunekit", "train"], versions={},
              precision={"name": "fp32", "reason": "set in recipe"}, adapter="lora", base_model=BASE,
              parameters={"total": 141632, "trainable": 16384}, world_size=1, effective_batch=8, global_step=6,
              train_loss=2.1, output="adapter", eval="completed",
              data={"split": {"train_records_read": 40, "train": 32, "held_out": 8,
                              "held_out_from": "data.eval_fraction"}, "contamination": contamination,
                    "train": {"examples": 19, "tokens": 761, "trained_tokens": 148},
                    "eval": {"examples": 8, "tokens": 321, "trained_tokens": 61}}).save(run)
    _gguf(run / "tiny-sft-q8_0.gguf")
    baseline = root / "base-eval"
    baseline.mkdir()
    (baseline / "metrics.json").write_text(json.dumps({"target": BASE, "kind": "base", "scores": BEFORE}))
    return run


@pytest.fixture
def hub():
    with StandInHub({GOOD: {"name": "alice", "orgs": ["acme"], "role": "write"},
                     "hf_read": {"name": "alice", "orgs": [], "role": "read"}}) as server:
        server.add_repo(BASE, {"README.md": b"---\nlicense: apache-2.0\n---\n# a tiny model\n"})
        yield server


def card_of(files: dict[str, bytes]) -> tuple[dict, str]:
    text = files["README.md"].decode()
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


# ---------------------------------------------------------------- what arrives


def test_an_adapter_arrives_whole_in_one_commit_with_its_card_and_curves(hub, run_dir):
    from tunekit.config.recipefile import load, to_yaml

    res = tunekit_push(hub.url, str(run_dir), "--repo", "alice/tiny-sft", "--baseline",
                       str(run_dir.parent / "base-eval"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{hub.url}/alice/tiny-sft" in res.stdout
    files = hub.files("alice/tiny-sft")
    assert len(hub.commits) == 1 and sorted(hub.commits[0]["paths"]) == sorted(set(files) - {".gitattributes"})
    for name in ("adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "adapter_config.json"):
        assert files[name] == (run_dir / "adapter" / name).read_bytes(), name
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == BASE
    assert hub.calls("PUT", "/lfs-objects/")  # the weights went over LFS, the text inline in the commit
    assert hub.calls("POST", "/api/repos/create")[0]["json"]["visibility"] == "public"

    meta, body = card_of(files)
    assert meta["base_model"] == BASE and meta["library_name"] == "peft" and meta["license"] == "apache-2.0"
    assert {"tunekit", "sft", "lora"} <= set(meta["tags"]) and meta["pipeline_tag"] == "text-generation"
    assert {"bleu", "chrf", "rouge", "exact_match"} <= set(meta["metrics"])
    assert f"Base model: `{BASE}`" in body and "rank 8, alpha 16" in body and f"tunekit {__version__}" in body
    assert "```yaml\n" + to_yaml(load(run_dir / "recipe.yaml")) + "```" in body  # the resolved recipe
    assert "| chrF | 12.50 | 61.25 | +48.75 |" in body and "| exact match % | 0.00 | 37.50 | +37.50 |" in body
    assert "| eval examples sharing a prompt or answer with training | 8 |" in body
    assert "| training examples dropped | 13 |" in body and "| training examples | 19 |" in body
    assert "PEFT's own card" not in body and "![training curves](training_curves.svg)" in body
    assert 'AutoPeftModelForCausalLM.from_pretrained("alice/tiny-sft")' in body

    svg = ET.fromstring(files["training_curves.svg"])
    curves = {p.get("data-key") for p in svg.iter(f"{SVG}path")}
    assert curves == {"loss", "eval_loss", "eval_bleu", "eval_chrf", "learning_rate", "grad_norm"}
    loss = next(p for p in svg.iter(f"{SVG}path") if p.get("data-key") == "loss").get("d")
    assert loss.count("L") == 5  # six logged steps, one line between each


def test_private_reaches_the_repo_and_revision_the_commit(hub, run_dir):
    res = tunekit_push(hub.url, str(run_dir), "--repo", "acme/tiny", "--private", "--revision", "dev")
    assert res.returncode == 0, res.stderr[-3000:]
    assert hub.calls("POST", "/api/repos/create")[0]["json"] == {"name": "tiny", "organization": "acme",
                                                                 "visibility": "private"}
    assert hub.repos["acme/tiny"]["private"] is True
    assert [r["path"] for r in hub.calls("POST", "/commit/")] == ["/api/models/acme/tiny/commit/dev"]
    assert hub.files("acme/tiny") == {".gitattributes": hub.files(BASE)[".gitattributes"]}  # main untouched
    assert "adapter_model.safetensors" in hub.files("acme/tiny", "dev")


def test_a_gguf_file_arrives_with_its_modelfile(hub, run_dir):
    res = tunekit_push(hub.url, str(run_dir), "--what", "gguf", "--repo", "alice/tiny-gguf")
    assert res.returncode == 0, res.stderr[-3000:]
    files = hub.files("alice/tiny-gguf")
    gguf_file = run_dir / "tiny-sft-q8_0.gguf"
    assert files[gguf_file.name] == gguf_file.read_bytes()
    assert files["tiny-sft-q8_0.Modelfile"] == gguf_file.with_suffix(".Modelfile").read_bytes()
    meta, body = card_of(files)
    assert "gguf" in meta["tags"] and "library_name" not in meta and meta["base_model"] == BASE
    assert "ollama run hf.co/alice/tiny-gguf" in body and "## Recipe" in body  # the run's card: it sits in the run

    res = tunekit_push(hub.url, str(gguf_file), "--repo", "alice/tiny-gguf-2")  # a .gguf TARGET: gguf by default
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(hub.files("alice/tiny-gguf-2")) == set(files)


def test_a_merged_directory_pushes_its_weights_not_its_local_files(hub, run_dir, tmp_path):
    from safetensors.numpy import save_file

    merged = tmp_path / "merged"
    merged.mkdir()
    save_file({"lm_head.weight": np.ones((4, 4), np.float32)}, str(merged / "model.safetensors"))
    (merged / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    (merged / "recipe.yaml").write_text((run_dir / "recipe.yaml").read_text())
    (merged / "README.md").write_text("# the card tunekit merge wrote\n")
    (merged / "tunekit.json").write_text(json.dumps({"source_run": str(run_dir), "dtype": "float32", "parity": {
        "max_abs_diff": 1.2e-5, "top1_agreement": 1.0, "positions": 40}}))
    _gguf(merged / "merged-q8_0.gguf")
    res = tunekit_push(hub.url, str(merged), "--repo", "alice/tiny-merged")
    assert res.returncode == 0, res.stderr[-3000:]
    files = hub.files("alice/tiny-merged")
    assert set(files) == {".gitattributes", "model.safetensors", "config.json", "README.md", "training_curves.svg"}
    assert files["model.safetensors"] == (merged / "model.safetensors").read_bytes()
    meta, body = card_of(files)
    assert meta["library_name"] == "transformers" and "max |logit diff| 1.20e-05" in body
    assert "Weights: float32, safetensors" in body


def test_force_replaces_the_files_of_a_repo_that_exists_in_one_commit(hub, run_dir):
    hub.add_repo("alice/tiny", {"README.md": b"# old\n", "old-weights.safetensors": b"old"})
    res = tunekit_push(hub.url, str(run_dir), "--repo", "alice/tiny")
    assert_one_line_error(res, "--repo alice/tiny: already exists on the Hub", "--force")
    assert hub.files("alice/tiny")["README.md"] == b"# old\n" and not hub.commits
    res = tunekit_push(hub.url, str(run_dir), "--repo", "alice/tiny", "--force")
    assert res.returncode == 0, res.stderr[-3000:]
    files = hub.files("alice/tiny")
    assert "old-weights.safetensors" not in files and files["adapter_model.safetensors"]
    assert len(hub.commits) == 1 and "old-weights.safetensors" in hub.commits[0]["paths"]  # deleted in that commit


# ---------------------------------------------------------------- what goes wrong: one line, exit 2, nothing remote


@pytest.mark.parametrize("case", ["no token", "rejected token", "read-only token", "another owner", "unreachable"])
def test_each_refusal_is_one_line_and_leaves_nothing_remote(hub, run_dir, tmp_path, case):
    url, token, repo = hub.url, GOOD, "alice/tiny"
    expected = {"no token": "no Hugging Face token here: set HF_TOKEN",
                "rejected token": "the Hugging Face Hub rejected the token (401",
                "read-only token": "the Hugging Face token here is read-only",
                "another owner": "the token here is alice's, who is not bob",
                "unreachable": "cannot reach the Hugging Face Hub at"}[case]
    if case == "no token":
        token = None
    elif case == "rejected token":
        token = BAD
    elif case == "read-only token":
        token = "hf_read"
    elif case == "another owner":
        repo = "bob/tiny"
    else:
        url = f"http://127.0.0.1:{free_port()}"
    line = assert_one_line_error(tunekit_push(url, str(run_dir), "--repo", repo, token=token, home=tmp_path), expected)
    assert "Connection refused" in line if case == "unreachable" else True
    assert set(hub.repos) == {BASE} and not hub.commits and not hub.lfs


@pytest.mark.parametrize("failure", ["drop", 500])
def test_an_interrupted_upload_leaves_none_of_it_and_the_same_command_finishes_it(hub, run_dir, failure):
    hub.fail["commit"] = failure
    res = tunekit_push(hub.url, str(run_dir), "--repo", "alice/tiny")
    line = assert_one_line_error(res, "upload to alice/tiny interrupted", "the repo holds none of it",
                                 "run the same command again")
    assert ("the Hub answered 500" if failure == 500 else "Server disconnected") in line
    assert hub.files("alice/tiny") == {".gitattributes": hub.files(BASE)[".gitattributes"]} and not hub.commits
    hub.fail.clear()
    res = tunekit_push(hub.url, str(run_dir), "--repo", "alice/tiny")  # the empty repo it left is no obstacle
    assert res.returncode == 0, res.stderr[-3000:]
    assert hub.files("alice/tiny")["adapter_model.safetensors"] == (
        run_dir / "adapter" / "adapter_model.safetensors").read_bytes()


def _unfinished(run_dir: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "unfinished"
    shutil.copytree(run_dir, copy)
    record = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps({**record, "status": "running"}))
    return copy


LOCAL = {  # case -> (arguments, what the error line says)
    "missing target": (["{tmp}/nope", "--repo", "alice/x"], "push target {tmp}/nope: does not exist"),
    "unfinished run": (["{unfinished}", "--repo", "alice/x"], "the run did not complete (status 'running')"),
    "bad repo id": (["{run}", "--repo", "alice"], "--repo alice: give OWNER/NAME"),
    "repo id with --": (["{run}", "--repo", "al--ice/x"], "--repo al--ice/x: give OWNER/NAME"),
    "adapter of a GGUF": (["{run}/tiny-sft-q8_0.gguf", "--what", "adapter", "--repo", "alice/x"],
                          "a GGUF file pushes as --what gguf, not adapter"),
    "not a run": (["{run}/adapter", "--repo", "alice/x"], "not a tunekit run directory"),
    "no GGUF in a merged dir": ([], ""),  # its directory is made in the test
    "missing baseline": (["{run}", "--repo", "alice/x", "--baseline", "{tmp}/nope"], "--baseline {tmp}/nope: does not"),
    "bad base model id": (["{run}", "--repo", "alice/x", "--base-model", "/models/llama"],
                          "--base-model /models/llama"),
    "no token": (["{run}", "--repo", "alice/x"], "no Hugging Face token here"),
    "offline": (["{run}", "--repo", "alice/x"], "HF_HUB_OFFLINE=1 forbids uploading"),
}
IN_A_FRESH_PROCESS = ("bad repo id", "no token")  # the others in this process: the same path, milliseconds each


@pytest.mark.parametrize("case", list(LOCAL))
def test_what_can_be_told_here_is_told_before_any_network_call_or_heavy_import(hub, run_dir, tmp_path, monkeypatch,
                                                                             case):
    from tunekit.core.errors import TunekitError
    from tunekit.export import push

    argv, expected = LOCAL[case]
    fill = {"tmp": str(tmp_path), "run": str(run_dir),
            "unfinished": str(_unfinished(run_dir, tmp_path)) if case == "unfinished run" else ""}
    argv, expected = [a.format(**fill) for a in argv], expected.format(**fill)
    if case in IN_A_FRESH_PROCESS:
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
               "HF_TOKEN": "" if case == "no token" else GOOD}
        code, _, err, heavy = run_watching_imports(("torch", "transformers", "peft", "safetensors"), "push", *argv,
                                                   env=env)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expected in lines[0], err[-2000:]
        assert heavy == []
    else:
        from huggingface_hub import constants

        monkeypatch.setattr(push, "Hub", lambda *a: pytest.fail("the Hub was asked before the local checks"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", case == "offline")
        monkeypatch.setenv("HF_TOKEN", GOOD)
        if case == "no GGUF in a merged dir":
            merged = tmp_path / "merged"
            merged.mkdir()
            (merged / "tunekit.json").write_text("{}")
            argv, expected = [str(merged), "--what", "gguf", "--repo", "alice/x"], f"{merged}: no GGUF file here"
        args = main.build_parser().parse_args(["push", *argv])
        with pytest.raises(TunekitError) as e:
            args.func(args)
        assert expected in str(e.value) and "\n" not in str(e.value)
    assert hub.requests == []


# ---------------------------------------------------------------- the curves


def test_the_curves_are_an_svg_with_a_path_per_curve_and_none_without_a_history():
    from tunekit.runs import curves

    series = {"loss": [[1, 2.0], [2, 1.5], [3, float("nan")], [4, 1.0]], "eval_loss": [[4, 1.2]],
              "eval_chrf": [[2, 10.0], [4, 30.0]], "learning_rate": [[1, 1e-4], [4, 1e-4]], "examples_per_s": [[2, 9]]}
    root = ET.fromstring(curves.svg(series))
    panels = [g.get("data-title") for g in root.iter(f"{SVG}g")]
    assert panels == ["loss", "held-out scores", "learning rate"]  # throughput is the machine's, left out
    paths = {p.get("data-key"): p.get("d") for p in root.iter(f"{SVG}path")}
    assert set(paths) == {"loss", "eval_loss", "eval_chrf", "learning_rate"}
    assert paths["loss"].count("M") == 1 and paths["loss"].count("L") == 2  # the NaN step is left out
    assert curves.svg({}) is None and curves.svg({"examples_per_s": [[1, 2]]}) is None


# ---------------------------------------------------------------- a trained run (slow)


@pytest.mark.slow
def test_a_trained_run_pushes_its_adapter_and_its_merged_weights(hub, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from conftest import run_cli, write_recipe

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"max_steps": 2}, eval=None,
                      data={"eval_fraction": 0.25})
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode == 0, res.stderr[-2000:]
    run = tmp_path / "run"
    res = tunekit_push(hub.url, str(run), "--repo", "alice/tiny", "--base-model", BASE)
    assert res.returncode == 0, res.stderr[-3000:]
    files = hub.files("alice/tiny")
    assert files["adapter_model.safetensors"] == (run / "adapter" / "adapter_model.safetensors").read_bytes()
    local = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert json.loads(files["adapter_config.json"]) == {**local, "base_model_name_or_path": BASE}
    assert card_of(files)[0]["base_model"] == BASE

    res = tunekit_push(hub.url, str(run), "--what", "merged", "--repo", "alice/tiny-merged")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "parity: max |logit diff|" in res.stderr
    merged = tmp_path / "downloaded"
    merged.mkdir()
    for name, content in hub.files("alice/tiny-merged").items():
        (merged / name).write_bytes(content)
    assert AutoModelForCausalLM.from_pretrained(merged).config.model_type == "llama"
    meta, body = card_of(hub.files("alice/tiny-merged"))
    assert meta["library_name"] == "transformers" and "base_model" not in meta  # a local base, not named by id
    assert "top-1 agreement 100.00%" in body and not list(run.glob(".push-*"))
