"""Two CUDA graphs of GEMMs replayed at the same time on two streams: do they race on a shared
cuBLAS workspace when they were captured on one capture stream?

Why (issue 9, --decode-overlap): torch keys the cuBLAS workspace by (handle, stream), and a
captured GEMM keeps the workspace of its capture stream. Graphs captured without `stream=` all
use torch's one default capture stream, so they share a workspace. Replayed one after the other
on one stream (the interleave) that is harmless. Replayed at once on two streams (the decode
graphs on the overlap's high-priority stream beside the prompt's prefill graphs) both would
write it: wrong results, or, where split-K kernels keep their counters there, a kernel that
spins forever. On the H200 no overlapped 32k row finished (benchmarks/README.md, nineteenth
session). Here, with nothing else:
- a "decode" graph: a chain of MLP-shaped GEMM pairs over 2 rows ([2, H] @ [H, 4H], then
  [2, 4H] @ [4H, H]: a long K at a small M, where cuBLAS likes split-K), replayed back to back
  on a high-priority stream;
- a "prefill" graph: the same chain over --rows rows (256 by default: few output tiles, split-K
  again), replayed meanwhile on the default stream.
Each graph ends by comparing its result with the eager one, on the device, inside the graph (one
launch a replay; a NaN counts as a mismatch), and both streams are held behind a device sleep
until both queues are full, so the replays do overlap (the overlap in ms is in the result).
Per mode (`separate`: each graph on its own capture stream, as the engine's graph families now
are, runtime/capture_stream.py; `shared`: both on torch's default capture stream): whether both
finished within --timeout, mismatching replays and the largest difference, the time, and the
kernels each chain ran (split-K ones are what would use the workspace). A result saying
"finished": false is written before each mode runs; a mode that hangs ends the process (exit
status 3) with that result in place (a spinning kernel cannot be stopped), so `shared` runs last.

    python -m bench.graph_race [--hidden 2048] [--rows 256] [--layers 8] [--replays 400]
        [--prefill-replays 100] [--timeout 30]
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import time

import torch

from bench.common import write_result


def chain(x: torch.Tensor, ws: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """x [M, H] through GEMM pairs (up [H, 4H], down [4H, H]): [M, H]."""
    for up, down in ws:
        x = (x @ up) @ down  # [M, 4H] -> [M, H]
    return x


def kernels(fn) -> list[str]:
    """The CUDA kernels one call of fn runs (names, deduplicated)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return sorted(n[:120] for n in names)


class Checked:
    """A chain on static input rows, compared with its eager result on the device: `bad` counts
    replays whose largest difference was not within tol (NaN included), `worst` keeps the
    largest difference seen."""

    def __init__(self, x: torch.Tensor, ws, tol: float):
        self.x, self.ws = x, ws
        self.ref = chain(x, ws).float()  # eager, before any graph
        self.tol = tol * float(self.ref.abs().max())
        self.bad = torch.zeros((), dtype=torch.int32, device=x.device)
        self.worst = torch.zeros((), dtype=torch.float32, device=x.device)

    def __call__(self) -> None:
        d = (chain(self.x, self.ws).float() - self.ref).abs().max()
        self.bad.add_((~(d <= self.tol)).int())
        self.worst.copy_(torch.maximum(self.worst, torch.nan_to_num(d, nan=float("inf"))))

    def reset(self) -> None:
        self.bad.zero_()
        self.worst.zero_()


def capture(fn, stream: torch.cuda.Stream | None) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (cuBLAS picks its kernels)
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g


