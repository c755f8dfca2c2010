"""The GPU kit (`make gpu-kit`, bench/gpu_kit.py) is complete: the same builder makes a kit for this machine's
Python holding everything but torch, and a fresh virtual environment with only torch installs tunekit from it
with `pip install --no-index`; `pip check` passes, `tunekit validate` runs and the kit's packages import (the
repacked bitsandbytes with its CPU library). The real kit, for CPython 3.12 on manylinux x86_64, fits its cap,
holds only wheels that install there, and the same distributions less what it leaves to the GPU image.

Needs the package index (the kits are downloaded, pip's cache helps) and the on-disk CPU build of torch that
`pip install torch==2.13.0` takes here (as `make setup` does)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_kit", ROOT / "bench" / "gpu_kit.py")
gpu_kit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_kit)
pytestmark = pytest.mark.slow
# The tests in a fresh venv (torch installed into it, then the kit: about three minutes of a 2-core machine) run in
# make test-full; make test checks what the kits hold and that they install where they are meant to (below).
IN_VENV = pytest.mark.full
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
TORCH = "torch==2.13.0"  # the Makefile's pin: here, the CPU build on disk


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))} exited {res.returncode}:\n{res.stdout[-3000:]}\n" \
                                f"{res.stderr[-3000:]}"
    return res


def remove_in_background(*paths: Path) -> None:
    """Deleting ~2 GB of small files takes a minute on a busy disk: a niced `rm` does it after the test, which
    need not wait for it."""
    subprocess.Popen(["nice", "-n", "19", "rm", "-rf", *map(str, paths)], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def distributions(kit: dict) -> set[str]:
    return {canonicalize_name(parse_wheel_filename(w)[0]) for w in kit["wheels"]}


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    """Two kits from the same builder, built side by side (each mostly waits on pip and the network):
    - the real one, with the default options (CPython 3.12, the GPU image's list, the 48 MiB cap);
    - one for this machine's Python that leaves out only torch, with bitsandbytes repacked as on the GPU kit
      (so the repacked wheel is installed and checked here too)."""
    gpu, here = tmp_path_factory.mktemp("gpu-kit"), tmp_path_factory.mktemp("here-kit")
    builds = [(out, subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_kit.py"), "--out", str(out), *args],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
              for out, args in [(gpu, []), (here, ["--python-version", HERE, "--image", "torch", "--max-mib", "0",
                                                   "--bitsandbytes", "slim"])]]
    finished = [(out, proc.communicate()[0], proc.returncode) for out, proc in builds]
    for out, output, returncode in finished:
        assert returncode == 0, f"building the kit in {out} failed:\n{output[-3000:]}"
    yield gpu, here
    remove_in_background(gpu, here)  # ~450 MiB of wheels


@pytest.fixture(scope="module")
def gpu_kit_dir(kits) -> Path:
    return kits[0]


@pytest.fixture(scope="module")
def here_kit_dir(kits) -> Path:
    return kits[1]


@pytest.fixture(scope="module")
def installed(here_kit_dir, tmp_path_factory):
    """A fresh virtual environment with only torch, then tunekit from the kit and nothing else."""
    venv = tmp_path_factory.mktemp("kit-venv") / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    run([sys.executable, "-m", "venv", str(venv)], env=env)
    python = str(venv / "bin" / "python")
    # --no-compile: byte-compiling torch, triton and transformers would take most of the time
    run([python, "-m", "pip", "install", "-q", "--no-compile", TORCH], env=env)
    # only the kit: no index, and no pip configuration (its extra indexes and find-links) at all
    offline = {k: v for k, v in env.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    kit = json.loads((here_kit_dir / "kit.json").read_text())
    run([python, "-m", "pip", "install", "-q", "--no-compile", "--no-index", "--find-links", str(here_kit_dir),
         "-r", str(here_kit_dir / "requirements.txt"), kit["requirement"]], env=offline)
    yield venv
    remove_in_background(venv)  # ~2 GB


@IN_VENV
def test_the_kit_installs_offline_into_a_venv_with_only_torch(installed, here_kit_dir):
    python = str(installed / "bin" / "python")
    run([python, "-m", "pip", "check"])
    listed = json.loads(run([python, "-m", "pip", "list", "--format", "json"]).stdout)
    versions = {canonicalize_name(p["name"]): p["version"] for p in listed}
    pins = dict(line.split("==") for line in (here_kit_dir / "requirements.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    wrong = {n: (v, versions.get(n)) for n, v in pins.items() if versions.get(n) != v}
    assert not wrong, f"installed versions differ from the kit's pins: {wrong}"
    assert versions["torch"].startswith("2.13.0")


@IN_VENV
def test_tunekit_from_the_kit_validates_a_shipped_recipe(installed):
    """The flagship GPU recipe (its model named on the Hub, which validate lets pass offline), with the DeepSpeed
    config resolved for two processes: that imports the training stack (torch, transformers, peft, trl)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    res = run([str(installed / "bin" / "tunekit"), "validate", "recipes/llama_qlora.yaml", "--world-size", "2"],
              cwd=ROOT, env=env)
    assert "adapter: lora" in res.stdout and "# DeepSpeed config for world size 2" in res.stdout


def gpu_check_env(installed: Path, kit: Path) -> dict:
    """bench/gpu_check.sh's surroundings on an offline GPU machine: the venv's Python, the kit, no pip index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PYTHON": str(installed / "bin" / "python"), "GPU_KIT": str(kit)}


@IN_VENV
def test_the_gpu_check_installs_the_kit_with_no_index_and_starts(installed, here_kit_dir):
    """bench/gpu_check.sh, the one command of an offline GPU machine, on this machine's kit: it installs the kit
    with no index (all there already: nothing changes) and starts the check on the venv's Python, which finds no
    GPU here and stops. Its CPU plumbing from the kit, TRL's script included, is the `full` test below (its
    vision and varlen rows from the repository's venv: tests/bench/test_gpu_check.py)."""
    res = run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=gpu_check_env(installed, here_kit_dir))
    assert "gpu-check: kit installed" in res.stdout and "no CUDA GPU on this machine" in res.stdout, res.stdout


