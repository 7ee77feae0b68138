"""Cache control of the GPU expert cache: one step per MoE layer call, all on the device.

One global pool of S expert slots is shared by every MoE layer; a slot holds one complete
expert (its rows of every bank). Residency lives on the device (`Residency`) and each MoE
layer call runs one control step (`control`) that, with no host sync:

  1. dedups the routed experts of the whole batch: U (pairs with NO_EXPERT are ignored);
  2. classifies them: hits (resident) and misses M, m = |M|;
  3. takes q = floor((c + m * r') / 1024) misses to fill, r' = round(r * 1024) (r = the fill
     share, a device scalar, 1 = fill-only) and c the credit carried from the calls before
     (then c = the remainder, in [0, 1024)): the share is kept exactly on average however few
     misses a call has (a call with one miss at r = 0.3 fills it about one time in three, where
     rounding per call would always fill it); capped by K (max_fill, the static size of the
     fill list) and by the number of slots holding no hit of this call;
  4. finds K victims among the slots holding no hit (free slots first, then the least
     recently used, or with policy "lfu" the lowest decayed routing count; ties by slot
     index) in one pass over the pool; the fill path consumes the first q;
  5. F = the first q misses in policy order ("recent": routed most recently first, by
     `seen`; "gate": largest summed gate weight in this batch first; "lfu": highest decayed
     routing count first; ties by first occurrence in the batch); F[j] goes to the j-th
     victim: the victim's old id is evicted, F admitted, hits and fills stamped with the new
     clock, `seen` set for all U;
  6. rewrites each routed pair to its physical slot (hit or fill), CPU (-2) for a miss that
     is not filled (run in place from the host banks), NO_EXPERT (-1) stays -1.

Everything has a fixed shape (fill list [K], CPU list [T*k], device-resident counts) so the
Triton version can be captured in a CUDA graph. `control_reference` is the pure-torch
reference (plain code, host syncs allowed); `control_triton` is one single-program launch
with identical results. `control` picks the kernel for CUDA tensors when Triton is present.

Using it (the cached executor, per MoE layer): run `control`; copy the host bank rows
fill_src -> slots fill_dst for every bank (entries past n_fill are -1: mask on them); the
GPU experts take `route` (as int64) as ids over the slot banks (the decode and grouped
kernels skip any negative id, so CPU and NO_EXPERT pairs add nothing there); the CPU branch runs
where(route == CPU, ids, NO_EXPERT) over the host banks. Both sums are exact partial sums
of the all-resident output. The fills must land before the GPU experts read their slots,
and a later call (the next layer) may evict any slot not hit by that call: whatever reads a
slot must be ordered before the next control call on the stream.

Policy "lfu" (LFU with decay in whole halvings, bench/policy_sim.py `lfu_halving`: on the
Mixtral traces it misses 0.47 where LRU misses 0.87 at batch 4 and half the experts cached):
every call adds 2^e to the score of each routed expert, e = clock // half - base, a power of
two built from its bits, so the float32 sums are exact and identical in both versions; when e
would pass 64 every score is scaled by 2^-64 (exact) and base advances by 64.

Exactness between the two: the fill count is computed in float32 (m * r, round half to
even, as torch.round) with FMA contraction off in the kernel; gate weights are summed in
fixed point (each weight truncated to a multiple of 2**-24, clamped to [0, 256]) so the sum,
and the "gate" order, do not depend on the summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import HAS_TRITON, use_triton
from .executor import NO_EXPERT

CPU = -2  # route of a pair whose expert runs on the CPU, in place from the host banks
POLICIES = ("recent", "gate", "lfu")
HALVING_TICKS = 64 * 40  # default clock ticks per halving of "lfu": ~64 decode steps of 40 MoE layers
RESCALE = 64  # "lfu": scores are scaled by 2^-RESCALE when the exponent would pass it
GATE_ONE = 1 << 24  # fixed-point scale of a gate weight (exact in float32: a power of two)
GATE_CAP = 256.0  # a weight counts at most this much (keeps the fixed-point sums in 44 bits)
MAX_PAIRS = 4096  # pairs (T * k) per call the kernel's composite sort keys are sized for


def pair_bucket(pairs: int) -> int:
    """The padded pair count (P_PAD) the kernel is compiled for: 16, 64, 256, 1,024 or 4,096.
    Each P_PAD is a separate Triton compile of seconds to tens of seconds (bench.control_compile:
    2.8 s at 2 pairs, 30 s at 4,096 on the H200); powers of four need five variants where powers
    of two needed twelve, and the sorts of a [4x] padded call cost a few microseconds more."""
    b = 16
    while b < pairs:
        b *= 4
    return b


assert pair_bucket(MAX_PAIRS) == MAX_PAIRS, "the sort keys are sized for MAX_PAIRS: keep it a bucket"


def fill_cap(pairs: int, layer_experts: int | None = None, slots: int | None = None) -> int:
    """The K (max_fill) a call needs to fill every miss it may: a call is one MoE layer's, so
    its distinct misses are at most min(pairs, experts per layer), and it fills at most the pool's
    slots. Any larger K changes no output. The kernel's fill-list sort and victim scan are sized
    by K's padding (fill_pad): at K = pairs a 4,096-pair prefill call compiled a [4096] top-k per
    scan chunk, minutes of Triton compile on the H200 (benchmarks/README.md, thirteenth session)."""
    k = pairs
    for bound in (layer_experts, slots):
        if bound:
            k = min(k, bound)
    return max(1, k)


def fill_pad(pairs: int, layer_experts: int | None = None, slots: int | None = None) -> int:
    """The fill list's static size (K_PAD) for a call of `pairs`: fill_cap of its pair bucket, so
    one compiled variant serves every call of the bucket, while the list itself (and the transfer
    launched over it, once per decode layer) keeps the call's own fill_cap entries."""
    return next_pow2(fill_cap(pair_bucket(pairs), layer_experts, slots))


