"""Dense projections of a CPU decode step: torch's GEMM against the C++ rows kernel (dense.h).

The weights of the Qwen3.6-35B-A3B shape's decode step (hidden 2048; the lm_head of its 248,320
tokens, a DeltaNet layer's fused in-projection and out-projection, an attention layer's fused
q/k/v, the fused router + shared expert, the shared expert's down), in bf16 and fp32, at 1-16 rows
of x, each weight cycled through enough copies (>= 512 MB) that every call reads it from DRAM, as
a decode step does. Per case, ms and GB/s of weight bytes: `torch` (F.linear), `lm_head_form` (the
w @ h^T form layers.lm_head used on the CPU; the lm_head rows only), `cpp` (ext.dense_gemv, what
model/linear.py's host_gemv now calls for up to HOST_ROWS rows), and the host's read bandwidth (a
plain fp32 sum over a 1 GB buffer, the same threads) for scale.
dtype `mixed`: bf16 weights under a float32 model (--dense-bf16, the CPU's default for bf16
checkpoints), float32 rows; its `torch` way is model/linear.py's widened_linear, what linear()
runs past MIXED_HOST_ROWS rows (a prompt chunk's rows), against the rows kernel at those counts.
    python -m bench.cpu_gemv [--threads 0] [--rows 1,2,4,8,16] [--dtypes bfloat16,float32,mixed]
Results: benchmarks/results/cpu_gemv-cpu.json (--name to change).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import timeit, write_result
from bench.cpu_experts import read_bandwidth
from freetoken.experts.cpu import extension
from freetoken.model.linear import widened_linear

H = 2048
SHAPES = {  # name: (N, K) of the Qwen3.6-35B-A3B decode step's weights
    "lm_head": (248320, H),
    "deltanet_in": (12352, H),  # q, k, v, z (+ b, a: 64 more rows in the model)
    "deltanet_out": (H, 4096),
    "attention_qkv": (9216, H),  # q with its gate, k, v
    "router_shared": (1281, H),  # router 256 + shared gate 1 + shared gate/up 1024
    "shared_down": (H, 512),
}


def cycled(n: int, k: int, dtype, total: int = 512 << 20) -> list[torch.Tensor]:
    """Copies of a random [n, k] weight totalling >= `total` bytes (one if it is that big)."""
    one = n * k * torch.empty((), dtype=dtype).element_size()
    return [torch.randn(n, k).to(dtype) for _ in range(max(1, -(-total // one)))]


def case(name: str, n: int, k: int, dtype, rows: list[int], ext) -> list[dict]:
    mixed = dtype == "mixed"  # bf16 weights, float32 rows
    ws = cycled(n, k, torch.bfloat16 if mixed else dtype)
    nbytes = ws[0].numel() * ws[0].element_size()
    out = []
    for m in rows:
        x = torch.randn(m, k).to(torch.float32 if mixed else dtype)
        it = {"i": 0}

        def nxt():
            it["i"] = (it["i"] + 1) % len(ws)
            return ws[it["i"]]
        ways = {"torch": (lambda: widened_linear(x, nxt())) if mixed else (lambda: F.linear(x, nxt()))}
        if name == "lm_head" and not mixed:
            cols = torch.cat([x, x]) if m == 1 else x
            ways["lm_head_form"] = lambda: (nxt() @ cols.T)[:, :m]
        if ext is not None:
            ways["cpp"] = lambda: ext.dense_gemv(x, nxt(), torch.empty(0), 3)
        row = {"weight": name, "n": n, "k": k, "dtype": "mixed" if mixed else str(dtype).replace("torch.", ""), "rows": m,
               "weight_mb": round(nbytes / 1e6, 2)}
        iters = 5 if nbytes > 256e6 else 30
        for way, fn in ways.items():
            s = timeit(fn, warmup=2, iters=iters)
            row[f"{way}_ms"] = round(s * 1e3, 3)
            row[f"{way}_gbs"] = round(nbytes / s / 1e9, 1)
        if "cpp_ms" in row:
            row["cpp_speedup"] = round(row["torch_ms"] / row["cpp_ms"], 2)
        print(row, flush=True)
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--weights", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    ap.add_argument("--name", default="cpu_gemv")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",") if r]
    dtypes = [d if d == "mixed" else getattr(torch, d) for d in a.dtypes.split(",") if d]
    ext = extension()
    probe = read_bandwidth(torch.randn(1 << 28), torch.get_num_threads())  # 1 GB
    res = {"threads": torch.get_num_threads(), "read_probe_gbs": round(probe, 1),
           "cpp": ext is not None, "cases": []}
    for d in dtypes:
        for w in a.weights.split(","):
            n, k = SHAPES[w]
            res["cases"] += case(w, n, k, d, rows, ext)
    write_result(a.name, res)


if __name__ == "__main__":
    main()
