"""The demo task, generated deterministically: pull a purchase out of a sentence into a fixed
one-line record. A small instruct model knows the words but not the format, and learns it in
a few minutes of LoRA on CPU, so the before/after gap is large and easy to see.

    python -m tunekit.data.demodata OUT_DIR   # writes extract_, prefer_ and kto_{train,eval}.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

INSTRUCTION = "Extract the purchase as: name | item | color | price | city"
NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena",
         "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
ITEMS = ["bicycle", "laptop", "jacket", "teapot", "guitar", "backpack", "lamp", "camera", "watch", "kettle",
         "chair", "umbrella", "scarf", "blender", "tent", "helmet"]
COLORS = ["red", "blue", "green", "black", "white", "yellow", "silver", "orange", "purple", "brown"]
CITIES = ["Paris", "Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Denver", "Porto", "Krakow", "Osaka",
          "Quito", "Dublin"]
SENTENCES = [
    "{name} bought a {color} {item} in {city} for {price} dollars.",
    "In {city}, {name} paid {price} dollars for a {color} {item}.",
    "For {price} dollars, {name} got a {color} {item} while visiting {city}.",
    "A {color} {item} cost {name} {price} dollars at a shop in {city}.",
    "While in {city}, {name} picked up a {color} {item}; it was {price} dollars.",
]


def example(rng: random.Random) -> dict:
    slots = dict(name=rng.choice(NAMES), item=rng.choice(ITEMS), color=rng.choice(COLORS),
                 city=rng.choice(CITIES), price=rng.randint(5, 500))
    sentence = rng.choice(SENTENCES).format(**slots)
    answer = "{name} | {item} | {color} | {price} | {city}".format(**slots)
    return {"instruction": INSTRUCTION, "input": sentence, "output": answer}


def generate(n_train: int = 400, n_eval: int = 40, seed: int = 1234) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_eval:
        row = example(rng)
        if row["input"] not in seen:  # no eval sentence also appears in training
            seen.add(row["input"])
            rows.append(row)
    return rows[:n_train], rows[n_train:]


def preference_pairs(rows: list[dict]) -> list[dict]:
    """The same task as preference pairs: the one-line record is chosen, restating the sentence (what
    the base model does unprompted) is rejected."""
    return [{"prompt": f"{r['instruction']}\n\n{r['input']}", "chosen": r["output"], "rejected": r["input"]}
            for r in rows]


def write_preference(out_dir: Path, n_train: int = 160, n_eval: int = 40) -> tuple[Path, Path]:
    """prefer_train.jsonl / prefer_eval.jsonl from the demo's split (other seed, no sentence shared)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    train, evals = generate(n_train, n_eval, seed=4321)
    paths = out_dir / "prefer_train.jsonl", out_dir / "prefer_eval.jsonl"
    for path, rows in zip(paths, (train, evals)):
        path.write_text("".join(json.dumps(r) + "\n" for r in preference_pairs(rows)), encoding="utf-8")
    return paths


def unpaired(pairs: list[dict]) -> list[dict]:
    """The pairs as KTO's unpaired examples: the chosen answer desirable, the rejected one not."""
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]


def write_unpaired(out_dir: Path) -> tuple[Path, Path]:
    """kto_train.jsonl / kto_eval.jsonl: prefer_*.jsonl unpaired."""
    paths = out_dir / "kto_train.jsonl", out_dir / "kto_eval.jsonl"
    for path, source in zip(paths, ("prefer_train.jsonl", "prefer_eval.jsonl")):
        pairs = [json.loads(line) for line in (out_dir / source).read_text(encoding="utf-8").splitlines()]
        path.write_text("".join(json.dumps(r) + "\n" for r in unpaired(pairs)), encoding="utf-8")
    return paths


def write(out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    train, evals = generate()
    paths = out_dir / "extract_train.jsonl", out_dir / "extract_eval.jsonl"
    for path, rows in zip(paths, (train, evals)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return paths


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "recipes/data")
    for p in (*write(out), *write_preference(out), *write_unpaired(out)):
        print(p)
