"""`tunekit plan`'s page: a plan (plan.estimate.Plan) in words and figures, or as JSON."""

from __future__ import annotations

import dataclasses
import json

from tunekit.config.schema import Recipe
from tunekit.plan import sharding, splitting, steptime
from tunekit.plan.estimate import Plan, Settings
from tunekit.plan.sizes import GiB, size_words


def layouts_line(plan: Plan) -> str:
    s = plan.settings
    return (f"{s.seq_len} tokens a row on {s.world_size} devices: "
            + ", ".join(f"{label} needs {p.peak / GiB:.2f} GiB per device" for label, p in plan.layouts))


def sharding_words(s: Settings) -> str:
    if s.fsdp:
        words = ["parameters resharded after forward" if s.fsdp_reshard_after_forward
                 else "layers kept gathered from forward to backward",
                 "one unit per decoder layer" if s.fsdp_auto_wrap else "one unit for every decoder layer"]
        words += ["CPU offload"] if s.fsdp_offload else []
        words += [f"gradients reduced in {'fp32' if s.fsdp_reduce_dtype == 'float32' else s.precision}"]
        return f"FSDP2 ({', '.join(words)})"
    return (f"ZeRO stage {s.zero_stage}" + (", optimizer offload" if s.offload_optimizer else "")
            + (", parameter offload" if s.offload_params else ""))


STATE = "weights, gradients and optimizer state"


def at_peak(plan: Plan) -> dict[str, float]:
    """Bytes by category at the plan's peak: the parts live all step plus its largest phase."""
    phased = {k for phase in plan.phases for k in phase}
    largest = max(plan.phases, key=lambda ph: sum(plan.parts[k] for k in ph), default=())
    out: dict[str, float] = {}
    for key, value in plan.parts.items():
        if key not in phased or key in largest:
            category = plan.categories.get(key) or (STATE if key.startswith(
                ("weights", "gradients (", "optimizer (", "master weights")) else "activations and the rest")
            out[category] = out.get(category, 0) + value
    return out


def why(category: str, fsdp_more: bool, s: Settings) -> str:
    """The mechanism behind the larger share of `category`, in words (`s`: the FSDP2 plan's settings)."""
    if category == sharding.GATHERED:
        if not fsdp_more:
            return ("ZeRO-3 keeps the parameters it uses again within stage3_max_reuse_distance gathered from "
                    "forward to backward, beside its prefetch bucket and the parameters under its persistence "
                    "threshold")
        if s.fsdp_auto_wrap and s.fsdp_reshard_after_forward:
            return "FSDP2 gathers a whole decoder layer and prefetches the next; ZeRO-3 fetches module by module"
        return "FSDP2 keeps every decoder layer gathered from forward to backward"
    if category == sharding.GRADIENTS:
        if fsdp_more and s.accumulation > 1:
            return ("FSDP2 keeps unsharded gradients over the micro-batches of an accumulation step (the Trainer "
                    "reduce-scatters after the last)")
        return ("FSDP2 reduce-scatters a whole layer's gradients at once" if fsdp_more
                else "ZeRO-3 keeps a reduce bucket of reduce_bucket_size elements")
    if category == STATE:
        if fsdp_more:
            return "the sharded state differs"
        if s.fsdp_offload:
            return "FSDP2's cpu_offload moves the sharded gradients to CPU RAM too"
        return "ZeRO-3 keeps 16-bit trained weights beside their fp32 masters; FSDP2 shards the fp32 weights alone"
    return "activations and the loss differ"


def versus_line(plan: Plan) -> str:
    """FSDP2's and ZeRO-3's peaks per device for this recipe, which is lower, by how much and why."""
    (f_label, f), (z_label, z) = plan.versus["fsdp"], plan.versus["zero3"]
    line = (f"FSDP2 ({f_label}) vs ZeRO-3 ({z_label}) on {plan.settings.world_size} devices: "
            f"{size_words(f.peak)} vs {size_words(z.peak)} per device")
    if f.cpu_bytes or z.cpu_bytes:
        line += f" ({size_words(f.cpu_bytes)} vs {size_words(z.cpu_bytes)} offloaded to CPU RAM)"
    diff = z.peak - f.peak
    if abs(diff) <= 0.001 * max(f.peak, z.peak):
        return line + ": the same within 0.1%"
    fc, zc = at_peak(f), at_peak(z)
    shares = sorted(((fc.get(k, 0), zc.get(k, 0), k) for k in {*fc, *zc}), key=lambda t: -abs(t[0] - t[1]))
    shares = [t for t in shares if abs(t[0] - t[1]) >= 0.05 * abs(diff)]
    detail = "; ".join(f"{k} {size_words(a)} vs {size_words(b)}" for a, b, k in shares)
    return (line + f": {'FSDP2' if diff > 0 else 'ZeRO-3'} needs {size_words(abs(diff))} less ({detail}: "
            f"{why(shares[0][2], shares[0][0] > shares[0][1], f.settings)})")