@IN_VENV  # two minutes more: a tunekit run and TRL's script in the kit's fresh venv
def test_the_gpu_check_runs_from_the_kit_with_no_index(installed, here_kit_dir, tmp_path):
    """bench/gpu_check.sh on this machine's kit runs the check's CPU plumbing (--tiny) on the venv's packages, TRL's
    script included."""
    env = gpu_check_env(installed, here_kit_dir)
    out = tmp_path / "gpu_check.json"
    res = run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--tiny", "--only", "lora-bf16", "--steps", "2",
               "--work", str(tmp_path / "work"), "--out", str(out)], cwd=ROOT, env=env)
    assert "gpu-check: kit installed" in res.stdout and "vs TRL tok/s" in res.stdout
    row = json.loads(out.read_text())["checks"][0]
    assert row["result"] == "ok" and row["status"] == "completed" and row["precision"] == "fp32", row
    assert len(row["loss"]) == 2 and row["tokens_per_s_whole_run"] > 0 and row["trl"]["tokens_per_s"] > 0
    # two steps are fewer than the warm-up the steady figures leave out: neither side has one, no ratio is made
    assert row["tokens_per_s"] is None and row["trl"]["steady_tokens_per_s"] is None and "speed_vs_trl" not in row
    chat = [json.loads(line) for line in (tmp_path / "work" / "chat.jsonl").read_text().splitlines()]
    assert len(chat) > 100 and {m["role"] for m in chat[0]["messages"]} == {"user", "assistant"}


@IN_VENV
def test_the_kits_packages_import_and_the_repacked_bitsandbytes_works_on_cpu(installed):
    code = (
        "import importlib.metadata as md, pathlib, torch, tunekit, trl, peft, datasets, deepspeed, rouge_score, gguf,"
        " sacrebleu, liger_kernel, cut_cross_entropy, pydantic, bitsandbytes as bnb\n"
        "from bitsandbytes import functional as F\n"
        f"assert pathlib.Path(tunekit.__file__).is_relative_to({str(installed)!r}), tunekit.__file__\n"
        "libs = sorted(p.name for p in pathlib.Path(bnb.__file__).parent.glob('libbitsandbytes_*'))\n"
        "assert libs == ['libbitsandbytes_cpu.so', 'libbitsandbytes_cuda130.so'], libs\n"
        "w = torch.randn(64, 64)\n"
        "q, state = F.quantize_4bit(w, quant_type='nf4')\n"
        "err = (F.dequantize_4bit(q, state) - w).abs().mean().item()\n"
        "assert err < 0.2, err\n"
        "print(md.version('bitsandbytes'), err)\n"
    )
    res = run([str(installed / "bin" / "python"), "-c", code], cwd=installed)
    assert res.stdout.splitlines()[-1].startswith("0.50.2+cu13 ")


