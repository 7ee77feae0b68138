"""Streamed expert loading for layer-major prefill passes (mechanism 1 of the design).

A prefill pass (runtime/prefill_stream.py) runs each layer once over many tokens, so each MoE
layer's experts must be on the device once per pass. This loader stages them in the GPU expert
cache's own slots (experts/cached.py SlotPool): no second allocation, so a pass never takes more
memory than the pool the memory plan sized.

The pool's S slots during a pass:
  keep     [0, S - R)  the decode cache's experts, never overwritten by the pass; an expert of
                       the layer found there is used where it lies (no copy at all, not even
                       D2D). Free ones take the pass's copies first (kept: they seed the cache)
  regions  [S - R, S)  R = 3E (triple), 2E (double), E (single) or min(S, E) (on-demand) slots;
                       layer j's experts go to region j % regions, expert e to slot base + e
                       (with a region of E slots: a full layer is one bulk copy per bank)
Buffering (chosen per pass from the pool's size; a mode that does not fit falls back, never
oversubscribing):
  triple     S >= 3E, asked for only (auto never takes it): as double, two layers ahead: layer
             j+2 loads once layer j-1 is done, for passes whose layers compute longer than their
             copies (attention over a long prompt); it measured no faster than double (TRIPLE)
  double     S >= 2E: while layer j computes from one region, a copy stream loads layer j+1
             into the other, starting before j+1's routing is known (at the hook before layer
             j, once layer j-1's experts, the region's previous tenant, are done)
  single     S >= E: layer j loads at the hook before layer j (overlapping its token mixer only)
  on-demand  layer j loads only the experts its tokens route to, once the router has run; with
             fewer than E slots, in groups of R experts, each computed before the next is loaded
Sparse passes: double and single load a full layer only while routing is dense. The coverage
of the next layer is predicted from the last one measured (the distinct experts the pass
routed to, over E; before any, from the pass length under uniform routing); below
`dense_share` the layer is loaded on demand, so a short prompt pays for its routed experts
only, never a full-pool stream.

Residency (control.Residency) is read to the host once at the start of a pass, followed there
(slots evicted and filled), and written back at the end, stamped with a new clock: what the
regions hold after the pass (the last layers' experts) seeds the decode cache. At the start the
device copy is rewritten with the regions emptied, so that decode steps run between the pass's
layers (the serving loop, with the cache frozen: no fills, no evictions, misses on the CPU) see
only the keep slots' experts, which the pass never overwrites; they change nothing of where an
expert lies, so the write-back at the end loses nothing of theirs.
On CUDA the copies are copy-engine transfers from the pinned host banks on a copy stream of
their own, ordered by events: a region is written only after the compute stream is past its
previous tenant, and a layer's experts compute only after their copy landed. On the CPU the
same code runs synchronously.
"""
from __future__ import annotations

import logging
import time

import torch

from .executor import NO_EXPERT, ExpertExecutor, Pending

log = logging.getLogger("freetoken.experts")
MODES = ("triple", "double", "single", "on-demand")
REGIONS = {"triple": 3, "double": 2}  # layer buffers a mode keeps (else one)
BUFFERING = ("auto",) + MODES
# TRIPLE: with two regions the copy of layer j+1 waits for layer j-1's experts, and on an H100 the
# copy engine idled ~18 ms after each attention layer of a 32k pass of the Qwen3.6 shape (plan 135,
# results/prefill_stream-timeline-*-h100-gpu.json). A third region did not remove those gaps: 1.389
# and 1.429 s a 40-layer pass against double's 1.419 and 1.439, alternating in one process (plan
# 137, prefill_stream-abab-40l-h100-gpu.json); the host paces the pass (its launches, and the sync
# below), not the regions. So auto stays with double, and the decode cache keeps its E slots.
# passes of at least this many tokens skip the host sync that reads a fully loaded layer's routed
# set: it only updates the coverage prediction, and at 4,096 tokens x top-k every expert of a layer
# is routed to even under skewed routing. The sync kept the host in lockstep with the device, the
# next layer's launches (and the copy they queue) waiting for this layer's router. On an H100, 40
# layers, 32k, double buffering, alternating in one process: 1.345 / 1.346 s a pass without it
# against 1.474 / 1.523 s with it, mixers in pieces of 2,048 (plan 140,
# results/prefill_stream-nosync2048-40l-h100-gpu.json); with pieces of 8,192 the same either way
# (prefill_stream-modes-40l{,-run2}-h100-gpu.json). None: always sync.
SYNC_FREE_TOKENS = 4096
# a layer's slot table [E] goes up on the copy stream ahead of that layer's bulk copy (the compute
# waits for the copy anyway) instead of on the compute stream, where it queued on the copy engine
# behind the bulk copy in flight and held the next token mixer until that copy landed. On an H100,
# 40 layers, 32k, mixers in pieces of 8,192, in two processes of 8 rows each (plan 140,
# results/prefill_stream-modes-40l{,-run2}-h100-gpu.json): 1.190-1.195 s a pass against
# 1.321-1.341 s on the compute stream, double and triple, synced or not (the expert-copy floor of
# those runs: 1.227 / 1.231 s).
TABLE_ON_COPY = True
# a full layer is loaded while the predicted share of a layer's experts routed to is at least
# this: loading it all overlaps the compute, loading the routed ones only does not, so skipping
# pays when few are left out and little compute hides the transfer (short passes)
DENSE_SHARE = 0.9


