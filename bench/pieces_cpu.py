"""The CPU side of expert pieces (experts/pieces.py): what the C++ executor reads per second when
the same experts come as whole experts or as their pieces.

With --expert-pieces the cache's CPU branch gets pieces, not experts: a Mixtral-sized expert (hidden
4096, intermediate 14336, 352 MB in bf16) cut into p pieces is p calls' worth of smaller experts
(I/p intermediate rows each) in one call. This measures, batch 1, one call of top-k experts
(distinct, a bank larger than the last-level cache, so every byte comes from DRAM):
  whole      the k experts, as the executor over the whole banks gets them
  pieces     all k x p pieces of the same experts (the same bytes) over the cut banks
  half       half of those pieces (what the CPU branch computes at a fill share of 0.5)
GB/s counts the expert bytes read; the output of `pieces` equals `whole`'s (checked each run).
`cut_s` / `cut_gbs`: the in-place re-layout of the whole bank into that many pieces (from the last).
    python -m bench.pieces_cpu [--hidden 4096] [--inter 14336] [--experts 12] [--top-k 2]
                               [--pieces 2,4,8] [--threads 0] [--iters 9]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import timeit, write_result
from freetoken.experts.cpu import CpuExpertExecutor, extension
from freetoken.experts.pieces import expand_routes, split_banks_


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--experts", type=int, default=12, help="experts in the bank (a call reads --top-k of them)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--pieces", default="2,4,8", help="piece counts, each dividing the next (the banks are cut in place)")
    ap.add_argument("--threads", type=int, default=0, help="executor threads (0: the physical cores)")
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--name", default="pieces_cpu")
    a = ap.parse_args()
    if extension() is None:
        raise SystemExit("bench.pieces_cpu needs the C++ expert executor (it could not be built here)")
    n, h, i, k = a.experts, a.hidden, a.inter, a.top_k
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(n, 2 * i, h, generator=g) * h ** -0.5).to(torch.bfloat16)  # [N, 2I, H]
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(torch.bfloat16)  # [N, H, I]
    expert_bytes = (gu[0].numel() + dn[0].numel()) * 2
    x = torch.randn(1, h, generator=g)  # [1, H]
    w = torch.softmax(torch.randn(1, k, generator=g), -1)  # [1, k]
    # a different set of experts each call, round robin, so no call finds its bytes in cache
    sets = [torch.arange(j * k, (j + 1) * k)[None] % n for j in range(max(1, n // k))]  # [1, k] each
    turn = [0]

    def ids():
        turn[0] = (turn[0] + 1) % len(sets)
        return sets[turn[0]]

    whole = CpuExpertExecutor(gu, dn, threads=a.threads)
    ref = whole(x, sets[0], w)
    # a first timing is dropped (warmup=iters): the first row ran slower in every run
    rows = [{"layout": "whole", "pieces": 1, "experts_read": k,
             "gbs": round(k * expert_bytes / timeit(lambda: whole(x, ids(), w), a.iters + 1, a.iters) / 1e9, 2)}]
    print(rows[-1], flush=True)
    del whole
    cut = 1
    for p in [int(v) for v in a.pieces.split(",")]:
        if p % cut:
            raise SystemExit(f"--pieces {a.pieces}: each value must divide the next")
        t0 = time.perf_counter()
        gu, dn = split_banks_(gu, dn, p // cut)  # in place: what the engine does at load
        cut_s = time.perf_counter() - t0
        cut = p
        ex = CpuExpertExecutor(gu, dn, threads=a.threads)
        got = ex(x, *expand_routes(sets[0], w, p))
        err = float((got - ref).abs().max() / ref.abs().max())
        t_all = timeit(lambda: ex(x, *expand_routes(ids(), w, p)), 1, a.iters)
        half = (k * p) // 2

        def half_call():
            pid, pw = expand_routes(ids(), w, p)
            return ex(x, pid[:, :half], pw[:, :half])
        t_half = timeit(half_call, 1, a.iters)
        rows.append({"layout": "pieces", "pieces": p, "experts_read": k, "rel_err_vs_whole": err,
                     "cut_s": round(cut_s, 3), "cut_gbs": round(n * expert_bytes / cut_s / 1e9, 2),
                     "gbs": round(k * expert_bytes / t_all / 1e9, 2)})
        rows.append({"layout": "half", "pieces": p, "pieces_read": half,
                     "gbs": round(half * expert_bytes / p / t_half / 1e9, 2)})
        print(rows[-2], rows[-1], flush=True)
        del ex
    write_result(a.name, {"hidden": h, "inter": i, "experts": n, "top_k": k, "expert_mb": round(expert_bytes / 1e6, 1),
                          "threads": a.threads or "physical cores", "rows": rows})


if __name__ == "__main__":
    main()
