"""Does the CPU expert branch overlap the PCIe fills? One MoE layer's worth of work, batch 1,
repeated for `--layers` layers inside one CUDA graph (as a decode step runs it), timed:
  fill    the zero-copy transfer kernel moving q experts into slots
  cpu     the stream-ordered CPU branch (staging copies, host-function node, C++ executor, the
          result back) on c experts
  both    the CPU branch forked first, the fills on the main stream, joined: what a split layer
          does; ideal = max(fill, cpu)
  pre     the fills launched first on a stream of their own, then the fork (is it the launch
          order, or the host node itself, that serializes?)
  serial  the fills, then the CPU branch: the no-overlap bound
and the same eagerly. Qwen3.6-35B-A3B expert shape, random bf16 scratch banks, pinned.

    python -m bench.split_overlap [--q 4] [--c 2,4] [--threads 14] [--layers 12] [--name NAME]
    FREETOKEN_CPU_BRANCH=hostfn python -m bench.split_overlap ...   (the host-function node; the
                                                                     doorbell is the default)
"""
from __future__ import annotations

import argparse

import torch

from bench.common import timeit, write_result
from freetoken.experts.cpu import CpuExpertExecutor
from freetoken.experts.cpu.hostcall import HostBranch
from freetoken.kernels.expert_transfer import transfer_triton
from freetoken.runtime.bw_measure import scratch_banks

H, I, K = 2048, 512, 8


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--q", default="2,4", help="experts filled per layer")
    ap.add_argument("--c", default="2,4,8", help="experts on the CPU per layer")
    ap.add_argument("--threads", type=int, default=14)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=1024, help="scratch bank size (read from DRAM, not cache)")
    ap.add_argument("--name", default="split_overlap", help="result file name (before -gpu.json)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    n = a.experts
    banks = scratch_banks("dense", [("bfloat16", [n, 2 * I, H], "gate_up", "values"),
                                    ("bfloat16", [n, H, I], "down", "values")], pin=True)
    cpu = CpuExpertExecutor(banks, threads=a.threads)
    host = HostBranch(cpu, dev)
    slots = [torch.empty(K, 2 * I, H, dtype=torch.bfloat16, device=dev),
             torch.empty(K, H, I, dtype=torch.bfloat16, device=dev)]
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16) * 0.1  # [1, H]
    w = torch.full((1, K), 1.0 / K, device=dev)  # [1, K]
    g = torch.Generator().manual_seed(0)
    results = []
    for q in [int(v) for v in a.q.split(",")]:
        for c in [int(v) for v in a.c.split(",")]:
            # distinct experts per layer, a different set per layer (DRAM reads, as decode makes)
            perm = [torch.randperm(n, generator=g) for _ in range(a.layers)]
            src = [p[:q].to(torch.int32).to(dev) for p in perm]
            dst = torch.arange(q, dtype=torch.int32, device=dev)
            ids = []
            for p in perm:
                row = torch.full((1, K), -1, dtype=torch.int64)
                row[0, :c] = p[q:q + c]
                ids.append(row.to(dev))
            out = torch.zeros(1, H, device=dev)

            def fill():
                for l in range(a.layers):
                    transfer_triton(banks_host, slots, src[l], dst)

            def cpu_only():
                for l in range(a.layers):
                    out.add_(host.enqueue(x, ids[l], w))
                    host.join()

            def both():
                for l in range(a.layers):
                    r = host.enqueue(x, ids[l], w)
                    transfer_triton(banks_host, slots, src[l], dst)
                    host.join()
                    out.add_(r)

            def pre():  # the fills launched first, on their own stream, then the fork
                for l in range(a.layers):
                    ts.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(ts):
                        transfer_triton(banks_host, slots, src[l], dst)
                    r = host.enqueue(x, ids[l], w)
                    torch.cuda.current_stream().wait_stream(ts)
                    host.join()
                    out.add_(r)

            def serial():
                for l in range(a.layers):
                    transfer_triton(banks_host, slots, src[l], dst)
                    r = host.enqueue(x, ids[l], w)
                    host.join()
                    out.add_(r)

            banks_host = [banks.gate_up, banks.down]
            ts = torch.cuda.Stream()
            row = {"q": q, "c": c, "layers": a.layers, "threads": cpu.threads, "signal": host.signal,
                   "copies": "zero-copy kernels" if host.zero_copy else "copy engine"}
            for name, fn in (("fill", fill), ("cpu", cpu_only), ("both", both), ("pre", pre), ("serial", serial)):
                eager = timeit(fn, warmup=3, iters=20, sync=torch.cuda.synchronize)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fn()
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                replay = timeit(graph.replay, warmup=3, iters=30, sync=torch.cuda.synchronize)
                row[f"{name}_eager_us_per_layer"] = round(eager / a.layers * 1e6, 1)
                row[f"{name}_graph_us_per_layer"] = round(replay / a.layers * 1e6, 1)
            row["ideal_graph_us"] = max(row["fill_graph_us_per_layer"], row["cpu_graph_us_per_layer"])
            print(row, flush=True)
            results.append(row)
    host.check()
    write_result(a.name, {"shape": {"hidden": H, "inter": I, "top_k": K}, "rows": results})


if __name__ == "__main__":
    main()
