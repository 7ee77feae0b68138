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
has written is touched. On CUDA the step's tokens are read at the next hook, not at once
(runtime/deferred_step.py): the device goes on to the next layer instead of draining; such a
step's cycle ends when its tokens are read (cycle's `ran`).

Points: before each layer and, with MID_LAYER, between each layer's token mixer and its MLP (the
hook at i + 0.5), so the grain is half a layer and a layer's fixed part is split in two; each
point has its own learned cost, and "layer" below means such a half where both are points.

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
loop's _jump_in): its first token does not wait for the long forward. One that is scheduled
while a long prompt prefills goes whole, past the chunk's latency budget (scheduler
short_whole; the long prompt then waits a step), or, where both fit the budget, in a forward
of its own before the chunk's (the loop's _groups); decode steps inside its forward come at
FIRST_TOKEN_SLOWDOWN (benchmarks/README.md, the 32k CPU rows: 2.0-2.4x its idle TTFT, against
2.8-3.9x before), and for a forward of at most FIRST_TOKEN_FLOOR_TOKENS not more often than every
FIRST_TOKEN_GAP_S (on the H200 a decode step is 6 ms: such a forward runs whole or nearly, as a
jump-in's does, and the streams wait up to ~50 ms once).

The CPU: eager decode could share one forward with the prompt chunk (the decode rows pay no
fixed part of their own; --decode-between-layers off), but that forward's prompt part has a
fixed part about as long as a decode step there or longer (every expert read, the DeltaNet
chunk machinery), so the streams' gaps cannot come under 2x their unloaded gap: the CPU
interleaves by default too (auto), eager CUDA alone keeps the mixed forward.
"""
from __future__ import annotations

import time
from collections import deque

from ..experts import split_experts
from ..kernels import split_keys

EMA = 0.3  # weight of the newest per-layer sample
MIN_PREFILL = 32  # prompt tokens a step takes at least, whatever the latency budget says
# the gap allowed inside a forward of prompts that all finish in it (short prompts, whose first
# token it gives): they are few and short, and a decode step every half decode step of their work
# would triple their time to first token. The gap is at least FIRST_TOKEN_GAP_S: the layer costs
# the interleaver has learned are a long prompt's chunk's (on the H200 2-3 ms a layer at 2,048
# tokens, against ~0.9 ms for a 200-token prompt: 35 ms to its first token on an idle server),
# so with a 6 ms decode step a short prompt's forward got a decode step every two or three
# layers and its first token came at 3.3x its idle time (plan 38). With BY_CLOCK it is judged by
# the time it has taken since the last decode step (on CUDA, the host's: a few hundred tokens'
# layers are launch-bound there), not by those costs, and teaches none.
# A stream's gap of 50 ms, once per short request, is below what a reader of the
# stream notices and what any client times out on; a short request waiting three times as long
# is not. Only for forwards of at most FIRST_TOKEN_FLOOR_TOKENS prompt tokens, so a stream's longer
# gap is bounded by one small prompt's forward (a 2k-token prompt would hold streams twice for
# 50 ms; it is paced at FIRST_TOKEN_SLOWDOWN, which keeps its own first token within ~2x).
# BY_CLOCK: such a forward (up to FIRST_TOKEN_FLOOR_TOKENS) judged by the time it has taken since
# the last decode step, teaching no layer costs, instead of at the learned costs against the floor.
# Off: on the H200 (plans 43-46, 23 rows of a 32k prompt) it ran the 200-token forward whole (one
# gap of 44-54 ms per stream against two of 25-31 and 15-21) and took the short request's TTFT
# from 1.15-1.39x to 0.87-1.08x its idle one, both far within the 3x target; but gaps past 2x at
# the long prompt's forward ends (11.3-16.1 ms: the last layers, the tail and a decode step)
# appeared in 13 of 15 rows with it against 0 of 8 without, and 1 of its 15 rows had the p99 gap
# under 2x against 3 of 8 (benchmarks/README.md, eighteenth session). Why is not known yet.
BY_CLOCK = False
# TAIL_CYCLES: the points after a forward's last decode step learn their costs at the forward's end
# (Interleaver.tail). Off: on the H200 (plan 49) 2.16/1.85/2.25x against the default's
# 2.29/1.89/1.85x in the same processes, within the noise (benchmarks/README.md, nineteenth session)
TAIL_CYCLES = False
FIRST_TOKEN_SLOWDOWN = 2.0
FIRST_TOKEN_GAP_S = 0.050
FIRST_TOKEN_FLOOR_TOKENS = 512
RECENT = 4  # forwards whose costliest layer gives the per-token cost (it grows with the context)
# the decode gap the chunk floor may reach (in decode steps): a layer that costs more than
# the fixed part's chunk would push decoding streams' p99 past 2x their unloaded gap
GAP_CEILING = 1.75
OUTLIER = 2.0  # a sample over this many times the fit of the others is a stall, not a cost
# measured headroom: while the largest recent chunk's costliest layer costs under HEADROOM x the
# ceiling, chunks keep that size even where the model asks for less, and where even GROW times
# that cost stays under the ceiling (the worst case: a cost in proportion to the tokens), they
# grow by GROW, once per RECENT forwards. Where a layer's cost is nearly flat in its tokens (the
# H200 with the prompt chunks' MoE graphs: a forward of 32 to 512 tokens cost 70-91 ms,
# prefill-graphs-gpu.json), the rate read at small chunks is mostly timing noise over a few tokens
# (for example, 0.5 ms over 32 tokens reads as 15 us a token) and kept the chunks at 32-160
# tokens (p10/p90; costliest layer 2.98-7.37 ms): a 32k prompt at 407 tok/s
# against 1,658 eagerly (benchmarks/README.md, interference-full-prefill-graphs). A measured
# cost is no model. Growth stops at the largest chunk the prefill graphs take (`cap`): past
# it a layer runs eagerly, several times dearer, a step no fit of this model sees coming. Only
# where prefill graphs run (the serving loop passes their cap): elsewhere a layer's cost grows
# with its tokens and the model's rate is no noise (the 2-core CPU's rows were measured without it).
HEADROOM = 0.85
GROW = 1.5
# a forward's sample (what sizes the chunks) is its costliest point; with STALL_FILTER, not a point
# that cost over OUTLIER times the median of its kind's points in that forward. On the H200 the
# host blocked ~15 ms launching layer 3 right after a decode step, and that time (most likely the
# device idling meanwhile) was charged to layer 3; in the first loaded run of a process layer 3
# was the costliest point of 27 of 42 forwards (the costliest layer's p90 8.43 ms against 4.62
# in the next run), its chunks p50 701 tokens against 1,535 and its p99 gap 2.79x against 1.87x
# (interference-full-firstrow-gpu.json). Off until measured
# there (device plan 43: bench.interference's interleave-nostall setting)
STALL_FILTER = False
# decode steps may also run between a layer's token mixer and its MLP (the hook at i + 0.5): the
# finest grain at which they interleave is then half a layer. Meant for the H200, where a layer's
# fixed part (its launches: 4-6 ms of a 32-token layer against a 6.4 ms decode step) is more than
# the gap's room and whole layers held the streams' p99 at 2.3x their unloaded gap; not measured
# there yet. Off: on the 2-core CPU it did not help (32k prompt: p99 2.51x against 2.32x, the
# prompt 365 tok/s against 399; one half of a layer costs about what the layer does there)
MID_LAYER = False
# on the CPU, decode steps may also run between the key pieces of a prompt chunk's attention over
# a long context (kernels/split_keys.py: points i + n * POINT_STEP, below i + 0.5): there a 32-token chunk's
# attention layer at 32k keys took 19-30 ms against a ~18 ms decode step (demo model, 2-core dev
# machine), so a gap holding one was past 2x the streams' unloaded gap whatever the chunk size.
# With them, between the pieces of a prompt chunk's routed experts on the CPU executor
# (experts/split_experts.py: points i + 0.5 + n * its POINT_STEP; its ENABLED is the A/B switch):
# a MoE block of the Qwen3.6 shape reads most of its 1.6 GB of experts whatever the chunk's size
KEY_POINTS = True


def affine_fit(costs) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of forwards [(tokens, seconds)], least squares; with
    too little spread in sizes, all of the time is charged per token (an upper bound)."""
    fit = _least_squares(costs)
    if fit is not None:
        return fit
    n = [c[0] for c in costs]
    t = [c[1] for c in costs]
    return 0.0, max(sum(t) / max(sum(n), 1), 1e-9)


def _least_squares(costs) -> tuple[float, float] | None:
    """(a, b) of t = a + b n, or None where the sizes do not spread or the fit is not a cost
    (a slope <= 0 or a negative fixed part)."""
    n = [c[0] for c in costs]
    t = [c[1] for c in costs]
    mn, mt = sum(n) / len(n), sum(t) / len(t)
    var = sum((x - mn) ** 2 for x in n)
    if var > 0:
        b = sum((x - mn) * (y - mt) for x, y in zip(n, t)) / var
        a = mt - b * mn
        if b > 0 and a >= 0:
            return a, b
    return None


def robust_fit(costs) -> tuple[float, float] | None:
    """_least_squares without the samples that a stall made slow: the worst sample is dropped
    while it took over OUTLIER times what the fit of the rest predicts (at most a quarter of
    them). On the H200 one cycle in a forward can take 50 ms (an allocation, a compile, the
    host), and a forward's costliest layer is then that cycle: a fit through it read no fixed
    part and a rate several times the real one. Only a sample whose removal leaves a fit is a
    candidate: where the others are all of one size, the one that differs carries the fixed
    part (a prompt's last, smaller chunk), not a stall."""
    costs = list(costs)
    for _ in range(len(costs) // 4):
        ratios = {}  # sample -> its seconds over what the fit of the others predicts
        for i, (n, t) in enumerate(costs):
            rest = _least_squares(costs[:i] + costs[i + 1:])
            if rest is not None:
                ratios[i] = t / max(rest[0] + rest[1] * n, 1e-12)
        if not ratios:
            break
        worst = max(ratios, key=ratios.get)
        if ratios[worst] <= OUTLIER:
            break
        costs.pop(worst)
    return _least_squares(costs)


class CostModel:
    """What a unit of prompt work costs against its tokens: a fixed part plus a part per token,
    from recent samples (tokens, seconds) of that work (the costliest layer of a prompt
    forward, or the prompt's share of a mixed forward).

    The two parts are read apart, because each is wrong alone. The part per token comes from
    the latest samples only: it grows with the context (attention reads every earlier token),
    so a fit over a longer history reads that growth as a fixed part; on the 2-core CPU a fit
    over forwards of one size at an 8k context read several times a layer's fixed part, and
    pinned the chunk at the step's maximum. The fixed part (weights
    read once per forward: a chunk of 32 tokens reads every expert of a layer, a decode step a
    few; the DeltaNet chunk padding; launches) does not change with the context, so it is
    refitted only when the recent samples differ enough in size to separate it from the slope
    (else the last such fit stands; none yet: zero, and the first chunks, sized by their rate
    alone, come out smaller and give the spread). Without the fixed part, a rate alone reads
    it as slowness at small chunks and shrinks the chunk to nothing."""

    SPREAD = 2.0  # max/min tokens among the recent samples before the fixed part is refitted (under
    # about 2x, the noise of a shared machine's timings reads as any fixed part at all)

    def __init__(self, window: int = 8):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.fixed = 0.0
        self.added = 0  # samples ever added
        self.doubled_at = -window  # `added` when the chunk last doubled (at most once per window)
        self.grown_at = -window  # `added` when a chunk last grew on measured headroom (HEADROOM)
        self.grown_to = 0  # to what size

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:  # a mixed step no slower than a plain one: noise, no sample
            self.samples.append((tokens, seconds))
            self.added += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token now), or None before any sample."""
        if not self.samples:
            return None
        ns = [n for n, _ in self.samples]
        if len(ns) >= 2 and max(ns) >= self.SPREAD * min(ns):
            fit = robust_fit(self.samples)
            if fit is not None:  # else the last fit stands (a failed one is no evidence of none)
                self.fixed = min(fit[0], min(t for _, t in self.samples))
        # the median rate of the latest samples: one stalled forward among them does not set it.
        # Never below 1/32 of a sample's plain rate: a fixed part fitted on noise can exceed its
        # time (an eighth was too much where the fixed part is most of a small chunk's time)
        rates = sorted(max(t - self.fixed, t / 32) / n for n, t in list(self.samples)[-RECENT:])
        mid = len(rates) // 2
        per_token = rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2
        return self.fixed, max(per_token, 1e-9)

    def tokens_within(self, room: float, ceiling: float | None = None, cap: int | None = None,
                      grow: bool = True) -> int:
        """Tokens whose work fits `room` seconds (there must be a sample); never below
        MIN_PREFILL, nor below the chunk whose per-token part equals the fixed part (smaller
        ones would slow the prompt without shortening the wait much), that floor itself at
        most twice the largest chunk in the window (a fixed part the noise inflated must not
        grow chunks far past what was measured: they grow by doubling, each size measured), and
        to the chunk that costs `ceiling` seconds where that is more than the fixed part (the
        floor's chunk costs twice the fixed part: on the H200, 6.3 ms against a 6.1 ms decode
        step, a p99 gap of 2.3x). Where even the fixed part is past the ceiling, no chunk keeps
        the gap under it, and the floor stays uncapped, deliberately: the prompt keeps half its
        speed rather than crawl at MIN_PREFILL for a gap that misses anyway (the 2-core CPU's
        mixed forward: a fixed part above a decode step). So the answer jumps up where the
        ceiling falls below the fixed part.

        Where every chunk in the window is of about one size, the answer is not smaller, and no
        fixed part is known or the answer is under 2 x MIN_PREFILL (on the H200 a fixed part fitted on
        the first, compiling forwards read 2 ms of a layer's ~3 as a rate at 32 tokens), the
        chunk doubles instead: chunks of one size cannot tell a fixed part from slowness, so a
        rate read at a small chunk (a stall in it, a fixed part) would keep every later chunk
        that small. One chunk of twice the size gives the spread that
        separates them (on the H200, chunks stuck at 32 tokens prefilled a 32k prompt at 346
        tok/s). "One size" is read over the latest RECENT forwards, not the window: stalled first
        forwards of other sizes would hold it at 32 tokens until they left the window (on the
        H200 at c471646, most of a 32k prompt's 151 forwards). At such sizes that chunk may pass
        the ceiling: one forward in a window.

        Then the measured headroom (HEADROOM, with `grow`): a larger chunk measured well under
        the ceiling keeps its size and may grow, up to `cap` (the prefill graphs' largest chunk)."""
        fixed, per_token = self.fit()
        ns = [n for n, _ in self.samples]  # the whole window
        floor = min(int(fixed / per_token), 2 * max(ns))
        if ceiling is not None and ceiling > fixed:  # the floor's own cost (twice the fixed part) within it
            floor = min(floor, int((ceiling - fixed) / per_token))
        floor = max(MIN_PREFILL, floor)
        want = max(floor, int((room - fixed) / per_token)) if room > fixed else floor
        recent = ns[-RECENT:]
        stuck = (len(recent) >= RECENT and min(recent) <= want < self.SPREAD * min(recent)
                 and max(recent) < self.SPREAD * min(recent))
        # once per window (asked again before the doubled chunk's sample: the same answer), so
        # where a chunk that small is right, 1 forward in 8 passes the ceiling, not 1 in 4
        again = self.added - self.doubled_at >= self.samples.maxlen or self.added == self.doubled_at
        if stuck and again and (fixed == 0 or want < 2 * MIN_PREFILL):
            self.doubled_at = self.added
            return 2 * min(recent)
        return self._headroom(want, ceiling, cap) if grow else want

    def _headroom(self, want: int, ceiling: float | None, cap: int | None) -> int:
        """want, or more where a larger chunk was measured under HEADROOM x ceiling (see HEADROOM):
        the largest of the latest RECENT chunks if its (latest) cost was, and GROW times it
        (at most `cap`, where it was within it) once per RECENT forwards where GROW times its
        cost is within the ceiling, so each size is measured before the next growth."""
        if self.added == self.grown_at:  # asked again before the grown chunk's sample: the same answer
            return max(want, self.grown_to)
        recent = list(self.samples)[-RECENT:]
        if ceiling is None or len(recent) < RECENT:
            return want
        big = max(n for n, _ in recent)
        cost = [t for n, t in recent if n == big][-1]
        if want >= big or cost > HEADROOM * ceiling:
            return want
        grown = int(big * GROW)
        if cap is not None and big <= cap:
            grown = min(grown, cap)
        if grown > big and cost * GROW <= ceiling and self.added - self.grown_at >= RECENT:
            self.grown_at, self.grown_to = self.added, grown
            return grown
        return big


class Interleaver:
    def __init__(self, slowdown: float):
        """slowdown: --decode-slowdown (>= 1; 0 turns interleaving off)."""
        self.slowdown = slowdown
        self.last_decode: float | None = None  # perf_counter at the end of the last decode step
        self.learn_from: float | None = None  # where a host-clock cycle's span starts (decoded(), tail())
        self.queued: list[int] = []  # indices of the layers queued since then
        # seconds of prompt work of layer i (EMA): layers differ (full attention reads the whole
        # context, a DeltaNet layer does not). Two tables where prefill graphs run (`cap`): a layer
        # of a chunk they take costs a fraction of an eager one (on the H200 a graphed 32-token
        # forward took 22.7 ms, 0.57 ms a layer; the interleaved eager layers averaged 3.22 ms), and
        # a short prompt's forward judged at the long prompt's eager costs got, very likely, a
        # decode step every layer or two (its TTFT 4.81x idle: benchmarks/README.md, twelfth session)
        self._costs: dict[bool, dict[float, float]] = {False: {}, True: {}}
        self.cap: int | None = None  # the largest chunk the prefill graphs take (set by the loop; None: none)
        self.steps = 0  # decode steps run between layers (telemetry)
        self.running = False  # inside such a step (its own forward must not recurse)
        self.tokens = 0  # prompt tokens of the forward in flight (set by the loop)
        self.first_tokens = False  # every prompt of the forward in flight finishes in it (set by the loop)
        # (prompt tokens, seconds) of each forward's costliest layer: what sizes the chunk
        self.samples = CostModel()
        self.this_forward: dict[int, float] = {}  # layer -> seconds, in the forward in flight
        self.history: deque[tuple[int, float]] = deque(maxlen=4096)  # (tokens, costliest layer s)
        # of the latest forwards (telemetry: bench.interference's chunk sizes)
        self.costliest_at: deque[float] = deque(maxlen=4096)  # which point was that layer (telemetry)
        self.mid_layer = MID_LAYER  # points between a layer's mixer and MLP too (keys i + 0.5)
        self.key_points = KEY_POINTS  # and between key pieces of a long attention (split_keys.point; the CPU)
        # STALL_FILTER (see there): each layer's kind (its index -> a label; the loop sets the
        # model's layer types), and how many points it left out of the samples
        self.stall_filter = STALL_FILTER
        self.by_clock = BY_CLOCK
        self.kinds: dict[int, str] = {}
        self.stalls_dropped = 0

    @property
    def enabled(self) -> bool:
        return self.slowdown >= 1

    @property
    def graphed(self) -> bool:
        """Whether the forward in flight is of a size the prefill graphs take."""
        return self.cap is not None and 0 < self.tokens <= self.cap

    @property
    def cost(self) -> dict:
        """The learned layer costs of the forward in flight's kind (graphed or eager)."""
        return self._costs[self.graphed]

    @cost.setter
    def cost(self, table: dict) -> None:
        self._costs[self.graphed] = table

    @property
    def costs_by_kind(self) -> dict[str, dict[float, float]]:
        """The learned layer costs of graphed and of eager forwards (telemetry)."""
        return {"graphed": self._costs[True], "eager": self._costs[False]}

    def _cost(self, j: float) -> float | None:
        """Layer j's learned cost for this kind of forward, else the other kind's (a graphed
        forward before any was measured is judged at eager costs: decode steps early, not late).
        A key piece's point not met yet (the context just grew past another piece,
        kernels/split_keys.py) costs what the same layer's latest earlier piece does: pieces
        are of one size, and an unknown cost would have a decode step before it in every
        attention layer of the forward; an expert piece's likewise (experts/split_experts.py)."""
        c = self.cost.get(j)
        if c is None:
            c = self._costs[not self.graphed].get(j)
        for kind in (split_keys.is_key_point, split_experts.is_expert_point):
            if c is None and kind(j):  # expert pieces (experts/split_experts.py) are of one size too
                known = [k for k in self.cost if int(k) == int(j) and kind(k) and k < j]
                c = self.cost[max(known)] if known else None
        return c

    @property
    def layers(self) -> int:
        return len(self.queued)

    @property
    def per_layer(self) -> float | None:
        """Mean seconds of a layer, its halves summed where both are points (telemetry)."""
        return sum(self.cost.values()) / len({int(i) for i in self.cost}) if self.cost else None

    @property
    def floored(self) -> bool:
        """With by_clock (BY_CLOCK), the forward in flight gives short prompts their first tokens
        (at most FIRST_TOKEN_FLOOR_TOKENS): decode steps inside it come at most every
        FIRST_TOKEN_GAP_S by the time it has taken, and its cycles teach no layer costs."""
        return self.by_clock and self.first_tokens and self.tokens <= FIRST_TOKEN_FLOOR_TOKENS

    def decoded(self) -> None:
        """A decode step (plain or between layers) just ended."""
        self.last_decode, self.queued = time.perf_counter(), []
        self.learn_from = self.last_decode  # where a host-clock cycle's span starts (tail() moves it)

    def due(self, decode_s: float | None, i: float = 0) -> bool:
        """Before point i (layer i, i + 0.5: its MLP after its mixer, or a key piece of its
        attention, split_keys.point): is a decode step due?
        decode_s: the plain decode step's time."""
        if not self.enabled or self.running or decode_s is None or self.last_decode is None or not self.queued:
            return False
        if self.floored:
            # its own clock: the learned costs are a long prompt's chunk's (2-3 ms a layer on the
            # H200 at 2,048 tokens against ~0.9 ms here), which split a 200-token forward at
            # layer 24 of 40: the streams waited twice (30 and 21 ms) where once would do
            # (interference-full-firstrow-events-gpu.json, plan 43). By its clock it ran whole
            # (one 44-54 ms gap) and the short request's TTFT was 0.98-1.01x idle against
            # 1.30-1.35x in the same processes (interference-full-ab{1,2}-gpu.json, plan 46)
            gap = max((max(self.slowdown, FIRST_TOKEN_SLOWDOWN) - 1) * decode_s, FIRST_TOKEN_GAP_S)
            spent = time.perf_counter() - self.last_decode
            return spent + spent / len(self.queued) / 2 >= gap
        if self.first_tokens:
            gap = (max(self.slowdown, FIRST_TOKEN_SLOWDOWN) - 1) * decode_s
            if self.tokens <= FIRST_TOKEN_FLOOR_TOKENS:  # by_clock off (the A/B): at the learned costs
                gap = max(gap, FIRST_TOKEN_GAP_S)
        else:
            gap = (self.slowdown - 1) * decode_s
        known = [self._cost(j) for j in self.queued]
        nxt = self._cost(i)
        if nxt is None or any(c is None for c in known):
            return True  # a cost not known yet: one layer at a time until each is measured
        # the queued work: its learned cost, or the time since the last decode step where that is
        # more (on the CPU a layer runs as it is called; a learned cost can lag a growing context)
        queued = max(sum(known), time.perf_counter() - self.last_decode)
        # the next layer would take the gap past its target by more than it would fall short
        return queued + nxt / 2 >= gap

    def layer_queued(self, i: float = 0) -> None:
        self.queued.append(i)

    def cycle(self, decode_s: float, ran: list | None = None, work_s: float | None = None,
              until: float | None = None) -> None:
        """A decode step between layers ended; the cycle since the previous decode step ran the
        queued layers of prompt work and that step: their time is shared among them in
        proportion to what they are known to cost (equally while any is unknown).
        ran: the points queued before the step (a deferred step, runtime/deferred_step.py: its
        tokens are read a hook later, and the points queued since run after it on the device:
        they stay queued, for the next cycle); None: every queued point. work_s: those points'
        time as the device measured it (the loop's device_costs), instead of the cycle's wall
        time less the decode step's. until: where that wall time ends, if not now: the step's
        start (perf_counter) on a device that runs each op as it is called, the step not in it."""
        points = self.queued if ran is None else ran
        if self.last_decode is not None and points:
            if work_s is None:
                work_s = max(0.0, until - self.learn_from) if until is not None else \
                    max(0.0, time.perf_counter() - self.learn_from - decode_s)
            self._learn(points, work_s)
        self.steps += 1
        after = [] if ran is None else self.queued
        self.decoded()
        self.queued = after

    def tail(self, work_s: float | None = None) -> None:
        """The forward in flight ended: the points queued since its last decode step (its last
        layers) learn from the time since that step too (work_s: on the device's clock; else the
        host's, where that step waited for its tokens). Without it they learn only in forwards
        whose last step comes after them: where it seldom does, the costs they were first given
        (at the first chunk's short context) stay while their real ones grow with the context,
        and the forwards' last gaps run long (TAIL_CYCLES)."""
        if self.last_decode is not None and self.queued:
            self._learn(self.queued, time.perf_counter() - self.learn_from if work_s is None else work_s)
        # the next cycle's host-clock span starts here (its streams' gap, for due(), still at the last step)
        self.queued, self.learn_from = [], time.perf_counter()

    def _learn(self, points: list, total: float) -> None:
        """The points' share of `total` seconds, in proportion to what they are known to cost
        (equally while any is unknown), into the cost table and this forward's points."""
        # a floored forward's points are a short prompt's at its own context: averaged into the
        # table they would have the long prompt's next chunk queue more per step than fits
        if self.floored:
            return
        known = [self._cost(j) for j in points]
        weights = known if all(k for k in known) else [1.0] * len(known)
        for j, wj in zip(points, weights):
            v = total * wj / sum(weights)
            self.cost[j] = v if j not in self.cost else (1 - EMA) * self.cost[j] + EMA * v
            self.this_forward[j] = v

    def forward_done(self) -> None:
        """The prompt forward in flight ended: its costliest layer (as the cycles inside it
        shared their time out) is a sample at this forward's size and context. Not a short
        prompt's (first_tokens): its layers at its own short context would mislead the chunk
        size of a long prompt."""
        if self.this_forward and self.tokens and not self.first_tokens:
            points = self._without_stalls(self.this_forward) if self.stall_filter else self.this_forward
            worst = max(points, key=points.get)
            self.samples.add(self.tokens, points[worst])
            self.history.append((self.tokens, points[worst]))
            self.costliest_at.append(worst)
        self.this_forward = {}

    def _without_stalls(self, points: dict[float, float]) -> dict[float, float]:
        """points without those that cost over OUTLIER times the median of their kind's points in
        the same forward (layers of one kind at one context cost about the same: one far above
        the others was a stall, not the chunk's cost); all of them where nothing is left."""
        kind = {j: self.kinds.get(int(j), "") for j in points}
        by: dict[str, list[float]] = {}
        for j, v in points.items():
            by.setdefault(kind[j], []).append(v)
        med = {k: sorted(v)[len(v) // 2] for k, v in by.items() if len(v) >= 3}
        kept = {j: v for j, v in points.items() if kind[j] not in med or v <= OUTLIER * med[kind[j]]}
        self.stalls_dropped += len(points) - len(kept)
        return kept or points

    def budget(self, decode_s: float | None, costs=(), layers: int = 1, cap: int | None = None) -> int | None:
        """Prompt tokens for the next forward, so its costliest layer (half a layer with
        MID_LAYER) fits the gap between decode steps (the finest grain at which they can
        interleave); None: no limit. The costliest layer's cost model (CostModel) from the recent forwards' samples;
        before two of them, the recent prompt forwards `costs` [(tokens, seconds)] spread
        over their `layers` (points, with MID_LAYER) stand in (no growth on measured headroom
        from those: a model rebuilt each call would grow every call). cap: the largest chunk
        the prefill graphs take (CostModel.tokens_within)."""
        if not self.enabled or decode_s is None:
            return None
        model, grow = self.samples, cap is not None  # the headroom rule where prefill graphs run only
        if len(model) < 2:
            model, grow = CostModel(), False
            for n, t in costs:
                model.add(n, t / max(1, layers))
            if len(model) < 2:
                return None
        return model.tokens_within((self.slowdown - 1) * decode_s, (max(self.slowdown, GAP_CEILING) - 1) * decode_s,
                                   cap, grow)
