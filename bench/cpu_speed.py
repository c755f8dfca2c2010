"""tunekit's defaults against the hand-written script on a CPU, on real text held out from the project, run after
run: real tokens/s and held-out loss of each, with their spread.

The data (`software`): English -> German software messages, git's own German translation (Debian package git,
/usr/share/locale/de/LC_MESSAGES/git.mo): each message and its translation as git ships them, natural lengths
(a word to a paragraph), format placeholders kept. No default of tunekit was chosen on it. The project's own
real-text sets (bench/realdata.py: translate, define) serve too, for comparing commits.

The runs are bench/run.py's: the script (bench/handwritten.py: transformers + peft, each batch padded to its longest
example, the stock loss) and tunekit's defaults (recipes/smollm2_lora.yaml set as the script is: LoRA r16 alpha 32
on all linear layers, dropout 0, micro-batch 8, lr 1e-3 constant, one epoch, seed 0, bf16 where the CPU computes
it natively, else fp32), in alternating order, --repeats times; the held-out loss of every adapter by the same
code. Writes bench/cpu_speed.json (with the machine's facts and CPU flags) and prints the table.

    python bench/cpu_speed.py [--set software] [--train 240] [--repeats 3] [--tunekit-set KEY=VALUE ...]

Another commit's tunekit: PYTHONPATH=WORKTREE/src python bench/cpu_speed.py --arms tunekit (a git worktree).
"""

from __future__ import annotations

import argparse
import gettext
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
import realdata  # noqa: E402
import run as bench_run  # noqa: E402

GIT_MO = Path("/usr/share/locale/de/LC_MESSAGES/git.mo")


def software_rows() -> list[dict]:
    """git's messages and their German translations (singular forms; the catalogue's header left out)."""
    if not GIT_MO.is_file():
        sys.exit(f"bench: {GIT_MO} not found; install it with: apt-get install git")
    with GIT_MO.open("rb") as f:
        catalog = gettext.GNUTranslations(f)._catalog
    rows = []
    for source, german in sorted(catalog.items(), key=lambda kv: str(kv[0])):
        if isinstance(source, tuple):  # a plural form: (msgid, n)
            continue
        source, german = source.strip(), german.strip()
        if len(source.split()) >= 2 and german and german != source:
            rows.append({"instruction": "Translate this message of the git program into German.", "input": source,
                         "output": german})
    return rows


def data(name: str, work: Path, n_train: int, n_eval: int) -> tuple[Path, Path]:
    if name != "software":
        return realdata.write(work, n_train, n_eval, sets=(name,))[name]
    train, held_out = realdata.split(software_rows(), n_train, n_eval, seed=0)
    paths = (work / "software_train.jsonl", work / "software_eval.jsonl")
    for path, rows in zip(paths, (train, held_out)):
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return paths


def spread(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "runs": values}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="software", help="software (default), or a bench/realdata.py set")
    p.add_argument("--train", type=int, default=240)
    p.add_argument("--eval", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: bf16 where the CPU computes it natively (avx512_bf16 or amx_bf16), else fp32")
    p.add_argument("--arms", default="script,tunekit")
    p.add_argument("--tunekit-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for tunekit's runs (a candidate setting)")
    p.add_argument("--out", default=str(ROOT / "bench" / "cpu_speed.json"))
    a = p.parse_args()

    facts = machine.facts()
    precision = a.precision if a.precision != "auto" else (
        "bf16" if facts["avx512_bf16"] or facts["amx_bf16"] else "fp32")
    from tunekit.models.loader import materialize

    model_dir = materialize(bench_run.BASE)
    work = Path(tempfile.mkdtemp(prefix="tunekit-cpu-speed-"))
    train, held_out = data(a.set, work, a.train, a.eval)
    arms = a.arms.split(",")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    started = time.perf_counter()
    for i in range(a.repeats):
        for arm in arms if i % 2 == 0 else arms[::-1]:  # alternate who goes first: drift hits both alike
            name = f"{arm}-{i}"
            print(f"cpu-speed: {a.set} {name}", flush=True)
            if arm == "script":
                r = bench_run.handwritten_run(name, work, model_dir, train, ["--precision", precision])
            else:
                r = bench_run.tunekit_run(name, work, train, a.train, [f"training.precision={precision}",
                                                                       *a.tunekit_set])
            r["eval_loss"] = bench_run.eval_loss(r.pop("adapter"), model_dir, held_out)
            r["load_average_after"] = os.getloadavg()[0]
            runs[arm].append(r)
            print(f"cpu-speed: {name}: {r['real_tokens_per_s']:.0f} real tokens/s, held-out loss "
                  f"{r['eval_loss']:.4f}", flush=True)
    summary = {arm: {"real_tokens_per_s": spread([r["real_tokens_per_s"] for r in rs]),
                     "eval_loss": spread([r["eval_loss"] for r in rs])} for arm, rs in runs.items()}
    if "script" in summary:
        base = summary["script"]["real_tokens_per_s"]["mean"]
        for arm, s in summary.items():
            s["speed_vs_script"] = s["real_tokens_per_s"]["mean"] / base
            s["speed_vs_script_per_pair"] = [r["real_tokens_per_s"] / b["real_tokens_per_s"]
                                             for r, b in zip(runs[arm], runs["script"])]
            s["eval_loss_vs_script"] = s["eval_loss"]["mean"] / summary["script"]["eval_loss"]["mean"] - 1
    result = {"machine": facts, "set": a.set, "train": a.train, "eval": a.eval, "repeats": a.repeats,
              "precision": precision, "tunekit_overrides": a.tunekit_set, "summary": summary, "runs": runs,
              "wall_s": round(time.perf_counter() - started, 1)}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{a.set}, {a.train} rows, one epoch, {precision}, {a.repeats} runs each "
          f"({facts['cpu']}, avx512_bf16 {facts['avx512_bf16']}, amx_bf16 {facts['amx_bf16']}):")
    for arm, s in summary.items():
        t, loss = s["real_tokens_per_s"], s["eval_loss"]
        pairs = ", ".join(f"{x:.2f}" for x in s.get("speed_vs_script_per_pair", []))
        ratio = f"  {s['speed_vs_script']:.2f}x (pairs {pairs})" if "speed_vs_script" in s else ""
        print(f"  {arm:<10} {t['mean']:7.1f} ± {t['sd']:5.1f} real tokens/s, held-out loss {loss['mean']:.4f} "
              f"± {loss['sd']:.4f}{ratio}")
    print(f"written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
