"""The contamination report at scale: `tunekit.data.contamination.check` on 200k training examples of real
text (the translate and define sets of bench/realdata.py, prompt = instruction and input, answer = output)
against a 2,000-example eval set, with known duplicates and overlaps planted in both.

Training: every pool row but the held-out ones, shuffled, then filled up to --train with copies of
training rows in other case and spacing (planted duplicates). Eval: rows held out of training, plus
--exact copies of training rows (upper-cased) and --spans prompts that quote 13 to 20 consecutive words of
a training answer (planted n-gram overlaps). Exact counts are checked against a plain set of normalised
texts; every planted overlap must be found. Reports the wall time of the check, peak RSS, the counts, and
the machine (CPU model and bf16 flags, load average, date, commit).

    python bench/contamination.py [--train 200000] [--eval 2000] [--out bench/contamination.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import machine  # noqa: E402
import realdata  # noqa: E402
from tunekit.data.contamination import check, normalize, words  # noqa: E402


def pairs(rows: list[dict]) -> list[tuple[str, str]]:
    return [(f"{r['instruction']}\n{r['input']}", r["output"]) for r in rows]


def recase(text: str, rng: random.Random) -> str:
    """The same text to normalisation: other case, other spacing."""
    text = text.upper() if rng.random() < 0.5 else text.title()
    return text.replace(" ", rng.choice(["  ", " \t", "\u00a0"]))


def build(n_train: int, n_eval: int, n_exact: int, n_spans: int, seed: int = 0):
    pool = pairs(realdata.translate_rows() + realdata.define_rows())
    rng = random.Random(seed)
    rng.shuffle(pool)
    clean = n_eval - n_exact - n_spans
    held, train = pool[:clean], pool[clean:][:n_train]
    originals = list(train)
    train += [tuple(recase(t, rng) for t in rng.choice(originals)) for _ in range(n_train - len(originals))]
    rng.shuffle(train)
    long = [a for _, a in train if len(words(normalize(a))) >= 24]
    quoted = []
    for answer in rng.sample(long, n_spans):
        tokens, k = answer.split(), rng.randint(13, 20)
        start = rng.randint(0, max(0, len(tokens) - k))
        while len(words(normalize(" ".join(tokens[start:start + k])))) < 13:  # a token may be punctuation only
            k += 1
        quoted.append((f"What does this mean? {' '.join(tokens[start:start + k])}", "It is a quotation."))
    copied = [(p.upper(), a.upper()) for p, a in rng.sample(train, n_exact)]
    held_out = held + copied + quoted
    return train, held_out, len(originals), range(clean, clean + n_exact), range(clean + n_exact, n_eval)


def reference(train, held_out) -> dict:
    """Exact counts by plain sets of normalised texts, to check the report against."""
    seen, dups = set(), 0
    prompts, answers = set(), set()
    for p, a in train:
        key = (normalize(p), normalize(a))
        dups += key in seen
        seen.add(key)
        prompts.add(key[0])
        answers.add(key[1])
    exact = sum((normalize(p) in prompts and bool(normalize(p))) or (normalize(a) in answers and bool(normalize(a)))
                for p, a in held_out)
    return {"duplicates": dups, "eval_exact": exact}


def groups(found, copied: range, quoted: range) -> dict:
    """Eval examples found exactly and by n-gram, among the held-out rows and each planted group."""
    held = range(0, copied.start)
    return {name: {"examples": len(part), "exact": len(set(part) & set(found.eval_exact)),
                   "ngram": len(set(part) & set(found.eval_ngram))}
            for name, part in (("held_out_rows", held), ("copied", copied), ("quoted", quoted))}


def rss() -> dict:
    status = Path("/proc/self/status").read_text()
    return {k: int(status.split(k + ":")[1].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=200_000)
    p.add_argument("--eval", type=int, default=2_000)
    p.add_argument("--exact", type=int, default=100, help="eval examples copied from training")
    p.add_argument("--spans", type=int, default=100, help="eval prompts quoting 13-20 words of a training answer")
    p.add_argument("--out", default=str(ROOT / "bench" / "contamination.json"))
    a = p.parse_args()
    realdata.require(("translate", "define"))
    train, held_out, originals, copied, quoted = build(a.train, a.eval, a.exact, a.spans)
    load_before = os.getloadavg()
    before = rss()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM counts from here
    start, cpu_start = time.perf_counter(), time.process_time()
    found = check(iter(train), held_out)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = rss()["VmHWM"]
    expected = reference(train, held_out)
    missed = sorted(set(copied) - set(found.eval_exact)) + sorted(set(quoted) - set(found.eval_ngram))
    result = {
        "machine": {**machine.facts(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "train_examples": len(train), "distinct_source_rows": originals, "planted_duplicates": len(train) - originals,
        "eval_examples": len(held_out), "planted_exact": len(copied), "planted_spans": len(quoted),
        "train_words": sum(len(words(normalize(p))) + len(words(normalize(a))) for p, a in train),
        "seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2),
        "rss_before_check_mb": round(before / 2**20, 1), "peak_rss_above_start_mb": round((peak - before) / 2**20, 1),
        "process_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "reference": expected, "planted_missed": missed, "found_by_group": groups(found, copied, quoted),
        "report": found.to_json(), "line": found.line(),
    }
    Path(a.out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(found.line())
    print(f"{len(train)} training / {len(held_out)} eval examples: {seconds:.1f} s ({cpu_seconds:.1f} s CPU), "
          f"peak RSS {result['peak_rss_above_start_mb']:.0f} MB above {result['rss_before_check_mb']:.0f} MB; "
          f"load average {load_before[0]:.1f}; written {a.out}")
    ok = not missed and found.to_json()["duplicates"] == expected["duplicates"] and \
        found.to_json()["eval_exact"] == expected["eval_exact"]
    if not ok:
        print(f"bench: MISMATCH: reference {expected}, planted overlaps missed {missed}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