def next_pow2(n: int) -> int:
    """The next power of two >= n, at least 2 (a tl.arange's smallest useful size)."""
    return max(2, 1 << (n - 1).bit_length())


@dataclass
class Residency:
    """Where each flat expert id lives in the slot pool; device tensors, updated in place.

    slot_of [N] int32  slot holding flat id i, or -1
    id_of   [S] int32  flat id held by each slot, or -1 (free)
    stamp   [S] int64  clock of the slot's last use (hit or fill); a free slot is older than
                       any held one whatever its stamp
    seen    [N] int64  clock at which each flat id was last routed (resident or not)
    clock   [1] int64  advanced by one per control call
    score   [N] float32  "lfu": decayed routing count of each flat id (resident or not)
    base    [1] int64  "lfu": halvings already taken out of the scores
    credit  [1] int64  fill share carried between calls, in 1/1024 of a fill (step 3)
    half    int        "lfu": clock ticks per halving (a decode step advances the clock once
                       per MoE layer)

    Invariants kept by `control` (and assumed by it): slot_of and id_of are inverse
    (a slot holds at most one id, an id at most one slot); stamp <= clock and seen <= clock.
    """
    slot_of: torch.Tensor
    id_of: torch.Tensor
    stamp: torch.Tensor
    seen: torch.Tensor
    clock: torch.Tensor
    score: torch.Tensor
    base: torch.Tensor
    credit: torch.Tensor
    half: int = HALVING_TICKS

    @classmethod
    def empty(cls, num_flat_experts: int, num_slots: int, device, half: int = HALVING_TICKS) -> "Residency":
        """All slots free, nothing seen, clock 0."""
        assert num_slots >= 1 and num_flat_experts >= 1 and half >= 1
        return cls(slot_of=torch.full((num_flat_experts,), -1, dtype=torch.int32, device=device),
                   id_of=torch.full((num_slots,), -1, dtype=torch.int32, device=device),
                   stamp=torch.zeros(num_slots, dtype=torch.int64, device=device),
                   seen=torch.zeros(num_flat_experts, dtype=torch.int64, device=device),
                   clock=torch.zeros(1, dtype=torch.int64, device=device),
                   score=torch.zeros(num_flat_experts, dtype=torch.float32, device=device),
                   base=torch.zeros(1, dtype=torch.int64, device=device),
                   credit=torch.zeros(1, dtype=torch.int64, device=device), half=half)

    @property
    def num_slots(self) -> int:
        return self.id_of.numel()

    @property
    def num_flat_experts(self) -> int:
        return self.slot_of.numel()

    def clone(self) -> "Residency":
        return Residency(*(t.clone() for t in (self.slot_of, self.id_of, self.stamp, self.seen, self.clock,
                                                self.score, self.base, self.credit)), half=self.half)


