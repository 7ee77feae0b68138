"""CPU expert executor bandwidth: GB/s of expert weights streamed, against memory bandwidth.

Full-size Qwen3.6-35B-A3B expert shape (hidden 2048, moe_intermediate 512, BF16 = 6.3 MB per
expert), top-8 routing over a bank much larger than the last-level cache, so every call
reads its experts from DRAM. Reports, per batch size: the C++ executor, the torch reference
(per-expert loop), and the host's read bandwidth measured on the same bank (torch sum).
    python -m bench.cpu_experts [--experts 512] [--threads 0] [--batches 1,2,4,8,32]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import timeit, write_result
from freetoken.experts.cpu import CpuExpertExecutor, physical_cores
from freetoken.experts.executor import reference_experts


def read_bandwidth(t: torch.Tensor, threads: int) -> float:
    """GB/s of a plain reduction over the bank (what streaming weights could reach)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flat = t.view(-1).view(torch.float32)  # same bytes; fp32 sum vectorises everywhere
        s = timeit(lambda: flat.sum(), warmup=1, iters=5)
    finally:
        torch.set_num_threads(old)
    return t.numel() * t.element_size() / s / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=512, help="experts in the bank (6.3 MB each)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batches", default="1,2,4,8,32")
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    n, h, i, k = a.experts, a.hidden, a.inter, a.top_k
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    gu = (torch.randn(n, 2 * i, h, generator=g) * 0.02).bfloat16()
    dn = (torch.randn(n, h, i, generator=g) * 0.02).bfloat16()
    gen_s = time.perf_counter() - t0
    ex = CpuExpertExecutor(gu, dn, threads=a.threads)
    threads = ex.threads
    per_expert = 3 * h * i * gu.element_size()
    res = {"isa": ex.isa, "threads": threads, "physical_cores": len(physical_cores()),
           "bank_gb": round(n * per_expert / 1e9, 2), "expert_mb": round(per_expert / 1e6, 2),
           "gen_s": round(gen_s, 1), "batches": []}
    for b in [int(x) for x in a.batches.split(",")]:
        calls = []
        for c in range(a.iters + 3):  # fresh routing every call, like decode across layers
            x = torch.randn(b, h, generator=g)
            ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
            calls.append((x, ids, torch.softmax(torch.randn(b, k, generator=g), -1)))
        distinct = sum(len(torch.unique(c[1])) for c in calls[3:]) / a.iters

        def run(fn):
            it = iter(calls)
            return timeit(lambda: fn(*next(it)), warmup=3, iters=a.iters)

        t_cpp = run(ex.kernel)
        # a bf16 model hands over bf16 activations: the VDPBF16PS path where the CPU has it
        t_bf = run(lambda x, ids, w: ex.kernel(x.bfloat16(), ids, w))
        row = {"batch": b, "distinct_experts": round(distinct, 1),
               "cpp_ms": round(t_cpp * 1e3, 3), "cpp_gbs": round(distinct * per_expert / t_cpp / 1e9, 1),
               "cpp_bf16act_ms": round(t_bf * 1e3, 3),
               "cpp_bf16act_gbs": round(distinct * per_expert / t_bf / 1e9, 1)}
        if b <= 32:
            t_ref = run(lambda x, ids, w: reference_experts(x.bfloat16(), ids, w, gu, dn))
            row.update(torch_ms=round(t_ref * 1e3, 3), torch_gbs=round(distinct * per_expert / t_ref / 1e9, 1))
        res["batches"].append(row)
        print(row, flush=True)
    # measured last: torch's OpenMP threads keep spinning after a parallel region and would
    # compete with the executor's pinned threads
    res["host_read_gbs"] = round(read_bandwidth(gu, threads), 1)
    best1 = max(res["batches"][0]["cpp_gbs"], res["batches"][0]["cpp_bf16act_gbs"])
    res["cpp_vs_read_bw_batch1"] = round(best1 / res["host_read_gbs"], 2)
    write_result("cpu_experts", res)


if __name__ == "__main__":
    main()
