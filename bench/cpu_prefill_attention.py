"""A prompt chunk's attention over the page pool on the CPU: the whole-context path (the pages
gathered, SDPA with the bottom-right causal bias) against the key pieces of
kernels/split_keys.py (pieces of KEY_PIECE keys through torch's CPU flash kernel with their
log-sum-exp, then the chunk's own keys, merged), on the demo's and the Qwen3.6 shape's
full-attention heads, at each --cases (context, chunk), in fp32 and bf16. Pages of 16, shuffled
in the pool. Median of --iters calls each. Then the gather of --gather-context keys of K (one
KV tensor of one layer) by plain indexing (page_gather.gather_pages, the CPU's gather before
51d9f3e) and by one index_select per KV head (gather_fresh, the CPU's now).

  python -m bench.cpu_prefill_attention [--cases 8192:2048,32768:64] [--dtypes float32,bfloat16]
      [--threads N] [--name NAME]
"""
from __future__ import annotations

import argparse

import torch

from bench.cpu_attention import median_s
from bench.common import write_result
from freetoken.kernels import split_keys
from freetoken.kernels.page_gather import gather_fresh, gather_pages
from freetoken.kernels.paged_attention import paged_prefill_attention_torch

SHAPES = {"demo": (2, 4, 64), "qwen3.6": (2, 16, 256)}  # kvh, nh, hd
CASES = "2048:2048,8192:64,8192:2048,32768:64,32768:512,32768:2048"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=CASES, help="context:chunk pairs")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--name", default="cpu_prefill_attention", help="result name")
    ap.add_argument("--gather-context", type=int, default=32768)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    wanted = split_keys.wanted
    for name, (kvh, nh, hd) in SHAPES.items():
        for dname in a.dtypes.split(","):
            dtype = getattr(torch, dname)
            for case in a.cases.split(","):
                ctx, t = (int(x) for x in case.split(":"))
                p = 16
                pages = -(-(ctx + t) // p) + 2
                kp = torch.randn(pages, kvh, p, hd, generator=g).to(dtype)
                vp = torch.randn(pages, kvh, p, hd, generator=g).to(dtype)
                table = torch.randperm(pages, generator=g).to(torch.int32)
                q = torch.randn(t, nh, hd, generator=g).to(dtype)
                call = lambda: paged_prefill_attention_torch(q, kp, vp, table, ctx, hd ** -0.5)  # noqa: E731
                with torch.inference_mode():
                    try:
                        split_keys.wanted = lambda *args: False
                        whole = median_s(call, a.iters)
                        split_keys.wanted = lambda *args: True
                        pieces = median_s(call, a.iters)
                    finally:
                        split_keys.wanted = wanted
                    default = "pieces" if wanted(q, ctx, None, None) else "whole"
                rows.append({"shape": name, "dtype": dname, "context": ctx, "chunk": t,
                             "whole_ms": round(1e3 * whole, 2), "pieces_ms": round(1e3 * pieces, 2),
                             "speedup": round(whole / pieces, 2), "default_without_hook": default})
                print(rows[-1], flush=True)
    write_result(a.name, {"threads": torch.get_num_threads(), "key_piece": split_keys.KEY_PIECE,
                          "rows": rows, "gather": gather_rows(a, g)})


def gather_rows(a, g) -> list[dict]:
    rows = []
    for name, (kvh, _, hd) in SHAPES.items():
        for dname in a.dtypes.split(","):
            p, n = 16, a.gather_context // 16
            pages = torch.randn(n + 2, kvh, p, hd, generator=g).to(getattr(torch, dname))
            ids = torch.randperm(n + 2, generator=g)[:n].to(torch.int32)
            with torch.inference_mode():
                plain = median_s(lambda: gather_pages(pages, ids, n * p), a.iters)
                fresh = median_s(lambda: gather_fresh(pages, ids, n * p), a.iters)
            rows.append({"shape": name, "dtype": dname, "context": n * p, "plain_indexing_ms": round(1e3 * plain, 2),
                         "index_select_per_head_ms": round(1e3 * fresh, 2), "speedup": round(plain / fresh, 1)})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
