"""Run time of the expert cache's control kernel per decode call, by warps and scan block size.

A replayed 40-layer cache step spent 1.1 ms in `_control_kernel`, 27 us a call (plan 78's
timelines, benchmarks/README.md): one program scans every slot of the pool for the K oldest
in chunks of BLOCK_S, a top-k per chunk. Here one call per MoE layer runs in a CUDA graph (as in
the decode step) on a full pool in its steady state, fresh routes each replay, for each
(num_warps, block_s) pair; device time per call from CUDA events over the replays.
The replays cycle through --route-sets sets of random routes: plan 79's rows cycled through
4, whose 1,280 experts all fit the 3,840 slots, so after the first cycle every call was all
hits and no fills (the served step misses ~56%). Each row reports the miss rate it ran at,
from the kernel's own running counts (acc).
--thrash-mb M: a kernel between every two control calls that reads and writes M MB (as the
step's ~30 other kernels a layer do, the experts' reads among them), so each call starts with
the residency and, likely, its own code out of the L2; the same graph of those kernels alone
is timed and subtracted. In the served step the kernel took 29.9 us a call against 18 here
without it (plans 82 and 89, benchmarks/README.md): whether a cold cache is the difference.
    python -m bench.control_speed --layers 40 --experts 256 --slots 3840 --pairs 8,32
"""
from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import write_result
from bench.expert_cache import capture
from freetoken.experts.control import (Residency, control_triton, control_warps, fill_cap, fill_pad,
                                       pair_bucket)


def routes(layers: int, experts: int, tokens: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[L, T, k] flat ids: per token k distinct experts of its layer."""
    r = torch.rand(layers, tokens, experts, generator=g).argsort(-1)[..., :k]  # [L, T, k]
    return r + (torch.arange(layers) * experts).view(-1, 1, 1)


def time_config(a, pairs: int, warps: int | None, block_s: int | None, dev) -> dict:
    k = 8 if pairs % 8 == 0 else 1
    t = pairs // k
    n_flat = a.layers * a.experts
    res = Residency.empty(n_flat, a.slots, dev)
    share = torch.full((1,), a.share, dtype=torch.float32, device=dev)
    cap, pad = fill_cap(pairs, a.experts, a.slots), fill_pad(pairs, a.experts, a.slots)
    g = torch.Generator().manual_seed(0)
    ids = routes(a.layers, a.experts, t, k, g).to(dev)  # [L, T, k], rewritten before each replay
    w = torch.rand(a.layers, t, k, generator=g).to(dev, torch.bfloat16)
    acc = torch.zeros(5, dtype=torch.int64, device=dev)  # the statistics the cache adds to in each call
    run = lambda l: control_triton(ids[l], w[l], res, share, cap, a.policy, block_s=block_s, acc=acc,  # noqa: E731
                                   num_warps=warps, k_pad=pad)
    for _ in range(a.fill_steps):  # the pool full and its stamps spread, as in a served decode
        ids.copy_(routes(a.layers, a.experts, t, k, g).to(dev))
        for l in range(a.layers):
            run(l)
    torch.cuda.synchronize()
    thrash = None
    if a.thrash_mb > 0:
        buf = torch.ones(int(a.thrash_mb * 2 ** 20) // 4, device=dev)  # [M MB / 4] f32
        thrash = lambda: buf.mul_(1.0)  # noqa: E731  reads and writes every byte: the L2 holds none of the control's
    replay = capture(lambda: [(run(l), thrash and thrash()) for l in range(a.layers)], dev)  # one step's calls
    n = a.route_sets
    fresh = routes(a.layers * n, a.experts, t, k, g).view(n, a.layers, t, k)  # [n, L, T, k], ids of layer l
    fresh = (fresh - (torch.arange(n) * a.layers * a.experts).view(-1, 1, 1, 1)).to(dev)  # each set's own layers
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(3):
        ids.copy_(fresh[i % n])
        replay()
    acc.zero_()
    start.record()
    for i in range(a.iters):
        ids.copy_(fresh[(i + 3) % n])  # a copy kernel per replay, timed with it (~2 us, said in the row)
        replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / a.iters
    thrash_us = 0.0
    if thrash is not None:  # the thrash kernels alone, in the same graph shape, subtracted
        alone = capture(lambda: [thrash() for _ in range(a.layers)], dev)
        start.record()
        for _ in range(a.iters):
            alone()
        end.record()
        torch.cuda.synchronize()
        thrash_us = start.elapsed_time(end) * 1e3 / a.iters
        us -= thrash_us
    calls, live, hits, fills, cpu = acc.tolist()
    misses = fills + cpu  # distinct experts per call not in a slot
    return {"pairs": pairs, "p_pad": pair_bucket(pairs), "k_pad": pad, "num_warps": warps or control_warps(pair_bucket(pairs)),
            "block_s": block_s or "default", "us_per_step": round(us, 1), "us_per_call": round(us / a.layers, 2),
            "default": warps is None and block_s is None,
            "miss_rate": round(misses / max(1, hits + misses), 3), "fills_per_call": round(fills / max(1, calls), 2),
            "thrash_mb": a.thrash_mb, "thrash_us_per_step": round(thrash_us, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slots", type=int, default=3840)
    ap.add_argument("--pairs", default="8,32", help="pairs per call (batch x top-k), comma-separated")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--blocks", default="256,512,1024,4096", help="scan block sizes (powers of two)")
    ap.add_argument("--policy", default="recent")
    ap.add_argument("--share", type=float, default=0.7)
    ap.add_argument("--fill-steps", type=int, default=30)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--route-sets", type=int, default=64, help="sets of routes the replays cycle through (enough "
                    "that the pool cannot hold them all: a served step's misses)")
    ap.add_argument("--thrash-mb", type=float, default=0.0, help="MB a kernel between control calls reads and "
                    "writes (0: none): each call then starts with a cold L2, as in the served step")
    ap.add_argument("--name", default="control_speed")
    a = ap.parse_args()
    if a.route_sets < 1:
        ap.error("--route-sets: at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("bench.control_speed times the Triton kernel on a CUDA device")
    dev = torch.device("cuda")
    rows = []
    for pairs in (int(p) for p in a.pairs.split(",")):
        configs = [(None, None)] + list(itertools.product((int(x) for x in a.warps.split(",")),
                                                          (int(x) for x in a.blocks.split(","))))
        for warps, block in configs:
            try:
                row = time_config(a, pairs, warps, block, dev)
            except Exception as e:  # noqa: BLE001  a variant that does not compile says why; the rest run
                row = {"pairs": pairs, "num_warps": warps, "block_s": block, "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            print(row, flush=True)
            # after every row: each variant compiles for seconds, and a run stopped by its time
            # limit keeps what it measured (plan 79's lost its JSON so)
            write_result(a.name, {"layers": a.layers, "experts": a.experts, "slots": a.slots, "policy": a.policy,
                                  "share": a.share, "route_sets": a.route_sets, "thrash_mb": a.thrash_mb,
                                  "note": "device time of one replayed graph of one control call per layer, plus "
                                  "one ids copy kernel per replay", "rows": rows}, quiet=True)


if __name__ == "__main__":
    main()
