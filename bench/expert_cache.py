"""Decode tok/s with the routed experts offloaded to host memory: the GPU expert cache (a pool
of VRAM slots that follows the router) against CPU-only and all-resident, on random BF16
weights of a real model shape made in place (no file).

Modes (the `mode` field of each row):
  resident   every expert in VRAM (the upper bound), one CUDA graph per step
  fill-only  the cache with r = 1: every miss copied into a slot by the fused zero-copy
             transfer kernel; the whole step is one CUDA graph
  cache      what users get by default: the adaptive split (experts/share.py) choosing r from
             the measured step times, its climb starting where the measured bandwidths point
             (`--start-share predicted`, as the engine starts from `ft bench bw`'s profile);
             warmed up until it has decided (at most `--cache-warmup` steps: `warmup_steps`,
             `split_decided`), then timed: the steady state a server reaches
  split      the cache with a fixed fill share r < 1 (`--fill-shares`): the other misses run
             on the C++ CPU executor, handed over in stream order (the doorbell by default,
             FREETOKEN_CPU_BRANCH=hostfn for a host-function node) while the GPU copies and
             computes; one CUDA graph
  cpu-only   every routed expert on the C++ CPU executor (the same hand-over), the rest on
             the GPU; one CUDA graph
Routing (`--routing`): `model` (the random router's own choices: near-uniform, the hardest
case for a cache), `trace:FILE` (a routing trace in the formats of experts/traces.py; its
shape must be the model's: `--shape mixtral` for the Mixtral-8x7B traces), or
`synthetic[:key=value,...]` (SYNTHETIC skewed routing, labelled so). Replayed routes replace
the router's ids (its gate weights are kept); the tokens still come from the model.

`--pieces 1,2,4`: rows with each expert cut into that many pieces of its intermediate dimension
(experts/pieces.py: every piece an expert of its own to the cache, so a layer's few large misses
split between the fills and the CPU); the banks are re-laid in place from one value to the next
(each must divide the next), so the rows of one value run together, in the order given. Slots,
misses, fills and CPU experts of a row count pieces (`pieces`); its floors use a piece's bytes.

`--hog N`: a concurrent host-memory hog (bench/hog.py, N threads) runs while each row is measured,
llama.cpp's included (`hog_gbs`: what it moved meanwhile); with `--threads 2` the two configurations
the issue asks the adaptive split to survive. `adaptive_vs_fixed`: each `cache` row against the
better of fill-only and the best fixed split of the same run.

`--llamacpp`: llama.cpp side by side (bench/llamacpp.py), before our rows: the same weights
written as a GGUF by llama.cpp's own converter, llama-bench decode (batch 1) at each thread count
with `-ncmoe` keeping the experts of round(L x (1 - capacity)) layers on the CPU (the same share
of experts in VRAM as the cache), all of them (cpu-only) and none (resident); each batch-1 row's
`llamacpp_tok_s` is its equivalent's. llama.cpp's source: bash bench/fetch_llamacpp.sh.

Also measured in the same run: B_P, expert-sized copies from pinned host banks into slots
(the fused kernel, and one copy-engine copy per expert), and B_H, the CPU executor's read rate
on the model's expert shape at each thread count; the analytic floor of each row is the
resident step plus the step's miss bytes over B_P (fill-only) or B_P + B_H (cache, split); the
resident step is timed after the rows when no `resident` row is asked for (`resident_ms_for_floor`).
`dram_floor_ms` caps that bandwidth at the host's DRAM read rate on all cores (`host_read_gbs`,
measured after the rows): the fills and the CPU branch read the same memory.
Each step is synchronised and its tokens read, as the serving loop does.
    python -m bench.expert_cache [--shape qwen36] [--layers 12] [--capacity 0.33]
        [--batch 1,4] [--threads 6,16] [--modes resident,fill-only,cache,cpu-only]
        [--fill-shares 0.75] [--routing model] [--tokens 64] [--warmup 48] [--cache-warmup 1500]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import timeit, write_result
from bench.decode import QWEN36_35B_A3B
from freetoken.config import ModelConfig
from freetoken.demo import random_tensor, weight_shapes
from freetoken.experts.cached import CachedExpertExecutor
from freetoken.experts.executor import ExpertExecutor, TorchExpertExecutor
from freetoken.experts.pieces import PiecedExecutor, split_banks_
from freetoken.experts.traces import parse_routing
from freetoken.model.registry import model_class
from freetoken.model.state import DecodeState
from freetoken.weights.hostmem import huge_bytes, thp_mode

# Mixtral-8x7B's MoE dimensions on our hybrid architecture (the non-expert layers are not
# Mixtral's; only the experts matter to the cache): for replaying the Mixtral routing traces
MIXTRAL_MOE = dict(QWEN36_35B_A3B, vocab_size=32000, hidden_size=4096, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=14336, num_hidden_layers=32)
SHAPES = {"qwen36": QWEN36_35B_A3B, "mixtral": MIXTRAL_MOE}


class ReplayRouting(ExpertExecutor):
    """Replaces the router's expert ids of decode steps with a trace's, read from a device
    buffer [L, B, k] (flat ids) the driver fills before each step: graph-capturable."""

    def __init__(self, inner: ExpertExecutor, buf: torch.Tensor):
        self.inner, self.buf = inner, buf
        self.name, self.backend = inner.name, inner.backend
        self.capturable = inner.capturable
        self.threads, self.isa = getattr(inner, "threads", None), getattr(inner, "isa", None)

    def launch(self, x, ids, weights, layer: int = 0, phase: str = "decode"):
        if phase == "decode" and ids.shape[0] == self.buf.shape[1]:
            ids = self.buf[layer]  # [B, k]
        return self.inner.launch(x, ids, weights, layer, phase)

    def finish(self, pending):
        return self.inner.finish(pending)

    def stats(self):
        return self.inner.stats()


def make_experts(mc, dev, seed: int = 0):
    """Random BF16 expert banks in host memory registered in place (cudaHostRegister), made layer
    by layer on the device: the engine's own path (FTW banks read into ordinary page-aligned host
    buffers on transparent huge pages, then registered: weights/reader.py, weights/hostmem.py), not
    cudaHostAlloc'd memory. Before this change the benchmark used pin_memory=True buffers, where
    the CPU executor read 36 GB/s at 6 threads against 50 in bench.cpu_experts on ordinary memory
    (expert_cache-confirm-gpu.json, cpu_experts-t6-prefetch1-gpu.json); FREETOKEN_HUGEPAGES=0
    gives the 4 KiB pages of the runs before hostmem.py."""
    from bench.prefill_stream import make_experts as registered
    return registered(mc, dev, seed)


def measure_bp(gu, dn, dev, experts: int = 64) -> dict:
    """Pinned host -> VRAM slots, expert-sized: the fused zero-copy kernel over a fill list,
    and one copy-engine copy per bank row."""
    from freetoken.kernels.expert_transfer import transfer_triton
    if dev.type != "cuda":
        return {}
    k = min(experts, gu.shape[0])
    slots = [torch.empty(k, *gu.shape[1:], dtype=gu.dtype, device=dev), torch.empty(k, *dn.shape[1:], dtype=dn.dtype,
                                                                                    device=dev)]
    src = torch.randperm(gu.shape[0])[:k].to(torch.int32).to(dev)
    dst = torch.arange(k, dtype=torch.int32, device=dev)
    nbytes = k * (gu[0].numel() + dn[0].numel()) * gu.element_size()

    def kernel():
        transfer_triton([gu, dn], slots, src, dst)

    def engine():
        for j, e in enumerate(src.tolist()):
            slots[0][j].copy_(gu[e], non_blocking=True)
            slots[1][j].copy_(dn[e], non_blocking=True)
    return {f"bp_{name}_gbs": round(nbytes / timeit(fn, warmup=1, iters=5, sync=torch.cuda.synchronize) / 1e9, 1)
            for name, fn in (("kernel", kernel), ("copy_engine", engine))}


def measure_bh(cpu, mc, dev, pairs: int = 64) -> float:
    """GB/s the CPU executor reads on the model's expert shape (batch 1, `pairs` experts)."""
    h = mc.hidden_size
    x = torch.randn(1, h, dtype=torch.bfloat16)
    ids = torch.randperm(cpu.gate_up.shape[0])[:pairs][None]  # [1, pairs] distinct experts
    w = torch.full((1, pairs), 1.0 / pairs)
    cpu.run(x, ids, w, "decode")
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        cpu.run(x, ids, w, "decode")
    per_expert = (cpu.gate_up[0].numel() + cpu.down[0].numel()) * cpu.gate_up.element_size()
    return reps * pairs * per_expert / (time.perf_counter() - t0) / 1e9


