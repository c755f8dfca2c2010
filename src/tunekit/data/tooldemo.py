"""The tool-use task, generated deterministically: OpenAI-style chat records calling four functions with typed
arguments, with tool results, final answers and some reasoning. What it generates: docs/data.md, "The tool-use
data".

    python -m tunekit.data.tooldemo OUT_DIR   # writes tools_train.jsonl and tools_eval.jsonl"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def _fn(name: str, properties: dict, required: list[str], description: str | None = None) -> dict:
    """A function schema; a description only where the name and arguments leave something to say."""
    fn = {"name": name, **({"description": description} if description else {}),
          "parameters": {"type": "object", "properties": properties, "required": required}}
    return {"type": "function", "function": fn}


TOOLS = [
    _fn("get_weather", {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"]),
    _fn("convert_currency", {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                             "to_currency": {"type": "string"}}, ["amount", "from_currency", "to_currency"],
        "Currencies as ISO codes."),
    _fn("book_table", {"restaurant": {"type": "string"}, "people": {"type": "integer"}, "time": {"type": "string"}},
        ["restaurant", "people", "time"], "Time as HH:MM, 24-hour."),
    _fn("set_reminder", {"text": {"type": "string"}, "minutes": {"type": "integer"}}, ["text", "minutes"],
        "Remind the user in a number of minutes."),
]

# (values for training and eval, values only eval sees)
CITIES = (["Paris", "Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Denver", "Porto", "Krakow", "Osaka", "Quito",
           "Dublin", "Cairo", "Seoul", "Madrid", "Toronto", "Perth", "Vienna"],
          ["Tbilisi", "Montreal", "Accra", "Bergen"])
RESTAURANTS = (["Luigi's", "The Blue Door", "Sakura", "Casa Lola", "Green Fork", "Le Petit Jardin", "Spice Route",
                "The Old Mill", "Noodle Bar", "Harbour Grill"], ["Olive Tree", "Café Nova", "Red Lantern"])
ERRANDS = (["call mom", "water the plants", "take the pizza out", "check the laundry", "stretch",
            "join the team call", "feed the cat", "move the car", "drink some water", "send the invoice"],
           ["book the dentist", "pick up the kids", "charge my phone"])
CURRENCIES = {"EUR": ["euros", "EUR"], "USD": ["US dollars", "USD"], "JPY": ["yen", "JPY"], "GBP": ["pounds", "GBP"],
              "CHF": ["Swiss francs", "CHF"], "INR": ["rupees", "INR"], "CAD": ["Canadian dollars", "CAD"],
              "BRL": ["reais", "BRL"]}
PER_EUR = {"EUR": 1.0, "USD": 1.08, "JPY": 162.0, "GBP": 0.85, "CHF": 0.95, "INR": 90.0, "CAD": 1.47, "BRL": 5.4}
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowing", "foggy"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]

WEATHER = ["What's the weather in {city}?", "How is the weather in {city} right now?", "weather {city}",
           "Can you check the weather for {city}?", "Is it cold in {city} today?", "Tell me the weather in {city}."]
WEATHER_UNIT = ["What's the weather in {city} in {unit}?", "Weather for {city}, in {unit} please.",
                "How warm is it in {city}? Give me {unit}."]
WEATHER_INDIRECT = ["I'm flying to {city} today. Should I pack a coat?", "Do I need an umbrella in {city} today?",
                    "Going for a run in {city} now, is that a good idea?"]
CURRENCY = ["Convert {amount} {src} to {dst}.", "How much is {amount} {src} in {dst}?",
            "What are {amount} {src} worth in {dst}?", "{amount} {src} to {dst} please",
            "I have {amount} {src}. How many {dst} is that?"]
BOOKING = ["Book a table for {people} at {restaurant} at {time}.",
           "Reserve {restaurant} for {people} people at {time}.",
           "Can you get us a table at {restaurant}? We are {people}, at {time}.",
           "Table for {people} at {restaurant}, {time} please."]
REMINDER = ["Remind me to {errand} in {n} minutes.", "In {n} minutes, remind me to {errand}.",
            "Set a reminder to {errand} in {n} min.", "Ping me in {n} minutes to {errand}."]
REMINDER_HOURS = ["Remind me to {errand} in {h} hours.", "In {h} hours, remind me to {errand}."]
SMALL_TALK = [("Hello!", "Hello! I can check the weather, convert currencies, book a table or set a reminder."),
              ("Thanks, that's all.", "You're welcome! Have a good day."),
              ("Who are you?", "I'm an assistant that can check the weather, convert currencies, book restaurant "
                               "tables and set reminders."),
              ("Can you order me a pizza?", "I can't order food, but I can book you a table at a restaurant."),
              ("Play some music.", "I can't play music. I can check the weather, convert currencies, book a table "
                                   "or set a reminder."),
              ("What's the capital of France?", "The capital of France is Paris.")]
SMALL_TALK_EVAL = [("Good morning!", "Good morning! I can check the weather, convert currencies, book a table or "
                                     "set a reminder."),
                   ("Can you send an email for me?", "I can't send emails, but I can set a reminder to do it."),
                   ("Thank you so much!", "You're welcome!"),
                   ("What's 7 times 8?", "7 times 8 is 56.")]


class Pools:
    """The values one split draws from: training's, or training's and eval's own (small talk: eval's own)."""

    def __init__(self, held_out: bool):
        pick = (lambda pair: pair[0] + pair[1]) if held_out else (lambda pair: pair[0])
        self.cities, self.restaurants, self.errands = pick(CITIES), pick(RESTAURANTS), pick(ERRANDS)
        self.small_talk = SMALL_TALK_EVAL if held_out else SMALL_TALK  # none shared


Task = tuple[str, list[tuple[str, dict]], str, int | None]  # request, calls, reasoning, WEATHER_INDIRECT index


def _weather(rng: random.Random, pools: Pools) -> Task:
    city = rng.choice(pools.cities)
    kind = rng.choices(["plain", "unit", "indirect", "two"], weights=[5, 2, 2, 1])[0]
    if kind == "two":
        other = rng.choice([c for c in pools.cities if c != city])
        request = rng.choice(["Weather in {city} and {other}?", "Compare the weather in {city} and {other}."])
        return request.format(city=city, other=other), [("get_weather", {"city": c}) for c in (city, other)], "", None
    args = {"city": city}
    if kind == "unit":
        args["unit"] = rng.choice(["celsius", "fahrenheit"])
    if kind == "indirect":
        k = rng.randrange(len(WEATHER_INDIRECT))
        reasoning = f"The answer depends on the weather in {city}, so I should check it with get_weather."
        return WEATHER_INDIRECT[k].format(city=city), [("get_weather", args)], reasoning, k
    request = rng.choice(WEATHER if kind == "plain" else WEATHER_UNIT)
    return request.format(city=city, unit=args.get("unit")), [("get_weather", args)], "", None


def _amount(rng: random.Random) -> float | int:
    return rng.choice([rng.randint(5, 3000), round(rng.uniform(1, 500), 2)])


def _currency(rng: random.Random, pools: Pools) -> Task:
    src, dst = rng.sample(sorted(CURRENCIES), 2)
    amount = _amount(rng)
    request = rng.choice(CURRENCY).format(amount=amount, src=rng.choice(CURRENCIES[src]),
                                          dst=rng.choice(CURRENCIES[dst]))
    return request, [("convert_currency", {"amount": amount, "from_currency": src, "to_currency": dst})], "", None


def _booking(rng: random.Random, pools: Pools) -> Task:
    restaurant, people = rng.choice(pools.restaurants), rng.randint(1, 10)
    hour, minute = rng.randint(12, 22), rng.choice([0, 15, 30, 45])
    pm = hour > 12 and rng.random() < 0.5
    said = f"{hour - 12}:{minute:02d} pm" if pm else f"{hour}:{minute:02d}"
    told = rng.choice([str(people), NUMBERS[people - 1]])
    request = rng.choice(BOOKING).format(people=told, restaurant=restaurant, time=said)
    time = f"{hour}:{minute:02d}"
    reasoning = f"{said} is {time} in 24-hour time." if pm else ""
    return request, [("book_table", {"restaurant": restaurant, "people": people, "time": time})], reasoning, None


def _reminder(rng: random.Random, pools: Pools) -> Task:
    errand = rng.choice(pools.errands)
    if rng.random() < 0.3:
        hours = rng.randint(2, 5)
        request = rng.choice(REMINDER_HOURS).format(errand=errand, h=hours)
        reasoning = f"{hours} hours is {hours * 60} minutes."
        return request, [("set_reminder", {"text": errand, "minutes": hours * 60})], reasoning, None
    n = rng.choice([5, 10, 15, 20, 25, 30, 40, 45, 50, 90])
    request = rng.choice(REMINDER).format(errand=errand, n=n)
    return request, [("set_reminder", {"text": errand, "minutes": n})], "", None


TASKS = [_weather, _currency, _booking, _reminder]


def _result(rng: random.Random, name: str, args: dict) -> dict:
    """What the function returns (made up, consistent with the arguments)."""
    if name == "get_weather":
        celsius = rng.randint(-5, 32)
        unit = args.get("unit", "celsius")
        return {"temperature": celsius if unit == "celsius" else round(celsius * 9 / 5 + 32), "unit": unit,
                "condition": rng.choice(CONDITIONS)}
    if name == "convert_currency":
        rate = PER_EUR[args["to_currency"]] / PER_EUR[args["from_currency"]]
        return {"result": round(args["amount"] * rate, 2)}
    if name == "book_table":
        return {"status": "confirmed", "confirmation": f"BK{rng.randint(1000, 9999)}"}
    return {"status": "scheduled"}


def _says(args: dict, result: dict) -> str:
    """One call's result in words."""
    if "condition" in result:
        sign = "°C" if result["unit"] == "celsius" else "°F"
        return f"{args['city']}: {result['temperature']}{sign} and {result['condition']}"
    if "result" in result:
        return f"{args['amount']} {args['from_currency']} is about {result['result']:,.2f} {args['to_currency']}"
    if "confirmation" in result:
        return (f"your table for {args['people']} at {args['restaurant']} is booked for {args['time']} "
                f"(confirmation {result['confirmation']})")
    return f"I'll remind you to {args['text']} in {args['minutes']} minutes"


