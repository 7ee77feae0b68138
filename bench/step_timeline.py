"""Where a replayed decode step's device time goes: a profiler timeline of a few steps, summed.

A CUDA graph's step shows no per-kernel cost in an eager profile (bench.decode.profile_step runs
the step eagerly, with launch gaps a replay does not have). Here the step runs as it is timed
(graph replays, the CPU branch's doorbell in stream order) under the profiler, and the kernels,
copies and memsets the device ran are summed from the exported timeline:
- `busy_us_per_step`: the union of device activity, `wall_us_per_step`: first start to last end;
- `by_name`: device time per kernel name (the top ones), with calls per step;
- `gaps`: idle device time, attributed to the activity that ends the gap (a long gap before the
  merge that follows the CPU branch's wait is time the device waited for the host; gaps before
  small kernels are launch and dependency latency).
Names are cut to 70 characters (Triton and cuBLAS names are long)."""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def device_events(trace: dict) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device activity of a chrome trace, by start."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            out.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e.get("name", "?"))[:70]))
    out.sort()
    return out


def summarize(events: list[tuple[float, float, str]], steps: int, top: int = 20, min_gap_us: float = 1.0) -> dict:
    """events: device_events' list over `steps` steps. Per-step figures (divided by steps)."""
    if not events:
        return {"error": "no device activity in the timeline (the profiler saw no kernels)"}
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    gaps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy = 0.0
    end = events[0][0]  # the union's frontier: activities on several streams overlap
    for s, e, name in events:
        by_name[name][0] += e - s
        by_name[name][1] += 1
        if s > end:
            if s - end >= min_gap_us:
                gaps[name][0] += s - end
                gaps[name][1] += 1
            busy += e - s
        elif e > end:
            busy += e - end
        end = max(end, e)
    wall = end - events[0][0]  # the last to end is not always the last to start

    def rows(d, key):
        ranked = sorted(d.items(), key=lambda kv: -kv[1][0])[:top]
        return [{key: k, "us_per_step": round(v[0] / steps, 1), "per_step": round(v[1] / steps, 1)} for k, v in ranked]
    return {"steps": steps, "wall_us_per_step": round(wall / steps, 1), "busy_us_per_step": round(busy / steps, 1),
            "idle_us_per_step": round((wall - busy) / steps, 1),
            "activities_per_step": round(len(events) / steps, 1),
            "by_name": rows(by_name, "name"), "gaps": rows(gaps, "before")}


def profile_steps(advance, steps: int = 3, sync=None, keep: str | None = None) -> dict:
    """Run advance(i) for i in range(steps) under the profiler (CUDA activity) and summarize the
    device timeline. keep: also write the chrome trace there."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            advance(i)
        if sync is not None:
            sync()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    if keep:
        with open(keep, "w") as f:
            json.dump(trace, f)
    return summarize(device_events(trace), steps)
