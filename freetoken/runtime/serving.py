"""ServingEngine: the engine thread behind `ft serve`, with continuous batching.

One background thread owns the model and the decode state and loops schedule -> execute ->
update. Requests arrive from the asyncio server through submit(); every new token goes back
to the request's asyncio queue with loop.call_soon_threadsafe. The thread never blocks the
event loop, and a failing step fails only the requests in it: the server keeps serving.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch

from .decode_runner import DecodeRunner
from .engine import Engine
from .request import Request, TokenEvent
from .sampler import SamplingParams, greedy_rows, sample, top_entries
from .scheduler import QueueFull, Scheduler
from ..cache.config import CacheConfig
from ..errors import FreeTokenError

log = logging.getLogger("freetoken.serving")


class ShuttingDown(QueueFull):
    """The server is stopping: no new requests (answered 503)."""


class ServingEngine:
    def __init__(self, engine: Engine, max_batch: int = 8, max_queue: int = 64, metrics=None,
                 max_new_tokens: int = 0, cache: CacheConfig | None = None, record_logits: bool = False,
                 start: bool = True, cuda_graphs: bool = False):
        self.engine = engine
        self.max_new_tokens = max_new_tokens  # server-side cap per request (0: none)
        self.record_logits = record_logits
        self.max_len = engine.max_len
        self.state = engine.new_state(self.max_len, slots=max_batch)
        self.cache = cache.build(engine, self.state) if cache is not None and cache.enabled else None
        if cuda_graphs and (engine.device.type != "cuda" or engine.experts_on != "gpu"):
            # graphs replay GPU work only; say so rather than ignore the flag
            raise FreeTokenError("--cuda-graphs needs a CUDA device with --experts gpu "
                                 f"(this run: device {engine.device.type}, experts on {engine.experts_on})")
        self.decode = DecodeRunner(engine.model, self.state, cuda_graphs)
        self.sched = Scheduler(max_batch, max_queue, engine.ecfg.prefill_chunk)
        self.metrics = metrics
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._gens: dict[int, torch.Generator | None] = {}
        self._stop = False
        self._closing: str | None = None  # why new requests are refused (shutting down)
        self._thread = threading.Thread(target=self._loop, name="ft-engine", daemon=True)
        if start:  # tests drive step() themselves
            self._thread.start()

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

    def describe(self) -> dict:
        """Engine.describe() plus the serving loop's own choices."""
        return {**self.engine.describe(), "decode_path": "cuda-graphs" if self.decode.graphs else "eager",
                "max_batch": self.state.slots, "prefix_cache": self.cache is not None}

    def queue_depth(self) -> int:
        return len(self.sched.waiting)

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and end every request in flight with an error event that says
        why (streams get a final error, waiting clients an error response). Called on
        SIGINT/SIGTERM before the HTTP server drains its connections."""
        with self._lock:
            self._closing = reason
        self._wake.set()

    def shutdown(self) -> None:
        self.begin_shutdown()
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        else:  # never started (tests drive step()): end what is left here
            self._abort_all()

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

    def step(self) -> bool:
        """One engine step: schedule, execute, update. False if there was nothing to do.

        A failure is charged to the request it belongs to: a prefill chunk or a sampling step
        that raises fails that request only. A batched decode step that raises fails the rows
        it decoded (their states advanced together, so none of them can be trusted), never the
        requests that were prefilling; the server keeps serving either way."""
        with self._lock:
            batch = self.sched.schedule()
        if batch.empty():
            return False
        for req in batch.cancelled:
            self._finish(req, req.finish_reason or "cancelled")
        for req, start, end in batch.prefill:
            if req.finished_at is None:
                self._guarded([req], self._prefill_chunk, req, start, end)
        decode = [r for r in batch.decode if r.finished_at is None]
        if decode:
            self._guarded(decode, self._decode, decode)
        return True

    def _guarded(self, reqs: list[Request], fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # a bug or OOM: fail these requests, keep serving
            log.exception("engine step failed for request(s) %s", [r.id for r in reqs])
            for req in reqs:
                if req.finished_at is None:
                    self._finish(req, "error", error=f"{type(e).__name__}: {e}")

    def _prefill_chunk(self, req: Request, start: int, end: int) -> None:
        eng = self.engine
        if not req.restored:
            req.restored = True
            self.state.reset(req.slot)
            if self.cache is not None:
                req.prefilled = req.cached_tokens = self.cache.restore(req, self.state)
            start = req.prefilled
            end = min(len(req.prompt_ids), start + self.sched.chunk)
        t0 = time.perf_counter()
        prompt = req.prompt_ids
        cuts = self.cache.positions(prompt, start, end) if self.cache is not None else []
        # checkpoints inside the chunk are taken by the DeltaNet layers in the same pass
        capture = self.cache.capture(prompt, cuts) if cuts else None
        try:
            # only the prompt's last token needs logits (they start decoding)
            out = eng.prefill(prompt[start:end], self.state, req.slot, start, logits=end == len(prompt),
                              capture=capture)
        except Exception:
            if capture is not None:
                capture.abort()
            raise
        req.prefilled = end
        if end == len(prompt):
            logits = out[-1:]  # [1, V]
            picks = self._device_picks([req], logits, [0])
            self._accept(req, self._host_row(logits, 0, req, picks), picks.get(req.id))
        if self.metrics:
            self.metrics.prefill(end - start, time.perf_counter() - t0)

    def _decode(self, reqs: list[Request]) -> None:
        n = max(r.slot for r in reqs) + 1  # rows [0, n): the decoding slots and any holes
        tokens = torch.zeros(n, dtype=torch.long)
        pos = torch.zeros(n, dtype=torch.long)
        active = torch.zeros(n, dtype=torch.bool)  # rows of idle or mid-prefill slots keep their state
        for r in reqs:
            tokens[r.slot] = r.output_ids[-1]
            pos[r.slot] = r.length - 1
            active[r.slot] = True
        t0 = time.perf_counter()
        logits = self.decode(tokens, pos, active)  # [>= n, V] on the device
        picks = self._device_picks(reqs, logits, [r.slot for r in reqs])
        host = logits.cpu() if self.record_logits or len(picks) < len(reqs) else None
        if self.metrics:
            self.metrics.decode_step(len(reqs), time.perf_counter() - t0)
        for r in reqs:
            self._guarded([r], self._accept, r, host[r.slot] if host is not None else None, picks.get(r.id))

    def _device_picks(self, reqs: list[Request], logits: torch.Tensor, rows: list[int]) -> dict:
        """Greedy rows are decided where the logits are; only the others copy theirs over."""
        greedy = [(r, row) for r, row in zip(reqs, rows) if r.sampling.temperature == 0 and not r.forcing()]
        if not greedy:
            return {}
        top = max(r.sampling.top_logprobs for r, _ in greedy)
        picks = greedy_rows(logits, [row for _, row in greedy], top)
        return {r.id: (tok, lp, tops[:r.sampling.top_logprobs]) for (r, _), (tok, lp, tops) in zip(greedy, picks)}

    def _host_row(self, logits: torch.Tensor, row: int, req: Request, picks: dict):
        """The row's logits on the host, when sampling or recording needs them."""
        return logits[row].cpu() if self.record_logits or req.id not in picks else None

    def _accept(self, req: Request, logits: torch.Tensor | None, pick: tuple | None = None) -> None:
        """Sample the next token of `req` (or take `pick`, chosen on the device), emit it,
        finish the request if it is done."""
        s = req.sampling
        if req.forcing():  # a forced token, with its log-probability under the model
            tok = s.forced[req.forced_next]
            req.forced_next += 1
            lsm = torch.log_softmax(logits.float(), -1)
            pick = tok, float(lsm[tok]), top_entries(lsm, s.top_logprobs)
        elif pick is None:
            pick = sample(logits, SamplingParams(s.temperature, s.top_p, s.top_k), self._gens.get(req.id),
                          s.top_logprobs)
        tok, lp, tops = pick
        if tok == s.forced_after:
            req.forced_armed = True
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        if self.record_logits:
            req.logits.append(logits.detach().float().cpu().clone())
        if s.top_logprobs:
            req.top_logprobs.append(tops)
        req.output_ids.append(tok)
        req.logprobs.append(lp)
        if self.cache is not None:  # the state now holds seq[:L]; checkpoint that boundary?
            seq = _Joined(req.prompt_ids, req.output_ids)  # no per-token copy of the whole context
            L = len(seq) - 1
            if self.cache.positions(seq, L - 1, L):
                self.cache.save((req.prompt_ids + req.output_ids)[:L], self.state, req.slot)
        reason = None
        if (not s.ignore_eos and tok in self.engine.eos_ids) or tok in s.stop_token_ids:
            reason = "stop"
        elif len(req.output_ids) >= s.max_tokens or req.length >= self.max_len:
            reason = "length"
        self._emit(req, TokenEvent(req.id, [tok], [lp]))
        if reason:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if self.cache is not None:
            # the slot holds K/V for the prompt part prefilled and all outputs but the last
            n = req.prefilled + max(0, len(req.output_ids) - 1) if req.slot is not None else 0
            seq = (req.prompt_ids + req.output_ids)[:n]
            ok = error is None and reason != "error"
            self.cache.release(req, self.state if ok else None, seq if ok else None)
        with self._lock:
            self.sched.finish(req)
        req.finish_reason = req.finish_reason or reason
        req.finished_at = time.monotonic()
        self._emit(req, TokenEvent(req.id, [], [], finish_reason=req.finish_reason, error=error))
        self._streams.pop(req.id, None)
        self._gens.pop(req.id, None)
        if self.metrics:
            self.metrics.finished(req)

    def _emit(self, req: Request, ev: TokenEvent) -> None:
        stream = self._streams.get(req.id)
        if stream is not None:
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, ev)
            except RuntimeError:  # the event loop is closing
                pass


class _Joined:
    """Read-only view of prompt + output (indexing and len only)."""

    __slots__ = ("a", "b")

    def __init__(self, a: list[int], b: list[int]):
        self.a, self.b = a, b

    def __len__(self) -> int:
        return len(self.a) + len(self.b)

    def __getitem__(self, i: int) -> int:
        n = len(self.a)
        return self.a[i] if i < n else self.b[i - n]
