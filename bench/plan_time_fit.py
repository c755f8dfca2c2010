"""`tunekit plan`'s GPU step time fitted to the GPU check's recorded runs (plan.steptime, plan.gpu_fit).

Reads two runs of bench/gpu_check.py: the H100's (bench/gpu_check_h100.json: bench/gpu_check.json as commit e22c0af
recorded it) and the H200's (bench/gpu_check.json as d9ba231 recorded it). Each check with a steady tokens/s is
planned with `tunekit plan`'s own code (tunekit.api.plan: the check's recipe and overrides on its shape's config, as
bench/gpu_check.py's start_plan plans it, at the rows' real lengths), which counts the host's work of a micro-batch:
decoder layers and LoRA-adapted linears run forward and backward, 4-bit weight uses, ZeRO-3 and FSDP2 gathers.
The operators of a layer and of an adapted linear are counted here once, on a small Llama with a dispatch counter.
The seconds per operator, per 4-bit use and per gather, and the extra of rows of natural length (the chat rows),
are fitted by least squares on relative error, none negative: on the H100's rows (checked on the H200's), on the
H200's (checked on the H100's), and on both, the fit `tunekit plan` ships. Two terms tried and left out are fitted
the same way for the record: the plan's elementwise bytes at each GPU's memory bandwidth, and the H100 run's code's
host syncs (one per trained tensor each step, before b4575f9). Writes src/tunekit/plan/gpu_fit.py and
bench/plan_time_fit.json and prints the table.

    python bench/plan_time_fit.py [--h100 FILE] [--h200 FILE] [--check]   # --check: print only, write nothing
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import pprint
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

OUT_JSON, OUT_MODULE = ROOT / "bench" / "plan_time_fit.json", ROOT / "src" / "tunekit" / "plan" / "gpu_fit.py"
RUNS = {"H100": ("bench/gpu_check_h100.json", "e22c0af"), "H200": ("bench/gpu_check.json", "d9ba231")}
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s, data sheets (H100 SXM HBM3, H200 HBM3e)
# the rows' real lengths: chat rows are 127.9 tokens on average (the check's 2,000 docstring rows counted with
# SmolLM2's tokenizer here; the H100 run's step clock gives 2218 tok/s x 0.47 s = ~1040 tokens a micro-batch of 8),
# packed; a vision row is 618 (576 image tokens and the chat template's text: 617-620)
ROW_TOKENS = {"chat": 128, "text": gpu_check.SQL, "vision": 618}
EXCLUDED = {"grpo": "its time is sampling, which the plan counts as FLOPs only; 4 steps give no steady figure",
            "cp2": "skipped in both runs (two GPUs)"}
TERMS = ("operators", "four_bit", "zero3_gathers", "fsdp_gathers", "varying")
COEFFICIENTS = ("seconds_per_operator", "seconds_per_four_bit_use", "seconds_per_zero3_gather",
                "seconds_per_fsdp_gather", "varying_rows_seconds")
GOAL = 0.25


def count_operators() -> dict[str, float]:
    """PyTorch operators a decoder layer and a LoRA-adapted linear dispatch, forward and backward: a small Llama
    (bf16 weights, fp32 adapters, bf16 autocast, one packed row of four sequences) with 2 and 3 layers, LoRA on
    q_proj alone and on all seven linears, with and without dropout, and fully trained."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def count(layers: int, targets, dropout: float = 0.0) -> tuple[int, int]:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                          attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        if targets:
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=dropout))
        for p in model.parameters():
            p.data = p.data.float() if p.requires_grad else p.data
        ids, positions = torch.randint(0, 400, (1, 256)), torch.arange(64).repeat(4)[None]
        for _ in range(2):  # the second pass: nothing left to initialise
            forward, backward = Counter(), Counter()
            with torch.autocast("cpu", dtype=torch.bfloat16), forward:
                loss = model(input_ids=ids, position_ids=positions, labels=ids).loss
            with backward:
                loss.backward()
        return forward.n, backward.n

    def per_layer(targets, dropout: float = 0.0) -> tuple[int, int]:
        (f2, b2), (f3, b3) = count(2, targets, dropout), count(3, targets, dropout)
        return f3 - f2, b3 - b2

    out = {}
    for suffix, dropout in (("", 0.0), ("_dropout", 0.05)):
        one, seven = per_layer(["q_proj"], dropout), per_layer("all-linear", dropout)
        forward, backward = ((s - o) / 6 for o, s in zip(one, seven))
        out |= {f"adapter_forward{suffix}": forward, f"adapter_backward{suffix}": backward}
        if not suffix:
            out |= {"layer_forward": one[0] - forward, "layer_backward": one[1] - backward}
    out["layer_backward_full"] = per_layer(None)[1]
    return out


