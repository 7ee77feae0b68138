"""One prompt chunk's forward, layer by layer, on the full-size model (GPU machine): issue 9's
costliest layer. In the interleaved 32k row the first attention layer (layer 3) took 1-2 ms more
device time than every later attention layer (bench.interference --layer-events). Here a chunk
of --chunk tokens at a --context-token context runs as the serving loop runs it (the prompt
chunks' graphs on, a hook before each layer), first timed with CUDA events at each hook (the
median of --repeats forwards), then once under the profiler: each layer's kernels by name with
their device time, for the layers named in --detail. Once more with the gather workspace off, to
see whether the first attention layer's gather is the part that costs, and once with the
prompt chunks' graphs off (every kernel eager, so the profiler charges each to its layer: a
graph replay's kernels are not charged to the layer whose range launched it).
    python -m bench.layer_profile [--context 16384] [--chunk 2046] [--detail 2,3,7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import write_result
from bench.fullsize import full_size_engine
from freetoken.kernels import page_gather
from freetoken.model.state import DecodeState


def layer_events(forward, layers: int) -> list[float]:
    """Device ms of each layer's stretch (hook i to hook i + 1; the last to the forward's end)."""
    evs, cuda = [], torch.cuda.is_available()

    def mark():
        if not cuda:  # the CPU runs each op as it is called: the host clock is the device's
            evs.append(time.perf_counter() * 1e3)
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        evs.append(ev)
    forward(lambda i: mark())
    mark()
    if cuda:
        torch.cuda.synchronize()
    assert len(evs) == layers + 1, (len(evs), layers)
    return [a.elapsed_time(b) if cuda else b - a for a, b in zip(evs, evs[1:])]


def layer_kernels(forward, detail: list[int]) -> dict:
    """Under the profiler: each layer's device ms and, for the layers in `detail`, its kernels
    (name, calls, ms), the costliest first. Kernels are charged to the layer whose range was
    open when the host launched them (a graph replay's kernels to the replay's launch)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile
    open_range = []

    def hook(i):
        if open_range:
            open_range.pop().__exit__(None, None, None)
        r = record_function(f"layer{i}")
        r.__enter__()
        open_range.append(r)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward(hook)
        if open_range:
            open_range.pop().__exit__(None, None, None)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    per: dict[int, dict[str, list]] = {}
    for e in prof.events():
        if not e.kernels:
            continue
        p = e
        while p is not None and not p.name.startswith("layer"):
            p = p.cpu_parent
        if p is None:
            continue
        layer = int(p.name[5:])
        for k in e.kernels:
            row = per.setdefault(layer, {}).setdefault(k.name[:90], [0, 0.0])
            row[0] += 1
            row[1] += k.duration / 1e3  # us -> ms
    out = {"layer_ms": {str(i): round(sum(r[1] for r in per[i].values()), 3) for i in sorted(per)}}
    for i in detail:
        rows = sorted(per.get(i, {}).items(), key=lambda kv: -kv[1][1])
        out[f"layer{i}_kernels"] = [[n, c, round(ms, 3)] for n, (c, ms) in rows[:14]]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--context", type=int, default=16384, help="tokens already in the sequence")
    ap.add_argument("--chunk", type=int, default=2046, help="tokens of the profiled chunk")
    ap.add_argument("--graph-tokens", type=int, default=2048, help="the engine's --prefill-graph-tokens")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--detail", default="2,3,4,7")
    ap.add_argument("--name", default="layer_profile")
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script itself (host times)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.layer_profile needs a CUDA device (or --device cpu, to check the script)")
    total = a.context + a.chunk
    eng = full_size_engine(a.layers, a.device, max_len=total + 64, prefill_graph_tokens=a.graph_tokens)
    dev, fill = eng.device, 2048
    st = DecodeState(eng.cfg, 1, total + 64, dev, torch.bfloat16, chunk=fill)
    st.set_pages(0, st.pages.alloc(st.pages.pages_for(total)))
    tokens = torch.randint(100, eng.cfg.vocab_size, (total,), device=dev)
    model = eng.model
    with torch.inference_mode():
        for s in range(0, a.context, fill):  # the context, as the serving loop's chunks would write it
            n = min(fill, a.context - s)
            model.prefill_batch(tokens[s:s + n], st, [(0, s, n, None, False)])
    if dev.type == "cuda":
        torch.cuda.synchronize()

    def forward(hook):  # the chunk again and again at the same place (its KV rewritten alike)
        model.prefill_batch(tokens[a.context:], st, [(0, a.context, a.chunk, None, True)], hook=hook)
    rows = {}
    graphs = eng.prefill_graphs
    for name, ws, graphed in (("workspace_on", True, True), ("workspace_off", False, True),
                              ("graphs_off", True, False)):
        page_gather.ENABLED = ws
        if graphs is not None:
            graphs.enabled = graphed
        forward(lambda i: None)  # warm: this chunk size's kernels
        runs = [layer_events(forward, a.layers) for _ in range(a.repeats)]
        med = [statistics.median(r[i] for r in runs) for i in range(a.layers)]
        attn = [i for i in range(a.layers) if eng.cfg.layer_types[i] == "full_attention"]
        mid = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
        row = {"gather_workspace": ws, "prefill_graphs": graphed and graphs is not None, "layer_ms_p50": [round(m, 3) for m in med],
               "attention_layers": attn, "first_attention_ms": round(med[attn[0]], 3),
               "later_attention_ms_p50": mid([med[i] for i in attn[1:]]),
               "other_layers_ms_p50": mid([med[i] for i in range(a.layers) if i not in attn])}
        if ws:  # graphed, the eager kernels only (a replay's are not the layer range's); eager, all
            row["profile"] = layer_kernels(forward, [int(x) for x in a.detail.split(",") if x])
        rows[name] = row
        print({k: v for k, v in row.items() if k not in ("layer_ms_p50", "profile")}, flush=True)
    page_gather.ENABLED = True
    if graphs is not None:
        graphs.enabled = True
    write_result(a.name, {"model": f"Qwen3.6-35B-A3B shape, {a.layers} layers, experts in VRAM",
                          "context": a.context, "chunk": a.chunk, "graph_tokens": a.graph_tokens,
                          "repeats": a.repeats, **rows})


if __name__ == "__main__":
    main()
