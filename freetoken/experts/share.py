"""The fill share r of the GPU expert cache, chosen from decode step times measured while
serving.

r is the share of a step's misses copied into slots; the rest run on the CPU. Which r is
fastest depends on what the link and the host deliver *while serving*: PCIe and host DRAM
bandwidth, the CPU executor's fixed per-call cost, contention from other processes. A
bandwidth model measured alone picks wrong by large factors (the peer engine's users report
8-40x); here the engine measures the real thing: the wall time of its own decode steps at each
candidate r, and keeps the fastest.

Procedure (a hill climb from fill-only, re-checked periodically):
  probe   run PROBE steps at a candidate, drop the first SETTLE (the cache's contents adjust
          to the new split), keep the median of the rest;
  climb   start at r = 1 (fill-only); step to the next smaller candidate while it is faster by
          more than MARGIN; stop at the first that is not (or at the end of the list);
  hold    keep the best for HOLD steps, then probe its neighbours again (conditions drift).
Samples are compared only within one batch size: a change of batch size restarts the probe.
r is a device scalar read by the control kernel, so changing it re-captures nothing.
"""
from __future__ import annotations

import logging
import statistics

log = logging.getLogger("freetoken.experts")

CANDIDATES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
PROBE, SETTLE, HOLD, MARGIN = 24, 8, 2048, 0.02


class ShareTuner:
    def __init__(self, candidates=CANDIDATES, probe: int = PROBE, settle: int = SETTLE, hold: int = HOLD,
                 margin: float = MARGIN):
        assert candidates[0] == 1.0 and list(candidates) == sorted(candidates, reverse=True)
        self.cands, self.probe, self.settle, self.hold, self.margin = list(candidates), probe, settle, hold, margin
        self.cur = 0  # index of the r in use
        self.best: tuple[int, float] | None = None  # (index, median step seconds) of the best measured
        self.samples: list[float] = []
        self.batch = None
        self.held = 0  # steps since the climb settled (None: climbing)
        self.climbing = True
        self.decisions = 0

    @property
    def share(self) -> float:
        return self.cands[self.cur]

    def observe(self, batch: int, seconds: float) -> float | None:
        """One decode step's wall time at the current r -> the r to use from now on if it
        changes, else None."""
        if batch != self.batch:  # times of different batch sizes do not compare: start over
            self.batch, self.samples, self.best, self.climbing, self.held = batch, [], None, True, 0
            return self._go(0) if self.cur != 0 else None
        if not self.climbing:
            self.held += 1
            if self.held < self.hold:
                return None
            # re-check: climb again from the neighbour above (or from the top)
            self.climbing, self.best, self.samples = True, None, []
            return self._go(max(0, self.cur - 1))
        self.samples.append(seconds)
        if len(self.samples) < self.probe:
            return None
        t = statistics.median(self.samples[self.settle:])
        if self.best is None or t < self.best[1] * (1 - self.margin):
            self.best = (self.cur, t)
            if self.cur + 1 < len(self.cands):
                return self._go(self.cur + 1)
        return self._settle()

    def _go(self, i: int) -> float:
        self.cur, self.samples = i, []
        return self.cands[i]

    def _settle(self) -> float | None:
        i, t = self.best
        self.climbing, self.held = False, 0
        self.decisions += 1
        log.info("expert cache: fill share r=%.2f (decode step %.2f ms at batch %d)", self.cands[i], t * 1e3,
                 self.batch)
        if i != self.cur:
            return self._go(i)
        return None
