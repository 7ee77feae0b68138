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
dtype `fp8`: FP8 block weights as an FP8 checkpoint publishes them (random e4m3 bytes, bf16 scales
per 128 x 128 block as Qwen's releases; the lm_head is not quantized there, so it is skipped), GB/s
of the e4m3 bytes: `cpp` is ext.dense_gemv_fp8 (host_gemv_fp8, up to FP8_HOST_ROWS rows), `torch`
model/linear.py's fp8_blocks_linear (past them), `dequant_cpp` the rows kernel on the same weight
dequantized to fp32 at load (the CPU's --dense-fp8 dequant; ms comparable, its GB/s of fp32 bytes).
    python -m bench.cpu_gemv [--threads 0] [--rows 1,2,4,8,16] [--dtypes bfloat16,float32,mixed,fp8]
Results: benchmarks/results/cpu_gemv-cpu.json (--name to change).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import timeit, write_result
from bench.cpu_experts import read_bandwidth
from freetoken.experts.cpu import extension
from freetoken.model.linear import fp8_blocks_linear, widened_linear
from freetoken.weights.dense_fp8 import Fp8BlockWeight

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


def random_fp8(n: int, k: int) -> Fp8BlockWeight:
    """A random FP8 block weight: e4m3 bytes (no NaN codes), bf16 block scales of a weight ~N(0, 1/k)."""
    v = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    v[(v & 0x7F) == 0x7F] = 0x7E  # 0x7f / 0xff are e4m3's NaN
    s = torch.full((-(-n // 128), -(-k // 128)), (k ** -0.5) / 64).bfloat16()
    return Fp8BlockWeight(v.view(torch.float8_e4m3fn), s, torch.float32)


def fp8_case(name: str, n: int, k: int, rows: list[int], ext) -> list[dict]:
    one = random_fp8(n, k)
    ws = [one] + [random_fp8(n, k) for _ in range(max(1, -(-(512 << 20) // one.nbytes)) - 1)]
    wf = cycled(n, k, torch.float32)  # the same shape dequantized at load: fp32 bytes
    out = []
    for m in rows:
        x = torch.randn(m, k)
        it = {"i": 0, "f": 0}

        def nxt():
            it["i"] = (it["i"] + 1) % len(ws)
            return ws[it["i"]]

        def nxtf():
            it["f"] = (it["f"] + 1) % len(wf)
            return wf[it["f"]]
        ways = {"torch": lambda: fp8_blocks_linear(x, nxt())}
        if ext is not None:
            ways["cpp"] = lambda: ext.dense_gemv_fp8(x, (w := nxt()).values, w.scale_inv, torch.empty(0), 3)
            if m <= 64:
                ways["dequant_cpp"] = lambda: ext.dense_gemv(x, nxtf(), torch.empty(0), 3)
        row = {"weight": name, "n": n, "k": k, "dtype": "fp8", "rows": m, "weight_mb": round(one.nbytes / 1e6, 2)}
        for way, fn in ways.items():
            s = timeit(fn, warmup=2, iters=30)
            nbytes = n * k * 4 if way == "dequant_cpp" else one.nbytes
            row[f"{way}_ms"] = round(s * 1e3, 3)
            row[f"{way}_gbs"] = round(nbytes / s / 1e9, 1)
        if "cpp_ms" in row:
            row["cpp_speedup"] = round(row["torch_ms"] / row["cpp_ms"], 2)
            if "dequant_cpp_ms" in row:
                row["cpp_over_dequant"] = round(row["dequant_cpp_ms"] / row["cpp_ms"], 2)
        print(row, flush=True)
        out.append(row)
    return out


def case(name: str, n: int, k: int, dtype, rows: list[int], ext) -> list[dict]:
    if dtype == "fp8":
        return [] if name == "lm_head" else fp8_case(name, n, k, rows, ext)
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
    dtypes = [d if d in ("mixed", "fp8") else getattr(torch, d) for d in a.dtypes.split(",") if d]
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