def _advice(k: int, result: dict) -> str:
    """The answer to WEATHER_INDIRECT[k] given the weather."""
    cold = result["temperature"] < (12 if result["unit"] == "celsius" else 54)
    wet = result["condition"] in ("rainy", "snowing")
    if k == 0:
        return "yes, pack a coat" if cold else "no coat needed"
    if k == 1:
        return "yes, take an umbrella" if wet else "no umbrella needed"
    return "better wait" if wet or result["condition"] == "windy" else "enjoy your run"


def _answer(calls: list[tuple[str, dict]], results: list[dict], advice: int | None) -> str:
    text = "; ".join(_says(args, r) for (_, args), r in zip(calls, results))
    if advice is not None:
        text += ", so " + _advice(advice, results[0])
    return text[0].upper() + text[1:] + "."


def _call_message(rng: random.Random, calls: list[tuple[str, dict]], reasoning: str) -> dict:
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{rng.randrange(16 ** 8):08x}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}} for name, args in calls]}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _offered(rng: random.Random, needed: set[str]) -> list[dict]:
    """The tools an example offers: the ones it calls and one or two others, in random order (short
    prompts, and the model must pick the function by what it does, not by where it stands)."""
    others = [t for t in TOOLS if t["function"]["name"] not in needed]
    offered = [t for t in TOOLS if t["function"]["name"] in needed] + rng.sample(others, 2 if not needed else 1)
    rng.shuffle(offered)
    return offered


