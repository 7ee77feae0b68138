"""Continuous batching: which requests prefill and which decode in the next engine step.

Plain Python, no torch: unit-tested with fake requests. The engine step is three calls:
schedule() -> Batch, execute(Batch) (runner), update() (engine). Waiting requests enter free
decode slots in arrival order; a prompt is prefilled in chunks of at most `chunk` tokens,
one chunk per step, so running requests keep decoding while a long prompt comes in.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Request


class QueueFull(Exception):
    """More requests waiting than the queue bound: the server answers 429."""


@dataclass
class Batch:
    # (request, start, end): prompt tokens [start, end) to prefill this step
    prefill: list[tuple[Request, int, int]] = field(default_factory=list)
    # requests that decode one token this step (their prompt is fully in the state)
    decode: list[Request] = field(default_factory=list)
    # requests to drop this step (cancelled before or while running)
    cancelled: list[Request] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.cancelled)


class Scheduler:
    def __init__(self, slots: int, max_queue: int, chunk: int, prefill_per_step: int = 1):
        self.free = list(range(slots))  # lowest slot first keeps the decode batch compact
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.max_queue, self.chunk, self.prefill_per_step = max_queue, chunk, prefill_per_step

    def add(self, req: Request) -> None:
        # free slots absorb arrivals the engine thread has not scheduled yet
        if len(self.waiting) >= self.max_queue + len(self.free):
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(req)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        b = Batch()
        for q in list(self.waiting):  # cancelled while still queued
            if q.cancelled:
                self.waiting.remove(q)
                b.cancelled.append(q)
        while self.waiting and self.free:
            req = self.waiting.popleft()
            self.free.sort()
            req.slot = self.free.pop(0)
            self.running[req.slot] = req
        budget = self.prefill_per_step
        for slot in sorted(self.running):
            req = self.running[slot]
            if req.cancelled:
                b.cancelled.append(req)
            elif req.prefilled < len(req.prompt_ids):
                if budget > 0:
                    end = min(len(req.prompt_ids), req.prefilled + self.chunk)
                    b.prefill.append((req, req.prefilled, end))
                    budget -= 1
            else:
                b.decode.append(req)
        return b

    def finish(self, req: Request) -> None:
        """Release a request's slot (finished, cancelled or failed)."""
        if req.slot is not None and self.running.get(req.slot) is req:
            del self.running[req.slot]
            self.free.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.slot = None

    def stats(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running), "free_slots": len(self.free)}
