"""Expert cache policy simulator: replay decode routing, count misses per policy and capacity.

One residency space for the routed experts of all MoE layers (mechanism 3 of the design),
capacity C experts given as a fraction of all layers' experts (L * E). Each decode step runs
the layers in order; at each layer the batch needs the distinct experts its tokens route to
(one *expert read* each). As the engine's control kernel does, a layer's reads are classified
against residency first (hits refresh), then every miss is admitted (a demand fill: the
all-fills case of q*), evicting an expert that this layer does not read. Static policies never
fill; their misses run elsewhere. miss_rate = misses / expert reads. Every policy starts
full at no cost (warm start): static sets are loaded before the replay, and a demand-fill
cache's fills into free slots (its first min(C, distinct experts) misses, before any eviction:
`cold_fills` in the JSON) are not counted. So counted, `min` bounds every demand-fill policy
and `min_bypass` every policy here, static ones included (those leave misses out of the
cache): any policy from any preload, replayed lazily from empty, pays at most C more misses,
and the optimum from empty pays no more than that.

Policies (names as in the JSON):
- lru: global LRU (the design's mechanism 3).
- lfu_decay: LFU with exponential decay: each read adds 2^(step/H) to the expert's score
  (half-life H decode steps, --lfu-half-life), history kept for evicted experts; evict the
  lowest score (ties: least recent).
- lfu_halving: lfu_decay in whole halvings (each read adds 2^floor(step/H)): sums of powers of
  two, exact in float32 on any device, which the GPU cache's control kernel can keep.
- static_first_layers / static_last_layers: every expert of floor(C/E) whole layers resident,
  nothing else; the first layers as the brief asks, the last layers as llama.cpp's
  `--n-cpu-moe N` actually does (it keeps the first N layers' experts on the CPU).
- hot_set: KTransformers-like: when a request starts, the C experts most used by its prefill
  (the recorded prompt routing where the trace has it, else its first --hot-prefix decode
  tokens) become the resident set, fixed until the next request starts (with a batch, the
  prefixes of all running requests; slots the prefix leaves free take random other experts).
- freq_oracle: the C most-read experts of the whole replay, fixed (the best static set).
- min: Belady's MIN (evict the resident expert whose next read is furthest; offline): the
  optimum of the demand-fill policies (every miss admitted: lru, lfu_decay, arc, ...).
- min_bypass: MIN allowed to leave a miss out of the cache (run it on the CPU) when it is read
  again later than every evictable resident: the optimum of all policies, static sets
  included (they never admit), and of what the q* split permits (the engine always fills at
  least one miss per layer, so it can do no better).
- next_read_est: ours: evict the largest estimated time to the next read, from the layer
  cycle and a per-expert reuse estimate (sim_next_read_est says how). An online candidate.
- arc, lru2, lfu_decay_gate: online candidates for closing the LRU-to-MIN gap (ARC, Megiddo &
  Modha 2003; LRU-2, evict the oldest second-to-last read; LFU-decay with each read weighted by
  its gate weight, summed over the batch's tokens). Measured like the others.

    python -m bench.policy_sim [SPEC ...] [--capacities 0.1,0.25,0.37,0.5,0.75]
        [--batches 1,4] [--pooled] [--lfu-half-life 64] [--hot-prefix 32]

SPEC as `--routing` takes it (freetoken/experts/traces.py: trace:PATH, csv:PATH,
synthetic:...); default: the SYNTHETIC Qwen3.6 shape. `--pooled` also runs all non-synthetic
traces given as one pool of sequences (batched replay needs several sequences). A batch larger
than a trace's sequence count is skipped (said in the JSON). Writes
`benchmarks/results/policy_sim-cpu.json` (OUT= to redirect) through bench.common.write_result.
"""
from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import Counter, OrderedDict

import numpy as np

from freetoken.errors import FreeTokenError
from freetoken.experts.traces import RoutingTrace, merge_traces, parse_routing