def shape_dir(shape: str, work: Path) -> Path:
    """A directory with the shape's config.json as bench/gpu_check.py builds it (token ids do not change a plan)."""
    out = work / shape
    if not out.is_dir():
        ids = types.SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=2, convert_tokens_to_ids=lambda t: 3)
        built = gpu_check.vision_config if shape in gpu_check.VISION_SHAPES else gpu_check.shape_config
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(built(shape, ids, False)))
    return out


def planned(c, work: Path, memory_bandwidth: float | None = None):
    """The check's plan at its rows' real length."""
    from tunekit import api

    sets = [f"model.name_or_path={shape_dir(c.shape, work)}", *c.overrides, f"data.max_length={ROW_TOKENS[c.data]}"]
    return api.plan(f"recipes/{c.recipe}", sets, c.gpus, memory_bandwidth=memory_bandwidth).plan


def rows_of(runs: dict, counted: dict, work: Path) -> list[dict]:
    """Each measured check of each run: its measured seconds per micro-batch and the terms its plan counts."""
    from tunekit.plan import steptime

    checks = {c.name: c for c in gpu_check.CHECKS}
    plans, rows = {}, []
    for gpu, run in runs.items():
        for r in run["checks"]:
            if r["name"] in EXCLUDED or not r.get("tokens_per_s"):
                continue
            c = checks[r["name"]]
            if c.name not in plans:
                plans[c.name] = (planned(c, work), planned(c, work, memory_bandwidth=1.0))
            p, with_bytes = plans[c.name]
            s, host = p.settings, p.time.host
            counts = {k: v for k, v in vars(host).items() if k not in ("operators", "seconds")}  # the fit's own
            tokens = s.micro_batch * s.sequences * s.seq_len
            rows.append({"gpu": gpu, "check": c.name, "data": c.data, "tokens": tokens,
                         "measured_tokens_per_s": r["tokens_per_s"], "measured_seconds": tokens / r["tokens_per_s"],
                         "matmul_seconds": p.time.matmul_seconds, "host": counts,
                         "terms": {"operators": steptime.operators(host, counted), "four_bit": host.four_bit,
                                   "zero3_gathers": host.zero3_gathers, "fsdp_gathers": host.fsdp_gathers,
                                   "varying": float(c.data == "chat")},
                         "elementwise_bytes": with_bytes.time.elementwise_bytes,
                         "h100_code_syncs": 0 if s.zero_stage == 3 else host.adapter_backwards * 2 / s.accumulation})
    return rows


