"""ServingEngine: the engine thread behind `ft serve`, with continuous batching.

One background thread owns the model and the state and loops EngineLoop.step() (schedule ->
execute -> update). Requests arrive from the asyncio server through submit(); every new token
goes back to the request's asyncio queue with loop.call_soon_threadsafe. The thread never
blocks the event loop, and a failure fails only the request it belongs to: the server keeps
serving.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import torch

from .gcwatch import GcWatch, freeze_startup_objects, refreeze, unfreeze
from .loop import EngineLoop
from .request import Request, TokenEvent
from .scheduler import QueueFull

log = logging.getLogger("freetoken.serving")


class ShuttingDown(QueueFull):
    """The server is stopping: no new requests (answered 503)."""


class ServingEngine(EngineLoop):
    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64, metrics=None,
                 max_new_tokens: int = 0, cache=None, record_logits: bool = False, start: bool = True,
                 page_size: int = 16, kv_tokens: int | None = None, gc_freeze: bool = True):
        super().__init__(engine, max_batch, max_queue, metrics, cache, record_logits, page_size, kv_tokens)
        self.max_new_tokens = max_new_tokens  # server-side cap per request (0: none)
        self.gc_frozen = 0  # objects this engine froze out of the collector's walks (freeze_gc)
        GcWatch.shared()  # the collector's pauses timed from now on (/metrics)
        self._wake = threading.Event()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._closing: str | None = None  # why new requests are refused (shutting down)
        self._thread = threading.Thread(target=self._loop, name="ft-engine", daemon=True)
        if start:  # tests drive step() themselves
            if gc_freeze:  # start-up is over: its objects live as long as the server (runtime/gcwatch.py)
                self.freeze_gc()
            try:
                self._thread.start()
                # the grammar engine's view of the vocabulary, built off the request path now, so the
                # first structured-output request does not wait for it (a worker thread)
                self.grammar.warm()
            except BaseException:
                self.thaw_gc()
                raise

    # ---- called from the event loop ---------------------------------------------------
    def submit(self, req: Request) -> asyncio.Queue:
        """Queue a request; raises scheduler.QueueFull past the bound, ShuttingDown after
        begin_shutdown()."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        if self.max_new_tokens:
            req.sampling.max_tokens = min(req.sampling.max_tokens, self.max_new_tokens)
        s = req.sampling
        gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        with self._lock:
            if self._closing:
                raise ShuttingDown(self._closing)
            # everything the engine thread reads about the request is in place before the
            # scheduler makes it visible to that thread
            self._gens[req.id] = gen
            self._streams[req.id] = (loop, q)
            try:
                self.sched.add(req)
            except Exception:
                del self._gens[req.id], self._streams[req.id]
                raise
        self._wake.set()
        return q

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Stop a request (client gone, or a stop string seen by the server)."""
        if req.finish_reason is None:
            req.finish_reason = reason
        req.cancelled = True
        self._wake.set()

    def queue_depth(self) -> int:
        return len(self.sched.waiting)

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and end every request in flight with an error event that says
        why (streams get a final error, waiting clients an error response). Called on
        SIGINT/SIGTERM before the HTTP server drains its connections."""
        with self._lock:
            self._closing = reason
        self._wake.set()

    def freeze_gc(self) -> int:
        """Every object alive now out of the cyclic collector's walks (gc.freeze; given back at
        shutdown): a full collection then walks what serving made, not the model and the
        libraries (runtime/gcwatch.py). Called again (the server, once it listens), it freezes
        what was made since. -> how many objects are frozen."""
        self.gc_frozen = refreeze() if self.gc_frozen else freeze_startup_objects()
        return self.gc_frozen

    def thaw_gc(self) -> None:
        """Let go of this engine's hold on the freeze (the last holder's thaw gives the objects
        back to the collector)."""
        if self.gc_frozen:
            unfreeze()
            self.gc_frozen = 0

    def shutdown(self) -> None:
        self.begin_shutdown()
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        else:  # never started (tests drive step()): end what is left here
            self._abort_all()
        self.thaw_gc()

    # ---- the engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            if self._closing:
                self._abort_all()
            if not self.sched.busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            if not self.step():
                self._wake.wait(timeout=0.01)
                self._wake.clear()
        self._abort_all()

    def _abort_all(self) -> None:
        """End every waiting and running request with an error event (shutdown)."""
        with self._lock:
            reqs = list(self.sched.running.values()) + list(self.sched.waiting)
        for req in reqs:
            if req.finished_at is None:
                self._finish(req, "error", error=self._closing or "the server is shutting down")

    def emit(self, req: Request, ev: TokenEvent) -> None:
        stream = self._streams.get(req.id)
        if stream is not None:
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, ev)
            except RuntimeError:  # the event loop is closing
                pass
        if ev.finish_reason is not None:
            self._streams.pop(req.id, None)
