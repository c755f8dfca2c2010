"""A compact profile of a few steady training steps: the top GPU kernels by time, the host syncs, and how long the
GPU sat idle between kernels (the CPU gaps), per step; on a CPU the top operators instead. A TrainerCallback,
so the same profile serves tunekit's runs and the TRL script's (bench/trl_sft.py --profile).

For tunekit's CLI, run in this process with the callback on every Trainer it builds:
    python bench/step_profile.py OUT.json FIRST LAST -- -m tunekit train RECIPE --set ...
profiles optimizer steps FIRST..LAST (1-based, inclusive) and writes OUT.json.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from transformers import TrainerCallback

SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpy ")  # .item()/bool() on a device tensor, explicit waits, blocking copies


def summarize(prof, steps: int, top: int = 10) -> dict:
    """Per-step figures of a finished torch.profiler run over `steps` steps."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    per = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731  (ms per step)
    device_time = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    kernels = sorted((e for e in events if device_time(e) > 0), key=device_time, reverse=True)
    out = {"steps": steps,
           "host_syncs_per_step": {k.strip(): sum(e.count for e in events if e.key.startswith(k.strip())) / steps
                                   for k in SYNCS},
           "operators_per_step": sum(e.count for e in events if e.key.startswith("aten::")) / steps}
    if kernels:
        out["top_kernels_ms_per_step"] = [[e.key[:90], per(device_time(e)), e.count // steps] for e in kernels[:top]]
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
        busy, gaps, end = 0.0, [], spans[0][0] if spans else 0.0
        for a, b in spans:
            if a > end:
                gaps.append(a - end)
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        span = (end - spans[0][0]) if spans else 0.0
        out["gpu"] = {"busy_fraction": round(busy / span, 3) if span else None, "idle_ms_per_step": per(span - busy),
                      "gaps_over_1ms_per_step": sum(g > 1e3 for g in gaps) / steps,
                      "longest_gap_ms": round(max(gaps) / 1e3, 2) if gaps else 0.0}
    else:
        cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        out["top_operators_ms_per_step"] = [[e.key[:90], per(e.self_cpu_time_total), e.count // steps]
                                            for e in cpu[:top]]
    return out


class StepProfile(TrainerCallback):
    """Profiles optimizer steps `first`..`last` (1-based) and writes the summary to `out` (the main process)."""

    def __init__(self, out: str, first: int, last: int):
        self.out, self.first, self.last, self.prof = Path(out), first, last, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.first and state.is_world_process_zero:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None and state.global_step == self.last:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.out.write_text(json.dumps({"first_step": self.first, "last_step": self.last,
                                            **summarize(self.prof, self.last - self.first + 1)}, indent=1) + "\n")
            self.prof = None


def main() -> None:
    out, first, last, dash, *rest = sys.argv[1:]
    if dash != "--" or rest[:1] != ["-m"]:
        sys.exit("usage: step_profile.py OUT FIRST LAST -- -m MODULE ARGS...")
    import transformers

    callback = StepProfile(out, int(first), int(last))
    init = transformers.Trainer.__init__

    def with_profile(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(callback)

    transformers.Trainer.__init__ = with_profile
    sys.argv = [rest[1], *rest[2:]]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