def lstsq_nonnegative(a: list[list[float]], b: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: the best over the subsets of columns whose free fit has none
    below 0 (few columns: all subsets)."""
    import numpy as np

    a, b = np.asarray(a, float), np.asarray(b, float)
    best, best_x = None, np.zeros(a.shape[1])
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (x < 0).any():
                continue
            full = np.zeros(a.shape[1])
            full[list(cols)] = x
            residual = float(((a @ full - b) ** 2).sum())
            if best is None or residual < best:
                best, best_x = residual, full
    return [float(v) for v in best_x]


def features(row: dict, extra: str | None) -> list[float]:
    out = [row["terms"][t] for t in TERMS]
    if extra == "bandwidth":
        out.append(row["elementwise_bytes"] / BANDWIDTH[row["gpu"]])
    elif extra == "h100_syncs":
        out.append(row["h100_code_syncs"] * (row["gpu"] == "H100"))
    return out


def fit(rows: list[dict], on: tuple[str, ...], extra: str | None = None) -> list[float]:
    """Coefficients minimising the relative error of the seconds per micro-batch on the rows of GPUs `on`."""
    train = [r for r in rows if r["gpu"] in on]
    return lstsq_nonnegative([[v / r["measured_seconds"] for v in features(r, extra)] for r in train],
                             [1.0] * len(train))


def host_seconds(row: dict, k: list[float], extra: str | None = None) -> float:
    """The host's work: every term but the extra of rows of natural length."""
    varying = TERMS.index("varying")
    return sum(c * v for i, (c, v) in enumerate(zip(k, features(row, extra))) if i != varying)


def predicted_seconds(row: dict, k: list[float], extra: str | None = None) -> float:
    """What the model says: the slower of the matmuls and the host's work, plus the extra of rows of natural
    length."""
    varying = TERMS.index("varying")
    return max(row["matmul_seconds"], host_seconds(row, k, extra)) + k[varying] * row["terms"]["varying"]


def ratio(row: dict, k: list[float], extra: str | None = None) -> float:
    """Predicted tokens/s over measured."""
    return row["measured_seconds"] / predicted_seconds(row, k, extra)


def worst(rows: list[dict], k: list[float], extra: str | None = None) -> tuple[float, str]:
    r = max(rows, key=lambda row: abs(ratio(row, k, extra) - 1))
    return ratio(r, k, extra), f"{r['gpu']} {r['check']}"


def load_runs(paths: dict[str, str]) -> dict:
    runs = {}
    for gpu, path in paths.items():
        run = json.loads((ROOT / path).read_text())
        if gpu not in run["machine"]["device"]:
            sys.exit(f"plan-time-fit: {path} was measured on {run['machine']['device']}, not an {gpu}")
        runs[gpu] = run
    return runs


def table(rows: list[dict], fits: dict) -> str:
    head = f"{'check':<15} {'GPU':<5} {'measured':>9} " + " ".join(f"{'fit ' + n:>16} {'ratio':>5}" for n in fits)
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["check"], r["gpu"])):
        cells = " ".join(f"{r['tokens'] / predicted_seconds(r, k):>16.0f} {ratio(r, k):>5.2f}" for k in fits.values())
        lines.append(f"{r['check']:<15} {r['gpu']:<5} {r['measured_tokens_per_s']:>9.0f} {cells}")
    return "\n".join(lines)


def module_text(fit_record: dict) -> str:
    body = pprint.pformat(fit_record, width=112, sort_dicts=False).replace("\n", "\n      ")
    return ('"""The coefficients of `tunekit plan`\'s GPU step time (plan.steptime), fitted by bench/plan_time_fit.py '
            "to the GPU\ncheck's recorded runs, and where they come from. Written by that script: run it again rather "
            f'than edit them."""\n\nFIT = {body}\n')


