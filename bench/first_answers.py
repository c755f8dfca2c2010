"""How long a command takes to give its first answer: `tunekit validate` of the flagship recipe, `tunekit
train` of it without the Hub (neither its data set nor its model is cached here; then with a local data
file, so that the model is what is missing), and `tunekit train` of the shipped SmolLM2 LoRA recipe on a
copy of its data with a malformed line. Each command runs in a fresh process, offline
(HF_HUB_OFFLINE=1), --runs times; prints the median wall time and the last line each command wrote.
With --src, another tunekit source tree (e.g. a `git worktree` of an older commit) is measured.

    python bench/first_answers.py [--src DIR] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(tmp: Path) -> dict[str, list[str]]:
    lines = (ROOT / "recipes/data/extract_train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    lines[199] = lines[199].replace('", "output"', '" "output"')  # line 200: a missing comma
    (tmp / "bad.jsonl").write_text("".join(lines), encoding="utf-8")
    return {
        "validate recipes/llama_qlora.yaml": ["validate", "recipes/llama_qlora.yaml"],
        "train recipes/llama_qlora.yaml (neither data set nor model cached)": [
            "train", "recipes/llama_qlora.yaml", "--set", f"output_dir={tmp / 'llama'}"],
        "train recipes/llama_qlora.yaml, local data (model not cached)": [
            "train", "recipes/llama_qlora.yaml", "--set", "data.train=recipes/data/extract_train.jsonl",
            "--set", f"output_dir={tmp / 'llama'}"],
        "train recipes/smollm2_lora.yaml, malformed line 200": [
            "train", "recipes/smollm2_lora.yaml", "--set", f"data.train={tmp / 'bad.jsonl'}",
            "--set", f"output_dir={tmp / 'smol'}"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", help="tunekit source tree to measure (default: this checkout's)")
    parser.add_argument("--runs", type=int, default=5)
    a = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    if a.src:
        env["PYTHONPATH"] = str(Path(a.src).resolve())
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in commands(Path(tmp)).items():
            times, last = [], ""
            for _ in range(a.runs):
                start = time.perf_counter()
                res = subprocess.run([sys.executable, "-m", "tunekit", *argv], cwd=ROOT, env=env,
                                     capture_output=True, text=True)
                times.append(time.perf_counter() - start)
                last = (res.stderr.strip().splitlines() or [""])[-1][:160]
            print(f"{name}: median {statistics.median(times):.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}; "
                  f"exit {res.returncode}; {last})")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
