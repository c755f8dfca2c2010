"""A general-knowledge benchmark from text a package ships, for "did the fine-tune forget?": "In which country is
the city of X?" with four countries to choose from. The cities and their countries are the IANA time zone table's
(the `tzdata` package: zone.tab names each zone's country and its principal city, iso3166.tab the countries); the
three wrong answers are countries of the same region (the zone's first part: Europe, America, Asia, ...), so that
the continent alone does not give the answer away. A city whose name is part of its country's (Singapore, Panama,
Kuwait) is left out. Written as an lm-evaluation-harness multiple-choice task:

    python bench/knowledge.py OUT_DIR [--limit N] [--seed S]   # OUT_DIR/geography.yaml and geography.jsonl
    tunekit eval RUN --benchmarks OUT_DIR/geography.yaml --compare base
"""

from __future__ import annotations

import argparse
import json
import random
from importlib import resources
from pathlib import Path

TASK = "geography"
YAML = f"""# {TASK}: "In which country is the city of X?", four countries to choose from (bench/knowledge.py)
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASK}.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: In which country is the city of {{{{city}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _table(name: str) -> list[list[str]]:
    text = resources.files("tzdata").joinpath("zoneinfo", name).read_text(encoding="utf-8")
    return [line.split("\t") for line in text.splitlines() if line and not line.startswith("#")]


def questions(seed: int = 0) -> list[dict]:
    countries = {code: name for code, name in _table("iso3166.tab")}
    cities: dict[str, tuple[str, str]] = {}  # city -> (country code, region)
    for code, _coords, zone, *_ in _table("zone.tab"):
        region, *_, place = zone.split("/")
        city = place.replace("_", " ")
        if region in ("Antarctica", "Arctic", "Etc") or city.lower() in countries[code].lower():
            continue
        cities.setdefault(city, (code, region))
    by_region: dict[str, set[str]] = {}
    for code, region in cities.values():
        by_region.setdefault(region, set()).add(code)
    rng = random.Random(seed)
    rows = []
    for city, (code, region) in sorted(cities.items()):
        pool = sorted(by_region[region] - {code})
        if len(pool) < 3:  # a region of too few countries: from all of them
            pool = sorted(set(countries) - {code})
        choices = [countries[c] for c in rng.sample(pool, 3)] + [countries[code]]
        rng.shuffle(choices)
        rows.append({"city": city, "choices": choices, "label": choices.index(countries[code])})
    rng.shuffle(rows)
    return rows


# the same questions answered in words: the country generated (greedy, to the line's end), exact match
GENERATE = f"""# {TASK}_gen: the same questions, the country written out (bench/knowledge.py)
task: {TASK}_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASK}.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Question: In which country is the city of {{{{city}}}}? Answer with the country's name.\\nAnswer:"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ["^\\\\s+"]  # the space the answer starts with
metadata:
  version: 1.0
"""


def write(out: Path, limit: int | None = None, seed: int = 0) -> Path:
    """OUT/geography.jsonl, OUT/geography.yaml (the task file to give to --benchmarks) and OUT/geography_gen.yaml
    (the same questions as a generation task)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = questions(seed)[:limit]
    (out / f"{TASK}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                       encoding="utf-8")
    (out / f"{TASK}.yaml").write_text(YAML, encoding="utf-8")
    (out / f"{TASK}_gen.yaml").write_text(GENERATE, encoding="utf-8")
    return out / f"{TASK}.yaml"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write(args.out, args.limit, args.seed)
    print(f"{path}: {sum(1 for _ in open(path.with_suffix('.jsonl')))} questions")