@dataclass
class ControlOut:
    """Result of one control step; fixed shapes, counts on the device.

    route    [T, k] int32  physical slot of each pair (hit or fill), CPU (-2) for a miss run
                           on the CPU, NO_EXPERT (-1) for pairs that run nowhere
    fill_src [K] int32     flat ids to copy from the host banks (first n_fill; then -1)
    fill_dst [K] int32     their slots (first n_fill; then -1)
    cpu_ids  [T*k] int32   distinct flat ids to run on the CPU, in policy order (first n_cpu; then -1)
    counts   [3] int32     n_fill, n_cpu, n_hit (distinct experts); one buffer, one copy to the host
    cpu_route [T, k] int64 the pair's flat id where route is CPU, else NO_EXPERT: the CPU branch's
                           routes as it takes them (three small kernels a layer less than a
                           torch.where over route)
    """
    route: torch.Tensor
    fill_src: torch.Tensor
    fill_dst: torch.Tensor
    cpu_ids: torch.Tensor
    counts: torch.Tensor
    cpu_route: torch.Tensor

    @classmethod
    def empty(cls, tokens: int, top_k: int, max_fill: int, device) -> "ControlOut":
        i32 = dict(dtype=torch.int32, device=device)
        return cls(route=torch.empty(tokens, top_k, **i32), fill_src=torch.empty(max_fill, **i32),
                   fill_dst=torch.empty(max_fill, **i32), cpu_ids=torch.empty(tokens * top_k, **i32),
                   counts=torch.empty(3, **i32),
                   cpu_route=torch.empty(tokens, top_k, dtype=torch.int64, device=device))

    @property
    def n_fill(self) -> torch.Tensor:  # [1]
        return self.counts[0:1]

    @property
    def n_cpu(self) -> torch.Tensor:  # [1]
        return self.counts[1:2]

    @property
    def n_hit(self) -> torch.Tensor:  # [1]
        return self.counts[2:3]


def control(ids: torch.Tensor, weights: torch.Tensor, res: Residency, fill_share: torch.Tensor,
            max_fill: int, policy: str = "recent", out: ControlOut | None = None, peek: bool = False,
            k_pad: int | None = None, acc: torch.Tensor | None = None) -> ControlOut:
    """One control step for one MoE layer call (see the module docstring).

    ids [T, k] int flat ids of one layer (or NO_EXPERT); weights [T, k] gate weights;
    fill_share [1] float32 device tensor r in [0, 1]; max_fill K >= 1 static; policy
    "recent" or "gate"; out: buffers to reuse (static addresses for a CUDA graph).
    peek: a step for routes that are only predicted (the cache's lookahead): the clock does not
    advance (hits and fills are stamped with the last call's clock), `seen`, the lfu scores and
    the carried credit are left alone, and no slot the last call used (stamp == clock) is a
    victim; the policy's state stays what the real routes made it. k_pad: the kernel's static
    fill-list size (>= max_fill; default its next power of two; the cache passes fill_pad).
    acc: an int64 [5] device tensor the call adds its counts to (calls, routed pairs, hits,
    fills, CPU experts; see _acc_counts), in the same launch: a cache's statistics, five small
    kernels a layer less than adding them after. Residency is updated in place. The Triton
    kernel for CUDA tensors, else the reference.
    """
    if use_triton(ids):
        return control_triton(ids, weights, res, fill_share, max_fill, policy, out, peek=peek, k_pad=k_pad, acc=acc)
    return control_reference(ids, weights, res, fill_share, max_fill, policy, out, peek=peek, acc=acc)


def _check_args(ids, weights, res, fill_share, max_fill, policy, acc=None):
    assert acc is None or (acc.dtype == torch.int64 and acc.numel() == 5), "acc: an int64 [5] tensor"
    assert ids.dim() == 2 and weights.shape == ids.shape, "ids and weights: [T, k]"
    assert fill_share.numel() == 1, "fill_share: a [1] device tensor"
    assert max_fill >= 1, "max_fill (K) must be at least 1"
    assert policy in POLICIES, f"policy must be one of {POLICIES}"


def _fixed_gate(w: torch.Tensor) -> torch.Tensor:
    """Gate weights -> int64 multiples of 2**-24 (truncated; NaN and negatives count 0)."""
    w = w.float()
    w = torch.where(w > 0, w, 0.0).clamp(max=GATE_CAP)
    return (w * GATE_ONE).to(torch.int64)


def _score_bits(score: torch.Tensor) -> torch.Tensor:
    """A non-negative float32 score -> int64 with the same order (its bit pattern)."""
    return score.contiguous().view(torch.int32).to(torch.int64)


SHARE_ONE = 1024  # fixed-point unit of the fill share and of its carried credit


def _fill_count(m: int, fill_share: torch.Tensor, credit: int) -> tuple[int, int]:
    """(q before the caps, the credit after): r' = floor(clamp(r, 0, 1) * 1024 + 0.5) (float32,
    as the kernel), x = credit + m * r', q = x // 1024, credit = x % 1024. Integer arithmetic
    from r' on, so kernel and reference agree exactly."""
    r = fill_share.reshape(1).float()
    r = torch.where(r > 0, r, 0.0)
    r = torch.where(r < 1, r, 1.0)
    rq = int(torch.floor(r * SHARE_ONE + 0.5).item())
    x = credit + m * rq
    return x // SHARE_ONE, x % SHARE_ONE