def pick_mode(requested: str, slots: int, experts: int) -> str:
    """The buffering a pool of `slots` slots can hold: the requested one, or the next smaller;
    auto: the largest that fits, double at most (TRIPLE above)."""
    if requested not in BUFFERING:
        raise ValueError(f"buffering must be one of {BUFFERING}, got {requested!r}")
    fits = ("triple" if slots >= 3 * experts else "double" if slots >= 2 * experts
            else "single" if slots >= experts else "on-demand")
    if requested == "auto":
        return "double" if fits == "triple" else fits
    return MODES[max(MODES.index(requested), MODES.index(fits))]


def uniform_coverage(tokens: int, top_k: int, experts: int) -> float:
    """Expected share of a layer's experts that `tokens` tokens route to, routing uniform."""
    return 1.0 - (1.0 - min(top_k, experts) / experts) ** max(tokens, 0)


class LayerStreamer(ExpertExecutor):
    """The pass's expert executor: begin(tokens) -> per MoE layer j: before_layer(j) (the hook
    before its token mixer), launch(x, ids, weights, layer=j) -> end(). Not for decode."""

    name = "stream"
    backend = "gpu-cache"

    def __init__(self, cache, moe_layers: int, experts: int, top_k: int, buffering: str = "auto",
                 dense_share: float = DENSE_SHARE, sub_tokens: int = 2048):
        """cache: the CachedExpertExecutor whose slot pool holds the regions (its public parts:
        pool.res / slots / copy_runs / slot_bytes, slot_executor, device); sub_tokens: tokens
        per expert computation (bounds the pairs' activations)."""
        pick_mode(buffering, 0, 1)  # validates
        self.cache, self.layers, self.experts, self.top_k = cache, moe_layers, experts, top_k
        self.buffering, self.dense_share, self.sub = buffering, dense_share, max(1, sub_tokens)
        self.device = torch.device(cache.device)
        self._copy = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._gpu = None  # the resident executor over the pool's banks (slot ids), at the first pass
        self._warned = False
        self.mode = None  # the running (or last) pass's buffering
        self.sync_free_tokens = SYNC_FREE_TOKENS  # an attribute: benchmarks try the sync-free path
        self.table_on_copy = TABLE_ON_COPY  # an attribute: benchmarks try both
        self.counts = {"passes": 0, "passes_triple": 0, "passes_double": 0, "passes_single": 0, "passes_on_demand": 0, "tokens": 0,
                       "layers_full": 0, "layers_routed": 0, "experts_h2d": 0, "experts_resident": 0,
                       "experts_skipped": 0, "bytes_h2d": 0}
        self.last = {}  # the last pass: tokens, seconds, layers loaded full / routed

    # ---- the pass ---------------------------------------------------------------------------
    def begin(self, tokens: int) -> str:
        """Start a pass of `tokens` tokens; returns its buffering."""
        pool = self.cache.pool
        if pool is None:
            raise RuntimeError("the expert cache has no slots yet: allocate() comes with the memory plan")
        if self._gpu is None or self._gpu.gate_up is not pool.gate_up:  # every bank of the slots, quantized too
            self._gpu = self.cache.slot_executor(layer_experts=self.experts)
        e, s = self.experts, pool.slots
        self.mode = pick_mode(self.buffering, s, e)
        if self.mode != self.buffering and self.buffering != "auto" and not self._warned:
            log.warning("prefill buffering %s needs %d expert slots, the pool has %d: %s instead", self.buffering,
                        REGIONS.get(self.buffering, 1) * e, s, self.mode)
            self._warned = True
        self.regions = REGIONS.get(self.mode, 1)
        self.width = e if self.mode != "on-demand" else min(s, e)  # slots per region
        self.base = s - self.regions * self.width
        res = pool.res
        pf = getattr(self.cache, "_pf_stream", None)
        if pf is not None:  # lookahead copies a failed decode step left in flight land before any slot is reused
            torch.cuda.current_stream(self.device).wait_stream(pf)
        self._slot_of = res.slot_of.to("cpu", torch.int64)  # [N] host mirror for the pass
        self._id_of = res.id_of.to("cpu", torch.int64)  # [S]
        for r in range(self.regions):  # the regions start empty: only this pass's layers live there
            self._evict(self.base + r * self.width, self.width)
        # published: decode steps between the pass's layers (the cache frozen, cached.py) read
        # this residency, which lists only the keep slots' experts, never overwritten in the pass
        self._publish(res)
        # free keep slots take copies before the regions: nothing overwrites them in the pass
        self._free = (self._id_of[:self.base] < 0).nonzero()[:, 0].tolist()
        self._free.reverse()  # popped from the end: lowest slot first, so runs stay contiguous
        self._used = torch.zeros(s, dtype=torch.bool)  # slots read this pass (stamped at the end)
        self._staged = {}  # layer -> (table [E] on the device, copy-done event or None)
        self._share = uniform_coverage(tokens, self.top_k, e)
        self._sync_free = self.sync_free_tokens is not None and tokens >= self.sync_free_tokens
        self.last = {"mode": self.mode, "tokens": tokens, "layers_full": 0, "layers_routed": 0}
        self._t0 = time.perf_counter()
        return self.mode

    def before_layer(self, j: int) -> None:
        """The hook before MoE layer j's token mixer: start the loads this mode runs ahead."""
        if self.mode in REGIONS:
            ahead = self.regions - 1
            # the first layers at once, then layer j + ahead into the region layer j-1 leaves
            for k in (range(ahead + 1) if j == 0 else (j + ahead,)):
                if k < self.layers:
                    self._prefetch(k)
        elif self.mode == "single":
            self._prefetch(j)

    def launch(self, x, ids, weights, layer: int = 0, phase: str = "prefill", ahead=None) -> Pending:
        """x [T, H], ids [T, k] flat ids of MoE layer `layer`, weights [T, k] -> Pending([T, H]).
        A decode call (a decode step between the pass's layers, made eagerly) goes to the cache,
        which the serving loop has frozen for the pass (cached.py CachedExpertExecutor.frozen)."""
        if phase == "decode":
            return self.cache.launch(x, ids, weights, layer, phase, ahead)
        e = self.experts
        live = ids >= 0
        local = torch.where(live, ids - layer * e, 0)  # [T, k] expert within the layer
        staged = self._staged.pop(layer, None)
        if staged is not None and self._sync_free:  # a long pass's full layer: no sync, the host runs ahead
            return Pending(out=self._compute(x, local, live, weights, *staged))
        routed = torch.unique(torch.where(live, local, -1)).cpu()  # the one host sync per layer: the routed set
        routed = routed[routed >= 0]
        self._share = routed.numel() / e  # predicts the next layer's coverage
        if staged is not None:
            return Pending(out=self._compute(x, local, live, weights, *staged))
        self.counts["layers_routed"] += 1
        self.last["layers_routed"] += 1
        self.counts["experts_skipped"] += e - routed.numel()
        hits, misses = self._split(layer, routed)
        out = None
        # with fewer slots than misses, groups of `width` experts, each computed before the
        # next overwrites the region (the copy stream waits for the compute stream)
        for g in range(0, max(len(misses), 1), self.width):
            part = self._compute(x, local, live, weights, *self._stage(layer, hits if g == 0 else [],
                                                                      misses[g:g + self.width]))
            out = part if out is None else out + part
        return Pending(out=out)

    def end(self) -> dict:
        """Finish the pass (also after a failure: the regions' contents changed): wait for the
        copies, write the residency back with a new clock. Returns the pass's summary."""
        if self._copy is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy)
        res = self.cache.pool.res
        dev = res.slot_of.device
        self._publish(res)
        res.clock.add_(1)
        held = self._used & (self._id_of >= 0)  # slots read this pass that still hold their expert
        if bool(held.any()):
            idx = held.nonzero()[:, 0].to(dev)
            res.stamp[idx] = res.clock  # refreshed: the most recently used experts of the cache
            res.seen[self._id_of[held].to(dev)] = res.clock
        if self._copy is not None:
            torch.cuda.current_stream(self.device).synchronize()  # the pass's time, and the logits it made
        self._staged = {}
        self.last["seconds"] = time.perf_counter() - self._t0
        c = self.counts
        c["passes"] += 1
        c[f"passes_{self.mode.replace('-', '_')}"] += 1
        c["tokens"] += self.last["tokens"]
        return dict(self.last)

    def _publish(self, res) -> None:
        """The host mirror's slot_of / id_of -> the device residency."""
        res.slot_of.copy_(self._slot_of.to(res.slot_of.device, res.slot_of.dtype))
        res.id_of.copy_(self._id_of.to(res.id_of.device, res.id_of.dtype))

    # ---- loading ----------------------------------------------------------------------------
    def _prefetch(self, j: int) -> None:
        """Load all of layer j now (copies queued) unless routing looks sparse, in which case
        it loads at launch from its routed set."""
        if j in self._staged or self._share < self.dense_share:
            return
        hits, misses = self._split(j, torch.arange(self.experts))
        self._staged[j] = self._stage(j, hits, misses)
        self.counts["layers_full"] += 1
        self.last["layers_full"] += 1

    def _split(self, j: int, experts: torch.Tensor) -> tuple[list[int], list[int]]:
        """Layer j's experts (local ids) -> (resident in a keep slot, to copy)."""
        slots = self._slot_of[experts + j * self.experts]  # [n]
        return experts[slots >= 0].tolist(), experts[slots < 0].tolist()

    def _stage(self, j: int, hits: list[int], misses: list[int]):
        """Copy `misses` of layer j into its region (evicting the region's previous tenant),
        -> (slot table [E] on the device, -1 where not loaded; the copies' event or None)."""
        e, flat = self.experts, j * self.experts
        base = self.base + (j % self.regions) * self.width
        self._evict(base, self.width)
        table = torch.full((e,), -1, dtype=torch.int64)  # [E]
        if hits:
            h = torch.tensor(hits)
            table[h] = self._slot_of[h + flat]
        copies = []
        for n, x in enumerate(misses):
            s = self._free.pop() if self._free else base + (x if self.width == e else n)
            self._slot_of[flat + x], self._id_of[s] = s, flat + x
            table[x] = s
            copies.append((flat + x, s))
        self._used[table[table >= 0]] = True
        self.counts["experts_resident"] += len(hits)
        self.counts["experts_h2d"] += len(copies)
        if self._copy is None:
            return table.to(self.device), self._issue(copies)
        table = table.pin_memory()  # from pinned memory: the upload does not wait for the compute stream
        if copies and self.table_on_copy:
            # allocated on the compute stream, which reads it only after waiting for the copies' event
            dev = torch.empty(e, dtype=torch.int64, device=self.device)  # [E]
            return dev, self._issue(copies, (dev, table))
        return table.to(self.device, non_blocking=True), self._issue(copies)

    def _evict(self, base: int, width: int) -> None:
        held = self._id_of[base:base + width]
        self._slot_of[held[held >= 0]] = -1
        held.fill_(-1)

    def _issue(self, copies: list[tuple[int, int]], table=None):
        """Copy host rows -> slots, runs of consecutive ids and slots as one copy per bank; on
        CUDA on the copy stream once the compute stream is past what it has queued (the
        region's previous tenant); table: (device [E], pinned host [E]) uploaded first on that
        stream. -> the event the compute waits for, or None."""
        if not copies:
            return None
        pool = self.cache.pool
        runs, (f0, s0), n = [], copies[0], 1
        for f, s in copies[1:]:
            if f == f0 + n and s == s0 + n:
                n += 1
            else:
                runs.append((f0, s0, n))
                (f0, s0), n = (f, s), 1
        runs.append((f0, s0, n))

        def copy():
            pool.copy_runs(runs)  # every bank of each run: gate_up, down (values, scales), biases
        self.counts["bytes_h2d"] += len(copies) * pool.slot_bytes
        if self._copy is None:
            copy()
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy):
            self._copy.wait_event(ready)
            if table is not None:
                table[0].copy_(table[1], non_blocking=True)
            copy()
            done = torch.cuda.Event()
            done.record(self._copy)
        return done

    # ---- computing --------------------------------------------------------------------------
    def _compute(self, x, local, live, weights, table, event) -> torch.Tensor:
        """The routed experts of pairs whose expert the table holds, in sub-chunks of tokens.
        Pairs outside it (another group's, or NO_EXPERT) add nothing."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        route = torch.where(live, table[local], NO_EXPERT)  # [T, k] slot ids
        out = torch.empty_like(x)  # [T, H]
        sub = self.sub  # read once: every row of out is written by exactly one sub-chunk
        for a in range(0, x.shape[0], sub):
            out[a:a + sub] = self._gpu.run(x[a:a + sub], route[a:a + sub], weights[a:a + sub], "prefill")
        return out

    def stats(self) -> dict:
        """Counters since start, and the last pass (mode, tokens, seconds)."""
        last = {f"last_{k}": (round(v, 4) if isinstance(v, float) else v) for k, v in self.last.items()}
        return {**self.counts, "buffering": self.buffering, **last}