def run_mode(mode: str, a, dev) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    h = a.hidden
    bf = torch.bfloat16
    ws = [(torch.randn(h, 4 * h, device=dev, generator=gen, dtype=bf) / h ** 0.5,
           torch.randn(4 * h, h, device=dev, generator=gen, dtype=bf) / (4 * h) ** 0.5) for _ in range(a.layers)]
    dec = Checked(torch.randn(2, h, device=dev, generator=gen, dtype=bf), ws, a.tol)  # [2, H]
    pre = Checked(torch.randn(a.rows, h, device=dev, generator=gen, dtype=bf), ws, a.tol)  # [rows, H]
    names = {"decode_kernels": kernels(lambda: chain(dec.x, ws)), "prefill_kernels": kernels(lambda: chain(pre.x, ws))}
    own = mode == "separate"
    g_dec = capture(dec, torch.cuda.Stream() if own else None)
    g_pre = capture(pre, torch.cuda.Stream() if own else None)
    dec.reset()
    pre.reset()
    torch.cuda.synchronize()
    main, hi = torch.cuda.current_stream(), torch.cuda.Stream(priority=-1)
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record(main)
    hi.wait_stream(main)
    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("dec_start", "dec_end", "pre_start", "pre_end")}
    gate = int(a.gate_ms * 1e6)  # cycles at ~1 GHz and more: both queues fill before either runs
    with torch.cuda.stream(hi):  # the decode graph back to back on the high-priority stream
        torch.cuda._sleep(gate)
        ev["dec_start"].record()
        for _ in range(a.replays):
            g_dec.replay()
        ev["dec_end"].record()
    torch.cuda._sleep(gate)  # meanwhile the prefill graph on the default stream
    ev["pre_start"].record(main)
    for _ in range(a.prefill_replays):
        g_pre.replay()
    ev["pre_end"].record(main)
    start = time.perf_counter()
    while not (ev["dec_end"].query() and ev["pre_end"].query()):
        if time.perf_counter() - start > a.timeout:
            return {"mode": mode, "finished": False, "timeout_s": a.timeout, **names,
                    "decode_done": ev["dec_end"].query(), "prefill_done": ev["pre_end"].query()}
        time.sleep(0.001)
    ms = {k: t0.elapsed_time(e) for k, e in ev.items()}
    overlap = min(ms["dec_end"], ms["pre_end"]) - max(ms["dec_start"], ms["pre_start"])
    return {"mode": mode, "finished": True, "seconds": round(time.perf_counter() - start, 3),
            "decode_ms": round(ms["dec_end"] - ms["dec_start"], 2), "prefill_ms": round(ms["pre_end"] - ms["pre_start"], 2),
            "overlap_ms": round(overlap, 2),
            "decode_replays": a.replays, "decode_mismatches": int(dec.bad), "decode_max_diff": float(dec.worst),
            "prefill_replays": a.prefill_replays, "prefill_mismatches": int(pre.bad), "prefill_max_diff": float(pre.worst),
            **names}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=256, help="rows of the prefill graph's GEMMs")
    ap.add_argument("--layers", type=int, default=8, help="GEMM pairs in each chain")
    ap.add_argument("--replays", type=int, default=400, help="decode graph replays")
    ap.add_argument("--prefill-replays", type=int, default=100, help="prefill graph replays meanwhile")
    ap.add_argument("--tol", type=float, default=0.02, help="a mismatch: a difference past this share of the "
                    "result's largest value (graph and eager run the same kernels: normally exactly 0)")
    ap.add_argument("--gate-ms", type=float, default=50.0, help="device sleep holding both streams at the start")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--modes", default="separate,shared")
    ap.add_argument("--name", default="graph_race")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench.graph_race needs CUDA: nothing to measure here")
        return
    dev = torch.device("cuda")
    rows = []
    meta = {"hidden": a.hidden, "rows": a.rows, "layers": a.layers}
    for mode in a.modes.split(","):
        # in place before the mode runs: a hang that blocks the host in a launch still leaves it
        write_result(a.name, {**meta, "modes": rows + [{"mode": mode, "finished": False, "note": "did not return"}]})
        faulthandler.dump_traceback_later(a.timeout + 30, exit=True)  # a host blocked in a launch: out
        rows.append(run_mode(mode, a, dev))
        faulthandler.cancel_dump_traceback_later()
        print(rows[-1], flush=True)
        write_result(a.name, {**meta, "modes": rows})
        if not rows[-1]["finished"]:
            os._exit(3)  # a kernel spinning on the device: the process cannot end otherwise


if __name__ == "__main__":
    main()
