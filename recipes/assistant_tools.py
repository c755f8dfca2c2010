"""The tools of recipes/smollm2_grpo_tools.yaml (grpo.tools): today's weather from a fixed table and a currency
converter. What they return is in no prompt: a model answers right only by calling them and reading the result.
The call and answer formats are those of the tool-use data (tunekit.data.tooldemo), so the SFT run of
recipes/smollm2_tools.yaml knows them.

    python recipes/assistant_tools.py   # writes recipes/data/tools_grpo_train.jsonl and tools_grpo_eval.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tunekit.data import tooldemo

_RNG = random.Random(4711)
WEATHER = {city: (_RNG.randint(-5, 32), _RNG.choice(tooldemo.CONDITIONS))
           for city in tooldemo.CITIES[0] + tooldemo.CITIES[1]}


# Spellings a weather service would take for its two units ("°F", "F", "Fahrenheit"): a call that names the
# right unit in another spelling answers, so rewards judge which unit the model asked for, not how it wrote it.
UNITS = {"c": "celsius", "celsius": "celsius", "centigrade": "celsius", "f": "fahrenheit", "fahrenheit": "fahrenheit"}


def get_weather(city: str, unit: str = "celsius") -> dict:
    """Today's weather in a city.

    Args:
        city: the city's name, e.g. Paris
        unit: celsius or fahrenheit
    """
    if city not in WEATHER:
        raise ValueError(f"no weather for {city!r}")
    unit = UNITS.get(unit.strip().lower().removeprefix("°").removeprefix("degrees").strip(), unit)
    if unit not in ("celsius", "fahrenheit"):
        raise ValueError("unit is celsius or fahrenheit")
    celsius, condition = WEATHER[city]
    return {"temperature": celsius if unit == "celsius" else round(celsius * 9 / 5 + 32), "unit": unit,
            "condition": condition}


def convert_currency(amount: float, from_currency: str, to_currency: str) -> dict:
    """Convert money between currencies at today's rate. Currencies as ISO codes.

    Args:
        amount: how much
        from_currency: the ISO code it is in, e.g. EUR
        to_currency: the ISO code wanted, e.g. USD
    """
    rates = tooldemo.PER_EUR
    for code in (from_currency, to_currency):
        if code not in rates:
            raise ValueError(f"unknown currency {code!r}")
    return {"result": round(amount * rates[to_currency] / rates[from_currency], 2)}


def _weather_prompt(rng: random.Random, cities: list[str]) -> dict:
    city = rng.choice(cities)
    if rng.random() < 0.3:
        unit = rng.choice(["celsius", "fahrenheit"])
        request = rng.choice(tooldemo.WEATHER_UNIT).format(city=city, unit=unit)
    else:
        unit, request = "celsius", rng.choice(tooldemo.WEATHER).format(city=city)
    result = get_weather(city, unit)
    return {"prompt": request, "answer": f"{result['temperature']}{'°C' if unit == 'celsius' else '°F'}"}


def _currency_prompt(rng: random.Random) -> dict:
    src, dst = rng.sample(sorted(tooldemo.CURRENCIES), 2)
    amount = rng.choice([rng.randint(5, 3000), round(rng.uniform(1, 500), 2)])
    request = rng.choice(tooldemo.CURRENCY).format(amount=amount, src=rng.choice(tooldemo.CURRENCIES[src]),
                                                   dst=rng.choice(tooldemo.CURRENCIES[dst]))
    return {"prompt": request, "answer": f"{convert_currency(amount, src, dst)['result']:,.2f}"}


def prompts(n: int, seed: int, cities: list[str], seen: set[str]) -> list[dict]:
    """`n` prompts, two weather requests to one conversion, none whose text is in `seen` (which they join)."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        row = _currency_prompt(rng) if len(rows) % 3 == 2 else _weather_prompt(rng, cities)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows


def write(out_dir: Path, n_train: int = 200, n_eval: int = 120) -> tuple[Path, Path]:
    """Training prompts on training's cities; held-out prompts, none seen in training, on every city (four of
    them training never asks about). Held-out prompts are drawn first, so how training is drawn never changes
    them."""
    seen: set[str] = set()
    held = prompts(n_eval, 2, tooldemo.CITIES[0] + tooldemo.CITIES[1], seen)
    train = prompts(n_train, 1, tooldemo.CITIES[0], seen)
    paths = out_dir / "tools_grpo_train.jsonl", out_dir / "tools_grpo_eval.jsonl"
    for path, rows in zip(paths, (train, held)):
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return paths


if __name__ == "__main__":
    for p in write(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "data")):
        print(p)
