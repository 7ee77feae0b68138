"""Two CUDA graphs of GEMMs replayed at the same time on two streams: do they race on a shared
cuBLAS workspace when they were captured on one capture stream?

Why (issue 9, --decode-overlap): torch keys the cuBLAS workspace by (handle, stream), and a
captured GEMM keeps the workspace of its capture stream. Graphs captured without `stream=` all
use torch's one default capture stream, so they share a workspace. Replayed one after the other
on one stream (the interleave) that is harmless. Replayed at once on two streams (the decode
graphs on the overlap's high-priority stream beside the prompt's prefill graphs) both would
write it: wrong results, or, where split-K kernels keep their counters there, a kernel that
spins forever. On the H200 no overlapped 32k row finished (benchmarks/README.md, nineteenth
session). Here, with nothing else: a "decode" graph (a chain of GEMMs of 2 rows) replayed back
to back on a high-priority stream while a "prefill" graph (the same chain over 2,048 rows)
replays on the default stream, each replay's result checked against its eager one on the
device. Per mode (`separate`: each graph on its own capture stream, as DecodeRunner now does;
`shared`: both on the default capture stream), whether both finished within --timeout,
how many replays differed from eager, and the time. A mode that does not finish ends the
process after writing the result (a spinning kernel cannot be stopped), so `shared` runs last.

    python -m bench.graph_race [--hidden 2048] [--layers 8] [--replays 400] [--prefill-replays 100] [--timeout 30]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from bench.common import write_result


def chain(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """x [M, H] through GEMMs [H, H] (each output scaled back to unit size): [M, H]."""
    for w in ws:
        x = x @ w  # [M, H]
    return x


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
    ws = [torch.randn(h, h, device=dev, generator=gen, dtype=torch.bfloat16) / h ** 0.5 for _ in range(a.layers)]
    x_dec = torch.randn(2, h, device=dev, generator=gen, dtype=torch.bfloat16)  # [2, H]
    x_pre = torch.randn(a.rows, h, device=dev, generator=gen, dtype=torch.bfloat16)  # [rows, H]
    ref_dec, ref_pre = chain(x_dec, ws), chain(x_pre, ws)  # eager, before any graph
    out = {}

    def dec():
        out["dec"] = chain(x_dec, ws)

    def pre():
        out["pre"] = chain(x_pre, ws)
    own = mode == "separate"
    g_dec = capture(dec, torch.cuda.Stream() if own else None)
    g_pre = capture(pre, torch.cuda.Stream() if own else None)
    o_dec, o_pre = out["dec"], out["pre"]  # the graphs' static outputs
    bad_dec = torch.zeros((), dtype=torch.int32, device=dev)
    bad_pre = torch.zeros((), dtype=torch.int32, device=dev)
    tol = 0.05  # bf16 rounding of one chain, far below a wrong result's difference
    hi = torch.cuda.Stream(priority=-1)
    hi.wait_stream(torch.cuda.current_stream())
    t0 = time.perf_counter()
    with torch.cuda.stream(hi):  # the decode graph back to back on the high-priority stream
        for _ in range(a.replays):
            g_dec.replay()
            bad_dec.add_(((o_dec.float() - ref_dec.float()).abs().max() > tol).int())
        done_dec = torch.cuda.Event()
        done_dec.record()
    for _ in range(a.prefill_replays):  # meanwhile the prefill graph on the default stream
        g_pre.replay()
        bad_pre.add_(((o_pre.float() - ref_pre.float()).abs().max() > tol).int())
    done_pre = torch.cuda.Event()
    done_pre.record()
    deadline = t0 + a.timeout
    while not (done_dec.query() and done_pre.query()):
        if time.perf_counter() > deadline:
            return {"mode": mode, "finished": False, "timeout_s": a.timeout,
                    "decode_done": done_dec.query(), "prefill_done": done_pre.query()}
        time.sleep(0.001)
    return {"mode": mode, "finished": True, "seconds": round(time.perf_counter() - t0, 3),
            "decode_replays": a.replays, "decode_mismatches": int(bad_dec), "prefill_replays": a.prefill_replays,
            "prefill_mismatches": int(bad_pre)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=2048, help="rows of the prefill graph's GEMMs")
    ap.add_argument("--layers", type=int, default=8, help="GEMMs in each chain")
    ap.add_argument("--replays", type=int, default=400, help="decode graph replays")
    ap.add_argument("--prefill-replays", type=int, default=100, help="prefill graph replays meanwhile")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--modes", default="separate,shared")
    ap.add_argument("--name", default="graph_race")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench.graph_race needs CUDA: nothing to measure here")
        return
    dev = torch.device("cuda")
    rows = []
    for mode in a.modes.split(","):
        rows.append(run_mode(mode, a, dev))
        print(rows[-1], flush=True)
        write_result(a.name, {"hidden": a.hidden, "rows": a.rows, "layers": a.layers, "modes": rows})
        if not rows[-1]["finished"]:
            os._exit(0)  # a kernel spinning on the device: the process cannot end otherwise


if __name__ == "__main__":
    main()
