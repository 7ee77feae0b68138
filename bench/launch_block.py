"""What holds the host in the first launch after a decode graph (issue 9).

On the H200 an interleaved prompt's first attention layer after a decode step holds the host
3.6-7 ms in one line, its q/k/v projection's F.linear (bench/line_trace.py, device plan 55),
about the decode step's device time, while the same line in the later attention layers, and the
graphed DeltaNet layers after a step, never take 1 ms. Here, with nothing else: the device kept
busy (`--busy-ms` of sleep, the prompt layers queued before the step), a decode-shaped graph
(`--layers` of [2, H] GEMMs with elementwise work between them) replayed, then one probe launch
whose host time is measured, and whether the decode graph had finished on the device when the
probe returned (the host waited for it). Cases:
  linear-after-graph    F.linear on the same stream, right after the graph (what the prompt does)
  add-after-graph       an elementwise kernel instead (is it cuBLAS, or any launch)
  graph-after-graph     a small graph's replay instead (the graphed layers after a step)
  linear-after-side     the graph on a high-priority side stream, the main stream waiting on it
                        through an event (device-side; the launch queues differ)
  linear-no-graph       no decode graph: the probe's host time behind the busy device alone
  linear-new-rows       no decode graph, the probe GEMM at a row count it has not met before
                        (a prompt chunk's T: new at almost every forward)
  linear-padded-rows    the same through model.linear.linear, its rows padded to a multiple of
                        ROW_GRANULE, after warm_gemm_rows

    python -m bench.launch_block [--hidden 2048] [--layers 40] [--busy-ms 3] [--reps 40]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import write_result
from bench.graph_race import capture  # warm-up on a side stream, then the capture


def decode_like(x: torch.Tensor, ws) -> torch.Tensor:
    """x [2, H] through `len(ws)` layers: a norm, an up and down GEMM, a gated activation."""
    for up, down in ws:
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        g, u = (h @ up).chunk(2, dim=-1)  # [2, I] each
        x = x + (F.silu(g) * u) @ down
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024, help="the decode graph's MLP width")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--rows", type=int, default=1024, help="the probe GEMM's rows (a prompt chunk)")
    ap.add_argument("--busy-ms", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--name", default="launch_block")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench.launch_block needs CUDA: nothing to measure here")
        return
    dev, bf = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    h = a.hidden
    ws = [(torch.randn(h, 2 * a.inter, device=dev, dtype=bf, generator=gen) / h ** 0.5,
           torch.randn(a.inter, h, device=dev, dtype=bf, generator=gen) / a.inter ** 0.5) for _ in range(a.layers)]
    xd = torch.randn(2, h, device=dev, dtype=bf, generator=gen)
    g_dec = capture(lambda: decode_like(xd, ws), torch.cuda.Stream())
    xp = torch.randn(a.rows, h, device=dev, dtype=bf, generator=gen)  # [rows, H]
    wp = torch.randn(3 * h, h, device=dev, dtype=bf, generator=gen) / h ** 0.5  # a q/k/v projection
    g_small = capture(lambda: F.linear(xp, wp), torch.cuda.Stream())
    for _ in range(3):  # the probes' own first calls out of the way
        F.linear(xp, wp)
        xp.add_(0)
        g_small.replay()
    torch.cuda.synchronize()
    # the decode graph's device time alone
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        g_dec.replay()
    t1.record()
    torch.cuda.synchronize()
    decode_ms = t0.elapsed_time(t1) / 10
    side = torch.cuda.Stream(priority=-1)
    cycles = int(a.busy_ms * 1.7e6)  # ~1.7-2 GHz: about busy_ms of device sleep
    probes = {"linear": lambda: F.linear(xp, wp), "add": lambda: xp.add_(0), "graph": g_small.replay}
    cases = {"linear-after-graph": ("linear", "same"), "add-after-graph": ("add", "same"),
             "graph-after-graph": ("graph", "same"), "linear-after-side": ("linear", "side"),
             "linear-no-graph": ("linear", None)}
    rows = []
    for name, (probe, where) in cases.items():
        host, done = [], 0
        for _ in range(a.reps):
            torch.cuda.synchronize()
            main = torch.cuda.current_stream()
            torch.cuda._sleep(cycles)  # the prompt's layers queued before the step
            end = torch.cuda.Event()
            if where == "same":
                g_dec.replay()
                end.record()
            elif where == "side":
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    g_dec.replay()
                    end.record()
                main.wait_event(end)
            else:
                end.record()
            s = time.perf_counter()
            probes[probe]()
            host.append((time.perf_counter() - s) * 1e3)
            done += bool(end.query())  # the step had finished when the probe returned: it waited
        rows.append({"case": name, "probe_host_ms_p50": round(statistics.median(host), 3),
                     "probe_host_ms_max": round(max(host), 3), "step_done_at_return": done, "reps": a.reps})
        print(rows[-1], flush=True)
    from freetoken.model import linear as lin
    for name, fn in (("linear-new-rows", F.linear), ("linear-padded-rows", lin.linear)):
        if fn is lin.linear:
            lin.linear(xp[:100], wp)  # the weight seen, then every padded row count through it
            lin.warm_gemm_rows(a.rows)
            torch.cuda.synchronize()
        host = []
        for r in range(a.reps):
            # row counts neither case met before (while 7 * reps stays under rows / 2)
            m = a.rows // 2 + (7 * r + (3 if fn is lin.linear else 1)) % (a.rows // 2)
            torch.cuda.synchronize()
            s = time.perf_counter()
            fn(xp[:m], wp)
            host.append((time.perf_counter() - s) * 1e3)
        rows.append({"case": name, "probe_host_ms_p50": round(statistics.median(host), 3),
                     "probe_host_ms_max": round(max(host), 3), "reps": a.reps})
        print(rows[-1], flush=True)
    write_result(a.name, {"hidden": h, "layers": a.layers, "rows": a.rows, "busy_ms": a.busy_ms,
                          "decode_graph_ms": round(decode_ms, 3), "cases": rows})


if __name__ == "__main__":
    main()
