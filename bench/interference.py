"""What a long prompt does to everyone else: inter-token latency of streams that are decoding,
and the time to first token of a short request, while a long prompt prefills.

Drives the engine loop in this thread (EngineLoop.step(), what `ft serve` runs) and stamps every
token as it is emitted. Per scheduler setting:
  unloaded   the decoding streams alone (their inter-token gaps), then the short request alone
  loaded     the same streams decoding, a long prompt arrives, then the short request arrives
             one step later; gaps of the streams while the long prompt prefills, TTFT of the
             short one
Settings compared in one run: `one-chunk` (one prompt chunk per step, arrival order, no latency
budget: the scheduler before the token budget), `budget` (a token budget per step, shortest
prompt first, prompt work sized so a step takes at most --decode-slowdown times a decode step;
on eager steps the decode rows share the prompt chunk's forward, --decode-between-layers off)
and `interleave` (decode steps between the prompt forward's layers, runtime/interleave.py; the
default with CUDA graphs and on the CPU) and `overlap`
(decode steps on a high-priority stream alongside the prompt forward, runtime/overlap.py,
--decode-overlap; experts in VRAM only).
With --full-size --moe cache the experts sit in pinned host memory behind a GPU expert cache
of --expert-cache, and prompts prefill in streamed passes (issue 11): `budget` then decodes
between passes only, `interleave` inside them too (the cache frozen). Each row also gives the
streams' tok/s while the long prompt prefills against their unloaded rate.
    python -m bench.interference [--long 32768] [--short 200] [--streams 2] [--full-size]
        [--moe resident|cache] [--expert-cache 16GB] [--cache-warmup N] [--warm-long N] [--warm-loaded N]
        [--gc-freeze on|off] [--gather-workspace on|off]
Each row also counts the CUDA caching allocator's events over the loaded window
(cuda_allocator_loaded: segments cudaMalloc'ed and freed, retries after a failed cudaMalloc).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
import warnings

import torch

from bench.common import write_result
from bench.fullsize import full_size_engine
from bench.layer_timeline import LayerTimeline
from bench.line_trace import LineTrace
from freetoken.demo import demo_path
from freetoken.experts import split_experts
from freetoken.kernels import page_gather, split_keys
from freetoken.model import linear
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.gcwatch import GcWatch
from freetoken.runtime.interleave import Interleaver
from freetoken.runtime.overlap import DecodeOverlap, eligible
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine

def interleaved(**kw) -> dict:
    """A setting with decode steps between the prompt's layers (the loop's default scheduling), and kw."""
    return {"order": "shortest", "step_tokens": 0, "slowdown": None, "interleave": True, **kw}


SETTINGS = {
    "one-chunk": dict(order="arrival", step_tokens=None, slowdown=0.0, interleave=False),
    "budget": dict(order="shortest", step_tokens=0, slowdown=None, interleave=False),
    "interleave": interleaved(),
    # decode steps before whole layers only, and also between each layer's mixer and MLP (interleave.MID_LAYER)
    "interleave-layers": interleaved(mid_layer=False),
    "interleave-halves": interleaved(mid_layer=True),
    # no decode steps between the key pieces of a long context's attention (interleave.KEY_POINTS; the CPU)
    "interleave-nokeys": interleaved(key_points=False),
    # a CPU prompt chunk's routed experts whole between two points (experts/split_experts.py off)
    "interleave-noexperts": interleaved(expert_pieces=False),
    # a CPU prompt chunk's dense projections over bf16 weights by the rows kernel up to 16 rows
    # only (model/linear.py MIXED_HOST_ROWS before the thirty-second session; 32 now)
    "interleave-rows16": interleaved(mixed_host_rows=16),
    # a long context's attention in pieces of 4,096 keys (kernels/split_keys.py KEY_PIECE, 8,192 by
    # default): shorter stretches between the decode steps, more pieces to merge
    "interleave-keys4k": interleaved(key_piece=4096),
    # the interleave with each decode step's tokens waited for at once (no deferral: the A/B of
    # runtime/deferred_step.py, which is on by default on CUDA)
    "interleave-wait": interleaved(defer=False),
    # deferred steps with the point costs learned on the device's clock (the loop's device_costs,
    # its default with deferred steps) and on the host's (the A/B)
    "interleave-devcost": interleaved(device_costs=True),
    # a lower target gap (the engine's --decode-slowdown): how much p99 margin it buys, at what prompt rate
    "interleave-s1.4": interleaved(slowdown=1.4),
    "interleave-s1.3": interleaved(slowdown=1.3),
    # the forward's sample without a point far above its kind's others (interleave.STALL_FILTER)
    "interleave-nostall": interleaved(stall_filter=True),
    # fd9e29e's pacing, the defaults again since (the A/B of plan 46): a short prompt's forward at
    # the learned costs against the 50 ms floor, each forward's first cycle on the host's clock.
    # The files of plans 44-46 name "interleave" what was then the default: interleave.BY_CLOCK on
    # (44-46) and the loop's start_marks on (45-46), now interleave-byclock and interleave-both
    "interleave-before": interleaved(by_clock=False, start_marks=False),
    "interleave-byclock": interleaved(by_clock=True),
    "interleave-startmarks": interleaved(start_marks=True),
    "interleave-both": interleaved(by_clock=True, start_marks=True),
    # a decode step before an eagerly launched point waits for its tokens (the loop's wait_before_eager)
    "interleave-eagerwait": interleaved(wait_before_eager=True),
    # the points after a forward's last decode step learn at its end (interleave.TAIL_CYCLES)
    "interleave-tail": interleaved(tail_cycles=True),
    "interleave-hostcost": interleaved(device_costs=False),
    # deferred steps launched on a stream of their own, ordered by events (the loop's step_stream)
    "interleave-side": interleaved(step_stream=True),
    # Python's GIL switch interval at 0.1 ms for the row (sys default 5 ms): whether the host
    # time lost in a prompt layer is a wait to take the GIL back from another thread
    "interleave-gil": interleaved(switch_s=1e-4),
    "interleave-halves-wait": interleaved(mid_layer=True, defer=False),
    # the interleave with the prompt chunks' MoE blocks eager (no prefill graphs: runtime/prefill_graphs.py)
    "interleave-eager-moe": interleaved(prefill_graphs=False),
    # the worker thread stepping back to back (DecodeOverlap.POLLED off, the default)
    "overlap": dict(order="shortest", step_tokens=0, slowdown=None, interleave=False, overlap=True, polled=False),
    # DecodeOverlap.POLLED: steps launched from the loop's thread, spaced by --decode-slowdown
    "overlap-polled": dict(order="shortest", step_tokens=0, slowdown=None, interleave=False, overlap=True,
                           polled=True),
    # the same back to back (each step launched as soon as the last one's tokens are out)
    "overlap-b2b": dict(order="shortest", step_tokens=0, slowdown=0.0, interleave=False, overlap=True, polled=True),
    # the overlap with Python's default 5 ms GIL switch interval (DecodeOverlap.SWITCH_S's reason)
    "overlap-gil5ms": dict(order="shortest", step_tokens=0, slowdown=None, interleave=False, overlap=True, polled=False,
                           switch_s=None),
}


class Stamped(ServingEngine):
    """The engine loop, recording when each token of each request is emitted, and (for the
    anatomy of the longest gaps) when each prompt layer and each forward starts."""

    def emit(self, req, ev):
        if ev.token_ids:
            self.stamps.setdefault(req.id, []).append(time.perf_counter())

    timeline = None  # a LayerTimeline with --layer-events on
    launched = 0  # decode steps started between layers (a deferred one's tokens come a hook later)

    def _hook(self, i, hook, steps: bool = True):
        """A prompt forward's hook before point i, stamped, and timed with --layer-events
        (steps: whether a decode step started inside it is flagged; not for the overlap's)."""
        self.events.append((time.perf_counter(), f"L{i}"))
        if self.timeline is not None:
            self.timeline.enter(i)
        launched = self.launched
        hook(i)
        if self.timeline is not None:
            self.timeline.leave(i, steps and self.launched > launched)

    def _between_layers(self, i):
        self._hook(i, super()._between_layers)

    def _alongside_layers(self, i):  # the overlapped prompt forward's layers
        self._hook(i, super()._alongside_layers, steps=False)

    def _side_poll(self):  # the polled overlap: its launches and emits in the anatomy
        before = self._side
        super()._side_poll()
        if self._side is not None and self._side is not before:
            self.events.append((time.perf_counter(), f"side-decode{len(self._side.reqs)}"))

    def _emit_step(self, d):
        ok = super()._emit_step(d)
        if self.overlap is not None:  # the polled overlap's (an interleaved step's have their own events)
            self.events.append((time.perf_counter(), f"emit-side-decode{len(d.reqs)}"))
        return ok

    def _forward(self, group, decode, captures):
        kind = f"prompt{sum(e - s for _, s, e in group)}" if group else f"decode{len(decode)}"
        timed = self.timeline is not None and group and not decode and not self.between.running
        self.launched += bool(decode and not group and self.between.running)
        self.events.append((time.perf_counter(), kind + ("-nested" if self.between.running else "")))
        if timed:
            self.timeline.begin(sum(e - s for _, s, e in group))
        try:
            super()._forward(group, decode, captures)
        except BaseException:
            if timed:  # a failed forward: not kept, and its line tracer off before the loop goes on
                self.timeline.abort()
            raise
        if timed:
            self.timeline.end()
        self.events.append((time.perf_counter(), "end-" + kind))


class SyncSites:
    """Where the host waits for the device inside the loaded window: CUDA's sync debug mode
    warns at each operation that synchronises (an .item(), a copy to pageable host memory, a
    nonzero, a stream's synchronize), and each warning's Python location is counted (not the
    caching allocator's own syncs, nor an event's synchronize)."""

    def __init__(self, device):
        self.on = torch.device(device).type == "cuda"
        self.counts: dict[str, int] = {}

    def __enter__(self):
        if self.on:
            self._catch = warnings.catch_warnings(record=True)
            self._got = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode(0)
            for w in self._got:
                if "synchroniz" in str(w.message):
                    where = f"{os.path.relpath(w.filename)}:{w.lineno}"
                    self.counts[where] = self.counts.get(where, 0) + 1
            self._catch.__exit__(*exc)
        return False

    def sites(self) -> dict[str, int]:
        return dict(sorted(self.counts.items(), key=lambda kv: -kv[1]))


def host_profiler(stacks: bool = False):
    """The profiler on the host's operators and, through CUPTI (ProfilerActivity.CUDA), the CUDA
    runtime's calls, which show a cudaMalloc or a wait that no operator reports. CUPTI's
    tracing adds overhead to the window: its timings are for finding stalls, not rows.
    stacks: record each operator's Python stack too (slower still), for long_host_stacks."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    kw = {}
    if stacks:  # some torch versions record the Python frames only in the verbose mode
        try:
            kw["experimental_config"] = torch._C._profiler._ExperimentalConfig(verbose=True)
        except (AttributeError, TypeError):
            pass
    return profile(activities=acts, with_stack=stacks, **kw)


def long_host_stacks(prof, over_ms: float = 2.0, top: int = 12, frames: int = 6) -> list:
    """The `top` longest operators of `over_ms` or more called from Python: [name, ms, the
    innermost `frames` frames outside torch], to say where a launch that waits comes from (an
    operator's time includes the runtime calls it makes)."""
    rows = []
    for e in prof.events():
        ms = e.time_range.elapsed_us() / 1e3
        if e.device_type.name != "CPU" or ms < over_ms or "/" in e.name or "(" in e.name:
            continue  # an operator or a runtime call, not a Python frame
        if not e.cpu_parent and e.stack:  # where the frames come as the event's stack instead
            rows.append([e.name[:60], round(ms, 2), [f.split("freetoken/")[-1] for f in e.stack[:frames]]])
            continue
        ours, up = [], e.cpu_parent  # the Python frames are the event's parents (with_stack)
        while up is not None and len(ours) < frames:
            if ".py(" in up.name and "torch/" not in up.name and "site-packages" not in up.name:
                ours.append(up.name.split("freetoken/")[-1])
            up = up.cpu_parent
        if ours:
            rows.append([e.name[:60], round(ms, 2), ours])
    return sorted(rows, key=lambda r: -r[1])[:top]


def long_host_calls(prof, over_ms: float = 1.0, top: int = 20) -> list:
    """Host events of `over_ms` or more by name: [name, count, max ms, total ms], the longest first
    (a user range or an operator includes what it calls: read the innermost names)."""
    by: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name != "CPU":
            continue
        ms = e.time_range.elapsed_us() / 1e3
        if ms >= over_ms:
            row = by.setdefault(e.name[:80], [0, 0.0, 0.0])
            row[0] += 1
            row[1] = max(row[1], ms)
            row[2] += ms
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return [[n, c, round(m, 2), round(t, 1)] for n, (c, m, t) in rows]


def anatomy(events, gaps, n: int = 5) -> list[str]:
    """The n longest gaps [(start, end)], each as the events inside it with their offsets (ms)."""
    out = []
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:n]:
        inside = [f"{(t - a) * 1e3:.1f}:{what}" for t, what in events if a <= t <= b]
        out.append(f"{(b - a) * 1e3:.1f} ms: " + " ".join(inside))
    return out


def once_per_step(gaps, within: float = 1e-3) -> list:
    """The gaps [(start, end)] with those that end within `within` seconds of a kept one dropped:
    the streams of one decode step emit their tokens a few microseconds apart."""
    kept: list = []
    for g in sorted(gaps, key=lambda g: g[1]):
        if not kept or g[1] - kept[-1][1] > within:
            kept.append(g)
    return kept


def gc_summary(pauses) -> dict:
    """Collector pauses [(start, generation, seconds)] -> per generation: count, longest and
    total ms."""
    out = {}
    for g in range(3):
        d = [dt for _, gen, dt in pauses if gen == g]
        out[f"gen{g}"] = {"count": len(d), "longest_ms": round(max(d, default=0.0) * 1e3, 2),
                          "total_ms": round(sum(d) * 1e3, 2)}
    return out


def gap_kinds(events, gaps, over: float) -> dict:
    """The loaded gaps [(start, end)] by what lies inside them: a Triton kernel meeting a new
    specialization ("jit", triton_misses), a garbage collection of 1 ms or
    more ("gc"), a prompt forward starting ("start": the step's host work, the
    forward's set-up and its first layers), one ending ("end": its last layers, its tail and the
    host's work after it), or only layers between two decode steps ("layers"); per kind the
    count, p50 / p99 / max (ms) and how many exceed `over` seconds (2x the unloaded p50: which
    kind holds the p99 past its target)."""
    kinds: dict[str, list[float]] = {"jit": [], "gc": [], "start": [], "end": [], "layers": []}
    for a, b in gaps:
        inside = [what for t, what in events if a < t <= b and "nested" not in what]
        kind = ("jit" if any(w.startswith("jit:") for w in inside)
                else "gc" if any(w.startswith("gc") for w in inside)
                else "start" if any(w.startswith("prompt") for w in inside)
                else "end" if any(w.startswith("end-prompt") for w in inside) else "layers")
        kinds[kind].append(b - a)
    return {k: {"count": len(v), "p50_ms": round(quantile(v, 0.5) * 1e3, 2) if v else None,
                "p99_ms": round(quantile(v, 0.99) * 1e3, 2) if v else None,
                "max_ms": round(max(v) * 1e3, 2) if v else None, "over_2x": sum(g > over for g in v)}
            for k, v in kinds.items()}


def decode_step_times(events, span) -> dict:
    """The host's time of each decode forward that started inside span (t0, t1): from its start
    event to its end event (a step between layers included; on CUDA a deferred step's launch
    only) -> its count and p50/p90/p99 in ms. A stream's gap is at least one such step: with the
    steps' own tail near 2x their median (the 2-core CPU), no gap's tail can stay under it."""
    steps, start = [], None
    for t, kind in events:
        if kind.startswith("decode") and span[0] <= t <= span[1]:
            start = t
        elif kind.startswith("end-decode") and start is not None:
            steps.append(t - start)
            start = None
    return {"count": len(steps), **{f"p{q}_ms": round(quantile(steps, q / 100) * 1e3, 2) if steps else None
                                    for q in (50, 90, 99)}}


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def allocator_counts(device) -> dict:
    """The CUDA caching allocator's event counters (empty off CUDA)."""
    if torch.device(device).type != "cuda":
        return {}
    st = torch.cuda.memory_stats(device)
    return {k: int(st.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                           "num_sync_all_streams", "num_ooms")}


def host_alloc_counts(device) -> dict:
    """The pinned host allocator's counters (torch.cuda.host_memory_stats; empty off CUDA or where
    this torch lacks it): a cudaHostAlloc in the loaded window can stall the host."""
    if torch.device(device).type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return {}
    st = torch.cuda.host_memory_stats()
    return {k: int(st.get(k, 0)) for k in ("num_host_alloc", "num_host_free")}


@contextlib.contextmanager
def triton_misses(events: list):
    """Triton kernels that meet a new specialization (an in-process cache miss: a compile, or a
    load from the disk cache) while this runs, each as a ("jit:NAME") event in `events`, so the
    anatomy of the longest gaps shows them; yields whether the hook is in (False where this Triton
    has no jit_cache_hook: then an empty record says nothing)."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        prev = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        yield False
        return

    def hook(*args, **kw):
        fn = kw.get("fn")  # a JitFunctionInfo(module, name, jit_function)
        name = getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", None), "__name__", "?")
        events.append((time.perf_counter(), f"jit:{name}"))
        return prev(*args, **kw) if prev else None  # None: compile as usual

    runtime.jit_cache_hook = hook
    try:
        yield True
    finally:
        runtime.jit_cache_hook = prev


CURRENT: dict = {}  # the setting running now and its loop ("srv"), for the progress lines


def progress(every: float, stop) -> None:
    """Every `every` seconds to stderr: the setting running, how many prompt layers, decode
    steps and overlap steps its loop has passed, and the allocator's retries and all-stream
    syncs (a stalled row: the layers stop; a crawling one: they creep)."""
    while not stop.wait(every):
        srv = CURRENT.get("srv")
        if srv is None:
            continue
        ev = list(srv.events)
        count = lambda p: sum(1 for _, w in ev if w.startswith(p))  # noqa: E731
        mem = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        print(f"progress {CURRENT.get('name')}: layers {count('L')}, steps {count('decode')}, side launches "
              f"{count('side-decode')}, side emits {count('emit-side')}, alloc retries {mem.get('num_alloc_retries')}, "
              f"all-stream syncs {mem.get('num_sync_all_streams')}", file=sys.stderr, flush=True)


def run_setting(eng, name: str, a) -> dict:
    """One setting's row; an interleaved setting's switch_s is the GIL switch interval meanwhile."""
    s = SETTINGS[name]
    switch, pieces = sys.getswitchinterval(), split_experts.ENABLED
    if s.get("interleave") and s.get("switch_s") is not None:
        sys.setswitchinterval(s["switch_s"])
    split_experts.ENABLED = s.get("expert_pieces", pieces)
    rows, keys = linear.MIXED_HOST_ROWS, split_keys.KEY_PIECE
    linear.MIXED_HOST_ROWS = s.get("mixed_host_rows", rows)
    split_keys.KEY_PIECE = s.get("key_piece", keys)
    splits = split_experts.SPLITS
    try:
        out = _run_setting(eng, name, a)
        # MoE calls that ran in expert pieces during the row (0: layers under MIN_BYTES, CUDA, key
        # points off, the DeepSeek family's blocks), and how many pieces each
        out["expert_piece_calls"] = split_experts.SPLITS - splits
        out["expert_pieces"] = split_experts.PIECES if out["expert_piece_calls"] else 1
    finally:
        sys.setswitchinterval(switch)
        split_experts.ENABLED = pieces
        linear.MIXED_HOST_ROWS = rows
        split_keys.KEY_PIECE = keys
    out["key_piece"] = s.get("key_piece", keys)
    if s.get("interleave") and s.get("switch_s") is not None:
        out["switch_interval_s"] = s["switch_s"]
    elif s.get("overlap"):  # DecodeOverlap's own while a prompt forward overlaps
        st = s.get("switch_s", DecodeOverlap.SWITCH_S)
        out["switch_interval_s"] = switch if st is None else min(switch, st)
    else:
        out["switch_interval_s"] = switch
    out["python_threads"] = sorted(t.name for t in threading.enumerate())  # at the row's end (an overlap worker has ended)
    return out


def _run_setting(eng, name: str, a) -> dict:
    s = SETTINGS[name]
    srv = Stamped(eng, max_batch=a.streams + 2, max_queue=8, start=False)
    srv.stamps, srv.events = {}, []
    CURRENT.update(srv=srv, name=name)
    lines = LineTrace() if a.layer_lines == "on" else None
    srv.timeline = LayerTimeline(eng.device, lines=lines) if a.layer_events == "on" or lines else None
    srv.defer_steps = srv.defer_steps and a.defer_steps == "on" and s.get("defer", True)
    if a.device_costs != "default":
        srv.device_costs = a.device_costs == "on"
    srv.device_costs = s.get("device_costs", srv.device_costs) and srv.defer_steps
    srv.sched.order = s["order"]
    if s["step_tokens"] is None:
        srv.sched.step_tokens = eng.ecfg.prefill_chunk
        srv.sched.idle = 0  # one chunk a step, with or without streams (as before --idle-step-tokens)
    if s["slowdown"] is not None:
        srv.slowdown = s["slowdown"]
    # decode steps between the prompt forward's layers (the default with CUDA graphs and on the
    # CPU), or, without, the decode rows in the prompt chunk's forward where decode is eager (the
    # CPU's --decode-between-layers off) and a forward of their own where it is graphed
    srv.mixed = not s["interleave"] and srv.decode.path == "eager" and not srv.streamed
    srv.between = Interleaver(srv.slowdown if s["interleave"] else 0.0)
    srv.between.mid_layer = s.get("mid_layer", srv.between.mid_layer)
    srv.between.key_points = s.get("key_points", srv.between.key_points)
    srv.between.stall_filter = s.get("stall_filter", srv.between.stall_filter)
    srv.between.by_clock = s.get("by_clock", srv.between.by_clock)
    srv.start_marks = s.get("start_marks", srv.start_marks)
    srv.wait_before_eager = s.get("wait_before_eager", srv.wait_before_eager)
    srv.tail_cycles = s.get("tail_cycles", srv.tail_cycles)
    srv.step_stream = s.get("step_stream", srv.step_stream)
    graphs = getattr(eng, "prefill_graphs", None)
    if graphs is not None:
        graphs.enabled, graphs.replays = s.get("prefill_graphs", True), 0
    srv.overlap = None
    if s.get("overlap"):
        why = eligible(eng, srv.decode)
        if why is not None:
            return {"setting": name, "skipped": why}
        srv.overlap = DecodeOverlap(eng.device, s.get("switch_s", DecodeOverlap.SWITCH_S), s.get("polled"))
        srv.mixed = False
    vocab = eng.cfg.vocab_size
    opts = lambda n: SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731

    def run_until(cond):
        while not cond():
            srv.step()

    # warm-up: every shape once
    for n in [a.short] + ([a.warm_long] if a.warm_long else []):
        w = Request(prompt(n, 1, vocab), opts(4))
        srv.sched.add(w)
        run_until(lambda: w.finished_at)
    if a.gc_freeze == "on":  # as `ft serve` does after start-up (runtime/gcwatch.py)
        srv.freeze_gc()
    # unloaded: the streams alone, then the short request alone
    streams = [Request(prompt(a.short, 10 + i, vocab), opts(10_000)) for i in range(a.streams)]
    for r in streams:
        srv.sched.add(r)
    run_until(lambda: all(len(r.output_ids) > 4 for r in streams))
    if a.cache_warmup:  # the expert cache's adaptive split climbs in probes of 24 steps (experts/share.py)
        run_until(lambda: all(len(r.output_ids) > 4 + a.cache_warmup for r in streams))
    mark = {r.id: len(srv.stamps[r.id]) for r in streams}
    run_until(lambda: all(len(srv.stamps[r.id]) - mark[r.id] >= a.tokens for r in streams))
    unloaded = [b - c for r in streams for c, b in zip(srv.stamps[r.id][mark[r.id]:], srv.stamps[r.id][mark[r.id] + 1:])]
    unloaded_span = (min(srv.stamps[r.id][mark[r.id]] for r in streams), max(srv.stamps[r.id][-1] for r in streams))
    gc_unloaded = gc_summary(GcWatch.shared().pauses(*unloaded_span))
    for r in streams:
        srv.cancel(r)
    run_until(lambda: not srv.sched.busy)
    idle = Request(prompt(a.short, 2, vocab), opts(2))
    t0 = time.perf_counter()
    srv.sched.add(idle)
    run_until(lambda: idle.first_token_at)
    idle_ttft = srv.stamps[idle.id][0] - t0
    run_until(lambda: not srv.sched.busy)
    # loaded: streams decoding, a long prompt arrives, the short request one step later
    streams = [Request(prompt(a.short, 20 + i, vocab), opts(10_000)) for i in range(a.streams)]
    for r in streams:
        srv.sched.add(r)
    run_until(lambda: all(len(r.output_ids) > 4 for r in streams))
    long = Request(prompt(a.long, 3, vocab), opts(2))
    short = Request(prompt(a.short, 4, vocab), opts(2))
    mark = {r.id: len(srv.stamps[r.id]) - 1 for r in streams}  # gaps from the last token before it
    alloc0, host0 = allocator_counts(eng.device), host_alloc_counts(eng.device)
    if srv.timeline is not None:  # the long prompt's forwards only (and the short one's)
        srv.timeline.forwards = []
        if srv.timeline.lines is not None:
            srv.timeline.lines.sites = {}
    syncs = SyncSites(eng.device) if a.sync_debug == "on" else contextlib.nullcontext()
    prof = host_profiler(a.host_profile == "stacks") if a.host_profile != "off" else contextlib.nullcontext()
    t_long = time.perf_counter()
    with syncs, prof, triton_misses(srv.events) as jit_hooked:
        srv.sched.add(long)
        srv.step()
        t_short = time.perf_counter()
        srv.sched.add(short)
        run_until(lambda: long.first_token_at and short.first_token_at)
    pairs = [(c, b) for r in streams for c, b in zip(srv.stamps[r.id][mark[r.id]:], srv.stamps[r.id][mark[r.id] + 1:])]
    loaded = [b - c for c, b in pairs]
    loaded_span = (t_long, time.perf_counter())
    alloc1, host1 = allocator_counts(eng.device), host_alloc_counts(eng.device)
    long_ttft = srv.stamps[long.id][0] - t_long
    short_ttft = srv.stamps[short.id][0] - t_short
    # the streams alone again once both prompts are done: the unloaded gap measured a second
    # time, at the end of the row (on the 2-core CPU the first window's p50 swung from 19 to 31 ms
    # between rows of one process while their loaded p99 stayed at 58-62 ms)
    run_until(lambda: long.finished_at and short.finished_at)
    mark2 = {r.id: len(srv.stamps[r.id]) for r in streams}
    run_until(lambda: all(len(srv.stamps[r.id]) - mark2[r.id] >= a.tokens for r in streams))
    after = [b - c for r in streams for c, b in zip(srv.stamps[r.id][mark2[r.id]:], srv.stamps[r.id][mark2[r.id] + 1:])]
    for r in streams:
        srv.cancel(r)
    run_until(lambda: not srv.sched.busy)
    ms = lambda x: round(x * 1e3, 2) if x is not None else None  # noqa: E731
    out = {"setting": name, "mixed_forward": srv.mixed, "step_tokens": srv.sched.step_tokens, "order": srv.sched.order,
           "decode_slowdown": srv.slowdown, "decode_steps_between_layers": srv.between.steps,
           "decode_steps_deferred": srv.deferred_steps, "device_costs": srv.device_costs,
           "stall_filter": srv.between.stall_filter, "key_points": srv.between.key_points, "stalls_dropped": srv.between.stalls_dropped,
           "by_clock": srv.between.by_clock, "start_marks": srv.start_marks,
           "wait_before_eager": srv.wait_before_eager, "tail_cycles": srv.tail_cycles,
           "step_stream": srv.step_stream,
           "decode_steps_alongside_prompts": srv.overlap.steps if srv.overlap is not None else 0,
           "overlap_polled": srv.overlap.polled if srv.overlap is not None else None,
           "prompts_between_layers": srv.jump_ins,
           "prompt_ms_per_layer": ms(srv.between.per_layer),
           "unloaded_gap_p50_ms": ms(quantile(unloaded, 0.5)), "unloaded_gap_p99_ms": ms(quantile(unloaded, 0.99)),
           "loaded_gap_p50_ms": ms(quantile(loaded, 0.5)), "loaded_gap_p99_ms": ms(quantile(loaded, 0.99)),
           "loaded_gaps": len(loaded), "loaded_gap_max5_ms": [ms(g) for g in sorted(loaded)[-5:]], "idle_short_ttft_s": round(idle_ttft, 3),
           "short_ttft_behind_long_s": round(short_ttft, 3), "long_ttft_s": round(long_ttft, 2),
           "long_prefill_tok_s": round(a.long / long_ttft, 1),
           "decode_step_host_unloaded": decode_step_times(srv.events, unloaded_span),
           "decode_step_host_loaded": decode_step_times(srv.events, loaded_span)}
    # what a decoding stream gets while the long prompt prefills (issue 11): its tokens emitted
    # between the long prompt's arrival and its first token, over that time (mean over streams),
    # against its unloaded rate
    t_first = srv.stamps[long.id][0]
    during = [sum(t_long < t <= t_first for t in srv.stamps[r.id]) / long_ttft for r in streams]
    out["stream_tok_s_during_long_prefill"] = round(statistics.mean(during), 2)
    out["stream_tok_s_unloaded"] = round(1 / statistics.median(unloaded), 2)
    out["expert_slots"] = srv.plan.expert_slots  # the memory plan's (0: no expert cache)
    ex_stats = eng.executor.stats() if eng.executor is not None else {}
    out["fill_share"] = ex_stats.get("fill_share")  # the split the streams decoded with at the end
    out["hit_rate"] = ex_stats.get("hit_rate")
    loaded_gc = GcWatch.shared().pauses(min(c for c, _ in pairs), max(b for _, b in pairs))  # the gaps' window
    # into each gap's anatomy: the pauses of 1 ms or more (a gen-0 pause is a fraction of that)
    srv.events += [(t, f"gc{g}:{dt * 1e3:.1f}ms") for t, g, dt in loaded_gc if dt >= 1e-3]
    srv.events.sort(key=lambda e: e[0])
    out.update(gc_freeze=a.gc_freeze, gc_frozen=srv.gc_frozen, gc_pauses_unloaded=gc_unloaded,
               gc_pauses_loaded=gc_summary(loaded_gc))
    srv.thaw_gc()
    # the CUDA caching allocator over the loaded window: segments asked of the driver, and the
    # retries after a failed cudaMalloc (each frees the cache: a device-wide sync)
    out["cuda_allocator_loaded"] = {k: alloc1[k] - alloc0[k] for k in alloc0} if alloc0 else None
    out["host_allocator_loaded"] = {k: host1[k] - host0[k] for k in host0} if host0 else None
    jit = [w[4:] for t, w in srv.events if t >= t_long and w.startswith("jit:")]
    out["jit_misses_loaded"] = {n: jit.count(n) for n in sorted(set(jit))}  # kernel -> new specializations
    out["jit_hook"] = jit_hooked  # whether that record was kept at all
    out["gather_workspace"] = {"enabled": page_gather.ENABLED, "grows": page_gather.WORKSPACE.grows,
                               "mib": round(page_gather.WORKSPACE.nbytes() / 2**20, 1)}
    if a.sync_debug == "on":
        out["host_syncs_loaded"] = syncs.sites()
    if a.host_profile != "off":
        out["host_calls_over_1ms"] = long_host_calls(prof)
    if a.host_profile == "stacks":
        out["host_stacks_over_2ms"] = long_host_stacks(prof)
        # none found and no Python frame recorded: this torch's profiler kept no stacks (the H200's 2.11)
        out["python_frames_recorded"] = sum(".py(" in e.name for e in prof.events())
    out["longest_gaps"] = anatomy(srv.events, pairs)
    # every gap past 2x, once (the streams share each step, so each gap comes once per stream):
    # the p99's target allows about 1% of the gaps past it
    over = once_per_step([g for g in pairs if g[1] - g[0] > 2 * statistics.median(unloaded)])
    out["over_2x_gaps_count"] = len(over)
    out["over_2x_gaps"] = anatomy(srv.events, over, n=32)
    out["gap_kinds"] = gap_kinds(srv.events, pairs, 2 * statistics.median(unloaded))
    out["prompt_chunks"] = chunk_summary(srv.between.history)
    out["cost_model"] = cost_summary(srv.between, srv._decode_s)
    if srv.timeline is not None:
        out["layer_timeline"] = srv.timeline.summary(srv._graph_cap())
        if srv.timeline.lines is not None:
            out["slow_lines"] = srv.timeline.lines.summary()
    out["prefill_graph_replays"] = graphs.replays if graphs is not None and graphs.enabled else 0
    out["prefill_graphed"] = sorted(graphs.blocks) if graphs is not None and graphs.enabled else []
    out["p99_gap_over_unloaded_p50"] = round(quantile(loaded, 0.99) / statistics.median(unloaded), 2)
    # the same against both unloaded windows' gaps together (the row's start and its end)
    out["unloaded_after_gap_p50_ms"] = ms(quantile(after, 0.5))
    out["p99_gap_over_both_unloaded_p50"] = round(quantile(loaded, 0.99) / statistics.median(unloaded + after), 2)
    out["short_ttft_over_idle"] = round(short_ttft / idle_ttft, 2)
    return out


def cost_summary(between, decode_s=None) -> dict:
    """What sized the chunks at the end of the run: the learned cost of each point (layer index;
    i + 0.5 a layer's MLP) of graphed and eager forwards, the costliest six of each, which points
    were each forward's costliest (how often), and the cost model's fit (fixed part, rate) against
    its ceiling. Where the costliest layer's cost is flat in the chunk's tokens and above the
    ceiling, the chunk sizing stops capping the chunk (CostModel.tokens_within)."""
    from collections import Counter

    from freetoken.runtime.interleave import GAP_CEILING
    top = lambda table: {str(k): round(v * 1e3, 2) for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:6]}  # noqa: E731
    out = {"layer_ms_top6": {kind: top(table) for kind, table in between.costs_by_kind.items()},
           "costliest_point_counts": {str(k): n for k, n in Counter(between.costliest_at).most_common(6)}}
    fit = between.samples.fit()
    if fit is not None:
        out["fixed_ms"], out["per_token_us"] = round(fit[0] * 1e3, 3), round(fit[1] * 1e6, 4)
    if decode_s and between.enabled:  # no ceiling where nothing interleaves
        out["ceiling_ms"] = round((max(between.slowdown, GAP_CEILING) - 1) * decode_s * 1e3, 2)
    return out


def chunk_summary(history) -> dict | None:
    """The interleaved prompt forwards' sizes and costliest layers (Interleaver.history): how
    the cost model sized the chunks (a collapse to small chunks shows here first)."""
    if not history:
        return None
    sizes = sorted(n for n, _ in history)
    costly = sorted(t for _, t in history)
    pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"forwards": len(sizes), "tokens_p10_p50_p90": [pick(sizes, q) for q in (0.1, 0.5, 0.9)],
            "tokens_min_max": [sizes[0], sizes[-1]],
            "costliest_layer_ms_p10_p50_p90": [round(pick(costly, q) * 1e3, 2) for q in (0.1, 0.5, 0.9)],
            "first_last_8": [[n, round(t * 1e3, 2)] for n, t in
                             (list(history) if len(history) <= 16 else list(history)[:8] + list(history)[-8:])]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", type=int, default=32768, help="tokens of the long prompt")
    ap.add_argument("--short", type=int, default=200, help="tokens of the short prompts")
    ap.add_argument("--streams", type=int, default=2, help="requests decoding meanwhile")
    ap.add_argument("--tokens", type=int, default=32, help="decode gaps measured unloaded, per stream")
    ap.add_argument("--settings", default="one-chunk,budget,interleave")
    ap.add_argument("--cpu-threads", type=int, default=0,
                    help="the demo engine's (or with --full-size --moe cpu the CPU engine's) --cpu-threads "
                         "(0: its default, every core)")
    ap.add_argument("--full-size", action="store_true", help="Qwen3.6-35B-A3B shape, random weights (GPU machine)")
    ap.add_argument("--layers", type=int, default=40, help="with --full-size")
    ap.add_argument("--name", default=None, help="result name (default interference[-full])")
    ap.add_argument("--moe", default="resident", choices=["resident", "cache", "cpu"],
                    help="with --full-size: every expert in VRAM, or pinned host banks behind a GPU expert cache "
                         "of --expert-cache (prompts prefill in streamed passes, issue 11), or cpu: a CPU-only "
                         "engine on the host's cores (no GPU used; --cpu-threads applies)")
    ap.add_argument("--expert-cache", default="16GB", help="with --moe cache: VRAM for expert slots")
    ap.add_argument("--cache-warmup", type=int, default=0,
                    help="decode steps the streams take before the unloaded gaps are measured (with --moe cache: "
                         "time for the adaptive split to settle; it probes each share for 24 steps)")
    ap.add_argument("--warm-long", type=int, default=0,
                    help="tokens of one more warm-up prompt (the streamed passes' kernels tuned at that size)")
    ap.add_argument("--gather-workspace", default="on", choices=["on", "off"],
                    help="the prefill attention's page gather into kept buffers (kernels/page_gather.py) "
                         "or into fresh tensors per layer (the A/B)")
    ap.add_argument("--layer-events", default="off", choices=["on", "off"],
                    help="time each stretch of the prompt forwards' work between hook points on the device "
                         "(CUDA events) and the host (bench/layer_timeline.py)")
    ap.add_argument("--layer-lines", default="off", choices=["on", "off"],
                    help="with the layer timeline (implied): the Python lines that held the host 1 ms or more "
                         "in each stretch of prompt work (bench/line_trace.py; slows the host: for diagnosis)")
    ap.add_argument("--defer-steps", default="on", choices=["on", "off"],
                    help="decode steps between layers read their tokens a hook later (runtime/deferred_step.py; "
                         "CUDA) or wait for them at once (the A/B)")
    ap.add_argument("--sync-debug", default="off", choices=["on", "off"],
                    help="count where the host synchronises with the device in the loaded window "
                         "(torch.cuda.set_sync_debug_mode; CUDA)")
    ap.add_argument("--host-profile", default="off", choices=["on", "stacks", "off"],
                    help="the host's calls of 1 ms or more in the loaded window, under the profiler "
                         "(stacks: and where the longest operators were called from)")
    ap.add_argument("--device-costs", default="default", choices=["on", "off", "default"],
                    help="with deferred steps, learn the prompt's point costs on the device's clock "
                         "(the serving loop's device_costs; on by default there with deferred steps)")
    ap.add_argument("--gc-freeze", default="on", choices=["on", "off"],
                    help="freeze the start-up objects out of the garbage collector's walks, as ft serve does")
    ap.add_argument("--prefill-graph-tokens", type=int, default=512,
                    help="largest prompt chunk replayed from the prefill graphs (the engine flag)")
    ap.add_argument("--stacks-every", type=float, default=0,
                    help="every this many seconds, every thread's Python stack to stderr (faulthandler): "
                         "where the host is when a row stalls (0: off)")
    ap.add_argument("--progress-every", type=float, default=0,
                    help="every this many seconds, a progress line to stderr (layers, steps, allocator retries; 0: off)")
    ap.add_argument("--warm-loaded", type=int, default=0,
                    help="a loaded window before the rows, not one of them: streams decoding while a prompt of this "
                         "many tokens prefills, with the first setting (does the first row of a process miss only "
                         "for being its first? 0: none)")
    a = ap.parse_args()
    if a.stacks_every > 0:
        import faulthandler
        faulthandler.dump_traceback_later(a.stacks_every, repeat=True)
    if a.progress_every > 0:
        threading.Thread(target=progress, args=(a.progress_every, threading.Event()), daemon=True).start()
    if a.moe != "resident" and not a.full_size:
        ap.error(f"--moe {a.moe} is a --full-size engine's: add --full-size (the demo engine's experts are its own)")
    page_gather.ENABLED = a.gather_workspace == "on"
    ctx = a.long + a.short + 64
    if a.full_size and a.moe == "cpu":  # the CPU-only product case at the real shape (the demo's decode
        # step reads a 127 MB lm_head and small experts; a prompt layer there costs ~6 ms whatever the chunk)
        eng = full_size_engine(a.layers, "cpu", experts_on="cpu", max_len=ctx, cpu_threads=a.cpu_threads)
    elif a.full_size and a.moe == "cache":
        eng = full_size_engine(a.layers, "cuda", experts_on="cache", max_len=ctx, expert_cache=a.expert_cache)
    elif a.full_size:
        eng = full_size_engine(a.layers, "cuda", max_len=ctx, prefill_graph_tokens=a.prefill_graph_tokens)
    else:
        eng = Engine(demo_path(), EngineConfig(max_seq_len=ctx, cpu_threads=a.cpu_threads))
    warm = None
    if a.warm_loaded:
        import copy
        wa = copy.copy(a)
        wa.long = a.warm_loaded
        w = run_setting(eng, a.settings.split(",")[0], wa)
        warm = {k: w.get(k) for k in ("setting", "p99_gap_over_unloaded_p50", "short_ttft_over_idle", "long_prefill_tok_s",
                                      "prompt_chunks")}
        warm["long_prompt"] = a.warm_loaded
        print("warm-up loaded window:", warm, flush=True)
    rows = []

    def save(complete: bool) -> None:
        write_result(a.name or ("interference-full" if a.full_size else "interference"),
                     {"model": f"Qwen3.6-35B-A3B shape, {a.layers} layers" if a.full_size else "demo",
                      "moe": a.moe if a.full_size else eng.experts_on,
                      "expert_cache": a.expert_cache if a.full_size and a.moe == "cache" else None,
                      "prefill_passes": eng.prefill_stream.stats() if eng.prefill_stream is not None else None,
                      "device": str(eng.device), "torch_threads": torch.get_num_threads(),
                      "cpu_expert_threads": getattr(eng.executor, "threads", None), "long_prompt": a.long,
                      "short_prompt": a.short, "decoding_streams": a.streams,
                      "prefill_graph_tokens": a.prefill_graph_tokens, "warm_loaded": warm,
                      # false while rows are still to come: the file is rewritten after each row, so a
                      # run stopped by a time limit keeps the rows it finished
                      "complete": complete, "settings": rows}, quiet=not complete)

    for name in a.settings.split(","):
        rows.append(run_setting(eng, name, a))
        print(rows[-1], flush=True)
        save(complete=len(rows) == len(a.settings.split(",")))


if __name__ == "__main__":
    main()