QWEN36_SYNTHETIC = "synthetic:layers=40,experts=256,k=8,skew=1.1,steps=2000,seed=0"
CAPACITIES = "0.1,0.25,0.37,0.5,0.75"
POLICIES = ["lru", "lfu_decay", "lfu_halving", "static_first_layers", "static_last_layers", "hot_set",
            "freq_oracle", "min", "min_bypass", "next_read_est", "arc", "lru2", "lfu_decay_gate"]
STATIC = {"static_first_layers", "static_last_layers", "hot_set", "freq_oracle"}


# ---------------------------------------------------------------------------------------------
# the read sequence

class Reads:
    """Expert reads of a replay, flattened: group g = one (decode step, layer) of the batch.

    ids[starts[g]:starts[g+1]] are the distinct flat expert ids (layer * E + expert) group g
    reads, gates[...] their gate weights summed over the batch's tokens (NaN: unknown);
    step[g] its decode step; admitted[step] the sequences that start at that step;
    prefix[seq] the flat ids of that sequence's prefill-like prefix (for hot_set)."""

    def __init__(self, trace: RoutingTrace, batch: int = 1, hot_prefix: int = 32):
        E = trace.num_experts
        self.num_experts, self.num_layers = E, trace.num_layers
        self.universe = trace.num_layers * E
        ids: list[int] = []
        gates: list[float] = []
        starts = [0]
        step: list[int] = []
        max_group = 0
        offs = (np.arange(trace.num_layers, dtype=np.int64) * E)[:, None]
        active = 0
        for t, (ex, gt) in enumerate(trace.decode_steps(batch, with_gates=True)):
            active += ex.shape[1]
            flat = np.where(ex >= 0, ex + offs[:, :, None], -1)  # [L, b, k]
            for layer in range(flat.shape[0]):
                row = flat[layer].ravel()
                g = gt[layer].ravel()
                if ex.shape[1] == 1:
                    keep = row >= 0
                    xs, ws = row[keep].tolist(), g[keep].tolist()
                else:
                    acc: dict[int, float] = {}
                    for x, w in zip(row.tolist(), g.tolist()):
                        if x >= 0:
                            acc[x] = acc.get(x, 0.0) + w
                    xs, ws = list(acc), list(acc.values())
                if not xs:
                    continue
                ids += xs
                gates += ws
                starts.append(len(ids))
                step.append(t)
                max_group = max(max_group, len(xs))
        self.ids, self.gates, self.starts, self.step = ids, gates, starts, step
        self.num_groups = len(step)
        self.num_steps = (step[-1] + 1) if step else 0
        self.mean_batch = active / max(1, self.num_steps)
        self.max_group = max_group
        self.admitted = trace.step_admissions(batch)
        self.seq_len = [s.num_steps for s in trace.sequences]
        self.prefix: list[list[int]] = []
        self.prefix_source: list[str] = []
        for s in trace.sequences:
            if s.prefill_experts is not None and len(s.prefill_experts):
                src, what = s.prefill_experts, "prefill"
            else:
                src, what = s.experts[:hot_prefix], f"first {min(hot_prefix, s.num_steps)} decode tokens"
            flat = np.where(src >= 0, src + offs[None], -1).ravel()
            self.prefix.append(flat[flat >= 0].tolist())
            self.prefix_source.append(what)

    def next_use(self) -> list[int]:
        """For each read, the group index of the next read of the same expert (inf: none)."""
        nxt = [0] * len(self.ids)
        last: dict[int, int] = {}
        inf = self.num_groups + 1
        ids, starts = self.ids, self.starts
        for g in range(self.num_groups - 1, -1, -1):
            for i in range(starts[g], starts[g + 1]):
                x = ids[i]
                nxt[i] = last.get(x, inf)
                last[x] = g
        return nxt


# ---------------------------------------------------------------------------------------------
# policies: each returns the number of misses