def test_the_gpu_kit_fits_its_cap_and_installs_on_cpython_312_manylinux(gpu_kit_dir):
    kit = json.loads((gpu_kit_dir / "kit.json").read_text())
    wheels = sorted(gpu_kit_dir.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    assert total == kit["total_bytes"] <= 48 * 1024 * 1024
    assert {w.name: w.stat().st_size for w in wheels} == kit["wheels"]
    from packaging import tags

    platforms = [f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)] + ["manylinux2014_x86_64",
                                                                          "manylinux2010_x86_64", "manylinux1_x86_64"]
    supported = set(tags.cpython_tags((3, 12), platforms=platforms)) | set(
        tags.compatible_tags((3, 12), interpreter="cp312", platforms=platforms))
    wrong = [w.name for w in wheels if not parse_wheel_filename(w.name)[3] & supported]
    assert not wrong, f"wheels that CPython 3.12 on manylinux_2_28 x86_64 cannot install: {wrong}"
    pinned = [line for line in (gpu_kit_dir / "requirements.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert sorted(pinned) == sorted(f"{canonicalize_name(n)}=={v}" for n, v, _, _ in
                                    map(parse_wheel_filename, kit["wheels"]))
    # what the GPU machine lacks is in the kit; the repacked bitsandbytes is the CUDA 13 one
    assert {"tunekit", "transformers", "trl", "pydantic", "datasets", "deepspeed", "bitsandbytes", "rouge-score",
            "gguf", "peft", "accelerate", "huggingface-hub"} <= distributions(kit)
    assert kit["bitsandbytes"].startswith("repacked") and any(w.name.startswith("bitsandbytes-0.50.2+cu13-")
                                                              for w in wheels)
    assert "torch" in kit["left_to_image"] and not any(n.startswith("nvidia") for n in distributions(kit))


def test_the_gpu_kit_holds_what_the_full_kit_holds_less_the_images_share(gpu_kit_dir, here_kit_dir):
    gpu = json.loads((gpu_kit_dir / "kit.json").read_text())
    here = json.loads((here_kit_dir / "kit.json").read_text())
    assert gpu["image"] == sorted(gpu_kit.DEFAULT_IMAGE) and here["image"] == ["torch"]
    assert distributions(gpu) == distributions(here) - set(gpu["left_to_image"])
    assert set(gpu["image"]) <= set(gpu["left_to_image"])


def test_the_gpu_kit_installs_beside_the_images_pinned_versions(gpu_kit_dir, here_kit_dir):
    """The image's own tokenizers (left out of the GPU kit) requires huggingface-hub<2: the kit's hub must meet
    it, as every requirement of each pinned distribution must be met by the kit's versions (`pip check` there)."""
    gpu = json.loads((gpu_kit_dir / "kit.json").read_text())
    assert gpu["image_pins"] == list(gpu_kit.IMAGE_PINS)
    versions = {canonicalize_name(n): v for n, v, _, _ in map(parse_wheel_filename, gpu["wheels"])}
    for pin in map(Requirement, gpu["image_pins"]):
        wheel = next(here_kit_dir.glob(f"{pin.name}-*.whl"))  # the here-kit holds the pinned version itself
        assert parse_wheel_filename(wheel.name)[1] in pin.specifier
        with zipfile.ZipFile(wheel) as whl:
            metadata = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        for line in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M):
            req = Requirement(line)
            if req.marker is None and canonicalize_name(req.name) in versions:
                assert versions[canonicalize_name(req.name)] in req.specifier, (pin, req)
