"""Two instruction sets built from real text that Debian packages ship (no Hub needed):

- translate: English -> German phrases and sentences from the Ding dictionary (package trans-de-en,
  /usr/share/trans/de-en), entries of four or more English words, annotations removed;
- define: WordNet 3.0 glosses (package wordnet-base, /usr/share/wordnet): a word and its part of
  speech in, its definition (with WordNet's usage examples) out.

Both have natural length variation (a few tokens to a few dozen) and are rendered with the model's
chat template, prompt masked, like any tunekit data set.

    python bench/realdata.py OUT_DIR [--train 128] [--eval 32]   # writes {translate,define}_{train,eval}.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

DING = Path("/usr/share/trans/de-en")
WORDNET = Path("/usr/share/wordnet")
PACKAGES = "apt-get install trans-de-en wordnet-base"
ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]|/[^/]*/|\([^)]*\)")


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", ANNOTATION.sub("", text.split(";")[0])).strip(" ,")


def translate_rows() -> list[dict]:
    rows, seen = [], set()
    for line in DING.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") or " :: " not in line:
            continue
        german, english = line.split(" :: ", 1)
        for de, en in zip(german.split(" | "), english.split(" | ")):
            de, en = _clean(de), _clean(en)
            if len(en.split()) >= 4 and de and en not in seen and not re.search(r"[{}\[\]/|]", de + en):
                seen.add(en)
                rows.append({"instruction": "Translate into German.", "input": en, "output": de})
    return rows


def define_rows() -> list[dict]:
    rows = []
    for pos, name in (("noun", "noun"), ("verb", "verb"), ("adj", "adjective"), ("adv", "adverb")):
        for line in (WORDNET / f"data.{pos}").read_text(encoding="utf-8").splitlines():
            if line.startswith(" ") or " | " not in line:
                continue
            fields, gloss = line.split(" | ", 1)
            word = fields.split()[4].replace("_", " ")
            word = re.sub(r"\(\w+\)$", "", word)  # adjective markers such as (a), (p)
            rows.append({"instruction": "Define the word.", "input": f"{word} ({name})", "output": gloss.strip()})
    return rows


SETS = {"translate": translate_rows, "define": define_rows}


def split(rows: list[dict], n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    picked = random.Random(seed).sample(rows, n_train + n_eval)
    return picked[:n_train], picked[n_train:]


def require() -> None:
    missing = [str(p) for p in (DING, WORDNET / "data.noun") if not p.exists()]
    if missing:
        sys.exit(f"bench: {', '.join(missing)} not found; install the data with: {PACKAGES}")


def write(out: Path, n_train: int, n_eval: int, seed: int = 0) -> dict[str, tuple[Path, Path]]:
    require()
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, build in SETS.items():
        train, held_out = split(build(), n_train, n_eval, seed)
        paths = (out / f"{name}_train.jsonl", out / f"{name}_eval.jsonl")
        for path, rows in zip(paths, (train, held_out)):
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        files[name] = paths
    return files


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--train", type=int, default=128)
    p.add_argument("--eval", type=int, default=32)
    a = p.parse_args()
    for name, (train, held_out) in write(a.out, a.train, a.eval).items():
        print(f"{name}: {train} {held_out}")
