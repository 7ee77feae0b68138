"""The server's engine loop without HTTP: decode step time at 1, 2, 4 and 8 requests.

Drives ServingEngine.step() in this thread (the same schedule -> execute -> update path
`ft serve` runs), so comparing with bench.serve splits a request's speed into engine time and
HTTP/streaming overhead. With --profile, a cProfile of the decode steps names where the host
time goes (a GPU step is bound by Python and launches, not by the GPU).
    python -m bench.serve_engine [--concurrency 1,2,4,8] [--steps 64] [--prompt-tokens 400] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import time

import torch

from bench.common import write_result
from bench.decode import profile_step
from bench.fullsize import full_size_engine
from freetoken.cache.config import CacheConfig
from freetoken.demo import demo_path
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine


def top_functions(prof: cProfile.Profile, n: int = 15) -> list[str]:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    lines = [ln.rstrip() for ln in buf.getvalue().splitlines()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return [ln for ln in lines[start:] if ln.strip()]


def level(srv: ServingEngine, c: int, steps: int, prompt_tokens: int, vocab: int, profile: bool) -> dict:
    gen = torch.Generator().manual_seed(c)
    reqs = [Request(torch.randint(100, vocab, (prompt_tokens,), generator=gen).tolist(),
                    SamplingOptions(temperature=0, max_tokens=steps + 16, ignore_eos=True)) for _ in range(c)]
    for r in reqs:
        srv.sched.add(r)
    while any(not r.output_ids for r in reqs):  # prefill all of them
        srv.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        srv.step()
    dt = (time.perf_counter() - t0) / steps
    prof = kernels = None
    if profile:  # after the timed steps: the profilers slow the host down
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(4):
            srv.step()
        prof.disable()
        kernels = profile_step(srv.step) if srv.engine.device.type == "cuda" else None
    for r in reqs:  # let them finish so the next level starts from empty slots
        srv.cancel(r)
    while srv.sched.busy:
        srv.step()
    row = {"concurrency": c, "ms_per_step": round(dt * 1e3, 2), "per_request_tok_s": round(1 / dt, 1),
           "aggregate_tok_s": round(c / dt, 1)}
    if prof:
        row["profile_top_tottime"] = top_functions(prof)
    if kernels:
        row["gpu_kernels"] = kernels
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-seq-len", type=int, default=0, help="context per slot (0: the model's)")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly (default: graphs on CUDA)")
    ap.add_argument("--full-size", action="store_true", help="Qwen3.6-35B-A3B shape, random weights (GPU machine)")
    ap.add_argument("--layers", type=int, default=40, help="with --full-size")
    a = ap.parse_args()
    graphs = not a.no_cuda_graphs
    if a.full_size:
        eng = full_size_engine(a.layers, "cuda", max_len=a.max_seq_len or 8192, cuda_graphs=graphs)
    else:
        eng = Engine(demo_path(), EngineConfig(device=a.device, max_seq_len=a.max_seq_len, cuda_graphs=graphs))
    srv = ServingEngine(eng, max_batch=8, max_queue=16, start=False, cache=CacheConfig(enabled=not a.no_prefix_cache))
    vocab = eng.cfg.vocab_size
    level(srv, 1, 4, 32, vocab, False)  # warm-up: kernels compiled, autotuned
    rows = []
    for c in a.concurrency.split(","):
        level(srv, int(c), 4, 32, vocab, False)  # this batch size's shapes
        rows.append(level(srv, int(c), a.steps, a.prompt_tokens, vocab, a.profile))
        print("level:", {k: v for k, v in rows[-1].items() if k not in ("profile_top_tottime", "gpu_kernels")}, flush=True)
        for ln in rows[-1].get("profile_top_tottime", [])[:8]:
            print("   ", ln)
        for k in rows[-1].get("gpu_kernels", {}).get("top", [])[:6]:
            print("    gpu:", k)
    name = "serve_engine" + ("-full" if a.full_size else "") + ("" if graphs else "-eager")
    write_result(name, {"model": f"Qwen3.6-35B-A3B shape, {a.layers} layers" if a.full_size else "demo",
                        "device": str(eng.device), "experts_on": eng.experts_on,
                        "config": {k: v for k, v in dataclasses.asdict(eng.cfg).items() if isinstance(v, (int, float, str, bool, list))},
                        "context_per_slot": eng.max_len, "decode_path": srv.describe()["decode_path"],
                                  "prompt_tokens": a.prompt_tokens, "steps": a.steps, "levels": rows})


if __name__ == "__main__":
    main()
