"""Paged KV attention kernels on the GPU, at the full-size model's attention shape (kvh 2, nh 16,
hd 256, bf16, pages of 16): the Triton split-K decode against the torch reference (gather the
pages + softmax) and against today's contiguous-cache decode_attention, at B = 1, 4, 8 and
contexts 1k-128k; optionally a tile/split sweep of the decode kernel and the paged prefill
against SDPA on contiguous K/V.

Timings are triton.testing.do_bench medians (L2 flushed before each call, so a 1k context is
not served from L2 as it would not be between layers): GPU time per call, launch overhead
hidden behind the flush. `graph_us` replays the Triton decode captured in a CUDA graph (lens on
the device: the capture itself is the capturability check). `wide_us`: the same lengths with a
block table as wide as the longest context (one captured graph per batch size serving every
length: the surplus splits find no tile). GB/s counts the K/V bytes the lengths cover.
    python -m bench.paged_attention [--batches 1,4,8] [--contexts 1024,8192,32768,131072]
                                    [--sweep] [--no-prefill] [--no-reference]
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch

from freetoken.kernels.paged_attention import (
    MIN_SPLIT_KEYS, default_splits, paged_decode_attention_torch, paged_decode_attention_triton,
    paged_prefill_attention_torch, paged_prefill_attention_triton)
from freetoken.model.attention import decode_attention, prefill_attention

KVH, NH, HD, P = 2, 16, 256, 16
DTYPE = torch.bfloat16


def bench_ms(fn) -> float:
    if torch.cuda.is_available():
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    import time  # --dry-run on a CPU: the script's plumbing only, under TRITON_INTERPRET=1
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def graph_ms(fn) -> float | str:
    """GPU time of fn replayed from a CUDA graph, or why it could not be captured."""
    if not torch.cuda.is_available():
        return "no cuda"
    try:
        fn()  # compile outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return bench_ms(g.replay)
    except Exception as e:  # reported, not fatal: the eager numbers still stand
        return f"capture failed: {type(e).__name__}: {e}"[:300]


def pool(b: int, ctx: int, width: int, dev, gen):
    """A shuffled pool holding b rows of ctx keys (page 0 left as the scratch page) and the
    contiguous copy today's decode_attention reads. -> k_pages, v_pages, block_table, kc, vc."""
    per = -(-ctx // P)
    n = b * per + 1
    k_pages = torch.randn(n, KVH, P, HD, generator=gen, device=dev, dtype=DTYPE)
    v_pages = torch.randn(n, KVH, P, HD, generator=gen, device=dev, dtype=DTYPE)
    ids = (torch.randperm(n - 1, generator=gen, device=dev) + 1).view(b, per).to(torch.int32)
    bt = torch.zeros(b, width, dtype=torch.int32, device=dev)  # past the end: the scratch page
    bt[:, :per] = ids
    kc = k_pages[ids.long()].permute(0, 2, 1, 3, 4).reshape(b, KVH, per * P, HD)[:, :, :ctx].contiguous()
    vc = v_pages[ids.long()].permute(0, 2, 1, 3, 4).reshape(b, KVH, per * P, HD)[:, :, :ctx].contiguous()
    return k_pages, v_pages, bt, kc, vc


def us(ms):
    return round(ms * 1e3, 1) if isinstance(ms, float) else ms


def decode_rows(batches, contexts, dev, reference: bool, max_ctx: int):
    rows = []
    scale = HD ** -0.5
    for b, ctx in itertools.product(batches, contexts):
        gen = torch.Generator(device=dev).manual_seed(b * 7 + ctx)
        k_pages, v_pages, bt, kc, vc = pool(b, ctx, -(-ctx // P), dev, gen)
        q = torch.randn(b, NH, HD, generator=gen, device=dev, dtype=DTYPE)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        mask = torch.arange(ctx, device=dev)[None] < lens[:, None]  # [B, L]
        kv_bytes = b * ctx * KVH * HD * 2 * 2
        tri = lambda: paged_decode_attention_triton(q, k_pages, v_pages, bt, lens, scale)  # noqa: E731
        out = tri()
        t_tri = bench_ms(tri)
        row = {"batch": b, "context": ctx, "splits": default_splits(b, KVH, bt.shape[1], P, _sms()),
               "triton_us": us(t_tri), "triton_gbs": round(kv_bytes / t_tri / 1e6, 1),
               "graph_us": us(graph_ms(tri))}
        t_dense = bench_ms(lambda: decode_attention(q, kc, vc, mask, scale))
        row.update(contiguous_us=us(t_dense), contiguous_gbs=round(kv_bytes / t_dense / 1e6, 1))
        dense = decode_attention(q, kc, vc, mask, scale)
        row["max_err_vs_contiguous"] = float((out.float() - dense.float()).abs().max())
        if reference:
            ref = paged_decode_attention_torch(q, k_pages, v_pages, bt, lens, scale)
            row["max_err_vs_reference"] = float((out.float() - ref.float()).abs().max())
            row["reference_us"] = us(bench_ms(lambda: paged_decode_attention_torch(q, k_pages, v_pages, bt, lens,
                                                                                   scale)))
        if max_ctx > ctx:  # the lengths in a table sized for the longest context
            wide = torch.zeros(b, -(-max_ctx // P), dtype=torch.int32, device=dev)
            wide[:, :bt.shape[1]] = bt
            wtri = lambda: paged_decode_attention_triton(q, k_pages, v_pages, wide, lens, scale)  # noqa: E731
            row["wide_splits"] = default_splits(b, KVH, wide.shape[1], P, _sms())
            row["wide_us"] = us(bench_ms(wtri))
            row["wide_graph_us"] = us(graph_ms(wtri))
        rows.append(row)
        print(row, flush=True)
        del k_pages, v_pages, kc, vc
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def sweep(batches, contexts, dev):
    """Tile shape, warps and stages at the default splits, then the splits (and the minimum
    keys per split) at the best of those: the numbers to hard-code as defaults."""
    out = []
    scale = HD ** -0.5
    for b, ctx in itertools.product(batches, contexts):
        gen = torch.Generator(device=dev).manual_seed(b * 7 + ctx)
        k_pages, v_pages, bt, kc, vc = pool(b, ctx, -(-ctx // P), dev, gen)
        del kc, vc
        q = torch.randn(b, NH, HD, generator=gen, device=dev, dtype=DTYPE)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        ref = paged_decode_attention_triton(q, k_pages, v_pages, bt, lens, scale, splits=1)
        base = default_splits(b, KVH, bt.shape[1], P, _sms())
        kv_bytes = b * ctx * KVH * HD * 2 * 2

        def run(**kw):
            f = lambda: paged_decode_attention_triton(q, k_pages, v_pages, bt, lens, scale, **kw)  # noqa: E731
            try:
                err = float((f().float() - ref.float()).abs().max())
                ms = bench_ms(f)
            except Exception as e:  # e.g. out of shared memory for a large tile with many stages
                return {**kw, "error": f"{type(e).__name__}: {e}"[:200]}
            return {**kw, "us": us(ms), "gbs": round(kv_bytes / ms / 1e6, 1), "max_err": err}

        tiles = [run(splits=base, block_n=n, num_warps=w, num_stages=s)
                 for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
        ok = [r for r in tiles if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        knobs = {k: best[k] for k in ("block_n", "num_warps", "num_stages")}
        splits = [run(splits=max(1, int(base * f)), min_split_keys=mk, **knobs)
                  for f in (0.25, 0.5, 1, 2, 4) for mk in (64, MIN_SPLIT_KEYS, 512)]
        ok_s = [r for r in splits if "us" in r]
        row = {"batch": b, "context": ctx, "default_splits": base, "best_tile": best,
               "best_splits": min(ok_s, key=lambda r: r["us"]) if ok_s else None, "tiles": tiles, "splits": splits}
        print({k: row[k] for k in ("batch", "context", "default_splits", "best_tile", "best_splits")}, flush=True)
        out.append(row)
        del k_pages, v_pages
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def prefill_rows(dev, starts, chunk: int, reference: bool, sweep_tiles: bool):
    """One chunk of `chunk` queries after `start` cached keys: Triton over pages, SDPA (flash,
    bottom-right causal) on contiguous K/V, and the paged reference (gather + SDPA)."""
    rows = []
    scale = HD ** -0.5
    for start in starts:
        s = start + chunk
        gen = torch.Generator(device=dev).manual_seed(s)
        k_pages, v_pages, bt, kc, vc = pool(1, s, -(-s // P), dev, gen)
        q = torch.randn(chunk, NH, HD, generator=gen, device=dev, dtype=DTYPE)
        row_bt = bt[0]
        kc, vc = kc[0], vc[0]  # [kvh, S, hd]
        flops = 4 * NH * HD * (chunk * start + chunk * (chunk + 1) / 2)  # causal: QK^T and PV
        tri = lambda: paged_prefill_attention_triton(q, k_pages, v_pages, row_bt, start, scale)  # noqa: E731
        out = tri()
        t_tri = bench_ms(tri)
        sdpa = lambda: prefill_attention(q.transpose(0, 1), kc, vc, None, scale)  # noqa: E731
        t_sdpa = bench_ms(sdpa)
        row = {"chunk": chunk, "start": start, "triton_us": us(t_tri), "triton_tflops": round(flops / t_tri / 1e9, 1),
               "sdpa_contiguous_us": us(t_sdpa), "sdpa_tflops": round(flops / t_sdpa / 1e9, 1),
               "max_err_vs_sdpa": float((out.float() - sdpa().transpose(0, 1).float()).abs().max())}
        if reference:
            row["reference_us"] = us(bench_ms(lambda: paged_prefill_attention_torch(q, k_pages, v_pages, row_bt,
                                                                                    start, scale)))
        if sweep_tiles:
            tiles = []
            for bm, bn, w, st in itertools.product((64, 128), (32, 64), (4, 8), (1, 2, 3)):
                f = lambda: paged_prefill_attention_triton(q, k_pages, v_pages, row_bt, start, scale,  # noqa: E731
                                                           block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                try:
                    tiles.append({"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st,
                                  "us": us(bench_ms(f))})
                except Exception as e:
                    tiles.append({"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st,
                                  "error": f"{type(e).__name__}: {e}"[:200]})
            row["best_tile"] = min((t for t in tiles if "us" in t), key=lambda t: t["us"], default=None)
            row["tiles"] = tiles
        rows.append(row)
        print({k: v for k, v in row.items() if k != "tiles"}, flush=True)
        del k_pages, v_pages, kc, vc
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--contexts", default="1024,8192,32768,131072")
    ap.add_argument("--sweep", action="store_true", help="tile/warps/stages/splits sweep of the decode kernel "
                    "(and of the prefill tiles)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--prefill-starts", default="0,8192,32768")
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow, eager) torch references")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1: "
                    "checks the script, measures nothing")
    a = ap.parse_args()
    if a.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry-run needs TRITON_INTERPRET=1 set before Python starts")
        global KVH, NH, HD
        KVH, NH, HD = 1, 2, 16
        a.batches, a.contexts, a.prefill_starts, a.prefill_chunk = "1,2", "32,64", "0,16", 16
    elif not torch.cuda.is_available():
        raise SystemExit("bench.paged_attention needs a CUDA device (or --dry-run)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    results = {"shape": {"kv_heads": KVH, "heads": NH, "head_dim": HD, "page": P, "dtype": str(DTYPE)},
               "timing": "triton.testing.do_bench median, L2 flushed before each call; us per call",
               "decode": decode_rows(batches, contexts, dev, not a.no_reference, max(contexts))}
    if a.sweep:
        results["decode_sweep"] = sweep(batches, contexts, dev)
    if not a.no_prefill:
        starts = [int(x) for x in a.prefill_starts.split(",")]
        results["prefill"] = prefill_rows(dev, starts, a.prefill_chunk, not a.no_reference, a.sweep)
    if a.dry_run:
        print("dry run: nothing written")
        return
    from bench.common import write_result
    write_result("paged_attention", results)


if __name__ == "__main__":
    main()
