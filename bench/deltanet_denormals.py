"""The gated DeltaNet chunk rule on the CPU with and without flush-to-zero on every thread
(experts/cpu/denormals.h): gates drawn from -U(0, s), so a 64-token chunk's cumulative log-decay
reaches about -32 s and, past s ~ 2.7, its decays' products are fp32 denormals.

    python -m bench.deltanet_denormals [--tokens 512] [--scales 1,2,3.3,5,10] [--threads 2]

Each row: ms of the plain call (IEEE denormals on torch's OpenMP workers), ms inside `flushed`,
and the largest difference of their outputs (medians of --reps calls). Results: benchmarks/results/deltanet_denormals-cpu.json.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import timeit, write_result
from freetoken.experts.cpu import extension
from freetoken.experts.cpu.denormals import flushed
from freetoken.model.deltanet import chunk_gated_delta_rule


def inputs(tokens: int, heads: int, d: int, scale: float, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(tokens, heads, d, generator=g), dim=-1) * d ** -0.5  # [T, Hv, dk]
    k = F.normalize(torch.randn(tokens, heads, d, generator=g), dim=-1)  # [T, Hv, dk]
    v = torch.randn(tokens, heads, d, generator=g)  # [T, Hv, dv]
    decay = -torch.rand(tokens, heads, generator=g) * scale  # [T, Hv] log-decay per token
    beta = torch.rand(tokens, heads, generator=g)  # [T, Hv]
    return q, k, v, decay, beta, torch.zeros(heads, d, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32, help="value heads (the Qwen3.6 shape: 32 of 128)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--scales", default="1,2,3.3,5,10")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--name", default="deltanet_denormals")
    a = ap.parse_args()
    if extension() is None:
        raise SystemExit("bench.deltanet_denormals needs the C++ extension (experts/cpu), which could not be built")
    torch.set_num_threads(a.threads)
    cpu = torch.device("cpu")
    rows = []
    for s in (float(x) for x in a.scales.split(",")):
        x = inputs(a.tokens, a.heads, a.dim, s)

        def flushed_call():
            with flushed(cpu):
                return chunk_gated_delta_rule(*x)
        plain, flush = (round(timeit(f, warmup=1, iters=a.reps) * 1e3, 1)
                       for f in (lambda: chunk_gated_delta_rule(*x), flushed_call))
        diff = float((chunk_gated_delta_rule(*x)[0] - flushed_call()[0]).abs().max())
        row = {"gate_scale": s, "plain_ms": plain, "flushed_ms": flush, "speedup": round(plain / flush, 2),
               "max_abs_diff": diff}
        print(row, flush=True)
        rows.append(row)
    write_result(a.name, {"tokens": a.tokens, "heads": a.heads, "dim": a.dim, "threads": a.threads, "rows": rows})


if __name__ == "__main__":
    main()
