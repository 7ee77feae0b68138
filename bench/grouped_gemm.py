"""Routed experts of a long prefill on the GPU: our Triton grouped kernel against torch's grouped GEMM.

A 32k streamed pass (issue 11) is compute-bound on the GPU machine: the 12-layer slice's pass
computes for 0.46-0.51 s against a 0.391 s transfer floor. Its routed experts are about a quarter
of its FLOPs, run by kernels/moe_grouped.py (pairs sorted by expert, tiles of 64 pairs, one
program per tile and column block). torch ships a grouped GEMM (`torch._grouped_mm`, CUTLASS on
sm90) that takes the pairs sorted by expert with the group ends as offsets: this measures both
on the full-size Qwen3.6-35B-A3B expert shape (hidden 2048, moe_intermediate 512, 256 experts,
top-8, bf16) at a pass's sub-chunk sizes, device time per call from CUDA events over several
calls, TFLOP/s of the routed FLOPs (3 GEMMs of 2 x H x I per pair), and each path's error
against the torch reference (max error over the output's max). kernels/moe_grouped.py's
`moe_grouped_mm` is the torch path as the engine would run it (the gather of the pairs' rows,
the two grouped GEMMs, the activation, the weighted sum in the Triton path's order). On an H100
it ran at 0.63-0.8x the Triton kernel's speed (results/grouped_gemm-h100-gpu.json): the engine
keeps the Triton kernel.
Rows `triton` (the engine's tiles: 64 pairs for a prefill chunk) and `triton_m128` (tiles of 128
pairs, 8 warps, 3-4 pipeline stages: the option for a long pass's sub-chunks), `m128_over_m64`.
    python -m bench.grouped_gemm [--tokens 2048,8192,32768] [--experts 256] [--reps 10]
"""
from __future__ import annotations

import argparse
import functools

import torch

from bench.common import write_result
from freetoken.experts.executor import reference_experts


def device_seconds(fn, reps: int) -> float:
    """Device time per call: a warm-up call (compiles, autotunes), then reps calls between events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def routes(t: int, n: int, k: int, gen: torch.Generator, dev):
    """ids [t, k] distinct experts a token (uniform, as a random router gives), weights [t, k]."""
    ids = torch.rand(t, n, generator=gen, device=dev).topk(k, dim=-1).indices
    w = torch.softmax(torch.randn(t, k, generator=gen, device=dev), -1)
    return ids, w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192,32768", help="tokens per call (a pass's expert sub-chunks)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--name", default="grouped_gemm")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.grouped_gemm measures CUDA kernels: no GPU here")
    from freetoken.kernels.moe_grouped import moe_grouped_mm, moe_grouped_triton
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n, h, i, k = a.experts, a.hidden, a.inter, a.top_k
    gu = (torch.randn(n, 2 * i, h, generator=gen, device=dev) * h ** -0.5).to(torch.bfloat16)
    dn = (torch.randn(n, h, i, generator=gen, device=dev) * i ** -0.5).to(torch.bfloat16)
    rows = []
    for t in (int(s) for s in a.tokens.split(",")):
        x = torch.randn(t, h, generator=gen, device=dev).to(torch.bfloat16)
        ids, w = routes(t, n, k, gen, dev)
        flop = 3 * 2 * h * i * t * k
        ref = reference_experts(x[:512], ids[:512], w[:512], gu, dn).float()  # the reference on the first rows
        row = {"tokens": t, "pairs": t * k, "gflop": round(flop / 1e9, 1)}
        m128 = functools.partial(moe_grouped_triton, block_m=128)  # tiles of 128 pairs, 8 warps, deeper pipeline
        for name, fn in (("triton", moe_grouped_triton), ("triton_m128", m128), ("grouped_mm", moe_grouped_mm)):
            try:
                out = fn(x, ids, w, gu, dn, n)
                err = float((out[:512].float() - ref).abs().max() / ref.abs().max())
                s = device_seconds(lambda: fn(x, ids, w, gu, dn, n), a.reps)
                row[name] = {"ms": round(s * 1e3, 3), "tflops": round(flop / s / 1e12, 1), "rel_err": round(err, 5)}
            except Exception as e:  # a path this torch or GPU lacks: said, the other row still stands
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if "ms" in row["triton"] and "ms" in row["grouped_mm"]:
            row["triton_over_grouped_mm"] = round(row["triton"]["ms"] / row["grouped_mm"]["ms"], 2)
        if "ms" in row["triton"] and "ms" in row["triton_m128"]:
            row["m128_over_m64"] = round(row["triton_m128"]["ms"] / row["triton"]["ms"], 2)
        rows.append(row)
        print(row, flush=True)
    write_result(a.name, {"shape": {"experts": n, "hidden": h, "inter": i, "top_k": k, "dtype": "bfloat16"},
                          "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
