"""Decode steps between the layers of a prefill forward, so streams that are decoding keep their
inter-token latency while a long prompt prefills.

A prefill forward (a chunk of one or more prompts, or a streamed pass over every expert) can
take far longer than a decode step: on the H200 a 2,048-token chunk of the full-size model is
~150 ms against a 6.6 ms decode step, and its fixed part (40 layers of launches) does not shrink
with the chunk, so a token budget per step alone left decoding streams stalled 39x their
unloaded gap. Here the forward's per-layer hook (model/base.py `_stack`) asks, before each
layer, whether a decode step is due; if so the loop runs one right there (a graph replay on the
same stream, so it runs on the device after the layers already queued and before the next).
The prompt's own rows are not in that step (mid-prefill rows are inactive), and nothing it
has written is touched.

When: the prompt work between two decode steps is kept near (slowdown - 1) x the plain decode
step (--decode-slowdown), so a decoding stream's gap is about slowdown x its unloaded one and
the prompt keeps the rest of the device. The host cannot see the device's progress without a
sync, so the work queued since the last decode step is counted in layers, at a cost per layer
index learned from the cycles themselves (layers differ: a full-attention layer reads the whole
context, a DeltaNet layer does not, so a decode step is taken before a costly layer rather than
after it): a cycle (decode end to decode end) is the queued layers plus one decode step, and the
decode step's own time is known from plain steps.

Short prompts: a request whose whole prompt fits one step's budget and arrives while such a
forward runs prefills at the next layer boundary, whole, before the forward goes on (the
loop's _jump_in): its first token does not wait for the long forward.
"""
from __future__ import annotations

import time
from collections import deque

EMA = 0.3  # weight of the newest per-layer sample
MIN_PREFILL = 32  # prompt tokens a step takes at least, whatever the latency budget says


def affine_fit(costs) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of forwards [(tokens, seconds)], least squares; with
    too little spread in sizes, all of the time is charged per token (an upper bound)."""
    n = [c[0] for c in costs]
    t = [c[1] for c in costs]
    mn, mt = sum(n) / len(n), sum(t) / len(t)
    var = sum((x - mn) ** 2 for x in n)
    if var > 0:
        b = sum((x - mn) * (y - mt) for x, y in zip(n, t)) / var
        a = mt - b * mn
        if b > 0 and a >= 0:
            return a, b
    return 0.0, max(sum(t) / max(sum(n), 1), 1e-9)


class Interleaver:
    def __init__(self, slowdown: float):
        """slowdown: --decode-slowdown (>= 1; 0 turns interleaving off)."""
        self.slowdown = slowdown
        self.last_decode: float | None = None  # perf_counter at the end of the last decode step
        self.queued: list[int] = []  # indices of the layers queued since then
        self.cost: dict[int, float] = {}  # seconds of prompt work of layer i (EMA): layers differ
        # (full attention reads the whole context, a DeltaNet layer does not)
        self.steps = 0  # decode steps run between layers (telemetry)
        self.running = False  # inside such a step (its own forward must not recurse)
        self.tokens = 0  # prompt tokens of the forward in flight (set by the loop)
        # (prompt tokens, seconds) of the costliest layer, measured alone: what sizes the chunk
        self.samples: deque[tuple[int, float]] = deque(maxlen=32)

    @property
    def enabled(self) -> bool:
        return self.slowdown >= 1

    @property
    def layers(self) -> int:
        return len(self.queued)

    @property
    def per_layer(self) -> float | None:
        """Mean seconds of a layer (telemetry)."""
        return sum(self.cost.values()) / len(self.cost) if self.cost else None

    def decoded(self) -> None:
        """A decode step (plain or between layers) just ended."""
        self.last_decode, self.queued = time.perf_counter(), []

    def due(self, decode_s: float | None, i: int = 0) -> bool:
        """Before layer i: is a decode step due? decode_s: the plain decode step's time."""
        if not self.enabled or self.running or decode_s is None or self.last_decode is None or not self.queued:
            return False
        gap = (self.slowdown - 1) * decode_s
        if i not in self.cost or any(j not in self.cost for j in self.queued):
            return True  # a cost not known yet: one layer at a time until each is measured
        queued = sum(self.cost[j] for j in self.queued)
        # the next layer would take the gap past its target by more than it would fall short
        return queued + self.cost[i] / 2 >= gap or time.perf_counter() - self.last_decode >= gap

    def layer_queued(self, i: int = 0) -> None:
        self.queued.append(i)

    def cycle(self, decode_s: float) -> None:
        """A decode step between layers ended; the cycle since the previous decode step ran the
        queued layers of prompt work and that step: their time is shared among them in
        proportion to what they are known to cost (equally while any is unknown)."""
        if self.last_decode is not None and self.queued:
            total = max(0.0, time.perf_counter() - self.last_decode - decode_s)
            known = [self.cost.get(j) for j in self.queued]
            weights = known if all(k for k in known) else [1.0] * len(known)
            for j, wj in zip(self.queued, weights):
                v = total * wj / sum(weights)
                self.cost[j] = v if j not in self.cost else (1 - EMA) * self.cost[j] + EMA * v
            j = self.queued[0]
            if self.tokens and len(self.queued) == 1 and self.cost[j] >= max(self.cost.values()):
                self.samples.append((self.tokens, total))  # the costliest layer, alone
        self.steps += 1
        self.decoded()

    def budget(self, decode_s: float | None, costs=(), layers: int = 1) -> int | None:
        """Prompt tokens for the next forward, so one of its layers fits the gap between decode
        steps (a layer is the finest grain at which they can interleave); None: no limit. The
        per-layer cost is fitted as a fixed part plus a part per token over the recent cycles;
        never below the chunk whose per-token part equals the fixed part (smaller chunks would
        slow the prompt without shortening the gap much). Before two cycles are measured, the
        recent prompt forwards `costs` [(tokens, seconds)] spread over their `layers` stand in."""
        if not self.enabled or decode_s is None:
            return None
        samples = self.samples if len(self.samples) >= 2 else [(n, t / max(1, layers)) for n, t in costs]
        if len(samples) < 2:
            return None
        fixed, per_token = affine_fit(samples)
        gap = (self.slowdown - 1) * decode_s
        floor = max(MIN_PREFILL, int(fixed / per_token))
        return max(floor, int((gap - fixed) / per_token)) if gap > fixed else floor