def sim_lru(R: Reads, C: int) -> int:
    cache: OrderedDict = OrderedDict()
    ids, starts = R.ids, R.starts
    misses = 0
    for g in range(R.num_groups):
        a, b = starts[g], starts[g + 1]
        miss = []
        for i in range(a, b):  # classify the whole layer first; hits refresh
            x = ids[i]
            if x in cache:
                cache.move_to_end(x)
            else:
                miss.append(x)
        for x in miss:  # the layer's hits are now most recent: never the victim (C >= group)
            if len(cache) >= C:
                cache.popitem(last=False)
            cache[x] = None
        misses += len(miss)
    return misses


def _sim_keyed(R: Reads, C: int, touch, bypass=None) -> int:
    """Evict the resident with the smallest key; `touch(x, i, g)` records read i (of expert
    x, group g) and returns x's new key. A lazy heap: stale entries are skipped on pop.
    `bypass(key_new, key_victim)`: True leaves the miss out of the cache."""
    ids, starts = R.ids, R.starts
    res: dict = {}
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    misses = 0
    for g in range(R.num_groups):
        a, b = starts[g], starts[g + 1]
        miss = []
        for i in range(a, b):
            x = ids[i]
            kx = touch(x, i, g)
            if x in res:
                res[x] = kx
                push(heap, (kx, x))
            else:
                miss.append((x, kx))
        if not miss:
            continue
        misses += len(miss)
        cur = set(ids[a:b])
        if bypass is not None:  # nearest next read first, so that no miss admitted here
            miss.sort(key=lambda m: m[1], reverse=True)  # is one a later miss should displace
        for x, kx in miss:
            if len(res) >= C:
                aside = []
                while True:
                    ky, y = pop(heap)
                    if res.get(y, None) != ky:
                        continue  # stale
                    if y in cur:
                        aside.append((ky, y))
                        continue
                    break
                if bypass is not None and bypass(kx, ky):
                    push(heap, (ky, y))  # keep the resident; x runs elsewhere
                    for e in aside:
                        push(heap, e)
                    continue
                del res[y]
                for e in aside:
                    push(heap, e)
            res[x] = kx
            push(heap, (kx, x))
        if len(heap) > 4 * C + 4096:  # compact
            heap = [(k, x) for x, k in res.items()]
            heapq.heapify(heap)
    return misses


def sim_min(R: Reads, C: int, nxt: list[int] | None = None, bypass: bool = False,
            depth: int = 8) -> int:
    """Belady's MIN; key = -(group of the next read): the smallest key is read furthest ahead.

    Demand fill: experts whose next reads fall in one group tie, harmlessly (both will be
    resident at that group whatever is chosen now). With bypass they do not: the key is
    then the next `depth` read groups, compared in order (packed into one integer)."""
    if not bypass:
        nxt = nxt if nxt is not None else R.next_use()
        return _sim_keyed(R, C, lambda x, i, g: -nxt[i])
    ids, starts = R.ids, R.starts
    group_of = [0] * len(ids)
    for g in range(R.num_groups):
        for i in range(starts[g], starts[g + 1]):
            group_of[i] = g
    npos = [-1] * len(ids)  # read index of the next read of the same expert
    last: dict[int, int] = {}
    for i in range(len(ids) - 1, -1, -1):
        npos[i] = last.get(ids[i], -1)
        last[ids[i]] = i
    bits = (R.num_groups + 1).bit_length()
    never = (1 << bits) - 1

    def touch(x, i, g):
        key, j = 0, npos[i]
        for _ in range(depth):
            key = (key << bits) | (never if j < 0 else group_of[j])
            j = npos[j] if j >= 0 else -1
        return -key
    return _sim_keyed(R, C, touch, lambda kn, kv: kn <= kv)