def control_reference(ids, weights, res: Residency, fill_share, max_fill: int, policy: str = "recent",
                      out: ControlOut | None = None, peek: bool = False, acc: torch.Tensor | None = None) -> ControlOut:
    """Pure-torch reference: plain code (host syncs, data-dependent sizes), same results as
    the kernel."""
    _check_args(ids, weights, res, fill_share, max_fill, policy, acc)
    t, k = ids.shape
    dev = ids.device
    pairs, kf = t * k, max_fill
    out = out or ControlOut.empty(t, k, kf, dev)
    flat = ids.reshape(-1).long()  # [P]
    gate = _fixed_gate(weights.reshape(-1))  # [P]
    clock = res.clock + (0 if peek else 1)  # [1] this call's stamp (a peek: the last call's)

    live = (flat >= 0).nonzero()[:, 0]  # [L] pair indices that route somewhere
    uniq, inv = torch.unique(flat[live], return_inverse=True)  # U [n_u] sorted by id
    first = torch.full_like(uniq, pairs).scatter_reduce_(0, inv, live, "amin")  # first pair routing it
    total = torch.zeros_like(uniq).index_add_(0, inv, gate[live])  # summed fixed-point gate
    old_slot = res.slot_of[uniq].long()
    hit = old_slot >= 0
    if policy == "lfu" and not peek:  # this call's reads counted: 2^e each, e in [0, RESCALE] after a rescale
        e = int(clock) // res.half - int(res.base)
        if e > RESCALE:
            res.score.mul_(2.0 ** -RESCALE)
            res.base += RESCALE
            e -= RESCALE
        res.score[uniq] = res.score[uniq] + torch.tensor(2.0 ** e, dtype=torch.float32, device=dev)

    # misses in policy order: priority descending, ties by first occurrence
    prio = {"recent": lambda: res.seen[uniq], "gate": lambda: total,
            "lfu": lambda: _score_bits(res.score[uniq])}[policy]()
    order = torch.argsort(first)
    order = order[torch.argsort(prio[order], descending=True, stable=True)]
    misses = uniq[order[~hit[order]]]  # [m]
    m = misses.numel()

    # victims: the least recently used slots holding no hit (or "lfu": the lowest scores),
    # free ones first, ties by index
    if policy == "lfu":
        age = torch.where(res.id_of >= 0, _score_bits(res.score[res.id_of.long().clamp(min=0)]), 0)  # [S]
    else:
        age = torch.where(res.id_of >= 0, res.stamp + 1, 0)  # [S]
    stamp = res.stamp.clone()
    stamp[old_slot[hit]] = clock  # hits refreshed first: a slot stamped with this clock is no victim
    evictable = (res.id_of < 0) | (stamp != clock)  # (a peek: nor one the last call used)
    by_age = torch.argsort(age, stable=True)
    cand = by_age[evictable[by_age]][:kf]  # the K oldest candidates
    q0, credit = _fill_count(m, fill_share, int(res.credit))
    q = min(q0, kf, cand.numel())
    if not peek:
        res.credit.fill_(credit)

    fills, victims = misses[:q], cand[:q]
    old = res.id_of[victims].long()
    res.slot_of[old[old >= 0]] = -1
    res.slot_of[fills] = victims.to(torch.int32)
    res.id_of[victims] = fills.to(torch.int32)
    res.stamp[old_slot[hit]] = clock
    res.stamp[victims] = clock
    if not peek:
        res.seen[uniq] = clock
        res.clock.copy_(clock)

    now = res.slot_of[flat.clamp(min=0)].long()
    route = torch.where(flat < 0, NO_EXPERT, torch.where(now >= 0, now, CPU))
    out.route.copy_(route.view(t, k))
    out.cpu_route.copy_(torch.where(route == CPU, flat, NO_EXPERT).view(t, k))
    out.fill_src.fill_(-1)[:q] = fills.to(torch.int32)
    out.fill_dst.fill_(-1)[:q] = victims.to(torch.int32)
    out.cpu_ids.fill_(-1)[:m - q] = misses[q:].to(torch.int32)
    out.counts.copy_(torch.tensor([q, m - q, int(hit.sum())], dtype=torch.int32))
    if acc is not None:
        acc.add_(torch.tensor(_acc_counts(live.numel(), int(hit.sum()), q, m - q), dtype=torch.int64, device=acc.device))
    return out


def _acc_counts(live: int, hits: int, fills: int, cpu: int) -> list[int]:
    """One call's row of a cache's statistics accumulator (`acc`): calls, routed pairs (not
    NO_EXPERT), distinct experts hit, filled, run on the CPU."""
    return [1, live, hits, fills, cpu]


