"""Instruction sets built from real text that packages ship (no Hub needed):

- translate: English -> German phrases and sentences from the Ding dictionary (Debian package
  trans-de-en, /usr/share/trans/de-en), entries of four or more English words, annotations removed;
- define: WordNet 3.0 glosses (Debian package wordnet-base, /usr/share/wordnet): a word and its part of
  speech in, its definition (with WordNet's usage examples) out;
- classify: a WordNet noun and its gloss in, its lexicographer category out (one of 25 words such as
  animal, artifact, person: WordNet's lexnames(5), the file number on each synset line), a checkable answer;
- docstring: a chat task on code, a Python standard-library function of the running interpreter (its
  source without the docstring) in the user turn, the docstring's first line as the assistant's answer.

The confirming tasks (manpage, translate-fr, closes) are built in bench/confirmdata.py. Each has natural length
variation (a few tokens to a few hundred) and is rendered with the model's
chat template, prompt masked, like any tunekit data set.

    python bench/realdata.py OUT_DIR [--train 128] [--eval 32]   # writes {set}_{train,eval}.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import sysconfig
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import confirmdata  # noqa: E402

DING = Path("/usr/share/trans/de-en")
WORDNET = Path("/usr/share/wordnet")
PACKAGES = f"apt-get install trans-de-en wordnet-base {confirmdata.PACKAGES}"
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


# WordNet's lexicographer files for nouns, by number (lexnames(5)); 03 (noun.Tops, 51 synsets) is left out
NOUN_FILES = ("act animal artifact attribute body cognition communication event feeling food group location "
              "motive object person phenomenon plant possession process quantity relation shape state "
              "substance time").split()
CLASSIFY = "Which WordNet category does this noun belong to? Answer with one of: " + ", ".join(NOUN_FILES) + "."


def classify_rows() -> list[dict]:
    rows = []
    for line in (WORDNET / "data.noun").read_text(encoding="utf-8").splitlines():
        if line.startswith(" ") or " | " not in line:
            continue
        fields, gloss = line.split(" | ", 1)
        number = int(fields.split()[1])
        if number < 4:
            continue
        word = fields.split()[4].replace("_", " ")
        definition = gloss.split(";")[0].strip()
        rows.append({"instruction": CLASSIFY, "input": f"{word}: {definition}", "output": NOUN_FILES[number - 4]})
    return rows


def _functions(path: Path):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            doc = node.body[0]
            first = ast.get_docstring(node).strip().split("\n\n")[0].replace("\n", " ")
            body = lines[node.lineno - 1:doc.lineno - 1] + lines[doc.end_lineno:node.end_lineno]
            yield first, textwrap.dedent("\n".join(body))


def docstring_rows() -> list[dict]:
    """Functions of 3-15 lines whose docstring opens with one sentence of 4-30 words."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows, seen = [], set()
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts[-2] or path.name.startswith("test"):
            continue
        for first, source in _functions(path):
            n = len(source.splitlines())
            if 3 <= n <= 15 and 4 <= len(first.split()) <= 30 and first not in seen:
                seen.add(first)
                user = f"Write a one-line docstring for this Python function.\n\n{source}"
                rows.append({"messages": [{"role": "user", "content": user},
                                          {"role": "assistant", "content": first}]})
    return rows


SETS = {"translate": translate_rows, "define": define_rows, "classify": classify_rows, "docstring": docstring_rows,
        **confirmdata.SETS}


def split(rows: list[dict], n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    picked = random.Random(seed).sample(rows, n_train + n_eval)
    return picked[:n_train], picked[n_train:]


def require(sets: tuple[str, ...]) -> None:
    needs = {"translate": [DING], "define": [WORDNET / "data.noun"], "classify": [WORDNET / "data.noun"]}
    missing = sorted({str(p) for name in sets for p in needs.get(name, []) if not p.exists()})
    missing += confirmdata.missing() if set(sets) & set(confirmdata.SETS) else []
    if missing:
        sys.exit(f"bench: {', '.join(missing)} not found; install the data with: {PACKAGES}")


def write(out: Path, n_train: int, n_eval: int, seed: int = 0,
          sets: tuple[str, ...] = ("translate", "define")) -> dict[str, tuple[Path, Path]]:
    require(sets)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in sets:
        build = SETS[name]
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
    p.add_argument("--sets", default=",".join(SETS))
    a = p.parse_args()
    for name, (train, held_out) in write(a.out, a.train, a.eval, sets=tuple(a.sets.split(","))).items():
        print(f"{name}: {train} {held_out}")
