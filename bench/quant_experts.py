"""GPU routed experts on quantized banks: the Triton kernels of kernels/moe_quant.py (decode GEMV,
grouped prefill GEMM, dequantizing in registers) against the bf16 kernels, GB/s of expert bytes.

Full-size Qwen3.6-35B-A3B expert shape (hidden 2048, moe_intermediate 512, 256 experts, top-8):
one layer's bank, larger than the L2 in every format, random as bench/cpu_experts.py makes it
(fp8_block 3.2 MB an expert, mxfp4 1.67 MB, nvfp4 1.77 MB, bf16 6.3 MB). Times are device time:
R calls with fresh routing each (as R layers of a decode step) captured in one CUDA graph and
replayed, so launch overhead is out of it as in the engine's decode graphs; per call = replay / R.
GB/s counts the bytes of the distinct experts a call reads (values and scales); for a prefill
chunk that is every expert it touches, once (the kernel may read a weight tile more than once:
the figure is what the bank costs, not traffic). Each configuration is also checked once
against its torch reference (max error relative to the output's max), reported as rel_err.
    python -m bench.quant_experts [--formats bf16,fp8_block,mxfp4,nvfp4] [--batches 1,4]
                                  [--chunks 512,2048] [--calls 16] [--reps 20]
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import write_result
from bench.cpu_experts import quantized_banks
from bench.decode import device_read_bw
from freetoken.experts.executor import reference_experts

FORMATS = ("bf16", "fp8_block", "mxfp4", "nvfp4")


def graph_seconds(calls, reps: int) -> float | str:
    """Device seconds per call of `calls` (closures) captured together in one CUDA graph, or why
    the capture failed (reported, not fatal: the other numbers still stand)."""
    try:
        for c in calls:  # compile and autotune outside the capture
            c()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps / len(calls)
    except Exception as e:
        return f"capture failed: {type(e).__name__}: {e}"[:300]


def routed(t: int, n: int, k: int, h: int, gen: torch.Generator):
    """x [t, h] bf16, ids [t, k] (distinct experts a token), weights [t, k] on the GPU."""
    x = torch.randn(t, h, generator=gen, device="cuda").bfloat16()
    ids = torch.rand(t, n, generator=gen, device="cuda").argsort(-1)[:, :k]  # [t, k]
    w = torch.softmax(torch.randn(t, k, generator=gen, device="cuda"), -1).bfloat16()
    return x, ids, w


def rel_err(got, ref) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def bench_format(fmt: str, a, gen: torch.Generator) -> dict:
    n, h, i, k = a.experts, a.hidden, a.inter, a.top_k
    if fmt == "bf16":
        from freetoken.kernels.moe_decode import moe_decode_triton as decode
        from freetoken.kernels.moe_grouped import moe_grouped_triton as grouped
        gu = torch.randn(n, 2 * i, h, generator=gen, device="cuda").mul_(h ** -0.5).bfloat16()  # [N, 2I, H]
        dn = torch.randn(n, h, i, generator=gen, device="cuda").mul_(i ** -0.5).bfloat16()  # [N, H, I]
        per_expert = 3 * h * i * 2
    else:
        from freetoken.kernels.moe_quant import moe_quant_decode_triton as decode
        from freetoken.kernels.moe_quant import moe_quant_grouped_triton as grouped
        banks = quantized_banks(fmt, n, h, i, torch.Generator().manual_seed(0)).to("cuda")
        gu, dn = banks.gate_up, banks.down
        per_expert = banks.expert_bytes  # values and scales
    out = {"expert_mb": round(per_expert / 1e6, 2), "bank_gb": round(n * per_expert / 1e9, 2),
           "decode": [], "grouped": []}
    for b in a.batches:
        calls = [routed(b, n, k, h, gen) for _ in range(a.calls)]
        distinct = sum(torch.unique(ids).numel() for _, ids, _ in calls) / len(calls)
        s = graph_seconds([lambda c=c: decode(c[0], c[1], c[2], gu, dn) for c in calls], a.reps)
        x, ids, w = calls[0]
        row = {"batch": b, "distinct_experts": round(distinct, 1),
               "rel_err": round(rel_err(decode(x, ids, w, gu, dn), reference_experts(x, ids, w, gu, dn)), 4)}
        if isinstance(s, str):
            row["error"] = s
        else:
            row.update(us=round(s * 1e6, 2), gbs=round(distinct * per_expert / s / 1e9, 1))
        out["decode"].append(row)
        print(fmt, row, flush=True)
    for t in a.chunks:
        calls = [routed(t, n, k, h, gen) for _ in range(2)]
        distinct = sum(torch.unique(ids).numel() for _, ids, _ in calls) / len(calls)
        s = graph_seconds([lambda c=c: grouped(c[0], c[1], c[2], gu, dn, n) for c in calls], max(2, a.reps // 4))
        x, ids, w = calls[0]
        row = {"tokens": t, "pairs": t * k, "distinct_experts": round(distinct, 1),
               "rel_err": round(rel_err(grouped(x, ids, w, gu, dn, n), reference_experts(x, ids, w, gu, dn)), 4)}
        if isinstance(s, str):
            row["error"] = s
        else:
            row.update(ms=round(s * 1e3, 3), gbs=round(distinct * per_expert / s / 1e9, 1),
                       tflops=round(2 * t * k * 3 * h * i / s / 1e12, 1))
        out["grouped"].append(row)
        print(fmt, row, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches", default="1,4", help="decode batch sizes (tokens)")
    ap.add_argument("--chunks", default="512,2048", help="prefill chunk sizes (tokens) for the grouped kernel")
    ap.add_argument("--calls", type=int, default=16, help="decode calls (fresh routing each) in one graph")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.quant_experts times the Triton expert kernels on a CUDA GPU; no CUDA device here")
    formats = a.formats.split(",")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        sys.exit(f"unknown format(s) {', '.join(unknown)}; known: {', '.join(FORMATS)}")
    a.batches = [int(v) for v in a.batches.split(",")]
    a.chunks = [int(v) for v in a.chunks.split(",") if v]
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"shape": {"hidden": a.hidden, "inter": a.inter, "experts": a.experts, "top_k": a.top_k},
           "calls_per_graph": a.calls, "device_read_gbs": round(device_read_bw("cuda"), 1), "formats": {}}
    for fmt in formats:
        res["formats"][fmt] = bench_format(fmt, a, gen)
        torch.cuda.empty_cache()
    base = res["formats"].get("bf16")
    if base:  # time of each format's call over bf16's, per configuration
        for fmt, r in res["formats"].items():
            for part, unit in (("decode", "us"), ("grouped", "ms")):
                for row, ref in zip(r[part], base[part]):
                    if unit in row and unit in ref:
                        row["time_vs_bf16"] = round(row[unit] / ref[unit], 3)
    write_result("quant_experts", res)


if __name__ == "__main__":
    main()