def replay_steps(spec: str, mc, batch: int, dev, trace_layers: int | None = None):
    """The trace's decode steps as flat ids [S, L, B, k] on the device (missing rows -1), or None.
    trace_layers: the MoE layers of the model the trace was taken from (a slice of --layers
    replays its first layers' routes)."""
    L = len(mc.moe_layers)
    trace = parse_routing(spec, num_layers=max(L, trace_layers or L), num_experts=mc.num_experts, top_k=mc.top_k)
    if trace is None:
        return None, None
    steps = []
    for st in trace.decode_steps(batch):  # [L_trace, b, k], b <= batch
        a = torch.full((L, batch, mc.top_k), -1, dtype=torch.int64)
        t = torch.as_tensor(st, dtype=torch.int64)[:L]
        a[:, :t.shape[1]] = t
        steps.append(a)
    ids = torch.stack(steps)  # [S, L, B, k] per-layer ids
    offs = (torch.arange(ids.shape[1]) * mc.num_experts)[None, :, None, None]
    ids = torch.where(ids >= 0, ids + offs, -1)  # flat ids
    return ids.to(dev), {"name": trace.name, "synthetic": trace.synthetic, "steps": len(steps)}


def capture(step, dev):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    return lambda: (g.replay(), out)[1]


def floors(row: dict, resident_ms: float, bp: float, bh: float, dram: float | None, expert_bytes: int) -> dict:
    """A row's analytic floors (GB/s in, ms out). floor_ms: the resident step plus the step's
    missed expert bytes over B_P (fill-only) or B_P + B_H (cache, split), the issue's formula.
    dram_floor_ms: the same with that bandwidth capped at what the host's DRAM gives all cores
    (`dram`): the fills and the CPU branch read one memory, and on the H200 at 6 threads B_P + B_H
    (48.5 + 57.1) passes the host's ~98 GB/s, so the first floor is out of reach by design."""
    split = row["mode"] in ("cache", "split")
    bw = bp + (bh if split else 0)
    miss = (row["fills_per_step"] + row.get("prefetched_per_step", 0) + row["cpu_experts_per_step"]) * expert_bytes
    out = {"floor_ms": round(resident_ms + miss / (bw * 1e9) * 1e3, 3)}
    out["floor_tok_s"] = round(row["batch"] / out["floor_ms"] * 1e3, 1)
    out["of_floor"] = round(out["floor_ms"] / row["ms_per_step"], 3)
    if dram:
        capped = min(bw, dram)
        out["dram_floor_ms"] = round(resident_ms + miss / (capped * 1e9) * 1e3, 3)
        out["of_dram_floor"] = round(out["dram_floor_ms"] / row["ms_per_step"], 3)
    return out


