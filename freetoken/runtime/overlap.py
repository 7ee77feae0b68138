"""Decode steps that run *while* a prompt forward runs, instead of between its layers.

runtime/interleave.py bounds a decoding stream's gap by stopping the prompt for a decode step
every few layers: on the H200 (full-size shape, 32k prompt, benchmarks/README.md) the p99 gap
came to 2.19x the unloaded one, but the prompt took 2.9x as long, because every decode step
and the layer it waited behind run one after the other. Here they run side by side: a worker
thread replays the decode graphs on a high-priority CUDA stream, back to back, for as long as
the prompt's forward runs on the main stream. A decode step at batch 1-8 leaves most of the
device idle (it is bound by latency, not by compute or HBM), so the prompt loses little and a
stream's gap is about one decode step under contention.

Why it is safe: the decode step touches only the decoding rows' state. Rows that are not
decoding (the prompt's own slot among them) are inactive in the graph: their K/V writes go to
the scratch page, they route to no expert, and the recurrent-state kernels mask their stores
(on the CPU the torch path writes the active rows only). The prompt forward writes only its
own slot and pages, allocated before it starts (and a short prompt jumping in between its
layers, below, only its own, while the worker waits). What the worker must not do meanwhile, it
leaves to the main thread: it grows a row's KV only when a page is at hand (no preemption:
the victim could be the prompt in flight), and a request that finishes in it is finished after
the forward (its pages and prefix handed to the cache on the loop's thread; its last token is
streamed at once, its finish event waits for the prompt forward).
Growing a row's KV may evict cached prefix pages, never one the prompt holds (held pages are
not evictable); a recurrent-state checkpoint is saved on the worker only into a free
checkpoint slot (evicting one could hand it the slot the prompt's capture is writing). The
worker's steps wait for the main stream's work queued before the forward, and the main stream
waits for the worker's before anything after it.

Short prompts that arrive meanwhile prefill whole between the prompt forward's layers, on the
loop's thread (the loop's _alongside_layers -> _jump_in), with the worker's decode steps paused
for them by a lock both take: that work restores prefixes, takes pages and finishes requests,
which the worker's steps must not do at the same time. Without it a short request waited for
the whole forward (on the H200, 7.7 s behind a 32k prompt, 73x its idle TTFT).

On CUDA the loop's thread would queue the whole prompt forward in a few milliseconds and then
wait for the device, passing every layer's hook before a short request had arrived (at c1de6eb
on the H200 no jump-in fired; the short request waited the forward out, 34x its idle TTFT):
LayerPacer keeps it at most two layers ahead of the device, so the hooks come in real time.

Where: CUDA with decode graphs captured at start-up (a capture while another thread runs
would fail), experts resident in VRAM (the C++ CPU executor and the expert cache's slots are
one per process and not reentrant), no streamed prefill passes. Opt-in (--decode-overlap):
measured on the H200 (benchmarks/README.md), not yet with the jump-ins. The CPU runs the same
code for the tests (the torch expert path).
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import deque

import torch

log = logging.getLogger("freetoken.serving")


class LayerPacer:
    """Holds the host at most `ahead` layers in front of the device during a prompt forward:
    before layer i, an event marks the work queued so far, and the host waits (polling, so the
    overlap worker keeps the GIL meanwhile) until the event of `ahead` layers back has run.
    Two layers: the device always has the next layer queued, no bubble."""

    def __init__(self, device: torch.device, ahead: int = 2, event=None, idle=None):
        """idle: called while the host waits (the polled overlap's decode steps: DecodeOverlap.polled)."""
        self.ahead = ahead
        self.device = device
        self.events: deque = deque()
        self._event = event or (lambda: torch.cuda.Event())  # a fake in the tests
        self._idle = idle

    def before_layer(self) -> None:
        ev = self._event()
        ev.record(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        self.events.append(ev)
        while len(self.events) > self.ahead:
            self.wait(self.events.popleft())

    def wait(self, ev) -> None:
        """Until the device has run what `ev` marks, polling (and calling `idle` meanwhile)."""
        while not ev.query():
            if self._idle is not None:
                self._idle()
            time.sleep(0.0002)


def eligible(engine, runner) -> str | None:
    """None if decode steps can overlap a prompt forward with this engine, else why not."""
    from ..kernels import HAS_TRITON
    from ..model.deltanet import GatedDeltaNet
    ex = engine.executor
    backend = getattr(ex, "backend", None) if ex is not None else None
    model = engine.model
    if getattr(engine, "prefill_stream", None) is not None:
        return "prompts run as streamed passes (--moe cache)"
    if engine.device.type == "cuda":
        if runner.path != "cuda-graphs":
            return "decode steps are not CUDA graphs"
        if ex is not None and backend != "gpu-resident":
            return f"the {backend} expert backend is not reentrant"
        # the torch fallback of a DeltaNet decode writes every row back (torch.where, no sync in
        # a graph), the prompt's slot among them: only the Triton kernels mask inactive rows
        if any(isinstance(m, GatedDeltaNet) and not (m.fusable and HAS_TRITON) for m, *_ in model.layers):
            return "a DeltaNet layer decodes on its torch path, which rewrites idle rows' state"
    else:
        if ex is not None and backend != "torch":
            return f"the {backend} expert backend is not reentrant"
        if getattr(model, "per_forward_state", False):  # eager decode runs that Python too
            return f"{type(model).__name__} keeps a forward's data in state its layers share"
    return None


class DecodeOverlap:
    """Runs `step()` (one decode step of the rows decoding now; False when there are none)
    on a worker thread, back to back, while a prompt forward runs on the caller's thread."""

    # Python's GIL switch interval while the worker runs (seconds; sys default 5 ms). Both threads
    # run Python between their launches; whenever the prompt's thread gives the GIL up (a host
    # sync, LayerPacer's polling) it waits up to the interval to get it back from a busy worker,
    # and a layer of the prompt forward is ~150 launches: on the H200 an overlapped 32k prompt
    # prefilled at 591 tok/s against 1,301 interleaved (benchmarks/README.md, 2026-12-03).
    SWITCH_S = 2e-4

    # POLLED: no worker thread. The loop's own thread launches each decode step on the
    # high-priority stream from the prompt forward's hooks and from LayerPacer's waits (the host
    # polls there anyway, the device two layers behind), and emits its tokens a poll after the
    # device has run it (runtime/deferred_step.py). The worker's Python competed with the
    # prompt's launches for the GIL, and its steps ran back to back: on the H200 the prompt
    # prefilled ~20x slower than alone. The loop spaces the polled steps by --decode-slowdown
    # times a plain decode step instead (EngineLoop._side_poll). Off by default: exact on the
    # CPU and on CUDA (tests/test_overlap.py). On the H200 no 32k polled row finished (plan 51)
    # while the decode and prefill graphs shared one cuBLAS workspace through one capture stream
    # (bench/graph_race.py: replays at once mismatched in that mode, never in separate ones;
    # runtime/capture_stream.py). Since, an 8k row finished (plan 52): the prompt at 13,665 tok/s
    # but a stream's p99 gap at 3.62x unloaded (the interleave 2.57x, the worker 1.38x with a
    # short request's first token at 17.9x idle)
    POLLED = False

    def __init__(self, device: torch.device, switch_s: float | None = SWITCH_S, polled: bool | None = None):
        """switch_s: the GIL switch interval while a prompt forward overlaps (None: leave it);
        polled: steps from the loop's thread (POLLED) or on a worker thread."""
        self.device = device
        self.switch_s = switch_s
        self.polled = self.POLLED if polled is None else polled
        # high priority: its kernels are scheduled ahead of the prompt's as SMs free up
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self.local = threading.local()  # .worker: True on the worker thread
        self.steps = 0  # decode steps run alongside a prompt forward (telemetry)
        self.deferred: list = []  # (request, reason, error) finished on the worker
        self.failures = 0  # worker loops ended by an unexpected error (logged)

    @property
    def in_worker(self) -> bool:
        return getattr(self.local, "worker", False)

    def sync(self) -> None:
        """The worker's own stream only (a device-wide sync would wait for the prompt too)."""
        if self.stream is not None:
            self.stream.synchronize()

    @contextlib.contextmanager
    def as_worker(self):
        """The polled overlap's decode step on the loop's thread: on the high-priority stream,
        and treated as the worker's (requests that finish in it are finished after the prompt
        forward; no prefix-cache eviction meanwhile)."""
        self.local.worker = True
        try:
            with self._on_stream():
                yield
        finally:
            self.local.worker = False

    def _on_stream(self):
        """The high-priority stream as the current one (nothing off CUDA)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def alongside(self, step):
        """Within the block (the prompt forward), `step` runs repeatedly on the worker."""
        stop = threading.Event()
        errors: list[BaseException] = []
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # what came before

        def work():
            self.local.worker = True
            try:
                with self._on_stream():
                    while not stop.is_set() and step():
                        self.steps += 1
            except Exception:  # noqa: BLE001 - _run fails its own rows; anything else is a bug
                log.exception("a decode step alongside a prompt forward failed; the streams decode after it")
                errors.append(True)

        worker = threading.Thread(target=work, name="ft-decode-overlap", daemon=True)
        switch = sys.getswitchinterval()
        try:
            if self.switch_s is not None:
                sys.setswitchinterval(min(switch, self.switch_s))
            worker.start()
            yield
        finally:
            stop.set()
            if worker.is_alive():
                worker.join()
            sys.setswitchinterval(switch)
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)  # what comes after
        self.failures += len(errors)  # not the prompt's fault: it is not failed for it
