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
          to the new split), keep the median of the rest; a probe too noisy to rank candidates
          MARGIN apart runs on, up to EXTEND x PROBE steps, unless it is already clearly slower
          than the best (by the margin and two standard errors of the difference);
  climb   start at r = 1 (fill-only); step to the next smaller candidate while it is faster by
          more than MARGIN than the best so far; past one that is not, probe PATIENCE more
          (a candidate can tie its neighbour: with one or two misses per layer call, nearby
          shares move the same experts; and a probe is noisy), then keep the best measured
          (patience past a far slower probe too: on the H200 at 14 threads the first probe with
          a CPU branch, r = 0.9, took 16.2 ms against fill-only's 9.75, and 0.8 then 8.1, 0.5 6.0);
  confirm probe the best and both its neighbours (measured or not) once more and keep the
          one whose fastest probe is lowest if it beats the best's by MARGIN. One probe's
          median varies by several percent from run to run (the cache's contents, the host),
          enough to stop a climb one candidate early or late (on the H200 at 6 threads a single
          unlucky probe at 0.5 left r at 0.6). The lowest, not the mean: contention from other
          processes only ever adds time, so a slow probe says less about its candidate than a
          fast one (with a host-memory hog beside it on the H200, one probe of 0.5 took 10.3 ms
          against 7.0 before, and a mean left r at 0.4: 20% slower than 0.5). Unmeasured
          neighbours too: a climb started from a prediction below the best only steps down.
          Not a neighbour already measured FAR slower than the best: its probe said enough (on an
          H100 with a memory hog on the CPU branch's cores, r = 0.9 took 2.8x fill-only's step and
          the confirmation probed it again; a periodic re-check measures it afresh);
  hold    keep the best for HOLD steps (at least 4x the steps the climb took), then probe its
          neighbours again (conditions drift). Meanwhile watch the steps: when the median of
          DRIFT_WINDOWS windows of PROBE steps in a row is over the hold's first window (after
          SETTLE steps) by more than DRIFT, the host (or the link) changed under the split
          (another process took the cores or the memory bandwidth): climb again at once, from
          fill-only, which needs no CPU. On the H100 of plan 78 the CPU branch's call went from
          ~105 us to 300-900 us in the middle of a run; the split held r = 0.7 at 22.4 tok/s
          where fill-only ran 71.5. A climb so started that keeps the same r (the steps became
          slower for another reason: longer contexts, other work on the device) mutes the watch
          until the next periodic re-check, so such a slowdown does not restart climbs over and over.
Samples are compared only within one batch size: each size climbs on its own (continuous
batching changes the number of decoding rows every few steps).
r is a device scalar read by the control kernel, so changing it re-captures nothing.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque

log = logging.getLogger("freetoken.experts")

# down to 0.1: with the doorbell the CPU branch overlaps the fills, and on the H200 r=0.4 beat
# 0.5 (expert_cache-doorbell-gpu.json); 0 (no fills at all) is --moe cpu's business
CANDIDATES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
PROBE, SETTLE, HOLD, MARGIN, PATIENCE = 24, 8, 2048, 0.02, 1
# a probe whose median is too uncertain to rank candidates MARGIN apart (its standard error,
# from the samples' spread, over MARGIN / 2) goes on collecting, up to EXTEND x PROBE steps:
# replayed real routing makes step times swing by 30% with each token's misses (the Mixtral
# HumanEval trace on the H200), where a 16-sample median cannot tell r = 0.8 from 0.4
EXTEND = 8
# the hold's watch: DRIFT_WINDOWS windows of PROBE steps in a row whose median is over the hold's
# first window's by more than DRIFT start a new climb from fill-only. 20% is about four standard
# errors of a 24-step median of steps swinging +-30% (replayed real routing): two such windows in
# a row by chance are rare
DRIFT, DRIFT_WINDOWS = 0.2, 2
# a neighbour of the best whose probe's median was over the best's by more than FAR is not probed
# again in the confirmation round. Not more than that: one probe can be off by far more than the few
# percent a probe usually varies by (the H200's first CPU-branch probe at 14 threads: 66% over
# fill-only, and the climb's next probes were faster than fill-only), so the climb keeps its patience
FAR = 0.25


def _stderr(samples: list[float]) -> float:
    """The standard error of the median of `samples`: ~ 1.25 sigma / sqrt(n), sigma from the
    median absolute deviation (robust to the odd slow step)."""
    med = statistics.median(samples)
    mad = statistics.median(abs(s - med) for s in samples)
    return 1.25 * 1.4826 * mad / len(samples) ** 0.5


def _uncertain(samples: list[float], margin: float) -> bool:
    """Whether the median of `samples` is known to worse than margin / 2 (relative)."""
    med = statistics.median(samples)
    return med > 0 and _stderr(samples) > med * margin / 2


def _clearly_slower(samples: list[float], ref: float, ref_se: float, margin: float) -> bool:
    """Whether a probe too noisy for a tie-level median is already known slower than the best
    (median ref, standard error ref_se): its median above ref by more than the margin plus two
    standard errors of the difference. A candidate 30% slower is known slower after a short
    probe; only near-ties need the long ones (on the H200, GLM-5's slice probed r=0.4, 34%
    slower, for up to 192 steps, and its 600-step warm-up ended before the split was decided).
    Not the other way: a probe that looks faster becomes the reference the next ones are judged
    against, so it runs to full precision (a short lucky probe would end its neighbours' early)."""
    se = _stderr(samples)
    return statistics.median(samples) - ref > ref * margin + 2 * (se * se + ref_se * ref_se) ** 0.5


class _Climb:
    """The hill climb of one batch size (see the module doc)."""

    def __init__(self, tuner: "ShareTuner"):
        self.t = tuner
        self.cur = tuner.start  # index of the r in use
        self.best: tuple[int, float] | None = None  # (index, median step seconds) of the best measured
        self.best_se = 0.0  # the standard error of that median
        self.samples: list[float] = []
        self.held = 0
        self.climbing = True
        self.misses = 0  # probes in a row not better than the best
        self.meds: dict[int, list[float]] = {}  # every probe's median, per candidate index
        self.climb_steps = 0  # steps the current (or last) climb has taken
        self.confirm: list[int] | None = None  # the confirmation round's candidates still to probe
        self.ref: float | None = None  # the hold's first window's median step (the watch's reference)
        self.window: list[float] = []  # the hold's current window of steps
        self.slow_windows = 0  # windows in a row over ref by more than DRIFT
        self.watching = False  # the hold's watch is on (off until a decision; muted, see _decide)
        self.drift_from: int | None = None  # the r a drift's climb started from (until it decides)

    def observe(self, seconds: float, batch: int) -> None:
        t = self.t
        if not self.climbing:
            self.held += 1
            if self._drifted(seconds, batch):
                self.drift_from = self.cur
                return self._climb_again(0)  # from fill-only: the CPU's share is what became slow
            # re-check: climb again from the neighbour above (or the top), after HOLD steps and at
            # least 4x the steps the last climb took (noisy probes are long: probing stays <= 1/5)
            if self.held >= max(t.hold, 4 * self.climb_steps):
                self._climb_again(max(0, self.cur - 1))
            return
        self.samples.append(seconds)
        self.climb_steps += 1
        if len(self.samples) < t.probe:
            return
        rest = self.samples[t.settle:]
        if (len(self.samples) < t.probe * t.extend and _uncertain(rest, t.margin)
                and (self.best is None or not _clearly_slower(rest, self.best[1], self.best_se, t.margin))):
            return  # a noisy probe, not yet clearly slower than the best: more samples before it is ranked
        med = statistics.median(rest)  # a one-off slow step (a capture) does not move it
        t.history.append((batch, t.cands[self.cur], med))
        self.meds.setdefault(self.cur, []).append(med)
        if self.confirm is not None:  # the confirmation round
            if self.confirm:
                self._go(self.confirm.pop(0))
                return
            low = {j: min(m) for j, m in self.meds.items()}  # two probes each (one: a neighbour new here)
            i, b = min(low, key=low.get), self.best[0]
            if low[i] >= low[b] * (1 - t.margin):  # a neighbour must win by the margin, as in the climb
                i = b
            return self._decide(i, low[i], batch)
        if self.best is None or med < self.best[1] * (1 - t.margin):
            self.best, self.best_se, self.misses = (self.cur, med), _stderr(rest), 0
        else:
            self.misses += 1
        if self.cur + 1 < len(t.cands) and self.misses <= t.patience:
            self._go(self.cur + 1)
            return
        b = self.best[0]
        # the best and both its neighbours once more, the best last (it is kept next); a
        # neighbour the climb never measured too: a climb that starts from a prediction below
        # the best r only ever steps down (at 2 threads on the H200 it started at 0.7, and 0.8,
        # 4% faster, was never probed); not one measured FAR slower than the best
        best_med = self.best[1]
        self.confirm = [j for j in (b - 1, b + 1, b) if 0 <= j < len(t.cands)
                        and (j == b or not self.meds.get(j) or min(self.meds[j]) <= best_med * (1 + t.far))]
        self.meds = {j: self.meds.get(j, []) for j in self.confirm}  # the decision is among these
        self._go(self.confirm.pop(0))

    def _drifted(self, seconds: float, batch: int) -> bool:
        """The hold's watch (module doc): whether the steps at the chosen r have become slower
        than when it was chosen, by more than DRIFT over DRIFT_WINDOWS windows in a row."""
        t = self.t
        if not self.watching or self.held <= t.settle:  # the cache's contents adjust to the r just set
            return False
        self.window.append(seconds)
        if len(self.window) < t.probe:
            return False
        med, self.window = statistics.median(self.window), []
        if self.ref is None:  # the first window: the hold's own level at its r
            self.ref = med
            return False
        self.slow_windows = self.slow_windows + 1 if med > self.ref * (1 + t.drift) else 0
        if self.slow_windows < t.drift_windows:
            return False
        t.drifts += 1
        log.info("expert cache: decode steps at batch %d take %.2f ms, %.2f after r=%.2f was chosen: "
                 "measuring the split again from fill-only", batch, med * 1e3, self.ref * 1e3, t.cands[self.cur])
        return True

    def _climb_again(self, i: int) -> None:
        self.climbing, self.best, self.misses, self.meds, self.confirm = True, None, 0, {}, None
        self.climb_steps, self.ref, self.window, self.slow_windows = 0, None, [], 0
        self._go(i)

    def _decide(self, i: int, m: float, batch: int) -> None:
        t = self.t
        self.climbing, self.held = False, 0
        self.ref, self.window, self.slow_windows = None, [], 0
        # a drift's climb that keeps the r it started from: the split was not what slowed down
        self.watching = self.drift_from is None or i != self.drift_from
        self.drift_from = None
        t.decisions += 1
        log.info("expert cache: fill share r=%.2f at batch %d (decode step %.2f ms, fastest of %d probes)",
                 t.cands[i], batch, m * 1e3, len(self.meds[i]))
        self._go(i)

    def _go(self, i: int) -> None:
        self.cur, self.samples = i, []


class ShareTuner:
    """r per batch size: continuous batching changes the number of decoding rows often, and
    each size has its own best split; each keeps its own climb, so a size that comes back
    resumes where it was instead of starting over."""

    def __init__(self, candidates=CANDIDATES, probe: int = PROBE, settle: int = SETTLE, hold: int = HOLD,
                 margin: float = MARGIN, start: float = 1.0, patience: int = PATIENCE, extend: int = EXTEND,
                 drift: float = DRIFT, drift_windows: int = DRIFT_WINDOWS, far: float = FAR):
        """start: a predicted r (`ft bench bw`'s profile, runtime/bandwidth.py): each climb
        begins one candidate above it instead of at fill-only, so a good prediction is reached
        in one probe and a bad one is still corrected by the climb."""
        assert candidates[0] == 1.0 and list(candidates) == sorted(candidates, reverse=True)
        self.cands, self.probe, self.settle, self.hold, self.margin = list(candidates), probe, settle, hold, margin
        self.patience, self.extend = patience, max(1, extend)
        self.drift, self.drift_windows, self.far = drift, max(1, drift_windows), far
        self.drifts = 0  # climbs started by the hold's watch (steps slower than when r was chosen)
        at = next((i for i, r in enumerate(self.cands) if r <= start + 1e-9), len(self.cands) - 1)
        self.start = max(0, at - 1)
        self.climbs: dict[int, _Climb] = {}
        self.batch: int | None = None
        self.decisions = 0
        self.history: deque[tuple[int, float, float]] = deque(maxlen=256)  # (batch, r, median s) per probe

    @property
    def share(self) -> float:
        """The r in use (for the batch size of the last step; 1 before any)."""
        c = self.climbs.get(self.batch)
        return self.cands[c.cur] if c is not None else 1.0

    @property
    def climbing(self) -> bool:
        c = self.climbs.get(self.batch)
        return c is None or c.climbing

    def observe(self, batch: int, seconds: float) -> float | None:
        """One decode step's wall time at batch size `batch` -> the r for the next step if it
        changes, else None (the next step is assumed to have the same batch size; a step of
        another size is first measured at that size's own r)."""
        before = self.share
        self.batch = batch
        c = self.climbs.get(batch)
        if c is None:
            c = self.climbs[batch] = _Climb(self)
        if self.cands[c.cur] != before:  # this step ran at another size's r: not a sample of this one
            return self.cands[c.cur]
        c.observe(seconds, batch)
        r = self.cands[c.cur]
        return r if r != before else None