def text(recipe: Recipe, plan: Plan, budget: int | None, fixes: list[tuple[str, Plan]]) -> str:
    """The page `tunekit plan` prints: the settings, each part's bytes, the peak, the time and the verdict."""
    s, c = plan.settings, plan.counts
    lines = [
        f"model: {recipe.model.name_or_path}  adapter: {recipe.adapter_kind}  precision: {s.precision}",
        f"parameters: {c.total:,} total, "
        + (f"{c.total - c.inactive:,} active per token ({c.experts}), " if c.experts else "")
        + f"{c.trainable:,} trainable ({100 * c.trainable / max(c.total, 1):.2f}%)",
        f"per device: world size {s.world_size}, micro-batch {s.micro_batch}"
        + (f" pairs ({s.micro_batch * s.sequences} sequences)" if s.sequences > 1 else "")
        + (f", {s.extra_forwards} no-grad forward(s) (reference, KL)" if s.extra_forwards else "")
        + (f", {s.sampled} sequences sampled before each step" if s.sampled else "")
        + (f" in up to {s.sample_turns} turns" if s.sampled and s.sample_turns > 1 else "")
        + f" x {s.seq_len} tokens, "
        f"gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}, {sharding_words(s)}",
        *([f"split: {splitting.words(s)}: a device holds {s.seq_len // splitting.pieces(s)} positions of each row"
           + (", 1/{} of each layer's matrices".format(s.tp) if s.tp > 1 else "")]
          if s.tp * splitting.pieces(s) > 1 else []),
        *([plan.vision] if plan.vision else []),
        "",
    ]
    width = max(len(k) for k in plan.parts) + 6
    for key, value in plan.parts.items():
        marks = "".join(f"[{i + 1}]" for i, phase in enumerate(plan.phases) if key in phase)
        remark = f"  ({plan.remarks[key]})" if key in plan.remarks else ""
        lines.append(f"  {key + (' ' + marks if marks else ''):<{width}}  {value / GiB:9.3f} GiB{remark}")
    lines.append(f"  {'peak per device':<{width}}  {plan.peak / GiB:9.3f} GiB")
    if len(plan.phases) > 1:
        lines.append("  (peak = the unmarked parts + the largest of the groups live together: "
                     + ", ".join(f"[{i + 1}] at {m}" for i, m in enumerate(plan.moments)) + ")")
    if plan.cpu_bytes:
        lines.append(f"  {'offloaded to CPU RAM':<{width}}  {plan.cpu_bytes / GiB:9.3f} GiB")
    if plan.versus:
        lines += ["", versus_line(plan)]
    if plan.layouts:
        lines += ["", layouts_line(plan)]
    if plan.communication:
        lines += ["", f"sent per step per device: {sum(plan.communication.values()) / 1e9:.3g} GB ("
                  + "; ".join(f"{k} {v / 1e9:.3g} GB" for k, v in plan.communication.items()) + ")"]
    lines += ["", *steptime.lines(recipe, s, plan.time, plan.flops_per_step, plan.step_seconds)]
    lines.append("peak = live tensors (what torch.cuda.max_memory_allocated reports); the CUDA context and "
                 "the allocator's cached blocks come on top")
    if budget is not None:
        verdict = "fits" if plan.peak <= budget else "does NOT fit"
        lines += ["", f"verdict: {verdict} in {budget / GiB:.1f} GiB ({plan.peak / GiB:.2f} GiB planned)"]
        if plan.peak > budget:
            for label, p in fixes:
                mark = "fits" if p.peak <= budget else "still over"
                lines.append(f"  - {label}: {p.peak / GiB:.2f} GiB ({mark})")
    return "\n".join(lines)


def to_json(plan: Plan) -> str:
    """`tunekit plan --json`: the plan's figures."""
    versus = {name: {"label": label, "peak": p.peak, "cpu_bytes": p.cpu_bytes}
              for name, (label, p) in (plan.versus or {}).items()}
    return json.dumps({"settings": dataclasses.asdict(plan.settings), "counts": dataclasses.asdict(plan.counts),
                       "parts": plan.parts, "remarks": plan.remarks, "phases": plan.phases, "moments": plan.moments,
                       "peak": plan.peak,
                       "cpu_bytes": plan.cpu_bytes, "flops_per_step": plan.flops_per_step,
                       "step_seconds": plan.step_seconds,
                       "time": dataclasses.asdict(plan.time) if plan.time else None,
                       "time_fit": steptime.provenance(plan.time), "versus": versus or None,
                       "communication": plan.communication},
                      indent=2)
