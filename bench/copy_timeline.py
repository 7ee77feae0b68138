"""Where a streamed prefill pass's time goes between its copy engine and its compute: a device
timeline of one call (torch.profiler's CUDA activity, read from the Chrome trace it exports,
whose copy events carry their byte counts and stream ids).

A double-buffered pass (experts/stream.py) is bound by the larger of its transfer floor (every
expert over PCIe once) and its compute; a pass that takes longer than both plus one layer loses
time to one of three things, which this tells apart:
  - the copies run slower under compute than alone (contention: `gbs_overlapped` against
    `gbs_alone`),
  - the copy engine idles mid-pass (`copy.gaps`: a copy waits for the compute stream to be past
    the region's previous tenant),
  - the compute idles waiting for copies or for the host (`compute.gaps`, each gap labelled by
    whether a copy was running through it and by how much of it passed before the host launched
    the kernel that ends it: `host_ms`, from the runtime calls matched by correlation id).
The window is the whole call profiled (a bench's state reset and the pass's begin and end with
it), so the first and last gaps include that set-up. Each copy row also says how long after its
host call it started (`after_issue_ms`: near 0, the
copy was issued late; more, it waited on the stream for the compute or an earlier copy).

    from bench.copy_timeline import timeline
    row["timeline"] = timeline(lambda: ps.prefill(prompt, st))
"""
from __future__ import annotations

import bisect
import json
import os
import tempfile

GAP_MS = 0.05  # idle stretches shorter than this are launch jitter, not a stall


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged intervals."""
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(a: float, b: float, busy: list[tuple[float, float]]) -> float:
    """Length of [a, b] that the merged intervals `busy` cover."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy if y > a and x < b)


def _gaps(busy: list[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """Idle stretches of [t0, t1] between the merged intervals `busy`."""
    out, t = [], t0
    for a, b in busy:
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t1 > t:
        out.append((t, t1))
    return out


def analyze(events: list[dict], top: int = 12) -> dict:
    """Chrome-trace events (ts / dur in microseconds, `cat` kernel or gpu_memcpy, args.stream,
    args.bytes on copies) -> the summary: wall, the copies (host-to-device ones: busy time, bytes,
    GB/s while busy, alone and under compute, the copy stream's idle gaps), the compute (kernel
    busy time, idle gaps and whether a copy ran through them) and the time both ran."""
    stream = lambda e: e.get("args", {}).get("stream")  # noqa: E731
    kernels = [e for e in events if e.get("cat") == "kernel"]
    k_streams = {stream(e) for e in kernels}
    h2d = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    # the streamed experts' copies: those on streams that run no kernels (the loader's copy stream);
    # small uploads on the compute stream (slot tables) are part of the compute
    copies = [e for e in h2d if stream(e) not in k_streams] or h2d
    # when the host issued each GPU event (its runtime call, matched by correlation id): a copy or
    # kernel that starts right after its call waited for the host, not for the device
    issued = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    issue = lambda e: issued.get(e.get("args", {}).get("correlation"))  # noqa: E731
    if not copies and not kernels:
        return {"events": 0}
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in copies + kernels]
    t0, t1 = min(a for a, _ in spans), max(b for _, b in spans)
    c_busy = _union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in copies])
    k_busy = _union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels])
    ms = lambda us: round(us / 1e3, 3)  # noqa: E731
    total_bytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
    alone = [0, 0.0]  # bytes, us of copies that ran (mostly) with no kernel beside them
    under = [0, 0.0]  # ... and of copies that ran (mostly) under kernels
    rows = []
    for e in sorted(copies, key=lambda e: e["ts"]):
        a, d = e["ts"], e.get("dur", 0)
        n = int(e.get("args", {}).get("bytes", 0))
        share = _covered(a, a + d, k_busy) / d if d > 0 else 0.0
        if share <= 0.1:
            alone[0], alone[1] = alone[0] + n, alone[1] + d
        elif share >= 0.9:
            under[0], under[1] = under[0] + n, under[1] + d
        i = issue(e)
        rows.append({"at_ms": ms(a - t0), "ms": ms(d), "gbs": round(n / d / 1e3, 1) if d > 0 else None,
                     "under_compute": round(share, 2), "after_issue_ms": None if i is None else ms(a - i)})
    c_span = (c_busy[0][0], c_busy[-1][1]) if c_busy else (t0, t0)
    c_gaps = [g for g in _gaps(c_busy, *c_span) if g[1] - g[0] >= GAP_MS * 1e3]
    k_gaps = [g for g in _gaps(k_busy, t0, t1) if g[1] - g[0] >= GAP_MS * 1e3]
    starts = sorted(((e["ts"], issue(e)) for e in kernels), key=lambda p: p[0])  # issue may be None
    start_ts = [ts for ts, _ in starts]
    k_gap_rows, host_us = [], 0.0
    for a, b in k_gaps:
        # the kernel that ends the gap: launched by the host inside the gap, the device waited for the host
        i = bisect.bisect_left(start_ts, b - 1e-3)
        nxt = starts[i][1] if i < len(starts) else None
        late = None if nxt is None else min(max(nxt - a, 0.0), b - a)  # None: no runtime call in the trace
        host_us += late or 0.0
        k_gap_rows.append({"at_ms": ms(a - t0), "ms": ms(b - a), "copy_running": round(_covered(a, b, c_busy) / (b - a), 2),
                           "host_ms": None if late is None else ms(late)})
    gbs = lambda n, us: round(n / us / 1e3, 1) if us > 0 else None  # noqa: E731  bytes per us / 1e3 = GB/s
    c_total = sum(b - a for a, b in c_busy)
    k_total = sum(b - a for a, b in k_busy)
    return {
        "wall_ms": ms(t1 - t0),
        "both_ms": ms(sum(_covered(a, b, k_busy) for a, b in c_busy)),
        "copy": {"n": len(copies), "busy_ms": ms(c_total), "gb": round(total_bytes / 1e9, 3),
                 "gbs_busy": gbs(total_bytes, c_total), "gbs_alone": gbs(*alone), "gbs_overlapped": gbs(*under),
                 "first_ms": ms(c_span[0] - t0), "last_end_ms": ms(c_span[1] - t0),
                 "gaps_ms": ms(sum(b - a for a, b in c_gaps)), "gaps": len(c_gaps),
                 "top_gaps": [{"at_ms": ms(a - t0), "ms": ms(b - a)} for a, b in
                              sorted(c_gaps, key=lambda g: g[0] - g[1])[:top]],
                 "rows": rows},
        "compute": {"kernels": len(kernels), "busy_ms": ms(k_total), "gaps_ms": ms(sum(b - a for a, b in k_gaps)),
                    "gaps": len(k_gaps),
                    "gaps_copy_running_ms": ms(sum(_covered(a, b, c_busy) for a, b in k_gaps)),
                    "gaps_host_ms": ms(host_us),
                    "tail_ms": ms(t1 - c_span[1]),
                    "top_gaps": sorted(k_gap_rows, key=lambda r: -r["ms"])[:top]},
    }


def timeline(fn, top: int = 12, host: bool = False) -> dict:
    """Profile one call of fn (CUDA activity; with host, CPU activity too: the runtime calls date
    each launch, at the price of a slower host, so a host-bound pass looks more host-bound than it
    is: plan 136's 40-layer pass took 1.9 s profiled so against 1.4 unprofiled) -> analyze() of its
    trace, `host` saying which."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host else [ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return {**analyze([e for e in events if e.get("ph") == "X"], top), "host": host}