def run_config(mc, w, ex, dev, batch: int, tokens: int, warmup: int, routes, prompt: int = 64,
               trace: str | None = None, max_warmup: int | None = None, profile: bool = False,
               cpu_branch: bool | None = None, timeline: bool = False, drift: dict | None = None,
               dtype: torch.dtype = torch.bfloat16) -> dict:
    """max_warmup: for an adaptive cache, warm up past `warmup` until its split has decided
    (the steady state a server reaches), at most this many steps; the row says how many ran.
    profile (CUDA): the row's `profile`, GPU time per kernel of three eager steps after the timed
    ones (bench.decode.profile_step): where a step's time goes, kernel by kernel.
    cpu_branch: whether the step has a CPU branch (the host thread then waits for each step as
    the serving loop does, runtime/host_wait.py; None: host_wait.has_cpu_branch(ex)).
    timeline (CUDA): the row's `timeline`, three more steps as timed (graph replays) under the
    profiler, their device activity summed (bench/step_timeline.py).
    drift (an adaptive cache): the row's `drift`, a host-memory hog started after the timed steps
    (drift_run: {"threads", "cpus", "steps"}), and what the split does about it.
    dtype: the model's compute dtype (float32: a CPU engine's default)."""
    from freetoken.runtime import host_wait
    inner = ex
    fixed_branch = cpu_branch  # None: asked of the executor at every step (the cache's split moves)
    tuner = getattr(inner, "tuner", None)
    max_warmup = max(warmup, max_warmup or 0) if tuner is not None else warmup
    buf = None
    if routes is not None:
        buf = torch.full((len(mc.moe_layers), batch, mc.top_k), -1, dtype=torch.int64, device=dev)
        ex = ReplayRouting(ex, buf)
    model = model_class(mc.arch)(mc, w, ex, dev, dtype, 4096)
    ctx = prompt + max_warmup + tokens + 8 + (drift["steps"] if drift else 0)
    st = DecodeState(mc, batch, ctx, dev, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    tok = torch.zeros(batch, dtype=torch.long, device=dev)
    for b in range(batch):
        st.reserve(b, ctx)
        p = torch.randint(0, mc.vocab_size, (prompt,), generator=g).to(dev)
        tok[b] = model.prefill(p, st, b, 0)[-1].argmax()
    pos = torch.full((batch,), prompt, dtype=torch.long, device=dev)
    step = lambda: model.decode(tok, st, pos)  # noqa: E731
    graph = dev.type == "cuda" and ex.capturable
    variant = getattr(inner, "graph_variant", None)  # the cache's step with or without its CPU branch
    graphs = {}

    def fn():
        if not graph:
            return step()
        v = variant() if variant is not None else None
        if v not in graphs:  # captured the first time the split needs it, as the decode runner does
            graphs[v] = capture(step, dev)
        return graphs[v]()
    n_routes = routes.shape[0] if routes is not None else 0

    observe = getattr(inner, "observe_step", None)

    host = [0.0, 0.0, 0.0, 0]  # host seconds in launching, waiting, reading the tokens; steps

    def advance(k):
        t0 = time.perf_counter()
        if buf is not None:
            buf.copy_(routes[k % n_routes])
        pos.fill_(prompt + k)
        tok.copy_(fn().argmax(-1))
        t1 = time.perf_counter()
        host_wait.wait(dev, host_wait.has_cpu_branch(inner) if fixed_branch is None else fixed_branch)
        t2 = time.perf_counter()
        tok.tolist()  # the serving loop reads each step's tokens: a sync per step
        t3 = time.perf_counter()
        if observe is not None:
            observe(batch, time.perf_counter() - t0)
        host[0] += t1 - t0
        host[1] += t2 - t1
        host[2] += t3 - t2
        host[3] += 1
    k = 0
    while k < warmup or (k < max_warmup and tuner.climbing):  # the cache (and its split) reach a steady state
        advance(k)
        k += 1
    warmed = k
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    before = ex.stats()
    host[:] = [0.0, 0.0, 0.0, 0]
    t0 = time.perf_counter()
    for k in range(warmed, warmed + tokens):
        advance(k)
    sync()
    dt = (time.perf_counter() - t0) / tokens
    after = ex.stats()
    # the host's share of a timed step: the step's launch (graph replay or eager ops, the argmax),
    # the wait for it, the token read (after the wait: the read's own copy); the timed steps only
    host_split = {k: round(v / max(host[3], 1) * 1e6, 1) for k, v in zip(("launch", "wait", "read"), host)}
    if trace:  # a timeline of a few steps (CUDA kernels with their streams, the host side) for chrome://tracing
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for k in range(warmed + tokens, warmed + tokens + 3):
                advance(k)
            sync()
        prof.export_chrome_trace(trace)
    row = {"batch": batch, "graph": graph, "ms_per_step": round(dt * 1e3, 3), "tok_s": round(batch / dt, 1),
           "host_us_per_step": host_split}
    # the extras run after the timed steps, each failing on its own (a failure here must not send
    # the row to be timed again eagerly)
    if timeline and dev.type == "cuda":
        from bench.step_timeline import profile_steps
        first = warmed + tokens + 3
        try:
            row["timeline"] = profile_steps(lambda i: advance(first + i), 3, sync)
        except Exception as e:  # noqa: BLE001
            row["timeline_error"] = f"{type(e).__name__}: {e}"[:300]
    if drift and tuner is not None:
        try:
            row["drift"] = drift_run(advance, tuner, warmed + tokens + 6, drift)
        except Exception as e:  # noqa: BLE001
            row["drift_error"] = f"{type(e).__name__}: {e}"[:300]
    if dev.type == "cuda":
        branch = host_wait.has_cpu_branch(inner) if fixed_branch is None else fixed_branch
        row["host_wait"] = "block" if host_wait.blocks(branch) else "spin"  # at the last step
    if profile and dev.type == "cuda":
        from bench.decode import profile_step
        row["profile"] = profile_step(step, top=25)
    if after.get("cpu_branch_calls", 0) > before.get("cpu_branch_calls", 0):  # time inside the C++ call
        calls = after["cpu_branch_calls"] - before["cpu_branch_calls"]
        row["cpu_call_us"] = round((after["cpu_busy_s"] - before["cpu_busy_s"]) / calls * 1e6, 1)
        row["cpu_calls_per_step"] = round(calls / tokens, 2)
        row["cpu_branch_signal"] = after.get("cpu_branch_signal")
    if tuner is not None:
        row["fill_share_chosen"] = tuner.share
        row["warmup_steps"], row["split_decided"] = warmed, not tuner.climbing  # decided before the timed steps
        # the climb's probes at this batch size: (r, median ms of a step) in the order taken
        row["fill_share_probes"] = [(r, round(s * 1e3, 3)) for b, r, s in inner.tuner.history if b == batch]
    if "hits" in after:
        d = {k: after.get(k, 0) - before.get(k, 0) for k in ("hits", "fills", "cpu_experts", "prefetched", "prefetch_used")}
        missed = d["fills"] + d["cpu_experts"]  # misses the layers' own control steps saw
        row.update(miss_rate=round(missed / max(1, d["hits"] + missed), 4),
                   fills_per_step=round(d["fills"] / tokens, 2), cpu_experts_per_step=round(d["cpu_experts"] / tokens, 2),
                   transfer=after.get("transfer"))
        if "prefetch" in after:  # the lookahead's copies, beside the fills (they cross the link too)
            row.update(prefetched_per_step=round(d["prefetched"] / tokens, 2),
                       prefetch_accuracy=round(d["prefetch_used"] / d["prefetched"], 4) if d["prefetched"] else None)
    return row


def drift_run(advance, tuner, first: int, drift: dict) -> dict:
    """The host changes under a decided split: a memory hog (bench/hog.py) starts on the given
    CPUs (the CPU branch's own cores by default: a busy host's other work) and `steps` decode steps
    run on. Per step the r in use and the wall time; summed: the step at the old r under the hog
    (until the split reacts), how many steps the split took to start measuring again
    (share.py's hold watch), the r it settled on and the last 100 steps' median."""
    from bench.hog import MemoryHog
    r0, decisions, drifts = tuner.share, tuner.decisions, tuner.drifts
    trace = []  # (r, ms, climbing)
    with MemoryHog(drift["threads"], drift.get("cpus"), mb=drift.get("mb", 1024)) as h:
        for i in range(drift["steps"]):
            r = tuner.share
            t0 = time.perf_counter()
            advance(first + i)
            trace.append((r, (time.perf_counter() - t0) * 1e3, tuner.climbing))
    react = next((i for i, (_, _, c) in enumerate(trace) if c), None)  # the first step the split climbs again
    before = [ms for r, ms, _ in trace[:react if react is not None else len(trace)] if r == r0]
    tail = [ms for _, ms, _ in trace[-100:]]
    med = lambda v: round(statistics.median(v), 3) if v else None  # noqa: E731
    return {"hog_threads": drift["threads"], "hog_cpus": drift.get("cpus"), "hog_gbs": h.gbs, "steps": len(trace),
            "r_before": r0, "ms_at_r_before_with_hog": med(before), "steps_to_react": react,
            "drifts": tuner.drifts - drifts, "decisions": tuner.decisions - decisions,
            "r_after": tuner.share, "decided_after": not tuner.climbing, "ms_last_100": med(tail),
            "r_per_step": [r for r, _, _ in trace], "ms_per_step": [round(ms, 2) for _, ms, _ in trace]}


def hog(a):
    """The memory hog of --hog around one measurement (or nothing)."""
    import contextlib

    from bench.hog import MemoryHog
    if not a.hog:
        return contextlib.nullcontext()
    cpus = [int(c) for c in a.hog_cpus.split(",") if c] or list(range(os.cpu_count()))[-a.hog:]
    return MemoryHog(a.hog, cpus)


def adaptive_vs_fixed(runs: list[dict]) -> list[dict]:
    """Per batch size and thread count: the adaptive split (`cache`) against the better of
    fill-only and the best fixed split measured in the same run (the issue's 5% criterion)."""
    out = []
    for row in runs:
        if row["mode"] != "cache" or "tok_s" not in row:
            continue
        same = [x for x in runs if x["batch"] == row["batch"] and "tok_s" in x and
                x.get("prefetch", 0) == row.get("prefetch", 0) and x.get("pieces", 1) == row.get("pieces", 1) and
                (x["mode"] == "split" and x["threads"] == row["threads"] or x["mode"] == "fill-only")]
        if same:
            best = max(same, key=lambda x: x["tok_s"])
            out.append({"batch": row["batch"], "threads": row["threads"], "prefetch": row.get("prefetch", 0),
                        "pieces": row.get("pieces", 1),
                        "cache_tok_s": row["tok_s"],
                        "best_fixed": best["mode"] if best["mode"] == "fill-only" else f"split r={best['fill_share']}",
                        "best_fixed_tok_s": best["tok_s"], "ratio": round(row["tok_s"] / best["tok_s"], 3)})
    return out


def side_by_side(a, cfg, mc, w, gu, dn, res) -> dict:
    """llama.cpp on the same weights, before our rows (nothing of ours runs meanwhile):
    {(threads, capacity, resident): tok/s}; res gains the runs and the export/build times."""
    from pathlib import Path

    from bench import llamacpp
    out = {}
    try:
        t0 = time.perf_counter()
        binary = llamacpp.build(llamacpp.source(), Path(a.llamacpp_build), cuda=True)
        res["llamacpp_build_s"] = round(time.perf_counter() - t0, 1)
        gguf, took = llamacpp.slice_gguf(cfg, mc, w, gu, dn, a.gguf, llamacpp.source())
        res["gguf_export_s"] = round(took, 1) if took is not None else "reused"
        layers = len(mc.moe_layers)
        runs = []
        threads = sorted({int(t) for t in a.threads.split(",")})
        plans = [(t, a.capacity, False) for t in threads] if {"cache", "split", "fill-only"} & set(a.modes.split(",")) else []
        plans += [(t, 0.0, False) for t in threads] if "cpu-only" in a.modes else []
        plans += [(None, 1.0, True)] if "resident" in a.modes else []
        for t, cap, resident in plans:
            ncmoe = 0 if resident else llamacpp.n_cpu_moe_for(cap, layers)
            with hog(a) as h:
                r = llamacpp.bench_decode(binary, gguf, threads=t or max(threads), n_cpu_moe=ncmoe, n_gen=a.tokens)
            runs.append(dict(r, capacity=cap, **({"hog_gbs": h.gbs} if h is not None else {})))
            out[(t, None if resident else cap, resident)] = r["tok_s"]
            print("llama.cpp", runs[-1], flush=True)
        res["llamacpp"] = runs
    except Exception as e:  # our rows still run
        res["llamacpp_error"] = f"{type(e).__name__}: {e}"[:600]
        print("llama.cpp side by side failed:", res["llamacpp_error"], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen36", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--capacity", type=float, default=0.33, help="slots as a fraction of all experts")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--threads", default="6,14", help="CPU threads of the rows that use the CPU (16-core host: 14 leaves two cores to the launching and callback threads)")
    ap.add_argument("--modes", default="resident,fill-only,cache,split,cpu-only")
    ap.add_argument("--fill-shares", default="0.75", help="fixed r of the `split` rows")
    ap.add_argument("--cache-warmup", type=int, default=1500, help="most warm-up steps of `cache` rows: they warm up "
                    "until the adaptive split has decided (a server's steady state), at least --warmup steps")
    ap.add_argument("--start-share", default="predicted", help="where the adaptive split's climb starts: "
                    "'predicted' (B_P / (B_P + B_H) as measured here, what `ft bench bw`'s profile gives the engine) or a number (1: fill-only)")
    ap.add_argument("--policy", default="recent", choices=["recent", "gate", "lfu"])
    ap.add_argument("--prefetch", default="0", help="lookahead: experts a layer copies in ahead for the next "
                    "(with --pieces, that many experts' pieces, as the engine's --expert-prefetch) "
                    "(comma-separated values: a row each; 0 off; not with trace routing, whose routes the model's "
                    "routers cannot predict)")
    ap.add_argument("--routing", default="model")
    ap.add_argument("--pieces", default="1", help="experts cut into this many pieces of their intermediate dimension "
                    "(experts/pieces.py; comma-separated: the rows of each value, each dividing the next)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--name", default="expert_cache", help="result file name (before -gpu.json)")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp side by side (bench/llamacpp.py): build it "
                    "from .llama/ if needed, write the same weights as a GGUF, time llama-bench at each thread count "
                    "with -ncmoe giving it the same share of the experts in VRAM; fills llamacpp_tok_s of batch-1 rows")
    ap.add_argument("--llamacpp-build", default="/tmp/ft-llama-build", help="llama.cpp CUDA build folder (reused)")
    ap.add_argument("--gguf", default="/tmp/ft-expert-cache.gguf", help="where the GGUF of the slice is written")
    ap.add_argument("--hog", type=int, default=0, help="threads of a concurrent host-memory hog (bench/hog.py) "
                    "running while every row (and llama.cpp's) is measured; 0: none")
    ap.add_argument("--hog-cpus", default="", help="CPUs the hog runs on (default: the last --hog CPUs)")
    ap.add_argument("--trace", action="store_true", help="save a profiler timeline of 3 steps per row ($OUT or "
                    "benchmarks/results, trace-<mode>-<r>-b<batch>-t<threads>.json)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.expert_cache needs a CUDA device (the cache's slots live in VRAM)")
    if a.routing != "model" and any(int(v) for v in a.prefetch.split(",")):
        raise SystemExit("--prefetch needs --routing model: replayed routes cannot be predicted by the model's routers")
    dev = torch.device("cuda")
    cfg = dict(SHAPES[a.shape], num_hidden_layers=a.layers)
    mc = ModelConfig.from_hf(cfg)
    g = torch.Generator(device=dev).manual_seed(0)
    w = {n: random_tensor(n, s, g, device=dev, embed_std=0.02) for n, s in weight_shapes(mc, experts=False).items()}
    t0 = time.perf_counter()
    gu, dn = make_experts(mc, dev)
    expert_bytes = (gu[0].numel() + dn[0].numel()) * 2
    slots = max(1, int(a.capacity * mc.num_flat_experts))
    res = {"model": f"{a.shape} shape, random BF16, {a.layers} layers", "config": cfg,
           "pool_gb": round(gu.shape[0] * expert_bytes / 1e9, 2), "expert_mb": round(expert_bytes / 1e6, 2),
           "capacity": a.capacity, "slots": slots, "policy": a.policy, "routing": a.routing,
           "setup_s": round(time.perf_counter() - t0, 1), **measure_bp(gu, dn, dev), "runs": []}
    hb = [huge_bytes(gu), huge_bytes(dn)]
    res.update(thp=thp_mode(), bank_huge_gb=None if None in hb else round(sum(hb) / 1e9, 2))
    llama = side_by_side(a, cfg, mc, w, gu, dn, res) if a.llamacpp else {}
    from freetoken.experts.cpu import CpuExpertExecutor
    resident = {}  # batch -> resident ms per step
    pieces = [int(p) for p in a.pieces.split(",")]
    if any(p < 1 or q % p for p, q in zip([1] + pieces, pieces)):
        raise SystemExit(f"--pieces {a.pieces}: each value must divide the next (the banks are cut in place)")
    cut = 1
    for p, batch in [(p, int(b)) for p in pieces for b in a.batch.split(",")]:
        if p != cut:  # the banks re-laid in place: every expert cut into p pieces
            t0 = time.perf_counter()
            gu, dn = split_banks_(gu, dn, p // cut)
            res.setdefault("split_s", {})[p] = round(time.perf_counter() - t0, 1)
            print(f"experts cut into {p} pieces in {res['split_s'][p]} s", flush=True)
            cut = p
        routes, rinfo = replay_steps(a.routing, mc, batch, dev, SHAPES[a.shape]["num_hidden_layers"])
        res["routing_trace"] = rinfo
        for mode in a.modes.split(","):
            thread_list = [int(t) for t in a.threads.split(",")]
            if mode in ("resident", "fill-only"):  # the CPU computes no expert: one row
                thread_list = [0] if mode == "resident" else thread_list[:1]
            shares = [float(r) for r in a.fill_shares.split(",")] if mode == "split" else [None if mode == "cache" else 1.0]
            pfs = [int(v) for v in a.prefetch.split(",")] if mode in ("cache", "split", "fill-only") else [0]
            for threads in thread_list:
                for r, pf in [(r, pf) for r in shares for pf in pfs]:
                    if mode == "resident":
                        ex = TorchExpertExecutor(gu.to(dev), dn.to(dev), layer_experts=mc.num_experts * p)
                    else:
                        cpu = CpuExpertExecutor(gu, dn, threads=threads)
                        if f"bh_{threads}_gbs" not in res:
                            res[f"bh_{threads}_gbs"] = round(measure_bh(cpu, mc, dev), 1)
                        if mode == "cpu-only":  # decode steps in stream order (one graph) where it can
                            from freetoken.experts.cpu.hostcall import StreamedCpuExecutor, host_branch_ok
                            ex = StreamedCpuExecutor(cpu, dev) if host_branch_ok(cpu) else cpu
                        else:
                            bh = res[f"bh_{threads}_gbs"]
                            start = (res["bp_kernel_gbs"] / (res["bp_kernel_gbs"] + bh) if a.start_share == "predicted"
                                     else float(a.start_share))
                            ex = CachedExpertExecutor(gu, dn, None, dev, torch.bfloat16, cpu, r, a.policy,
                                                      mc.num_experts * p, start_share=start, prefetch=pf * p)
                            # decode rows: the control kernel's prefill call sizes (compiled at an engine's
                            # load, 5 variants, up to a minute) are not met here; a call size compiles when used
                            ex.warm_control = False
                            ex.allocate(slots * p)
                    if p > 1:
                        ex = PiecedExecutor(ex, p)
                    row = {"mode": mode, "threads": threads or None, "fill_share": r if mode == "split" else None,
                           "capacity": a.capacity if mode in ("cache", "split", "fill-only") else None,
                           "routing": a.routing, "pieces": p}
                    if mode in ("cache", "split", "fill-only"):
                        row["prefetch"] = pf
                    if mode == "cache":
                        row["start_share"] = round(start, 3)
                    warm = a.warmup
                    try:
                        trace = os.path.join(os.environ.get("OUT") or "benchmarks/results",
                                             f"trace-{mode}-{r}-b{batch}-t{threads}.json") if a.trace else None
                        with hog(a) as h:
                            row.update(run_config(mc, w, ex, dev, batch, a.tokens, warm, routes, trace=trace,
                                                  max_warmup=a.cache_warmup))
                        if h is not None:
                            row["hog_gbs"] = h.gbs
                    except Exception as e:  # one failed configuration does not lose the others
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    if mode == "resident":
                        resident.setdefault(batch, row.get("ms_per_step"))
                    # llama.cpp's equivalent: same threads, same share of the experts in VRAM, batch 1
                    row["llamacpp_tok_s"] = llama.get((threads or None, row["capacity"] if mode != "cpu-only" else 0.0,
                                                       mode == "resident")) if batch == 1 else None
                    print(row, flush=True)
                    res["runs"].append(row)
                    del ex
                    torch.cuda.empty_cache()
    for batch in {row.get("batch") for row in res["runs"]} - set(resident) - {None}:
        # no resident row asked for: its step is still timed (briefly, not a row) for the floors
        try:
            ex = TorchExpertExecutor(gu.to(dev), dn.to(dev), layer_experts=mc.num_experts * cut)
            ex = PiecedExecutor(ex, cut) if cut > 1 else ex
            routes, _ = replay_steps(a.routing, mc, batch, dev, SHAPES[a.shape]["num_hidden_layers"])
            resident[batch] = run_config(mc, w, ex, dev, batch, 32, 8, routes)["ms_per_step"]
            res.setdefault("resident_ms_for_floor", {})[batch] = resident[batch]
            del ex
            torch.cuda.empty_cache()
        except Exception as e:  # the rows stand without their floors
            res.setdefault("floor_errors", []).append(f"batch {batch}: {type(e).__name__}: {e}"[:300])
    if any(row["mode"] in ("cache", "split") for row in res["runs"]):
        # after the rows: torch's OpenMP threads keep spinning after a parallel region
        from bench.cpu_experts import read_bandwidth
        span = gu[:max(1, min(gu.shape[0], (4 << 30) // (gu[0].numel() * gu.element_size())))]  # ~4 GB of bank
        res["host_read_gbs"] = round(read_bandwidth(span, os.cpu_count() or 1), 1)
    for row in res["runs"]:  # the analytic floors, once the resident step of the batch size is known
        bh = res.get(f"bh_{row['threads'] or 0}_gbs")
        if resident.get(row.get("batch")) and "miss_rate" in row and bh is not None:
            row.update(floors(row, resident[row["batch"]], res["bp_kernel_gbs"], bh, res.get("host_read_gbs"),
                              expert_bytes // row.get("pieces", 1)))
    res["adaptive_vs_fixed"] = adaptive_vs_fixed(res["runs"])
    if a.hog:
        res["hog"] = {"threads": a.hog, "cpus": a.hog_cpus or f"the last {a.hog}"}
    write_result(a.name, res)


if __name__ == "__main__":
    main()