def sim_lfu_decay(R: Reads, C: int, half_life: float = 64.0, gate_weighted: bool = False) -> int:
    score: dict[int, float] = {}
    step, gates = R.step, R.gates
    # a score is the sum of 2^(step / H) over the expert's reads: decayed counts, all scaled
    # by the same 2^(now / H), so comparing them compares the decayed counts
    if R.num_steps / half_life > 900:
        raise FreeTokenError(f"lfu_decay: {R.num_steps} steps is over 900 half-lives "
                             "(float range); raise --lfu-half-life")

    def touch(x, i, g):
        w = 2.0 ** (step[g] / half_life)
        if gate_weighted:
            gw = gates[i]
            w *= gw if gw == gw else 1.0  # NaN: gate unknown
        s = score.get(x, 0.0) + w
        score[x] = s
        return (s, g)
    return _sim_keyed(R, C, touch)


def sim_lfu_halving(R: Reads, C: int, half_life: float = 64.0) -> int:
    """lfu_decay with the decay applied in whole halvings: each read adds 2^floor(step / H), a
    power of two, so a float32 score sums exactly the same way on any device (what the GPU
    cache's control kernel can keep per expert, policy "lfu"). Kept in float64 here; the
    device rescales before float32 runs out."""
    score: dict[int, float] = {}
    step = R.step
    h = max(1, int(half_life))

    def touch(x, i, g):
        s = score.get(x, 0.0) + 2.0 ** (step[g] // h)
        score[x] = s
        return (s, g)
    return _sim_keyed(R, C, touch)


def sim_lru2(R: Reads, C: int) -> int:
    """LRU-2: evict the expert whose second-to-last read is oldest (once-read experts first,
    least recent of them first). History kept for evicted experts."""
    hist: dict[int, tuple] = {}

    def touch(x, i, g):
        prev = hist.get(x)
        k = (prev[1], g) if prev is not None else (-1, g)
        hist[x] = k
        return k
    return _sim_keyed(R, C, touch)


def sim_static(R: Reads, resident: set) -> int:
    return sum(1 for x in R.ids if x not in resident)


def static_layers(R: Reads, C: int, last: bool) -> set:
    n = min(R.num_layers, C // R.num_experts)
    layers = range(R.num_layers - n, R.num_layers) if last else range(n)
    return {l * R.num_experts + e for l in layers for e in range(R.num_experts)}


def freq_oracle_set(R: Reads, C: int) -> set:
    cnt = Counter(R.ids)
    return {x for x, _ in sorted(cnt.items(), key=lambda kv: (-kv[1], kv[0]))[:C]}


def sim_hot_set(R: Reads, C: int, seed: int = 0) -> int:
    rnd = random.Random(seed)
    ids, starts, step = R.ids, R.starts, R.step
    running: list[tuple[int, int]] = []  # (sequence, last step)
    resident: set = set()
    misses = 0
    g = 0
    for t, started in enumerate(R.admitted):
        if started:
            running = [r for r in running if r[1] >= t] + [(s, t + R.seq_len[s] - 1) for s in started]
            cnt = Counter()
            for s, _ in running:
                cnt.update(R.prefix[s])
            top = [x for x, _ in sorted(cnt.items(), key=lambda kv: (-kv[1], kv[0]))[:C]]
            resident = set(top)
            if len(resident) < C:  # fill the free slots with other experts, at random
                rest = [x for x in range(R.universe) if x not in resident]
                resident.update(rnd.sample(rest, min(len(rest), C - len(resident))))
        while g < R.num_groups and step[g] == t:
            for i in range(starts[g], starts[g + 1]):
                if ids[i] not in resident:
                    misses += 1
            g += 1
    return misses


def sim_arc(R: Reads, C: int) -> int:
    """ARC (Megiddo & Modha): T1/T2 resident (seen once / more than once recently), B1/B2
    ghost lists, adaptive target p for T1. A layer's reads are never the victim."""
    T1: OrderedDict = OrderedDict()
    T2: OrderedDict = OrderedDict()
    B1: OrderedDict = OrderedDict()
    B2: OrderedDict = OrderedDict()
    p = 0.0
    ids, starts = R.ids, R.starts
    misses = 0

    def lru_not_cur(T, cur):
        for y in T:
            if y not in cur:
                return y
        return None

    def replace(x_in_b2, cur):
        nonlocal p
        y1 = lru_not_cur(T1, cur)
        y2 = lru_not_cur(T2, cur)
        from_t1 = y1 is not None and (len(T1) > p or (x_in_b2 and len(T1) == p) or y2 is None)
        if from_t1:
            del T1[y1]
            B1[y1] = None
        else:
            del T2[y2]
            B2[y2] = None

    for g in range(R.num_groups):
        a, b = starts[g], starts[g + 1]
        cur = set(ids[a:b])
        miss = []
        for i in range(a, b):
            x = ids[i]
            if x in T1:
                del T1[x]
                T2[x] = None
            elif x in T2:
                T2.move_to_end(x)
            else:
                miss.append(x)
        misses += len(miss)
        for x in miss:
            if x in B1:
                p = min(C, p + max(len(B2) / len(B1), 1.0))
                if len(T1) + len(T2) >= C:
                    replace(False, cur)
                del B1[x]
                T2[x] = None
            elif x in B2:
                p = max(0.0, p - max(len(B1) / len(B2), 1.0))
                if len(T1) + len(T2) >= C:
                    replace(True, cur)
                del B2[x]
                T2[x] = None
            else:
                if len(T1) + len(B1) >= C:
                    if len(T1) < C:
                        B1.popitem(last=False)
                        if len(T1) + len(T2) >= C:
                            replace(False, cur)
                    else:
                        y = lru_not_cur(T1, cur)
                        del T1[y]
                elif len(T1) + len(T2) + len(B1) + len(B2) >= C:
                    if len(T1) + len(T2) + len(B1) + len(B2) >= 2 * C:
                        B2.popitem(last=False)
                    if len(T1) + len(T2) >= C:
                        replace(False, cur)
                T1[x] = None
    return misses


def sim_next_read_est(R: Reads, C: int, half_life: float = 64.0, prior: float = 2.0) -> int:
    """Evict the resident expert with the largest estimated time to its next read.

    The layers run in a cycle, so an expert of layer l can next be read at layer l's next
    pass, a fraction f in (0, 1] of a decode step away (global LRU evicts exactly the experts
    of the layers about to run: the least recently used are the next layer's). If it is read
    there with probability p, the expected wait is f + (1 - p) / p steps (geometric). p: for an
    expert read at its layer's last pass, its own reuse rate (how often a read of it was
    followed by a read at the next pass; shrunk towards the global rate with `prior` pseudo
    reads: temporal locality); otherwise its decayed read rate per step (LFU with half-life H
    steps). Per-slot state only (decayed score, last step, two counters, layer id), so a
    device kernel can score every slot and take the K largest in one scan, as it does stamps."""
    U, E, L = R.universe, R.num_experts, R.num_layers
    score = np.zeros(U)  # sum over reads of 2^((step - base) / H)
    base = 0
    last = np.full(U, -10, np.int64)  # last step read
    nread = np.zeros(U)  # reads whose layer has had its next pass since
    nreuse = np.zeros(U)  # ... and that were read again at that next pass
    rep = tot = 0.0
    layer_of = np.arange(U) // E
    slots = np.full(C, -1, np.int64)
    pos = np.full(U, -1, np.int64)  # slot of each expert, -1: not resident
    used = 0
    norm = 1.0 - 2.0 ** (-1.0 / half_life)
    ids, starts, step = R.ids, R.starts, R.step
    last_pass: dict[int, tuple[int, np.ndarray]] = {}
    misses = 0
    for g in range(R.num_groups):
        a, b = starts[g], starts[g + 1]
        grp = np.asarray(ids[a:b], np.int64)
        t = step[g]
        lc = ids[a] // E
        if (t - base) / half_life > 500:  # rebase the decayed scores before they overflow
            score *= 2.0 ** (-(t - base) / half_life)
            base = t
        pp = last_pass.get(lc)
        if pp is not None and pp[0] == t - 1:
            prev = pp[1]
            again = np.isin(prev, grp)
            nread[prev] += 1
            nreuse[prev[again]] += 1
            tot += len(prev)
            rep += int(again.sum())
        last_pass[lc] = (t, grp)
        score[grp] += 2.0 ** ((t - base) / half_life)
        last[grp] = t
        miss = grp[pos[grp] < 0]
        if not len(miss):
            continue
        misses += len(miss)
        take = min(C - used, len(miss))
        if take:
            slots[used:used + take] = miss[:take]
            pos[miss[:take]] = np.arange(used, used + take)
            used += take
        rest = miss[take:]
        if not len(rest):
            continue
        p = score[slots] * (2.0 ** (-(t - base) / half_life) * norm)
        ls = layer_of[slots]
        recent = last[slots] == np.where(ls < lc, t, t - 1)
        r = (rep + 1.0) / (tot + 2.0)
        p = np.where(recent, (nreuse[slots] + prior * r) / (nread[slots] + prior), p)
        p = np.clip(p, 1e-12, 1.0)
        wait = ((ls - lc - 1) % L + 1) / L + (1.0 - p) / p
        hit = pos[grp]
        wait[hit[hit >= 0]] = -np.inf  # never evict what this layer reads
        v = np.argpartition(-wait, len(rest) - 1)[:len(rest)]
        pos[slots[v]] = -1
        slots[v] = rest
        pos[rest] = v
    return misses


# ---------------------------------------------------------------------------------------------

def run_policies(R: Reads, C: int, policies: list[str], *, half_life: float = 64.0,
                 nxt: list[int] | None = None, has_gates: bool = True) -> dict[str, int]:
    """Misses of each policy at capacity C (experts). C must hold one layer's reads."""
    if C < R.max_group:
        raise FreeTokenError(f"capacity {C} experts is below one layer's reads ({R.max_group})")
    out: dict[str, int] = {}
    for p in policies:
        if p == "lru":
            out[p] = sim_lru(R, C)
        elif p == "lfu_decay":
            out[p] = sim_lfu_decay(R, C, half_life)
        elif p == "lfu_halving":
            out[p] = sim_lfu_halving(R, C, half_life)
        elif p == "lfu_decay_gate":
            if has_gates:
                out[p] = sim_lfu_decay(R, C, half_life, gate_weighted=True)
        elif p == "static_first_layers":
            out[p] = sim_static(R, static_layers(R, C, last=False))
        elif p == "static_last_layers":
            out[p] = sim_static(R, static_layers(R, C, last=True))
        elif p == "hot_set":
            out[p] = sim_hot_set(R, C)
        elif p == "freq_oracle":
            out[p] = sim_static(R, freq_oracle_set(R, C))
        elif p == "min":
            out[p] = sim_min(R, C, nxt)
        elif p == "min_bypass":
            out[p] = sim_min(R, C, nxt, bypass=True)
        elif p == "next_read_est":
            out[p] = sim_next_read_est(R, C, half_life)
        elif p == "arc":
            out[p] = sim_arc(R, C)
        elif p == "lru2":
            out[p] = sim_lru2(R, C)
        else:
            raise FreeTokenError(f"unknown policy '{p}' (known: {', '.join(POLICIES)})")
    # warm start: every policy starts full at no cost. Static sets are loaded before the
    # replay; a demand-fill cache's fills into free slots (its first min(C, distinct) misses,
    # before any eviction) are not counted. MIN so counted is a lower bound for all of them.
    cold = min(C, len(set(R.ids)))
    return {p: (v if p in STATIC else v - cold) for p, v in out.items()}


def simulate(trace: RoutingTrace, batch: int, fractions: list[float], policies: list[str],
             half_life: float, hot_prefix: int) -> dict:
    t0 = time.perf_counter()
    R = Reads(trace, batch, hot_prefix)
    nxt = R.next_use() if any(p.startswith("min") for p in policies) else None
    reads = len(R.ids)
    res = {"batch": batch, "decode_steps": R.num_steps, "mean_active_batch": round(R.mean_batch, 3),
           "expert_reads": reads, "reads_per_step": round(reads / max(1, R.num_steps), 2),
           "distinct_experts_read": len(set(R.ids)),
           "hot_set_prefix": sorted(set(R.prefix_source)), "capacities": {}}
    for f in fractions:
        C = max(R.max_group, int(round(f * R.universe)))
        m = run_policies(R, C, policies, half_life=half_life, nxt=nxt, has_gates=trace.has_gates)
        res["capacities"][f"{f:g}"] = {
            "fraction": f, "slots": C, "cold_fills": min(C, len(set(R.ids))), "misses": m,
            "miss_rate": {p: round(v / reads, 4) for p, v in m.items()},
            "lru_gap_closed": ({p: round((m["lru"] - v) / (m["lru"] - m["min"]), 3)
                                for p, v in m.items() if p not in ("lru", "min")}
                               if "lru" in m and "min" in m and m["lru"] > m["min"] else None)}
        print(f"  {trace.name} batch {batch} C={f:g} ({C}): " +
              " ".join(f"{p}={v / reads:.3f}" for p, v in m.items()), file=sys.stderr, flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("specs", nargs="*", help="routing specs (trace:PATH, csv:PATH, synthetic:...)")
    ap.add_argument("--capacities", default=CAPACITIES, help="fractions of all layers' experts")
    ap.add_argument("--batches", default="1", help="decode batch sizes (sequences interleaved)")
    ap.add_argument("--pooled", action="store_true", help="also run all recorded traces as one pool")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--lfu-half-life", type=float, default=64.0, help="decode steps")
    ap.add_argument("--hot-prefix", type=int, default=32,
                    help="hot_set: decode tokens standing in for a prefill the trace lacks")
    a = ap.parse_args(argv)
    fractions = [float(x) for x in a.capacities.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"policy_sim: unknown policies {bad} (known: {', '.join(POLICIES)})")
    specs = a.specs or [QWEN36_SYNTHETIC]
    traces = [parse_routing(s) for s in specs]
    if any(t is None for t in traces):
        raise SystemExit("policy_sim: 'model' routing needs the model; give a trace or synthetic spec")
    runs = [(s, t) for s, t in zip(specs, traces)]
    real = [t for t in traces if not t.synthetic]
    if a.pooled and len(real) > 1:
        runs.append(("pooled", merge_traces(real, name="pooled:" + "+".join(t.name for t in real))))
    out = {"description": "expert cache policy simulation: miss rate = misses / expert reads "
                          "(one read = one distinct (layer, expert) a decode step's batch needs "
                          "at one layer), one global residency space over all MoE layers, "
                          "capacity = fraction of all layers' experts; see bench/policy_sim.py",
           "policies": policies, "lfu_half_life_steps": a.lfu_half_life,
           "hot_prefix_tokens": a.hot_prefix, "traces": {}}
    for spec, t in runs:
        entry = {"spec": spec, **t.summary(), "runs": {}}
        for b in batches:
            if b > len(t.sequences):
                entry["runs"][f"batch_{b}"] = {"skipped": f"batch {b} > {len(t.sequences)} sequences"}
                continue
            entry["runs"][f"batch_{b}"] = simulate(t, b, fractions, policies, a.lfu_half_life,
                                                   a.hot_prefix)
        key = t.name
        while key in out["traces"]:
            key += "#2"
        out["traces"][key] = entry
    from bench.common import write_result
    write_result("policy_sim", out)


if __name__ == "__main__":
    try:
        main()
    except FreeTokenError as e:
        raise SystemExit(f"policy_sim: {e}")