def conversation(rng: random.Random, pools: Pools, end: str) -> dict:
    """One record. end: "answer" (the whole chain: request, call, results, answer), "call" (ends at the
    assistant's tool call), "small_talk" (a message that needs no tool, and its answer)."""
    if end == "small_talk":
        user, reply = rng.choice(pools.small_talk)
        return {"tools": _offered(rng, set()), "messages": [{"role": "user", "content": user},
                                                           {"role": "assistant", "content": reply}]}
    request, calls, reasoning, advice = rng.choice(TASKS)(rng, pools)
    call = _call_message(rng, calls, reasoning)
    messages = [{"role": "user", "content": request}, call]
    if end == "answer":
        results = [_result(rng, name, args) for name, args in calls]
        messages += [{"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"],
                      "content": json.dumps(r, ensure_ascii=False)} for c, r in zip(call["tool_calls"], results)]
        messages.append({"role": "assistant", "content": _answer(calls, results, advice)})
    return {"tools": _offered(rng, {name for name, _ in calls}), "messages": messages}


def _unique(rng: random.Random, pools: Pools, ends: list[str], seen: set[str]) -> list[dict]:
    """One record per entry of `ends`, none whose request or final answer is in `seen` (small talk aside:
    training repeats it), each adding its own to `seen`."""
    rows = []
    for end in ends:
        while True:
            row = conversation(rng, pools, end)
            texts = {row["messages"][0]["content"]} | ({row["messages"][-1]["content"]} if end == "answer" else set())
            if end == "small_talk" or not texts & seen:
                break
        seen |= texts
        rows.append(row)
    return rows


EVAL_ENDS = ["call"] * 7 + ["answer"] * 2 + ["small_talk"]  # repeated: every 10 eval rows


def generate(n_train: int = 400, n_eval: int = 40, seed: int = 2929) -> tuple[list[dict], list[dict]]:
    """Training records (whole chains, one in ten small talk) and eval records (EVAL_ENDS), from
    different generators so that the eval values include some training never saw."""
    seen: set[str] = set()
    train_rng, eval_rng = random.Random(seed), random.Random(seed + 1)
    train = _unique(train_rng, Pools(False), ["small_talk" if i % 10 == 9 else "answer" for i in range(n_train)],
                    seen)
    evals = _unique(eval_rng, Pools(True), [EVAL_ENDS[i % len(EVAL_ENDS)] for i in range(n_eval)], seen)
    return train, evals


def write(out_dir: Path, n_train: int = 400, n_eval: int = 40) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "tools_train.jsonl", out_dir / "tools_eval.jsonl"
    for path, rows in zip(paths, generate(n_train, n_eval)):
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return paths


if __name__ == "__main__":
    for p in write(Path(sys.argv[1] if len(sys.argv) > 1 else "recipes/data")):
        print(p)
