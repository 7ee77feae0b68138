"""Paged decode attention on the CPU: the C++ kernel (experts/cpu/attention.h) against the torch
reference it replaced on the CPU path (kernels/paged_attention.py), one layer, batch 1, bf16.

Shapes: a full-attention layer of gpt-oss (8 KV heads of 64, 64 query heads, sinks) and of
Qwen3.6-35B-A3B (2 KV heads of 256, 16 query heads), at each --contexts length; pages of 16
shuffled in the pool. Median of --iters calls; bytes_read is the K and V the call must read, so
gb_s says how close a call is to the machine's memory bandwidth.

  python -m bench.cpu_attention [--contexts 4096,32768] [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import write_result
from freetoken.kernels.paged_attention import paged_decode_attention_cpu, paged_decode_attention_torch

SHAPES = {"gpt-oss": (8, 64, 64, True), "qwen3.6": (2, 256, 16, False)}  # kvh, hd, nh, sinks


def median_s(fn, iters: int) -> float:
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (kvh, hd, nh, has_sinks) in SHAPES.items():
        for ctx in (int(c) for c in a.contexts.split(",")):
            p = 16
            pages = ctx // p + 2
            kp = torch.randn(pages, kvh, p, hd, generator=g).bfloat16()
            vp = torch.randn(pages, kvh, p, hd, generator=g).bfloat16()
            table = (torch.randperm(pages - 1, generator=g) + 1).int()[None]  # [1, W] shuffled pages
            q = torch.randn(1, nh, hd, generator=g).bfloat16()
            lens = torch.tensor([ctx], dtype=torch.int32)
            sinks = torch.randn(nh, generator=g) if has_sinks else None
            cpp = median_s(lambda: paged_decode_attention_cpu(q, kp, vp, table, lens, hd ** -0.5, None, sinks), a.iters)
            ref = median_s(lambda: paged_decode_attention_torch(q, kp, vp, table, lens, hd ** -0.5, None, sinks),
                           a.iters)
            read = 2 * ctx * kvh * hd * 2
            rows.append({"shape": name, "context": ctx, "cpp_ms": round(1e3 * cpp, 2), "torch_ms": round(1e3 * ref, 2),
                         "speedup": round(ref / cpp, 2), "bytes_read": read, "cpp_gb_s": round(read / cpp / 1e9, 2)})
            print(rows[-1], flush=True)
    write_result("cpu_attention", {"threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