# --------------------------------------------------------------------------------------------
# Triton kernel: one program does the whole step. Threads share global memory, and a small
# vector is held by several threads at once, so every location is only read in phases before
# the barrier that precedes its writes, or after the one that follows them (one CTA: a
# barrier orders its threads' global accesses).
#
#   pairs   [P_PAD]  sort (id, pair) -> runs of one id; run starts = U; scans give each run's
#                    summed gate; hits / misses from slot_of; stamp hits, set seen
#   misses  [P_PAD]  sort by (policy priority, first pair) -> ranks; q from m and r
#   -- barrier (hit stamps are visible: a slot stamped with this clock holds a hit) --
#   slots   [BLOCK_S] per chunk: key (age, slot), hits and padding +inf; running K_PAD
#                    smallest via top-k of the chunk merged with the running set
#   write fill_src / fill_dst / cpu_ids, seen
#   -- barrier --   [K_PAD] read fill_src and the victims' old ids
#   -- barrier --   evict, admit, stamp fills
#   -- barrier --   [P_PAD] route each pair from the new slot_of
# --------------------------------------------------------------------------------------------
if HAS_TRITON:
    import triton
    import triton.language as tl

    _NONE: tl.constexpr = tl.constexpr(2**63 - 1)  # sort key of an absent entry (sorts last)
    _GATE_MAX: tl.constexpr = tl.constexpr(1 << 44)  # bound of a fixed-point gate sum

    @triton.jit
    def _count_of_max(ia, ca, ib, cb):
        """Scan summary over sorted ids: (largest id, how often it occurs). Associative and
        commutative, so the scan direction does not matter."""
        i = tl.maximum(ia, ib)
        return i, tl.where(ia == i, ca, 0) + tl.where(ib == i, cb, 0)

    @triton.jit
    def _sum_of_min(ia, va, ib, vb):
        """Scan summary over sorted ids: (smallest id, sum of the values carrying it)."""
        i = tl.minimum(ia, ib)
        return i, tl.where(ia == i, va, 0) + tl.where(ib == i, vb, 0)

    @triton.jit
    def _smallest(x, N: tl.constexpr, TOPK: tl.constexpr):
        """The N smallest of x [M] (M >= N, powers of two), ascending -> [N]."""
        if TOPK:  # the largest of -x, largest first (older tl.topk has no `descending`)
            r = -tl.topk(-x, N)
        else:  # Triton without tl.topk: sort, then row 0 of the [M / N, N] view is the answer
            r = tl.min(tl.reshape(tl.sort(x), [x.shape[0] // N, N]), axis=0)
        return r

    # P and K unspecialized: Triton would compile a variant per value class (1, a multiple of 16,
    # other) of each; the sizes that shape the program are P_PAD and K_PAD
    @triton.jit(do_not_specialize=["P", "K"])
    def _control_kernel(ids_ptr, w_ptr, share_ptr,  # [P] int64, [P] gate weights, [1] float32
                        slot_of_ptr, id_of_ptr, stamp_ptr, seen_ptr, clock_ptr,  # residency (in place)
                        score_ptr, base_ptr, credit_ptr,  # residency: "lfu", the fill share's credit
                        route_ptr, fill_src_ptr, fill_dst_ptr, cpu_ptr, counts_ptr,  # outputs
                        cpu_route_ptr, acc_ptr,  # outputs: [P] int64 CPU routes; [5] int64 running counts (ACC)
                        P, S, N, HALF, K,  # K: most fills (a runtime int: a constexpr compiled a variant per call size)
                        P_PAD: tl.constexpr, K_PAD: tl.constexpr,
                        BLOCK_S: tl.constexpr, RECENT: tl.constexpr, LFU: tl.constexpr, TOPK: tl.constexpr,
                        TICK: tl.constexpr, COUNT: tl.constexpr, ACC: tl.constexpr):
        clock = tl.load(clock_ptr)  # a peek stamps with the last call's clock
        if TICK:
            clock = clock + 1  # this call's stamp
        if COUNT:  # lfu, not a peek: the exponent of this call's count; every score halved 64 times when it passes 64
            base = tl.load(base_ptr)
            tl.debug_barrier()  # every warp read the old base before one stores the rescaled one
            e = clock // HALF - base
            if e > 64:  # RESCALE
                for n0 in range(0, N, BLOCK_S):
                    n = n0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
                    sc = tl.load(score_ptr + n, mask=n < N, other=0.0)
                    tl.store(score_ptr + n, sc * 5.421010862427522e-20, mask=n < N)  # 2^-64
                tl.store(base_ptr, base + 64)
                e = e - 64
            inc = ((e + 127).to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^e, exact
            tl.debug_barrier()  # rescaled scores are in memory before they are read

        # ---- dedup: sort the pairs by (id, pair index); each run of one id is one expert of U
        p = tl.arange(0, P_PAD)  # [P_PAD]
        pid = tl.load(ids_ptr + p, mask=p < P, other=-1)
        sk = tl.sort(tl.where(pid >= 0, pid * P_PAD + p, _NONE))  # [P_PAD] ascending
        valid = sk != _NONE
        sid = sk // P_PAD  # flat id; absent entries form the last run, above every id
        uid = tl.where(valid, sid, 0)  # the same, safe as an address
        first = sk % P_PAD  # pair index; at a run's start, the id's first occurrence
        w = tl.load(w_ptr + first, mask=valid, other=0.0).to(tl.float32)
        w = tl.minimum(tl.where(w > 0, w, 0.0), 256.0)  # GATE_CAP
        gate = (w * 16777216.0).to(tl.int64)  # GATE_ONE: fixed point, exact sums
        _, nth = tl.associative_scan((sid, tl.full([P_PAD], 1, tl.int32)), 0, _count_of_max)
        rep = valid & (nth == 1)  # [P_PAD] run starts: one per expert of U
        _, total = tl.associative_scan((sid, gate), 0, _sum_of_min, reverse=True)  # run sum at its start

        slot = tl.load(slot_of_ptr + uid, mask=rep, other=-1).to(tl.int64)
        hit = rep & (slot >= 0)
        miss = rep & (slot < 0)
        n_hit = tl.sum(hit.to(tl.int32), axis=0)
        m = tl.sum(miss.to(tl.int32), axis=0)
        seen_old = tl.load(seen_ptr + uid, mask=rep, other=0)
        tl.store(stamp_ptr + slot, clock, mask=hit)  # hits refreshed (and marked for the scan)

        # ---- policy order of the misses: smaller key first, ties by first occurrence
        if LFU:
            sc_new = tl.load(score_ptr + uid, mask=rep, other=0.0)
            if COUNT:  # a peek counts nothing
                sc_new = sc_new + inc  # one run start per id
                # every thread holding a copy of an entry (a call of fewer pairs than threads) has
                # read the old score before one of them writes the new one: a late reader would
                # count twice and order the misses differently from the others
                tl.debug_barrier()
                tl.store(score_ptr + uid, sc_new, mask=rep)
            prio = 2147483647 - sc_new.to(tl.int32, bitcast=True).to(tl.int64)  # highest count first
        elif RECENT:
            prio = clock - seen_old  # routed most recently first
        else:
            prio = _GATE_MAX - tl.minimum(total, _GATE_MAX)  # largest summed gate first
        mk = tl.sort(tl.where(miss, prio * P_PAD + first, _NONE))  # [P_PAD] rank order
        mid = tl.load(ids_ptr + mk % P_PAD, mask=mk != _NONE, other=-1)  # flat id of each rank

        # ---- q = (credit + m * r') // 1024, r' = floor(r * 1024 + 0.5); credit = the remainder
        r = tl.load(share_ptr).to(tl.float32)
        r = tl.where(r > 0, r, 0.0)
        r = tl.where(r < 1, r, 1.0)
        rq = tl.floor(r * 1024.0 + 0.5).to(tl.int64)  # SHARE_ONE
        xq = tl.load(credit_ptr) + m.to(tl.int64) * rq
        q = (xq // 1024).to(tl.int32)

        tl.debug_barrier()  # the hits' stamps are in memory before the scan reads them
        if TICK:  # after the barrier: every warp has read the old credit (else a late one took the
            tl.store(credit_ptr, xq % 1024)  # new one, and warps disagreed on q)

        # ---- victims: the K_PAD smallest keys (age, slot) over the pool, one pass in chunks
        best = tl.full([K_PAD], _NONE, tl.int64)  # [K_PAD] ascending
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
            held = tl.load(id_of_ptr + s, mask=s < S, other=-1)
            st = tl.load(stamp_ptr + s, mask=s < S, other=0)
            if LFU:  # the lowest decayed count (a held id's score is not changed by this call)
                hs = tl.load(score_ptr + tl.maximum(held, 0), mask=held >= 0, other=0.0)
                age = tl.where(held >= 0, hs.to(tl.int32, bitcast=True).to(tl.int64), 0)
            else:
                age = tl.where(held >= 0, st + 1, 0)  # a free slot is the oldest
            usable = (s < S) & ((held < 0) | (st != clock))  # not holding a hit of this call (a peek: nor the last's)
            key = tl.where(usable, age * S + s, _NONE)
            both = tl.reshape(tl.join(best, _smallest(key, K_PAD, TOPK)), [2 * K_PAD])
            best = _smallest(both, K_PAD, TOPK)
        j = tl.arange(0, K_PAD)  # [K_PAD] fill index
        n_cand = tl.sum(((j < K) & (best != _NONE)).to(tl.int32), axis=0)
        q = tl.minimum(q, n_cand)  # q <= K too: n_cand counts only the first K
        victim = tl.where(j < q, best % S, -1)  # j-th oldest usable slot

        # ---- outputs: F = ranks [0, q), C = ranks [q, m); padding -1; seen (read before bar 1)
        if TICK:
            tl.store(seen_ptr + uid, clock, mask=rep)
        tl.store(fill_dst_ptr + j, victim.to(tl.int32), mask=j < K)
        tl.store(fill_src_ptr + p, mid.to(tl.int32), mask=p < q)
        tl.store(fill_src_ptr + j, tl.full([K_PAD], -1, tl.int32), mask=(j >= q) & (j < K))
        tl.store(cpu_ptr + (p - q), mid.to(tl.int32), mask=(p >= q) & (p < m))
        tl.store(cpu_ptr + p, tl.full([P_PAD], -1, tl.int32), mask=(p >= m - q) & (p < P))
        tl.debug_barrier()  # fill_src is in memory before it is read back beside its victim

        # ---- residency: evict each victim's old id, admit F, stamp the fills
        fills = j < q
        src = tl.load(fill_src_ptr + j, mask=fills, other=-1)  # [K_PAD]
        old = tl.load(id_of_ptr + victim, mask=fills, other=-1)
        tl.debug_barrier()  # every thread holding a copy has read the old ids before they change
        tl.store(slot_of_ptr + old, -1, mask=fills & (old >= 0))
        tl.store(slot_of_ptr + src, victim.to(tl.int32), mask=fills)
        tl.store(id_of_ptr + victim, src, mask=fills)
        tl.store(stamp_ptr + victim, clock, mask=fills)
        tl.debug_barrier()  # slot_of is final before the routes read it

        # ---- routes: slot of a hit or fill, CPU for the rest, NO_EXPERT stays
        now = tl.load(slot_of_ptr + pid, mask=pid >= 0, other=-1)
        route = tl.where(pid < 0, -1, tl.where(now >= 0, now, -2))  # NO_EXPERT, CPU
        tl.store(route_ptr + p, route.to(tl.int32), mask=p < P)
        tl.store(cpu_route_ptr + p, tl.where(route == -2, pid, -1), mask=p < P)
        tl.store(counts_ptr, q)
        tl.store(counts_ptr + 1, m - q)
        tl.store(counts_ptr + 2, n_hit)
        if ACC:  # every thread reads the running counts before one of them stores the new ones
            live = tl.sum((pid >= 0).to(tl.int64), axis=0)
            a0, a1, a2 = tl.load(acc_ptr), tl.load(acc_ptr + 1), tl.load(acc_ptr + 2)
            a3, a4 = tl.load(acc_ptr + 3), tl.load(acc_ptr + 4)
            tl.debug_barrier()
            tl.store(acc_ptr, a0 + 1)
            tl.store(acc_ptr + 1, a1 + live)
            tl.store(acc_ptr + 2, a2 + n_hit.to(tl.int64))
            tl.store(acc_ptr + 3, a3 + q.to(tl.int64))
            tl.store(acc_ptr + 4, a4 + (m - q).to(tl.int64))
        if TICK:
            tl.store(clock_ptr, clock)


def control_triton(ids, weights, res: Residency, fill_share, max_fill: int, policy: str = "recent",
                   out: ControlOut | None = None, topk: bool | None = None,
                   block_s: int | None = None, peek: bool = False, num_warps: int | None = None,
                   k_pad: int | None = None, acc: torch.Tensor | None = None) -> ControlOut:
    """The Triton kernel: one single-program launch, no host sync, CUDA-graph capturable.
    topk: use tl.topk in the victim scan (default: when this Triton has it); block_s: slots
    per chunk of the scan (default up to scan_block's; a power of two, at least K's); num_warps:
    default control_warps of the pair bucket; k_pad: the fill list's static size, a power of two
    >= max_fill (default max_fill's; fill_pad gives one per pair bucket)."""
    _check_args(ids, weights, res, fill_share, max_fill, policy, acc)
    t, k = ids.shape
    pairs, s = t * k, res.num_slots
    assert 1 <= pairs <= MAX_PAIRS, f"{pairs} pairs: the kernel handles 1..{MAX_PAIRS}"
    out = out or ControlOut.empty(t, k, max_fill, ids.device)
    p_pad = pair_bucket(pairs)
    k_pad = k_pad or next_pow2(max_fill)
    assert k_pad >= max_fill and k_pad & (k_pad - 1) == 0, f"k_pad {k_pad}: a power of two >= max_fill {max_fill}"
    block_s = max(k_pad, block_s or min(scan_block(p_pad), triton.next_power_of_2(s)))
    assert block_s & (block_s - 1) == 0
    if topk is None:
        topk = hasattr(tl, "topk")
    _control_kernel[(1,)](
        ids.reshape(-1).to(torch.int64).contiguous(), weights.reshape(-1).contiguous(), fill_share,
        res.slot_of, res.id_of, res.stamp, res.seen, res.clock, res.score, res.base, res.credit,
        out.route, out.fill_src, out.fill_dst, out.cpu_ids, out.counts,
        out.cpu_route, acc if acc is not None else out.counts,  # (a pointer the kernel never touches without ACC)
        pairs, s, res.num_flat_experts, res.half, max_fill, P_PAD=p_pad, K_PAD=k_pad, BLOCK_S=block_s,
        RECENT=policy == "recent", LFU=policy == "lfu", TOPK=topk, TICK=not peek,
        COUNT=policy == "lfu" and not peek, ACC=acc is not None,
        num_warps=num_warps or control_warps(p_pad), enable_fp_fusion=False)
    return out


def control_warps(p_pad: int) -> int:
    """Warps of the control program for a call padded to p_pad pairs (its pair_bucket): 8 for
    decode-sized calls (up to 64 pairs), 4 up to 1,024 pairs, then about 8 pairs per thread (16
    warps at 4,096). Each thread's share of the [P_PAD] sorts is unrolled code: at 4 warps a
    4,096-pair variant (32 a thread) took 51 s to compile on the H200
    (benchmarks/results/control-compile-gpu.json). Decode calls are bound by the victim scan, not
    the sorts: 8 warps with scan_block's 4,096-slot chunks ran a 40-layer step's calls in 17.8 us
    each against 24.8 at 4 warps and 1,024 (H100, 3,840 slots, 8 pairs; 30.5 against 41.8 at 32;
    bench.control_speed, twenty-seventh session)."""
    if p_pad <= 64:
        return 8
    return max(4, min(16, p_pad // 256))


def scan_block(p_pad: int) -> int:
    """The largest scan chunk (BLOCK_S) of the victim scan for a call of p_pad pairs: 4,096
    slots for decode-sized calls (fewer chunks, fewer merges of the running K smallest), 1,024
    for larger ones (whose fill lists, and the top-k over each chunk, are larger: kept as
    measured and compiled before)."""
    return 4096 if p_pad <= 64 else 1024


def warm_up_control(num_flat_experts: int, num_slots: int, device, policy: str = "recent",
                    weight_dtype: torch.dtype = torch.bfloat16, max_pairs: int = MAX_PAIRS,
                    layer_experts: int | None = None) -> list[int]:
    """Compile the control kernel's variants before a request needs them: one per bucket of a
    call's (token, expert) pairs (pair_bucket) up to max_pairs, with every pair allowed to fill
    (as the cache's calls ask, decode and prefill alike), gate weights in weight_dtype (the
    model's activations: Triton compiles a variant per pointer type). The kernel is one program
    sized by the bucket, so each is a separate compile. Unwarmed, a serving engine compiled them
    inside its first prompts of each size: a CUDA test of streamed prefill spent its whole
    230 s limit in them on a fresh H200 (benchmarks/README.md, eleventh session). Runs on a
    scratch Residency of the pool's shape (the same scan blocks; the real one untouched). Not
    warmed: the lookahead's peek calls (decode only, compiled when the decode graphs are
    captured at start-up). The fill list is padded as the cache's calls pad it (fill_pad: by the
    layer's experts and the slots, per bucket). -> the buckets warmed."""
    res = Residency.empty(num_flat_experts, num_slots, device)
    share = torch.ones(1, dtype=torch.float32, device=device)
    acc = torch.zeros(5, dtype=torch.int64, device=device)  # the cache's calls add to its statistics (ACC)
    g = torch.Generator().manual_seed(0)
    warmed, b = [], pair_bucket(1)
    while b <= pair_bucket(max_pairs):
        p = min(b, max_pairs)  # the bucket's largest call
        ids = torch.randint(0, num_flat_experts, (p, 1), generator=g).to(device)  # [P, 1]
        w = torch.rand(p, 1, generator=g).to(device, weight_dtype)  # [P, 1]
        control_triton(ids, w, res, share, fill_cap(p, layer_experts, num_slots), policy,
                       k_pad=fill_pad(p, layer_experts, num_slots), acc=acc)
        warmed.append(b)
        b *= 4
    return warmed
