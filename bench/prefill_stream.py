"""Prefill tok/s with the routed experts offloaded to pinned host memory and streamed per layer in
layer-major passes (runtime/prefill_stream.py, experts/stream.py), on a Qwen3.6-35B-A3B-shaped
model with random BF16 weights made in place (no file). GPU only.

Rows (`runs`), per --layers (12: the slice; 40: the full model), buffering and prompt length:
  buffering      triple / double / single / on-demand (asked; `mode_ran` is what the pool allowed), or
                 `resident` (every expert in VRAM, chunked prefill: the compute-bound ceiling)
  tok_s, pass_s  prompt tokens per second; mean seconds of one pass (ceil(n / pass_tokens) passes)
  floor_s        the transfer floor of one pass: pool_bytes / B_P, B_P measured in this run with
                 expert-sized copies from the pinned banks (one copy-engine copy per expert and
                 bank); floor_bulk_s with whole-layer copies (what a full layer load issues)
  of_floor       floor_s / pass_s (1.0: transfer-bound at line rate)
  resident-pass  (--compute-pass) the same passes with every expert resident in VRAM: their
                 compute alone, nothing streamed; `resident-N` rows: chunked at N tokens
                 (--resident-chunks), `resident` being the engine's default 2,048; with --profile
                 the resident-pass rows at the longest length (one per --compute-subs value) also
                 get `profile`: GPU time by kernel over that row's passes; with --timeline the
                 double and triple rows at the longest length get `timeline`: the copy engine against the
                 compute, one more pass profiled (bench/copy_timeline.py)
  bound_s        max(floor_s, the resident row's seconds per pass at that length): a pass can beat
                 neither; of_bound = bound_s / pass_s, `bound` says which limit binds
  llamacpp_tok_s with --llamacpp: llama.cpp's prompt processing of the same weights (a GGUF written
                 by its converter, bench/llamacpp.py) and length in the same run, before our rows:
                 on the streamed rows with the experts of all but two layers in host memory
                 (`-ncmoe L-2`: the two layers' worth of VRAM our pool has) and its default
                 512-token micro-batch, `llamacpp_ub4096_tok_s` with `-ub 4096`; on the resident
                 rows all in VRAM. Null without it, or past --llamacpp-max-layers (a 40-layer GGUF
                 is 64 GB: more than the GPU machine's disk holds beside the system), or at a
                 length left out of --llamacpp-lengths
Each streamed run starts cold (an empty slot pool), the pool holding `--slots` experts (default
two layers: what double buffering needs, the consumer-card case). A warm-up pass per mode
compiles and autotunes first.
    python -m bench.prefill_stream [--layers 12,40] [--lengths 1024,2048,4096,8192,16384,32768]
        [--buffering double,single,on-demand] [--pass-tokens 32768] [--slots 512] [--no-resident]
        [--compute-pass [--compute-subs 8192,32768] [--mixer-subs 2048,8192] [--profile]]
        [--llamacpp [--llamacpp-lengths 1024,4096]]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import timeit, write_result
from bench.decode import QWEN36_35B_A3B
from freetoken.config import ModelConfig
from freetoken.demo import random_tensor, weight_shapes
from freetoken.experts.cached import CachedExpertExecutor
from freetoken.experts.executor import ExpertExecutor, TorchExpertExecutor
from freetoken.model.registry import model_class
from freetoken.model.state import DecodeState
from freetoken.runtime.prefill_stream import PrefillStream
from freetoken.weights.hostmem import host_tensor
from freetoken.weights.reader import pin_in_place

SUB = 2048  # the engine's default --prefill-chunk: pieces of a pass, and the resident baseline's chunks


def host_bank(shape, dtype) -> torch.Tensor:
    """A host tensor on page boundaries that owns its padding, for pin_in_place (cudaHostRegister,
    exact size: the caching pinned allocator rounds each allocation up to a power of two, 64 GiB
    for the 40-layer gate_up bank's 43 GB), on huge pages as the engine's FTW banks are."""
    return host_tensor(shape, dtype)


def make_experts(mc, dev, seed: int = 0):
    """Random BF16 expert banks in registered host memory, made layer by layer on the device."""
    n, i, h, e = mc.num_flat_experts, mc.moe_intermediate_size, mc.hidden_size, mc.num_experts
    gu, dn = host_bank((n, 2 * i, h), torch.bfloat16), host_bank((n, h, i), torch.bfloat16)  # [N, 2I, H], [N, H, I]
    g = torch.Generator(device=dev).manual_seed(seed)
    for s in range(0, n, e):
        gu[s:s + e].copy_(torch.randn(e, 2 * i, h, generator=g, device=dev, dtype=torch.bfloat16).mul_(h ** -0.5))
        dn[s:s + e].copy_(torch.randn(e, h, i, generator=g, device=dev, dtype=torch.bfloat16).mul_(i ** -0.5))
    from freetoken.kernels.expert_transfer import zero_copy_ok
    # registered views: Tensor.is_pinned() looks at the storage's start, not these pages
    if not pin_in_place([gu, dn]) or not (zero_copy_ok(gu) and zero_copy_ok(dn)):
        raise SystemExit("could not register the expert banks for DMA (cudaHostRegister): the numbers would be "
                         "pageable-copy numbers")
    return gu, dn


def measure_bp(gu, dn, dev, experts: int = 64) -> dict:
    """GB/s from the pinned banks into VRAM: expert-sized copies (one per expert and bank), and
    bulk (one layer's experts per bank in one copy)."""
    e = min(experts, gu.shape[0])
    dst = [torch.empty(e, *gu.shape[1:], dtype=gu.dtype, device=dev), torch.empty(e, *dn.shape[1:], dtype=dn.dtype,
                                                                                  device=dev)]
    src = torch.randperm(gu.shape[0])[:e].tolist()
    nbytes = e * (gu[0].numel() + dn[0].numel()) * gu.element_size()

    def per_expert():
        for j, f in enumerate(src):
            dst[0][j].copy_(gu[f], non_blocking=True)
            dst[1][j].copy_(dn[f], non_blocking=True)

    def bulk():
        dst[0].copy_(gu[:e], non_blocking=True)
        dst[1].copy_(dn[:e], non_blocking=True)
    return {name: nbytes / timeit(fn, warmup=1, iters=5, sync=torch.cuda.synchronize)
            for name, fn in (("expert", per_expert), ("bulk", bulk))}


def cold(cache) -> None:
    """An empty pool: every run streams from scratch (no experts left by the previous run)."""
    res = cache.pool.res
    res.slot_of.fill_(-1)
    res.id_of.fill_(-1)


def run_layers(layers: int, a, dev, res: dict) -> None:
    cfg = dict(QWEN36_35B_A3B, num_hidden_layers=layers)
    mc = ModelConfig.from_hf(cfg)
    lengths = [int(x) for x in a.lengths.split(",")]
    max_len = max(lengths) + 64
    g = torch.Generator(device=dev).manual_seed(0)
    w = {n: random_tensor(n, s, g, device=dev, embed_std=0.02) for n, s in weight_shapes(mc, experts=False).items()}
    t0 = time.perf_counter()
    gu, dn = make_experts(mc, dev)  # pinned host banks [N, 2I, H], [N, H, I]
    setup_s = time.perf_counter() - t0
    e = mc.num_experts
    slot_bytes = (gu[0].numel() + dn[0].numel()) * gu.element_size()
    pool_bytes = gu.shape[0] * slot_bytes
    bp = measure_bp(gu, dn, dev)
    floor_s, floor_bulk_s = pool_bytes / bp["expert"], pool_bytes / bp["bulk"]
    slots = a.slots or 2 * e
    res["sections"].append({"layers": layers, "pool_gb": round(pool_bytes / 1e9, 2), "slots": slots,
                            "slots_gb": round(slots * slot_bytes / 1e9, 2), "bp_expert_gbs": round(bp["expert"] / 1e9, 1),
                            "bp_bulk_gbs": round(bp["bulk"] / 1e9, 1), "setup_s": round(setup_s, 1)})
    print(res["sections"][-1], flush=True)
    llama = side_by_side(a, cfg, mc, w, gu, dn, a.llamacpp_lengths or lengths, slots, res["sections"][-1]) \
        if a.llamacpp and layers <= a.llamacpp_max_layers else {}
    st = DecodeState(mc, 1, max_len, dev, torch.bfloat16, chunk=a.pass_tokens)  # rings (window layers) sized for a pass
    st.reserve(0, max_len)
    prompt = torch.randint(0, mc.vocab_size, (max(lengths),)).tolist()
    # the cache's CPU branch never runs in a prefill pass: the host torch path stands in for it
    cache = CachedExpertExecutor(gu, dn, None, dev, torch.bfloat16, TorchExpertExecutor(gu, dn), 1.0, "recent",
                                 layer_experts=e)
    # a pass never runs the decode cache's control kernel: not compiled here (its variants for a new
    # slot count took a cold machine past plan 137's and 138's 130-150 s step limits before any row)
    cache.warm_control = False
    cache.allocate(slots)
    model = model_class(mc.arch)(mc, w, cache, dev, torch.bfloat16, max_len)
    for buffering, msub, sft, toc in [(b, int(m), int(t), c == "1") for b in a.buffering.split(",")
                                      for m in a.stream_mixer_subs.split(",") for t in a.sync_free_tokens.split(",")
                                      for c in a.table_on_copy.split(",")]:
        ps = PrefillStream(model, mc, cache, msub, max_pass_tokens=a.pass_tokens, buffering=buffering)
        if sft >= 0:  # passes this long skip the loader's routed-set sync (experts/stream.py)
            ps.loader.sync_free_tokens = sft or None
        ps.loader.table_on_copy = toc  # a layer's slot table uploaded on the copy stream (experts/stream.py)

        def prefill(n):
            st.reset(0)
            cold(cache)
            torch.cuda.synchronize()
            t = time.perf_counter()
            ps.prefill(prompt[:n], st, 0, 0)
            torch.cuda.synchronize()
            return time.perf_counter() - t
        print(f"{buffering}, mixer pieces of {msub}, sync-free from {ps.loader.sync_free_tokens}, "
              f"table on the copy stream {toc}: warm-up passes",
              flush=True)
        prefill(min(SUB, max(lengths)))  # compile and autotune
        prefill(min(a.pass_tokens, max(lengths)))
        for n in lengths:
            reps = 1 if n >= 8192 else 2  # short runs are noisier: the better of two
            before = dict(ps.loader.counts)
            wall = min(prefill(n) for _ in range(reps))
            after = ps.loader.counts
            d = {k: (after[k] - before[k]) // reps for k in ("layers_full", "layers_routed", "experts_h2d",
                                                             "experts_skipped", "passes")}
            passes = max(1, d["passes"])
            row = {"layers": layers, "prompt_tokens": n, "buffering": buffering, "mode_ran": ps.loader.mode,
                   "mixer_sub": msub, "sync_free_tokens": ps.loader.sync_free_tokens, "table_on_copy": toc,
                   "tok_s": round(n / wall, 1), "pass_s": round(wall / passes, 4), "passes": passes,
                   "floor_s": round(floor_s, 4), "floor_bulk_s": round(floor_bulk_s, 4),
                   "of_floor": round(floor_s / (wall / passes), 3), "pass_tokens": ps.pass_tokens(), **d,
                   "llamacpp_tok_s": llama.get((n, "offloaded")) if buffering == "double" else None}
            if buffering == "double" and llama:
                row["llamacpp_ub4096_tok_s"] = llama.get((n, "offloaded-ub4096"))
            if a.timeline and n == max(lengths) and buffering in ("double", "triple"):  # one more run, profiled
                from bench.copy_timeline import timeline
                row["timeline"] = timeline(lambda: prefill(n), host=a.timeline_host)
            print(row, flush=True)
            res["runs"].append(row)
        del ps
    del model, cache
    torch.cuda.empty_cache()
    if a.compute_pass:
        compute_pass_rows(a, layers, mc, w, gu, dn, st, prompt, lengths, max_len, dev, res)
        torch.cuda.empty_cache()  # its copy of every expert in VRAM
    if a.resident:
        ex = TorchExpertExecutor(gu.to(dev), dn.to(dev), layer_experts=e)
        model = model_class(mc.arch)(mc, w, ex, dev, torch.bfloat16, max_len)
        tokens = torch.tensor(prompt, device=dev)

        def chunked(n, sub):
            st.reset(0)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for s in range(0, n, sub):
                model.prefill(tokens[s:min(n, s + sub)], st, 0, s, logits=s + sub >= n)
            torch.cuda.synchronize()
            return time.perf_counter() - t
        for sub in [int(c) for c in a.resident_chunks.split(",")]:
            # compile and autotune every chunk size the rows run (plan 113's 16k row chunked at
            # 32,768 compiled its one 16k chunk inside the timed run: 7.8 s)
            for size in sorted({min(sub, n - s) for n in lengths for s in range(0, n, sub)}):
                chunked(size, sub)
            for n in lengths:
                wall = chunked(n, sub)
                # the engine's default chunk is the row the bounds read ("resident"); others say theirs
                row = {"layers": layers, "prompt_tokens": n, "buffering": "resident" if sub == SUB else f"resident-{sub}",
                       "chunk": sub, "tok_s": round(n / wall, 1), "pass_s": None, "floor_s": None,
                       "llamacpp_tok_s": llama.get((n, "resident")) if sub == SUB else None}
                if a.profile and n == min(lengths):  # GPU time against wall: is a chunked prefill host-bound?
                    from bench.prefill import kernels
                    row["profile"] = kernels(lambda: chunked(n, sub), top=15, ops=True)
                    row["profile"]["wall_ms"] = round(wall * 1e3, 1)
                print(row, flush=True)
                res["runs"].append(row)
        del ex, model
    del gu, dn, st, w
    torch.cuda.empty_cache()


class SubChunked(ExpertExecutor):
    """A resident executor whose prefill calls run in sub-chunks of `sub` tokens, as the pass's
    loader computes a layer's experts (experts/stream.py LayerStreamer._compute)."""

    def __init__(self, inner: ExpertExecutor, sub: int):
        self.inner, self.sub = inner, sub
        self.backend, self.activation = inner.backend, inner.activation  # what the MoE block checks
        self.gate_up_bias, self.down_bias = inner.gate_up_bias, inner.down_bias

    def run(self, x, ids, weights, phase):  # x [T, H], ids / weights [T, k] -> [T, H]
        if phase != "prefill":
            return self.inner.run(x, ids, weights, phase)
        return torch.cat([self.inner.run(x[a:a + self.sub], ids[a:a + self.sub], weights[a:a + self.sub], phase)
                          for a in range(0, x.shape[0], self.sub)])


def compute_pass_rows(a, layers, mc, w, gu, dn, st, prompt, lengths, max_len, dev, res) -> None:
    """Rows `resident-pass`: a streamed pass's order of work with nothing to stream, every expert
    resident in VRAM. As runtime/prefill_stream.py runs a pass: one varlen forward over the pass's
    tokens in pieces of SUB (the token mixers piece by piece, the dense MLP parts over the whole
    pass at once), the experts in sub-chunks of SUB tokens. Its time is the pass's compute alone:
    what bounds a streamed pass once the link does not (the non-expert part included), and against
    the `resident` rows (chunked prefill, the same tokens) what the layer-major order gains."""
    ex = SubChunked(TorchExpertExecutor(gu.to(dev), dn.to(dev), layer_experts=mc.num_experts), SUB)
    model = model_class(mc.arch)(mc, w, ex, dev, torch.bfloat16, max_len)
    tokens = torch.tensor(prompt, device=dev)
    # (mixer piece, expert sub-chunk) pairs, the experts in sub-chunks of at least the mixers' pieces
    runs = dict.fromkeys((m, max(int(e), m)) for m in (int(c) for c in a.mixer_subs.split(","))
                         for e in a.compute_subs.split(","))
    for msub, esub in runs:
        ex.sub = esub  # the experts' sub-chunk: larger ones give each expert's GEMM more rows
        pass_rows(a, layers, model, st, tokens, lengths, esub, res, msub)
    del ex, model


def pass_rows(a, layers, model, st, tokens, lengths, esub, res, msub: int = SUB) -> None:
    """The resident-pass rows of one expert sub-chunk size and one mixer piece size (compute_pass_rows)."""
    def passes(n):
        st.reset(0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for s in range(0, n, a.pass_tokens):
            e = min(n, s + a.pass_tokens)
            pieces = [(0, p, min(e, p + msub) - p, None, e == n and p + msub >= e) for p in range(s, e, msub)]
            model.prefill_batch(tokens[s:e], st, pieces)
        torch.cuda.synchronize()
        return time.perf_counter() - t
    passes(min(msub, max(lengths)))  # compile and autotune
    passes(min(a.pass_tokens, max(lengths)))
    for n in lengths:
        wall = min(passes(n) for _ in range(1 if n >= 8192 else 2))
        count = -(-n // a.pass_tokens)
        kind = "resident-pass" if esub == SUB else f"resident-pass-{esub}"
        row = {"layers": layers, "prompt_tokens": n, "buffering": kind if msub == SUB else f"{kind}-mixers-{msub}",
               "expert_sub": esub, "mixer_sub": msub, "tok_s": round(n / wall, 1),
               "pass_s": round(wall / count, 4), "passes": count, "floor_s": None, "llamacpp_tok_s": None}
        if a.profile and n == max(lengths):  # where the longest pass's compute goes, kernel by kernel
            from bench.prefill import kernels
            row["profile"] = kernels(lambda: passes(n), top=25, ops=True)
        print(row, flush=True)
        res["runs"].append(row)


def side_by_side(a, cfg, mc, w, gu, dn, lengths, slots, section) -> dict:
    """llama.cpp's prompt processing on the same weights, before our rows: {(tokens, setting):
    tok/s}, settings "offloaded" (default micro-batch), "offloaded-ub4096", "resident"; the
    runs go into the section."""
    from pathlib import Path

    from bench import llamacpp
    out, runs = {}, []
    try:
        # the GGUF first: a device plan's background build (bench/device_llamacpp.sh build) goes on meanwhile
        gguf, took = llamacpp.slice_gguf(cfg, mc, w, gu, dn, a.gguf, llamacpp.source())
        binary = llamacpp.build(llamacpp.source(), Path(a.llamacpp_build), cuda=True)
        section["gguf_export_s"] = round(took, 1) if took is not None else "reused"
        layers = len(mc.moe_layers)
        on_cpu = max(0, layers - slots // mc.num_experts)  # whole layers of experts in VRAM: as many as our slots
        for n in lengths:
            plans = [("offloaded", on_cpu, None), ("offloaded-ub4096", on_cpu, min(4096, n))]
            plans += [("resident", 0, None)] if a.resident else []
            for name, ncmoe, ub in plans:
                r = llamacpp.bench_prefill(binary, gguf, tokens=n, n_cpu_moe=ncmoe, threads=a.llamacpp_threads, ubatch=ub)
                out[(n, name)] = r["tok_s"]
                runs.append(dict(r, setting=name))
                print("llama.cpp", runs[-1], flush=True)
    except Exception as e:  # our rows still run
        section["llamacpp_error"] = f"{type(e).__name__}: {e}"[:600]
        print("llama.cpp side by side failed:", section["llamacpp_error"], flush=True)
    section["llamacpp"] = runs
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="12,40")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--buffering", default="double,single,on-demand")
    ap.add_argument("--pass-tokens", type=int, default=32768, help="most tokens one pass takes")
    ap.add_argument("--slots", type=int, default=0, help="expert slots in VRAM (0: two layers' worth)")
    ap.add_argument("--no-resident", dest="resident", action="store_false",
                    help="skip the all-experts-in-VRAM chunked prefill rows")
    ap.add_argument("--resident-chunks", default=str(SUB),
                    help="chunk sizes of the resident rows (the first row kind's default: the engine's 2,048)")
    ap.add_argument("--compute-pass", action="store_true",
                    help="add `resident-pass` rows: the passes with every expert resident (their compute alone)")
    ap.add_argument("--profile", action="store_true",
                    help="the --compute-pass rows at the longest length also get `profile`: GPU time by kernel "
                         "and by the torch op that launched it (torch.profiler, the 25 costliest of each), where a "
                         "compute-bound pass goes (needs --compute-pass); the --resident-chunks rows at the "
                         "shortest length get one too, with their wall time (GPU time well under it: host-bound)")
    ap.add_argument("--timeline", action="store_true",
                    help="the double and triple rows at the longest length also get `timeline` (bench/copy_timeline.py): "
                         "one more pass, profiled: the copy engine's and the compute's busy time and idle gaps, "
                         "copy GB/s alone and under compute")
    ap.add_argument("--timeline-host", action="store_true",
                    help="the timeline also traces the host's calls (dates each launch: host lateness), which "
                         "slows the host and so the pass it profiles")
    ap.add_argument("--sync-free-tokens", default="-1",
                    help="passes of this many tokens or more skip the loader's per-layer routed-set sync "
                         "(experts/stream.py SYNC_FREE_TOKENS; 0: never skip; -1: the loader's default); "
                         "several separated by commas: rows for each, in turn")
    ap.add_argument("--table-on-copy", default="0",
                    help="1: a layer's slot table goes up on the copy stream ahead of its bulk copy, 0: on the "
                         "compute stream (experts/stream.py TABLE_ON_COPY); 0,1: rows for each, in turn")
    ap.add_argument("--stream-mixer-subs", default=str(SUB),
                    help="the token mixers' piece sizes of the streamed rows (the engine's: --prefill-chunk, 2,048)")
    ap.add_argument("--mixer-subs", default=str(SUB),
                    help="the token mixers' piece sizes of the --compute-pass rows (the engine's: --prefill-chunk, 2,048); "
                         "experts then in sub-chunks of at least that")
    ap.add_argument("--compute-subs", default=str(SUB),
                    help="the experts' sub-chunk sizes of the --compute-pass rows (the mixers in pieces of --mixer-subs)")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp side by side (see llamacpp_tok_s above)")
    ap.add_argument("--llamacpp-build", default="/tmp/ft-llama-build", help="llama.cpp CUDA build folder (reused)")
    ap.add_argument("--llamacpp-threads", type=int, default=14)
    ap.add_argument("--llamacpp-max-layers", type=int, default=24, help="sections with more layers get no llama.cpp rows")
    ap.add_argument("--llamacpp-lengths", default="",
                    help="prompt lengths llama.cpp runs (default: all of --lengths; its default micro-batch "
                         "prefills a few hundred tokens a second on the 12-layer slice, slow at 32k)")
    ap.add_argument("--gguf", default="/tmp/ft-expert-cache.gguf", help="the slice's GGUF (shared with bench.expert_cache)")
    ap.add_argument("--name", default="prefill_stream", help="result name (results/NAME-gpu.json)")
    a = ap.parse_args()
    try:
        a.llamacpp_lengths = [int(x) for x in a.llamacpp_lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--llamacpp-lengths takes prompt lengths separated by commas, got {a.llamacpp_lengths!r}")
    for opt in ("lengths", "compute_subs", "mixer_subs", "resident_chunks", "stream_mixer_subs"):
        vals = getattr(a, opt).split(",")
        if not all(v.strip().isdigit() and int(v) > 0 for v in vals):
            ap.error(f"--{opt.replace('_', '-')} takes positive token counts separated by commas, got {getattr(a, opt)!r}")
    if not all(v.strip().lstrip("-").isdigit() and int(v) >= -1 for v in a.sync_free_tokens.split(",")):
        ap.error(f"--sync-free-tokens takes token counts (0: never, -1: the default) separated by commas, "
                 f"got {a.sync_free_tokens!r}")
    if not all(v.strip() in ("0", "1") for v in a.table_on_copy.split(",")):
        ap.error(f"--table-on-copy takes 0 or 1 separated by commas, got {a.table_on_copy!r}")
    if a.profile and not a.compute_pass:
        ap.error("--profile profiles the --compute-pass rows: give --compute-pass too")
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill_stream needs a CUDA device: it streams experts from pinned host memory "
                         "into VRAM slots (run it on the GPU machine)")
    dev = torch.device("cuda")
    res = {"model": "Qwen3.6-35B-A3B shape, random BF16, experts in pinned host memory",
           "config": QWEN36_35B_A3B, "sub_chunk": SUB, "pass_tokens": a.pass_tokens, "sections": [], "runs": []}
    for layers in [int(x) for x in a.layers.split(",")]:
        run_layers(layers, a, dev, res)
    add_bounds(res["runs"])
    write_result(a.name, res)


def add_bounds(runs: list[dict]) -> None:
    """A streamed pass can be no faster than its transfer floor, nor than the same tokens'
    compute with every expert resident: bound_s = max(floor_s, resident seconds per pass) and
    of_bound = bound_s / pass_s (1.0: at whichever limit binds; `bound` says which), on each
    streamed row whose length has a resident row in the same run."""
    resident = {(r["layers"], r["prompt_tokens"]): r["prompt_tokens"] / r["tok_s"]
                for r in runs if r.get("buffering") == "resident" and r.get("tok_s")}
    for r in runs:
        wall = resident.get((r.get("layers"), r.get("prompt_tokens")))
        if wall is None or not r.get("pass_s") or r.get("floor_s") is None:
            continue
        compute = wall / r.get("passes", 1)
        r["bound_s"] = round(max(r["floor_s"], compute), 4)
        r["bound"] = "transfer" if r["floor_s"] >= compute else "compute"
        r["of_bound"] = round(r["bound_s"] / r["pass_s"], 3)


if __name__ == "__main__":
    main()
