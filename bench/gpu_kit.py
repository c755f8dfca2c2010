"""Build the GPU kit: every wheel that tunekit (with its `kernels` extra) needs on an offline GPU machine and
that the machine's image lacks, in one folder that travels with the repository (`make gpu-kit`).

The GPU machines are bare and offline: Python 3.12 with torch 2.11 (CUDA 13), transformers, peft, accelerate,
numpy, pyarrow, triton and a few more; no trl, bitsandbytes, deepspeed, datasets, pydantic, rouge-score or gguf,
and nothing can be fetched there. At most 64 MiB travels with a run, so the kit has a cap (48 MiB).

Steps, on a connected machine:
1. tunekit's own wheel (`pip wheel --no-deps .`);
2. the dependency closure of tunekit[kernels] for the target (CPython 3.12, manylinux x86_64), resolved with
   `pip install --dry-run --report` and `--only-binary=:all:`; a requirement with no wheel on the index (deepspeed
   and rouge-score publish only source archives) is built here into a wheel, which must come out pure Python;
3. what the image has is left out: each name given by --image and everything only those need (torch's
   nvidia-*, sympy, networkx, ...); small wheels the image has in some unknown version stay in the kit, so
   tunekit's pins hold whatever the image's versions;
4. each remaining wheel at its resolved version (`pip download --no-deps`);
5. bitsandbytes repacked with only its CUDA 13.0 and CPU libraries when the whole wheel does not fit the cap
   (its version gets the local label +cu13; RECORD rewritten);
6. requirements.txt (every wheel pinned) and kit.json (target, sizes, what was left to the image).

On the GPU machine: pip install --no-index --find-links .gpu-kit -r .gpu-kit/requirements.txt
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
# What the GPU image already has and the kit leaves out, with everything only these need (torch's nvidia-*,
# sympy, networkx, ...). The image's versions are unknown beyond torch 2.11, transformers 5.17, accelerate 1.15,
# safetensors 0.8 and tokenizers 0.23, so the list is as short as the 48 MiB cap allows and every other wheel
# stays in the kit, tunekit's pins then holding whatever the image's versions:
# - torch, triton, numpy, pyarrow: the image's own, and far too big (torch with its CUDA libraries: gigabytes);
# - tokenizers, safetensors, regex: compiled; the image's transformers 5.17 requires the same ranges as
#   tunekit's 5.23 (tokenizers>=0.23.1,<0.24, safetensors>=0.8, regex>=2025.10.22), so the image's meet them;
# - lxml (5 MiB): compiled; only sacrebleu needs it, with no version bound, and the image has sacrebleu;
# - hf-xet (4 MiB): compiled; the image's huggingface_hub needs it. The one guess: the kit's huggingface_hub
#   wants hf-xet>=1.6, and a hub older than 1.33 settles for less (then `pip check` names it; nothing
#   tunekit does offline uses hf-xet, which only moves files to and from the Hub).
# Versions measured on the image (the H200 run, 2026-11), held in the resolve as constraints though the kit leaves
# these out: the image's tokenizers 0.23.2 requires huggingface-hub<2, so an unconstrained resolve picks a hub
# (2.x) that `pip check` then refuses beside it.
IMAGE_PINS = ("tokenizers==0.23.2",)
DEFAULT_IMAGE = ("torch", "triton", "numpy", "pyarrow", "tokenizers", "safetensors", "regex", "lxml", "hf-xet")
# the target's platforms, newest first: manylinux_2_28 x86_64 and every older manylinux tag it accepts
PLATFORMS = ([f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])
# A slim bitsandbytes keeps its CUDA 13.0 library and its CPU one. The image's torch is built for CUDA 13: on a
# 13.0 runtime bitsandbytes loads the 13.0 library, and on a later 13.x runtime without its own library it loads
# the highest packaged 13.y below it, the 13.0 one again (the 13.2 library, 3.4 MiB more, would serve only 13.2
# and later). The ROCm, XPU and CUDA 11/12 libraries go.
BNB_KEEP = re.compile(r"^bitsandbytes/libbitsandbytes_(cuda130|cpu)\.so$")
BNB_LOCAL = "cu13"
# tunekit's requirements known to publish only a source archive: built before resolving, which spares a resolve
# that fails on each (any other such requirement is still found, and built, by the resolve)
SOURCE_ONLY = ("deepspeed", "rouge-score")


_START = time.time()


def say(message: str) -> None:
    print(f"gpu-kit [{time.time() - _START:5.1f} s] {message}", flush=True)


class KitError(Exception):
    pass


def target_tags(python_version: str) -> set[Tag]:
    """Every wheel tag a CPython of this version on manylinux_2_28 x86_64 installs."""
    from packaging import tags

    major, minor = (int(p) for p in python_version.split(".")[:2])
    return set(tags.cpython_tags((major, minor), platforms=PLATFORMS)) | set(
        tags.compatible_tags((major, minor), interpreter=f"cp{major}{minor}", platforms=PLATFORMS))


def marker_environment(python_version: str) -> dict[str, str]:
    major_minor = ".".join(python_version.split(".")[:2])
    full = python_version if python_version.count(".") == 2 else f"{major_minor}.0"
    return {"python_version": major_minor, "python_full_version": full,
            "implementation_name": "cpython", "implementation_version": full,
            "platform_python_implementation": "CPython", "os_name": "posix", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "", "platform_version": ""}


def pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def last_error(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (res.stderr + res.stdout).splitlines() if ln.startswith("ERROR")]
    return lines[-1] if lines else (res.stderr.strip().splitlines() or ["(no output)"])[-1]


def target_args(python_version: str) -> list[str]:
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *[a for p in PLATFORMS for a in ("--platform", p)]]


def build_wheel(spec: str, into: Path, tags: set[Tag], from_source: str | None = None) -> Path:
    """A wheel built here from a source tree, or from the index's source archive of `from_source`; it must
    install on the target (a pure-Python wheel does)."""
    before = set(into.glob("*.whl"))
    source_only = ["--no-binary", from_source] if from_source else []  # never a wheel made for this machine
    # DS_BUILD_OPS=0: DeepSpeed's C++/CUDA ops compile on first use (JIT) instead of into the wheel
    res = pip("wheel", "--no-deps", *source_only, "-w", str(into), spec, env={"DS_BUILD_OPS": "0"})
    built = sorted(set(into.glob("*.whl")) - before)
    if res.returncode != 0 or len(built) != 1:
        raise KitError(f"building a wheel of {spec} failed: {last_error(res)}")
    if not set(parse_wheel_filename(built[0].name)[3]) & tags:
        raise KitError(f"{built[0].name} (built from {spec}) does not install on the target")
    return built[0]


def source_copy(into: Path) -> Path:
    """What tunekit's wheel is built from, copied: an in-tree build would write build/ and *.egg-info into the
    working tree, and two builds at once would share them."""
    shutil.copytree(ROOT / "src", into / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for path in [ROOT / "pyproject.toml", ROOT / "README.md", *ROOT.glob("LICEN[CS]E*")]:
        shutil.copy2(path, into / path.name)
    return into


def resolve(requirement: str, python_version: str, local: Path, tags: set[Tag], work: Path,
            pins: tuple[str, ...] = ()) -> list[dict]:
    """The closure's entries of pip's installation report, with `pins` as constraints; sdist-only requirements
    are built into `local`."""
    report = work / "report.json"
    constraints = work / "image-pins.txt"
    constraints.write_text("".join(f"{p}\n" for p in pins))
    for _ in range(10):
        res = pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                  *target_args(python_version), "--find-links", str(local), "-c", str(constraints), requirement)
        if res.returncode == 0:
            return json.loads(report.read_text())["install"]
        missing = re.search(r"No matching distribution found for (\S+)", res.stderr + res.stdout)
        if not missing:
            raise KitError(f"resolving {requirement} for CPython {python_version} failed: {last_error(res)}")
        say(f"{missing.group(1)} has no wheel for the target on the index: building a wheel here")
        built = build_wheel(missing.group(1), local, tags, from_source=Requirement(missing.group(1)).name)
        say(f"built {built.name}")
    raise KitError("resolving kept finding requirements without a wheel; giving up")


def closure(entries: list[dict], root: str, root_extras: set[str], image: set[str],
            python_version: str) -> set[str]:
    """Names reachable from `root` without passing through what the image has."""
    by_name = {canonicalize_name(e["metadata"]["name"]): e["metadata"] for e in entries}
    env = marker_environment(python_version)
    seen: dict[str, set[str]] = {}
    todo = [(canonicalize_name(root), set(root_extras))]
    while todo:
        name, extras = todo.pop()
        if name in image or name not in by_name:
            continue
        if name in seen and extras <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | extras
        for line in by_name[name].get("requires_dist", []):
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in {"", *seen[name]}):
                todo.append((canonicalize_name(req.name), set(req.extras)))
    return set(seen)


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim_bitsandbytes(wheel: Path, into: Path) -> Path:
    """The bitsandbytes wheel with only its CUDA 13.0 and CPU libraries, as version X+cu13 (so it is never
    taken for the index's wheel); dist-info renamed and RECORD rewritten to match what is left."""
    version = parse_wheel_filename(wheel.name)[1]
    new_version = f"{version.public}+{BNB_LOCAL}"
    old_info, new_info = f"bitsandbytes-{version}.dist-info", f"bitsandbytes-{new_version}.dist-info"
    out = into / wheel.name.replace(f"-{version}-", f"-{new_version}-", 1)
    kept: list[tuple[zipfile.ZipInfo, bytes]] = []
    with zipfile.ZipFile(wheel) as src:
        libraries = [n for n in src.namelist() if re.match(r"^bitsandbytes/libbitsandbytes_\w+\.so$", n)]
        if not any(BNB_KEEP.match(n) and "cuda" in n for n in libraries):
            raise KitError(f"{wheel.name} has no CUDA 13 library (libraries: {', '.join(libraries)})")
        for info in src.infolist():
            if info.filename in libraries and not BNB_KEEP.match(info.filename):
                continue
            if info.filename == f"{old_info}/RECORD" or info.is_dir():
                continue
            data = src.read(info)
            path = info.filename.replace(f"{old_info}/", f"{new_info}/", 1)
            if path == f"{new_info}/METADATA":
                data = re.sub(rb"^Version: .*$", f"Version: {new_version}".encode(), data, count=1, flags=re.M)
            entry = zipfile.ZipInfo(path, info.date_time)
            entry.external_attr, entry.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            kept.append((entry, data))
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for entry, data in kept:
        writer.writerow([entry.filename, _hash(data), len(data)])
    writer.writerow([f"{new_info}/RECORD", "", ""])
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for entry, data in kept:  # in the original order: the package, then its dist-info
            dst.writestr(entry, data, compresslevel=9)
        record_entry = zipfile.ZipInfo(f"{new_info}/RECORD", kept[-1][0].date_time)
        record_entry.external_attr, record_entry.compress_type = 0o644 << 16, zipfile.ZIP_DEFLATED
        dst.writestr(record_entry, record.getvalue(), compresslevel=9)
    return out


def build(python_version: str, out: Path, image: set[str], max_mib: float, bitsandbytes: str,
          image_pins: tuple[str, ...] = IMAGE_PINS) -> dict:
    start = time.time()
    tags = target_tags(python_version)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.whl"), out / "requirements.txt", out / "kit.json"]:
        old.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-kit-") as tmp:
        work = Path(tmp)
        local, downloads = work / "local", work / "downloads"
        local.mkdir()
        say("step 1/6: tunekit's own wheel (pip wheel --no-deps .)")
        own = build_wheel(str(source_copy(work / "source")), local, tags)
        with zipfile.ZipFile(own) as whl:
            metadata = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        extras = {"kernels"} & set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.M))  # optional until declared
        for line in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M):
            req = Requirement(line)
            if canonicalize_name(req.name) in SOURCE_ONLY and req.marker is None:
                say(f"{req} has only a source archive on the index: building a wheel here")
                say(f"built {build_wheel(str(req), local, tags, from_source=req.name).name}")
        requirement = f"tunekit{'[' + ','.join(sorted(extras)) + ']' if extras else ''} @ {own.resolve().as_uri()}"
        say(f"step 2/6: resolving tunekit{'[' + ','.join(sorted(extras)) + ']' if extras else ''} "
            f"for CPython {python_version} manylinux_2_28 x86_64")
        entries = resolve(requirement, python_version, local, tags, work, image_pins)
        versions = {canonicalize_name(e["metadata"]["name"]): e["metadata"]["version"] for e in entries}
        say(f"step 3/6: {len(entries)} distributions resolved; leaving out the image's: {', '.join(sorted(image))}")
        kept = closure(entries, "tunekit", extras, image, python_version)
        left = sorted(set(versions) - kept)
        say(f"step 4/6: downloading {len(kept) - 1} wheels (pip download --no-deps)")
        downloads.mkdir()
        wanted = [f"{n}=={versions[n]}" for n in sorted(kept) if n != "tunekit"]
        res = pip("download", "--no-deps", "--quiet", *target_args(python_version), "--find-links", str(local),
                  "-d", str(downloads), *wanted)
        if res.returncode != 0:
            raise KitError(f"downloading the kit's wheels failed: {last_error(res)}")
        wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in downloads.glob("*.whl")}
        wheels["tunekit"] = own
        if set(wheels) != kept:
            raise KitError(f"pip download returned {sorted(set(wheels) ^ kept)} unexpectedly")

        def total() -> int:
            return sum(w.stat().st_size for w in wheels.values())

        cap = max_mib * MIB if max_mib else float("inf")
        slim = "bitsandbytes" in wheels and (bitsandbytes == "slim" or (bitsandbytes == "auto" and total() > cap))
        if slim:
            whole = wheels["bitsandbytes"]
            wheels["bitsandbytes"] = slim_bitsandbytes(whole, work)
            say(f"step 5/6: bitsandbytes repacked with only its CUDA 13.0 and CPU libraries: "
                f"{whole.stat().st_size / MIB:.1f} MiB -> {wheels['bitsandbytes'].stat().st_size / MIB:.1f} MiB")
        else:
            say("step 5/6: bitsandbytes kept whole" if "bitsandbytes" in wheels else "step 5/6: no bitsandbytes")
        wrong = [w.name for w in wheels.values() if not set(parse_wheel_filename(w.name)[3]) & tags]
        if wrong:
            raise KitError(f"wheels that do not install on CPython {python_version} manylinux_2_28 x86_64: {wrong}")
        if total() > cap:
            biggest = sorted(wheels.values(), key=lambda w: -w.stat().st_size)[:5]
            raise KitError(f"the kit is {total() / MIB:.1f} MiB, over its {max_mib:g} MiB cap; biggest: "
                           + ", ".join(f"{w.name} {w.stat().st_size / MIB:.1f} MiB" for w in biggest))
        say(f"step 6/6: writing {out} (requirements.txt, kit.json)")
        for name, wheel in wheels.items():
            shutil.copyfile(wheel, out / wheel.name)
            wheels[name] = out / wheel.name
    pins = {n: str(parse_wheel_filename(w.name)[1]) for n, w in wheels.items()}
    (out / "requirements.txt").write_text(
        "# the GPU kit (bench/gpu_kit.py): pip install --no-index --find-links DIR -r DIR/requirements.txt\n"
        + "".join(f"{n}=={pins[n]}\n" for n in sorted(pins)))
    kit = {
        "python_version": python_version,
        "implementation": "cp",
        "platform": "manylinux_2_28_x86_64",
        "requirement": f"tunekit{'[' + ','.join(sorted(extras)) + ']' if extras else ''}",
        "total_bytes": total(),
        "total_mib": round(total() / MIB, 2),
        "cap_mib": max_mib or None,
        "wheels": {w.name: w.stat().st_size for w in sorted(wheels.values(), key=lambda w: w.name)},
        "image": sorted(image),
        "image_pins": list(image_pins),
        "left_to_image": {n: versions[n] for n in left},
        "bitsandbytes": ("repacked: only libbitsandbytes_cuda130.so and libbitsandbytes_cpu.so, version "
                         f"{pins['bitsandbytes']}") if slim else ("whole" if "bitsandbytes" in pins else None),
        "seconds": round(time.time() - start, 1),
    }
    (out / "kit.json").write_text(json.dumps(kit, indent=2) + "\n")
    say(f"done: {len(wheels)} wheels, {kit['total_mib']} MiB in {out}; left to the image: {len(left)} "
        f"distributions ({kit['seconds']} s)")
    return kit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--python-version", default="3.12", help="the target's CPython version (default 3.12)")
    p.add_argument("--out", type=Path, default=ROOT / ".gpu-kit", help="the kit's folder (default .gpu-kit)")
    p.add_argument("--image", default=",".join(DEFAULT_IMAGE),
                   help="comma-separated distributions the target already has, left out with everything only "
                        f"they need (default {','.join(DEFAULT_IMAGE)})")
    p.add_argument("--max-mib", type=float, default=48, help="fail when the kit is larger (default 48; 0: no cap)")
    p.add_argument("--bitsandbytes", choices=["auto", "slim", "whole"], default="auto",
                   help="auto: repack with only the CUDA 13.0 and CPU libraries when the whole wheel breaks the cap")
    p.add_argument("--image-pins", default=",".join(IMAGE_PINS),
                   help="comma-separated requirements the image's own distributions hold the resolve to "
                        f"(default {','.join(IMAGE_PINS)}; empty: none)")
    a = p.parse_args(argv)
    image = {canonicalize_name(n) for n in a.image.split(",") if n.strip()}
    pins = tuple(r.strip() for r in a.image_pins.split(",") if r.strip())
    try:
        build(a.python_version, a.out.resolve(), image, a.max_mib, a.bitsandbytes, pins)
    except KitError as e:
        print(f"gpu-kit: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
