"""A pass's prefill attention by SDPA backend: flash (what the engine runs) against cuDNN's.

A 32k streamed pass computes its attention in pieces of 2,048 queries over every key before them
(the mixers' chunks), and at the full-size shape (16 query heads, 2 KV heads, head dim 256, bf16)
that is about a third of the 12-layer slice's pass. model/attention.prefill_attention leaves cuDNN
out because it builds a graph for every new shape (67-70 ms of host time each,
results/attention_shapes-gpu.json); in a pass most pieces share a few shapes (2,048 queries over
2,048 j keys), so a graph built once serves them all. This times both on those shapes after a
warm-up call (device time from CUDA events, the mean of --reps calls), TFLOP/s of the causal
attention's FLOPs (4 x head dim x heads a query-key pair it sees), and cuDNN's output against
flash's (max error over flash's max).
    python -m bench.attention_backends [--queries 2048] [--keys 2048,8192,16384,32768] [--reps 10]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from bench.common import write_result
from bench.grouped_gemm import device_seconds

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=2048)
    ap.add_argument("--keys", default="2048,8192,16384,32768")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--name", default="attention_backends")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention_backends times CUDA kernels: no GPU here")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    nh, kvh, hd, t = a.heads, a.kv_heads, a.head_dim, a.queries
    rows = []
    for s in (int(x) for x in a.keys.split(",")):
        q = torch.randn(1, nh, t, hd, generator=g, device=dev).to(torch.bfloat16)
        k = torch.randn(1, kvh, s, hd, generator=g, device=dev).to(torch.bfloat16)
        v = torch.randn(1, kvh, s, hd, generator=g, device=dev).to(torch.bfloat16)
        bias = causal_lower_right(t, s)
        pairs = t * (s - t) + t * (t + 1) // 2  # query-key pairs the causal mask keeps
        flop = 4 * hd * nh * pairs
        row, outs = {"queries": t, "keys": s, "tflop": round(flop / 1e12, 3)}, {}
        for name, backend in BACKENDS.items():
            def call():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=hd ** -0.5, enable_gqa=True)
            try:
                outs[name] = call()
                sec = device_seconds(call, a.reps)
                row[name] = {"ms": round(sec * 1e3, 3), "tflops": round(flop / sec / 1e12, 1)}
            except Exception as e:  # a backend this torch or GPU lacks for the shape: said, the others stand
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if "flash" in outs:
            ref = outs["flash"].float()
            for name, o in outs.items():
                if name != "flash":
                    row[name]["vs_flash"] = round(float((o.float() - ref).abs().max() / ref.abs().max()), 5)
        rows.append(row)
        print(row, flush=True)
    write_result(a.name, {"shape": {"heads": nh, "kv_heads": kvh, "head_dim": hd, "dtype": "bfloat16"},
                          "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
