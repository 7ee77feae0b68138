"""Prefill speed on the full-size model (GPU machine): tok/s at several prompt lengths, and
where a prefill chunk's time goes (GPU kernel time against wall time, top kernels, top host
functions), to aim the next prefill work.
    python -m bench.prefill [--lengths 512,2048,8192] [--layers 40]
With --chunks 64,128,...: a --total-token prompt prefilled in chunks of each size, with the MoE
blocks replayed from the prompt chunks' graphs (runtime/prefill_graphs.py) and eagerly, in one
run: what the graphs save per chunk (the serving loop's interleaved chunks are this small).
"""
from __future__ import annotations

import argparse
import cProfile
import time

import torch

from bench.common import write_result
from bench.decode import QWEN36_35B_A3B, build
from bench.serve_engine import top_functions
from freetoken.model.state import DecodeState


def kernels(fn, top: int = 12, ops: bool = False) -> dict:
    """GPU time of fn by kernel: {"kernels", "gpu_ms", "top": the `top` costliest}. With ops, also
    "ops": GPU time by the torch op that launched it (aten::mul, aten::cat, ...; self time, so a
    composite op's kernels count under the op that ran them): which lines of the model to fuse
    when elementwise kernels add up."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])
    with profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    rows = [e for e in avg if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: -e.device_time_total)
    out = {"kernels": sum(e.count for e in rows), "gpu_ms": round(sum(e.device_time_total for e in rows) / 1e3, 1),
           "top": [{"kernel": e.key[:80], "calls": e.count, "ms": round(e.device_time_total / 1e3, 2)}
                   for e in rows[:top]]}
    if ops:
        cpu = [e for e in avg if e.device_type.name == "CPU" and e.self_device_time_total > 0]
        cpu.sort(key=lambda e: -e.self_device_time_total)
        out["ops"] = [{"op": e.key[:80], "calls": e.count, "ms": round(e.self_device_time_total / 1e3, 2)}
                      for e in cpu[:top]]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--chunks", default="", help="chunk sizes for the graphs-against-eager rows (empty: none)")
    ap.add_argument("--total", type=int, default=4096, help="prompt tokens of each --chunks row")
    ap.add_argument("--graph-tokens", type=int, default=512, help="largest chunk the prefill graphs take")
    ap.add_argument("--name", default="prefill")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill needs a CUDA device")
    dev = torch.device("cuda")
    mc, _, ex, model = build(dict(QWEN36_35B_A3B, num_hidden_layers=a.layers), dev, "gpu")
    lengths = [int(x) for x in a.lengths.split(",")]
    chunk = 2048  # the engine's default prefill chunk
    need = max(max(lengths), a.total if a.chunks else 0)
    st = DecodeState(mc, 1, need + 8, dev, torch.bfloat16, chunk=chunk)  # rings sized for a chunk
    prompt = torch.randint(0, mc.vocab_size, (need,), device=dev)

    def prefill(n):
        st.reset(0)
        for s in range(0, n, chunk):
            model.prefill(prompt[s:min(n, s + chunk)], st, 0, s, logits=s + chunk >= n)
        torch.cuda.synchronize()

    prefill(min(lengths))  # compile, autotune, warm cuBLAS
    rows = []
    for n in lengths:
        prefill(n)
        t0 = time.perf_counter()
        prefill(n)
        wall = time.perf_counter() - t0
        row = {"prompt_tokens": n, "wall_s": round(wall, 3), "tok_s": round(n / wall, 1)}
        if n == lengths[0] or n == 2048:
            row["gpu"] = kernels(lambda: prefill(n))
            prof = cProfile.Profile()
            prof.enable()
            prefill(n)
            prof.disable()
            row["host_top_tottime"] = top_functions(prof, 12)
        rows.append(row)
        print({k: v for k, v in row.items() if k in ("prompt_tokens", "wall_s", "tok_s")},
              "gpu_ms" in row.get("gpu", {}) and row["gpu"]["gpu_ms"], flush=True)
    chunked = chunk_rows(model, ex, st, prompt, [int(c) for c in a.chunks.split(",") if c], a.total, dev,
                         a.graph_tokens) if a.chunks else []
    write_result(a.name, {"model": f"Qwen3.6-35B-A3B shape, {a.layers} layers, random BF16, experts in VRAM",
                          "config": dict(QWEN36_35B_A3B, num_hidden_layers=a.layers), "chunk": chunk, "runs": rows,
                          "chunked": chunked})


def chunk_rows(model, ex, st, prompt, chunks, total, dev, graph_tokens: int = 512) -> list:
    """A `total`-token prompt in chunks of each size, MoE blocks through the prefill graphs and
    eagerly (best of three each): ms per chunk, tok/s, and their ratio."""
    from freetoken.runtime.prefill_graphs import attach
    t0 = time.perf_counter()
    graphs = attach(model, ex, dev, torch.bfloat16, graph_tokens)
    capture_s = round(time.perf_counter() - t0, 2)  # warm-up and capture of every (block, bucket)
    if graphs is None:
        return [{"skipped": "the prefill graphs could not be captured here (see the log)"}]
    out = []
    for c in chunks:
        row = {"chunk": c, "graphed": sorted(graphs.blocks), "graphs_captured": len(graphs.graphs),
               "capture_s": capture_s}
        for on in (True, False):
            graphs.enabled = on

            def run():
                st.reset(0)
                for s in range(0, total, c):
                    model.prefill(prompt[s:min(total, s + c)], st, 0, s, logits=False)
                torch.cuda.synchronize()
            run()  # warm
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t0)
            n = -(-total // c)
            key = "graphs" if on else "eager"
            row[key] = {"ms_per_chunk": round(best / n * 1e3, 2), "tok_s": round(total / best, 1)}
        row["speedup"] = round(row["graphs"]["tok_s"] / row["eager"]["tok_s"], 2)
        print(row, flush=True)
        out.append(row)
    graphs.enabled = True
    return out


if __name__ == "__main__":
    main()
