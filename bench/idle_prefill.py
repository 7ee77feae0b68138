"""A long prompt on an idle server: its time to first token through the serving loop, by the
prompt budget of a step in which nothing decodes (--idle-step-tokens).

Drives ServingEngine.step() in this thread (the path `ft serve` runs), one request at a time,
nothing else decoding: every step is an idle one. Each setting gets a loop of its own over the
same engine (its memory plan sized for that setting's step), and records what the loop chose
(`idle_step_tokens`) and the KV pool that was left (`kv_tokens`).
    python -m bench.idle_prefill [--full-size --layers 40] --lengths 8192,32768 --idle 2048,auto
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from bench.common import write_result
from bench.fullsize import full_size_engine
from freetoken.demo import demo_path
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine


def ttft(srv: ServingEngine, n: int, vocab: int, seed: int) -> tuple[float, int]:
    """(seconds to the first token of an n-token prompt, steps it took), the loop otherwise idle."""
    g = torch.Generator().manual_seed(seed)
    req = Request(torch.randint(100, vocab, (n,), generator=g).tolist(),
                  SamplingOptions(temperature=0, max_tokens=2, ignore_eos=True))
    steps = 0
    if srv.engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    srv.sched.add(req)
    while not req.output_ids:
        srv.step()
        steps += 1
    dt = time.perf_counter() - t0  # the token is on the host: the device work behind it is done
    srv.cancel(req)
    while srv.sched.busy:
        srv.step()
    return dt, steps


def setting(eng, idle: str, lengths: list[int], reps: int) -> dict:
    eng.ecfg = dataclasses.replace(eng.ecfg, idle_step_tokens=0 if idle == "auto" else int(idle))
    srv = ServingEngine(eng, max_batch=2, max_queue=4, start=False)
    d = srv.describe()
    vocab = eng.cfg.vocab_size
    ttft(srv, max(lengths), vocab, 0)  # warm-up: this step size's kernels and GEMM shapes
    rows = []
    for n in lengths:
        times = [ttft(srv, n, vocab, 1 + r) for r in range(reps)]
        best = min(t for t, _ in times)
        rows.append({"prompt_tokens": n, "ttft_s": round(best, 4), "tok_s": round(n / best, 1),
                     "ttft_all_s": [round(t, 4) for t, _ in times], "steps": times[0][1]})
        print(f"idle {idle} ({d['idle_step_tokens']}): {rows[-1]}", flush=True)
    out = {"idle": idle, "idle_step_tokens": d["idle_step_tokens"], "max_step_tokens": d["max_step_tokens"],
           "kv_tokens": d["memory_plan"]["kv_tokens"], "work_gb": round(d["memory_plan"]["work"] / 1e9, 3),
           "decode_path": d["decode_path"], "rows": rows}
    del srv
    gc.collect()
    if eng.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--idle", default="2048,auto", help="--idle-step-tokens values (auto: the engine's choice)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--full-size", action="store_true", help="Qwen3.6-35B-A3B shape, random weights (GPU machine)")
    ap.add_argument("--layers", type=int, default=40, help="with --full-size")
    ap.add_argument("--experts", default="gpu", choices=["gpu", "cache"],
                    help="with --full-size: every expert in VRAM, or in host memory behind the GPU cache (a "
                         "long prompt then prefills in streamed passes, runtime/prefill_stream.py)")
    ap.add_argument("--expert-cache", default="", help="with --experts cache: the cache's size (default: the "
                    "engine's memory plan)")
    ap.add_argument("--table-on-copy", default="", help="with --experts cache: 0,1 runs every setting with the "
                    "passes' slot tables on the compute stream, then on the copy stream (experts/stream.py "
                    "TABLE_ON_COPY); default: the engine's")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--name", default="")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    ctx = max(lengths) + 64
    if a.full_size:
        extra = {"expert_cache": a.expert_cache} if a.expert_cache else {}
        eng = full_size_engine(a.layers, "cuda", experts_on=a.experts, max_len=ctx, **extra)
    else:
        eng = Engine(demo_path(), EngineConfig(device=a.device, max_seq_len=ctx))
    rows = []
    for toc in [int(v) for v in a.table_on_copy.split(",") if v] or [None]:
        if toc is not None and eng.prefill_stream is not None:
            eng.prefill_stream.loader.table_on_copy = bool(toc)
        for s in a.idle.split(","):
            rows.append(setting(eng, s, lengths, a.reps))
            rows[-1]["table_on_copy"] = (eng.prefill_stream.loader.table_on_copy
                                         if eng.prefill_stream is not None else None)
    name = a.name or "idle_prefill" + ("-full" if a.full_size else "")
    write_result(name, {"model": f"Qwen3.6-35B-A3B shape, {a.layers} layers" if a.full_size else "demo",
                        "device": str(eng.device), "experts_on": eng.experts_on, "context": ctx, "settings": rows,
                        "prefill_passes": eng.prefill_stream.stats() if eng.prefill_stream is not None else None})


if __name__ == "__main__":
    main()
