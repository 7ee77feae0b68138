"""Continuous batching with a token budget per step: which requests prefill and which decode.

Plain Python, no torch: unit-tested with fake requests. The engine step is three calls:
schedule() -> Batch, execute(Batch) (runner), update() (engine). Waiting requests enter free
batch slots in arrival order. Every step decodes one token for every running request that has
its prompt in (decode rows cost one token of the budget each) and spends what is left of the
step's token budget on prompt chunks, possibly of several requests (one varlen forward):
shortest remaining prompt first, so a short request that arrives while a long prompt is being
prefilled gets its first token after one step instead of after the whole long prompt.

The runtime may lower the prefill budget of a step (to keep decoding streams' inter-token
latency bounded) and may preempt a request when KV pages run out: preempt() puts it back at
the head of the queue, to be recomputed from its tokens when a slot frees up. A step in which
nothing decodes may take a budget of its own (idle_tokens): on CUDA a prompt chunk of 2,048
tokens is bound by host launch time, and with no stream waiting a larger one costs no one.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Request

ORDERS = ("shortest", "arrival")


class QueueFull(Exception):
    """More requests waiting than the queue bound: the server answers 429."""


@dataclass
class Batch:
    # (request, start, end): tokens [start, end) of prompt (+ output, after a preemption) to prefill
    prefill: list[tuple[Request, int, int]] = field(default_factory=list)
    # requests that decode one token this step (their prompt is fully in the state)
    decode: list[Request] = field(default_factory=list)
    # requests to drop this step (cancelled before or while running)
    cancelled: list[Request] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.cancelled)


class Scheduler:
    def __init__(self, slots: int, max_queue: int, chunk: int, step_tokens: int = 0, order: str = "shortest",
                 idle_tokens: int = 0):
        """chunk: most tokens of one request per step; step_tokens: token budget of a step
        (decode rows + prefill chunks; 0: one chunk); order: which prompts prefill first;
        idle_tokens: the prompt tokens of a step in which nothing decodes and the runtime sets no
        latency budget, one request's chunk included (0: step_tokens and chunk as any step)."""
        if order not in ORDERS:
            raise ValueError(f"prefill order must be one of {ORDERS}, got {order!r}")
        self.free = list(range(slots))  # lowest slot first keeps the decode batch compact
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.max_queue, self.chunk = max_queue, chunk
        self.step_tokens = step_tokens or chunk
        self.idle = idle_tokens  # 0: follow step_tokens (which callers may change)
        self.order = order

    @property
    def idle_tokens(self) -> int:
        return self.idle or self.step_tokens

    def add(self, req: Request) -> None:
        # free slots absorb arrivals the engine thread has not scheduled yet
        if len(self.waiting) >= self.max_queue + len(self.free):
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(req)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_budget: int | None = None, short_whole: bool = False) -> Batch:
        """prefill_budget: at most this many prompt tokens this step (None: the step budget
        less the decode rows). At least one prompt token is scheduled when nothing decodes.
        short_whole: a prompt that fits the step budget whole, context and all, goes whole
        past prefill_budget (that budget sizes a long prompt's chunk by its costliest layer
        at a deep context; a short prompt's layers are cheap, and cut to that size it would
        take several forwards to its first token)."""
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
        prefilling = []
        for slot in sorted(self.running):
            req = self.running[slot]
            if req.cancelled:
                b.cancelled.append(req)
            elif req.prefilling:
                prefilling.append(req)
            else:
                b.decode.append(req)
        idle = not b.decode and prefill_budget is None and self.idle > 0
        budget = self.idle_tokens if idle else self.step_tokens - len(b.decode)
        chunk = max(self.chunk, self.idle_tokens) if idle else self.chunk
        if prefill_budget is not None:
            budget = min(budget, prefill_budget)
        if not b.decode:
            budget = max(budget, 1)
        if self.order == "shortest":
            prefilling.sort(key=lambda r: (r.prefill_end - r.computed, r.arrival))
        else:
            prefilling.sort(key=lambda r: r.arrival)
        room = budget if idle else self.step_tokens - len(b.decode)  # the step's own budget, past the latency one
        for req in prefilling:
            rest = req.prefill_end - req.computed
            if short_whole and rest > budget and req.prefill_end <= min(room, chunk):
                b.prefill.append((req, req.computed, req.prefill_end))
                room -= rest
                budget = 0  # the latency budget is spent: long prompts wait for the next step
                continue
            if budget <= 0:
                if short_whole:
                    continue  # a short prompt further on may still go whole (arrival order)
                break
            end = min(req.prefill_end, req.computed + chunk, req.computed + budget)
            b.prefill.append((req, req.computed, end))
            budget -= end - req.computed
            room -= end - req.computed
        return b

    def admit_whole(self, max_tokens: int) -> list[tuple[Request, int, int]]:
        """Waiting requests whose whole prompt is at most max_tokens, into free slots (arrival
        order; cancelled ones stay for schedule() to drop) -> (request, 0, prompt end): what the
        loop prefills between the layers of a long prompt's forward, so a short request does not
        wait for that forward (runtime/loop.py _jump_in)."""
        out = []
        for req in list(self.waiting):
            if not self.free:
                break
            if req.cancelled or req.prefill_end > max_tokens:
                continue
            self.waiting.remove(req)
            self.free.sort()
            req.slot = self.free.pop(0)
            self.running[req.slot] = req
            out.append((req, req.computed, req.prefill_end))
        return out

    def preempt(self, req: Request) -> None:
        """Give a running request's slot back and queue it first (it will be recomputed)."""
        if req.slot is not None and self.running.get(req.slot) is req:
            del self.running[req.slot]
            self.free.append(req.slot)
        req.slot = None
        self.waiting.appendleft(req)

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