def summary(rows: list[dict], fits: dict, runs: dict, paths: dict, counted: dict) -> dict:
    """bench/plan_time_fit.json's record: where the runs come from, each fit and what it checked, each row."""
    record = {"runs": {g: {"file": paths[g], "commit": RUNS[g][1], "device": runs[g]["machine"]["device"]}
                       for g in runs},
              "excluded": EXCLUDED, "row_tokens": ROW_TOKENS, "operators": counted, "goal": GOAL, "fits": {}}
    for name, k in fits.items():
        checked_on = list(runs) if name == "both" else [g for g in runs if g != name]
        checked = [r for r in rows if r["gpu"] in checked_on]
        outside = sorted(f"{r['gpu']} {r['check']} {ratio(r, k):.2f}" for r in checked if abs(ratio(r, k) - 1) > GOAL)
        record["fits"][name] = {"fitted_on": list(runs) if name == "both" else [name], "checked_on": checked_on,
                                "coefficients": dict(zip(COEFFICIENTS, k)), "worst": list(worst(checked, k)),
                                "outside_goal": outside, "rows_checked": len(checked)}
    record["host_bound"] = all(r["matmul_seconds"] < host_seconds(r, fits["both"]) for r in rows)
    record["alternatives"] = {}
    for extra in ("bandwidth", "h100_syncs"):
        alt = record["alternatives"][extra] = {}
        for name, on in (("H100", ("H100",)), ("H200", ("H200",)), ("both", ("H100", "H200"))):
            k = fit(rows, on, extra)
            checked = [r for r in rows if name == "both" or r["gpu"] != name]
            alt[name] = {"coefficients": k, "worst": list(worst(checked, k, extra))}
    record["rows"] = [{**r, "predicted_tokens_per_s": {n: r["tokens"] / predicted_seconds(r, k)
                                                       for n, k in fits.items()}} for r in rows]
    return record


def shipped(record: dict) -> dict:
    """What plan.gpu_fit holds: the fit on both runs, the operator counts and where they come from."""
    gpus = [f"{'an' if g[0] in 'AEFHILMNORSX' else 'a'} {g}" for g in record["runs"]]
    both = record["fits"]["both"]
    return {"basis": f"estimated from runs measured on {' and '.join(gpus)} (bench/plan_time_fit.py)",
            "gpus": list(record["runs"]), "script": "bench/plan_time_fit.py", "runs": record["runs"],
            "operators": record["operators"], "coefficients": both["coefficients"], "worst": both["worst"],
            "rows": both["rows_checked"]}


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--h100", default=RUNS["H100"][0])
    a.add_argument("--h200", default=RUNS["H200"][0])
    a.add_argument("--check", action="store_true", help="print the fit, write nothing")
    args = a.parse_args(argv)
    os.chdir(ROOT)  # the recipes' and checks' paths (ds_configs/...) are the repository's
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.disable(logging.WARNING)  # the recipes' hub data sets cannot be read offline: no matter to a plan
    paths = {"H100": args.h100, "H200": args.h200}
    runs = load_runs(paths)
    counted = count_operators()
    with tempfile.TemporaryDirectory() as work:
        rows = rows_of(runs, counted, Path(work))
    fits = {"H100": fit(rows, ("H100",)), "H200": fit(rows, ("H200",)), "both": fit(rows, ("H100", "H200"))}
    record = summary(rows, fits, runs, paths, counted)
    print(table(rows, fits))
    for name, f in record["fits"].items():
        print(f"fit on {name}: " + ", ".join(f"{c} {v:.3g}" for c, v in f["coefficients"].items())
              + f"; checked on {' and '.join(f['checked_on'])}: worst {f['worst'][0]:.2f} ({f['worst'][1]}), "
              f"{len(f['outside_goal'])} of {f['rows_checked']} rows outside {GOAL:.0%}")
    print(f"every row bound by the host, not by its matmuls at the plan's utilization: {record['host_bound']}")
    for extra, alt in record["alternatives"].items():
        print(f"with {extra} (left out): " + "; ".join(
            f"fit on {n}: its coefficient {v['coefficients'][-1]:.3g}, worst {v['worst'][0]:.2f} ({v['worst'][1]})"
            for n, v in alt.items()))
    if not args.check:
        OUT_JSON.write_text(json.dumps(record, indent=1) + "\n")
        OUT_MODULE.write_text(module_text(shipped(record)))
        print(f"wrote {OUT_JSON.relative_to(ROOT)} and {OUT_MODULE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
