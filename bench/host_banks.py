"""How the host memory behind an expert bank changes what the CPU executor reads.

The same random BF16 bank (full-size Qwen3.6 expert, 2048 x 512, 6.3 MB) in different host
memory, the C++ executor on the same threads:
  plain        torch.empty, 4 KiB pages (what bench.cpu_experts measures on)
  plain-reg    page-aligned, 4 KiB pages, registered for DMA (cudaHostRegister), the engine's
               banks before hostmem.py
  huge         2 MiB-aligned and advised onto transparent huge pages (hostmem.host_buffer)
  huge-reg     the same, registered: the engine's banks now
and two call shapes: `top8` (one token, 8 experts, fresh routing each call: a decode layer on
CPU-only) and `one64` (one token, 64 distinct experts per call: the shape of the expert cache
benchmark's B_H probe, where the executor read 36-39 GB/s at 6 threads against 50 here).
Also the host read bandwidth of each bank (torch fp32 sum) and the bytes on huge pages
(`huge_gb`, from /proc/self/smaps).
    python -m bench.host_banks [--experts 768] [--threads 6] [--variants plain,plain-reg,huge,huge-reg]
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from bench.common import timeit, write_result
from bench.cpu_experts import read_bandwidth
from freetoken.experts.cpu import CpuExpertExecutor
from freetoken.weights.hostmem import host_tensor, huge_bytes, thp_mode
from freetoken.weights.reader import pin_in_place

VARIANTS = ("plain", "plain-reg", "huge", "huge-reg")


def make_bank(variant: str, shape, g: torch.Generator) -> torch.Tensor:
    """A bf16 bank of `shape` in the variant's memory, written once by the CPU (first touch),
    in 64-expert pieces."""
    huge = variant.startswith("huge")
    t = torch.empty(shape, dtype=torch.bfloat16) if variant == "plain" else host_tensor(shape, torch.bfloat16, huge=huge)
    for s in range(0, shape[0], 64):
        piece = t[s:s + 64]
        piece.copy_(torch.randn(piece.shape, generator=g).mul_(0.02))
    if variant.endswith("-reg") and not pin_in_place([t]):
        return None  # no CUDA here: the variant cannot be made
    return t


def calls(shape: str, n: int, h: int, iters: int, g: torch.Generator):
    """(x bf16 [1, h], ids [1, k], w [1, k]) per call, fresh routing each."""
    k = 8 if shape == "top8" else 64
    out = []
    for _ in range(iters + 5):
        ids = torch.randperm(n, generator=g)[:k][None]
        out.append((torch.randn(1, h, generator=g).bfloat16(), ids, torch.full((1, k), 1.0 / k)))
    return out, k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--name", default="host_banks")
    a = ap.parse_args()
    n, h, i = a.experts, a.hidden, a.inter
    per_expert = 3 * h * i * 2
    res = {"thp": thp_mode(), "threads": a.threads, "experts": n, "expert_mb": round(per_expert / 1e6, 2),
           "bank_gb": round(n * per_expert / 1e9, 2), "rows": []}
    for variant in a.variants.split(","):
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        gu = make_bank(variant, (n, 2 * i, h), g)
        dn = make_bank(variant, (n, h, i), g)
        if gu is None or dn is None:
            print(f"{variant}: skipped (cannot register host memory without CUDA)", flush=True)
            continue
        row = {"variant": variant, "make_s": round(time.perf_counter() - t0, 1)}
        hb = [huge_bytes(gu), huge_bytes(dn)]
        row["huge_gb"] = None if None in hb else round(sum(hb) / 1e9, 2)
        ex = CpuExpertExecutor(gu, dn, threads=a.threads)
        row["isa"] = ex.isa
        time.sleep(0.5)  # torch's OpenMP threads (they wrote the bank) stop spinning on the executor's cores
        for shape in ("top8", "one64"):
            cs, k = calls(shape, n, h, a.iters, g)
            it = iter(cs)
            s = timeit(lambda: ex.kernel(*next(it)), warmup=5, iters=a.iters)
            row[f"{shape}_ms"] = round(s * 1e3, 3)
            row[f"{shape}_gbs"] = round(k * per_expert / s / 1e9, 1)
        del ex
        gc.collect()
        row["read_gbs"] = round(read_bandwidth(gu, a.threads), 1)  # after the executor: see bench.cpu_experts
        res["rows"].append(row)
        print(row, flush=True)
        del gu, dn
        gc.collect()
    write_result(a.name, res)


if __name__ == "__main__":
    main()
