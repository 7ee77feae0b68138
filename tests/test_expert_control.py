"""Cache control of the GPU expert cache (experts/control.py): the Triton kernel against its
pure-torch reference on fuzzed residency and routes, the step's invariants checked by an
independent oracle, and the end-to-end property: experts computed from slot banks (hits and
fills) plus from the host banks (the CPU set) give exactly the all-resident output.

On a CPU machine the kernel runs under TRITON_INTERPRET=1 (set in conftest.py).
"""
import dataclasses

import numpy as np
import pytest
import torch

from freetoken.experts.control import (CPU, POLICIES, ControlOut, Residency, control,
                                       control_reference, control_triton, fill_cap, fill_pad)
from freetoken.experts.executor import NO_EXPERT, reference_experts

triton = pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHARES = (0.0, 0.3, 0.5, 1.0)
FIELDS = ("slot_of", "id_of", "stamp", "seen", "clock", "score", "base", "credit")



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: torch's thread pool only adds waiting on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- fuzzing helpers

def random_residency(g, n, s):
    """Some slots free, some full; stamps and seen clocks with many ties, all <= clock."""
    clock = int(torch.randint(3, 12, (1,), generator=g))
    res = Residency.empty(n, s, "cpu")
    held = int(torch.randint(0, min(n, s) + 1, (1,), generator=g))
    slots = torch.randperm(s, generator=g)[:held]
    ids = torch.randperm(n, generator=g)[:held]
    res.slot_of[ids] = slots.int()
    res.id_of[slots] = ids.int()
    res.stamp.copy_(torch.randint(0, clock + 1, (s,), generator=g))
    res.seen.copy_(torch.randint(0, clock + 1, (n,), generator=g))
    res.clock.fill_(clock)
    # "lfu": small whole counts (many ties), a halving period of 1-3 ticks, and sometimes a base
    # that puts the exponent past the rescale threshold within the next calls
    res.score.copy_(torch.randint(0, 4, (n,), generator=g).float() * 0.5)
    res.half = int(torch.randint(1, 4, (1,), generator=g))
    res.base.fill_(-60 if bool(torch.rand(1, generator=g) < 0.5) else 0)
    res.credit.fill_(int(torch.randint(0, 1024, (1,), generator=g)))  # a fill share's carried remainder
    return to(res, DEV)


def to(res, dev):
    """A copy on dev (never the same tensors)."""
    return Residency(*(getattr(res, f).to(dev, copy=True) for f in FIELDS), half=res.half)


def random_route(g, layers, experts, t, k, res=None):
    """ids [T, k] of one layer: distinct experts per row (as a router gives), repeats across
    rows, some rows NO_EXPERT; sometimes biased towards resident experts (more hits)."""
    layer = int(torch.randint(0, layers, (1,), generator=g))
    base = layer * experts
    pool = torch.arange(experts)
    if res is not None and bool(torch.rand(1, generator=g) < 0.5):
        resident = (res.slot_of[base:base + experts] >= 0).cpu()
        if int(resident.sum()) >= k:  # a hot set: the resident experts, then a few others
            pool = torch.cat([pool[resident], pool[~resident][:2]])
    ids = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:k]] for _ in range(t)]) + base
    dead = torch.rand(t, generator=g) < 0.25
    ids[dead] = NO_EXPERT
    if bool(torch.rand(1, generator=g) < 0.5):
        ids = ids.int()  # the kernel takes any integer dtype
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    if bool(torch.rand(1, generator=g) < 0.3):  # equal sums: the gate policy's ties
        w = torch.where(torch.rand(t, k, generator=g) < 0.5, 0.25, 0.5)
    if bool(torch.rand(1, generator=g) < 0.3):
        w = w.bfloat16()
    return ids.to(DEV), w.to(DEV)


def share(r, device=DEV):
    return torch.tensor([r], dtype=torch.float32, device=device)


def same_out(a, b):
    return all(torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu())
               for f in ("route", "fill_src", "fill_dst", "cpu_ids", "counts", "cpu_route"))


def to_cpu(out: ControlOut) -> ControlOut:
    return dataclasses.replace(out, **{f.name: getattr(out, f.name).cpu() for f in dataclasses.fields(out)})


def same_res(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


# ---------------------------------------------------------------------------- the oracle

def expected_q(m, r, k_cap, evictable, credit=0):
    """(q, credit after): the share in 1/1024 of a fill, its remainder carried (control.py step 3)."""
    rq = int(np.floor(np.float32(min(max(r, 0.0), 1.0)) * np.float32(1024) + np.float32(0.5)))
    x = credit + m * rq
    return min(x // 1024, k_cap, evictable), x % 1024


def lfu_scores(pre, uniq, clock):
    """"lfu": (scores before this call's counts, after the rescale if any; scores after them;
    base after), from the spec in plain Python (float32 via numpy)."""
    score = np.array(pre.score.cpu().numpy(), dtype=np.float32)
    base = int(pre.base[0])
    e = clock // pre.half - base
    if e > 64:
        score = (score * np.float32(2.0 ** -64)).astype(np.float32)
        base, e = base + 64, e - 64
    after = score.copy()
    for x in uniq:
        after[x] = np.float32(after[x] + np.float32(2.0 ** e))
    return score, after, base


def bits(x) -> int:
    return int(np.array([x], dtype=np.float32).view(np.int32)[0])


def check_step(pre, post, ids, weights, out, max_fill, r, policy, peek=False):
    """Invariants of one step, re-derived from the spec with plain Python (peek: a lookahead
    step: no clock tick, no seen, score or credit change, the last call's slots kept)."""
    res_pre = pre
    pre = {f: getattr(pre, f).cpu().tolist() for f in FIELDS}
    post = {f: getattr(post, f).cpu().tolist() for f in FIELDS}
    flat = ids.reshape(-1).cpu().tolist()
    w = weights.reshape(-1).float().cpu()
    gate = (torch.where(w > 0, w, 0.0).clamp(max=256.0) * 2 ** 24).long().tolist()
    route = out.route.reshape(-1).cpu().tolist()
    fill_src, fill_dst = out.fill_src.cpu().tolist(), out.fill_dst.cpu().tolist()
    cpu_ids = out.cpu_ids.cpu().tolist()
    n_fill, n_cpu, n_hit = out.counts.cpu().tolist()
    s, clock = len(pre["id_of"]), pre["clock"][0] + (0 if peek else 1)

    uniq = sorted({e for e in flat if e >= 0})
    first = {e: flat.index(e) for e in uniq}
    total = {e: sum(gv for f, gv in zip(flat, gate) if f == e) for e in uniq}
    hits = [e for e in uniq if pre["slot_of"][e] >= 0]
    misses = [e for e in uniq if pre["slot_of"][e] < 0]
    scaled, after, base = lfu_scores(res_pre, uniq, clock)
    if peek:  # counts nothing
        scaled = after = np.array(res_pre.score.cpu().numpy(), dtype=np.float32)
        base = int(res_pre.base[0])
    prio = {"recent": lambda e: pre["seen"][e], "gate": lambda e: total[e],
            "lfu": lambda e: bits(after[e])}[policy]
    misses.sort(key=lambda e: (-prio(e), first[e]))
    hit_slots = {pre["slot_of"][e] for e in hits}
    if peek:  # the last call's hits and fills stay
        hit_slots |= {i for i in range(s) if pre["id_of"][i] >= 0 and pre["stamp"][i] == clock}
    if policy == "lfu":  # the lowest decayed count first (held ids not routed: unchanged this call)
        age = [bits(scaled[pre["id_of"][i]]) if pre["id_of"][i] >= 0 else 0 for i in range(s)]
    else:
        age = [pre["stamp"][i] + 1 if pre["id_of"][i] >= 0 else 0 for i in range(s)]
    oldest = sorted((i for i in range(s) if i not in hit_slots), key=lambda i: (age[i], i))
    q, credit = expected_q(len(misses), r, max_fill, s - len(hit_slots), int(res_pre.credit[0]))
    if peek:
        credit = int(res_pre.credit[0])
    assert post["credit"] == [credit]

    assert n_hit == len(hits) and n_fill == q and n_cpu == len(misses) - q
    assert n_fill <= min(max_fill, len(misses))
    if misses and s > len(hit_slots) and r >= 1:  # fill-only: a fill whenever a slot can be evicted
        assert n_fill >= 1
    fills, victims = misses[:q], oldest[:q]  # the victims are the oldest non-hit slots
    assert fill_src == fills + [-1] * (max_fill - q)
    assert fill_dst == victims + [-1] * (max_fill - q)
    assert cpu_ids == misses[q:] + [-1] * (len(flat) - len(misses) + q)

    # residency: exactly the evictions, admissions, stamps and seen clocks of the step
    want = {f: list(pre[f]) for f in FIELDS}
    for e, v in zip(fills, victims):
        if pre["id_of"][v] >= 0:
            want["slot_of"][pre["id_of"][v]] = -1
    for e, v in zip(fills, victims):
        want["slot_of"][e], want["id_of"][v], want["stamp"][v] = v, e, clock
    for e in hits:
        want["stamp"][pre["slot_of"][e]] = clock  # hits refreshed
    for e in uniq if not peek else []:
        want["seen"][e] = clock
    want["clock"], want["credit"] = [clock], [credit]
    if policy == "lfu":
        want["score"], want["base"] = after.tolist(), [base]
    assert post == want
    held = [(i, e) for i, e in enumerate(post["id_of"]) if e >= 0]  # no slot holds two ids
    assert all(post["slot_of"][e] == i for i, e in held)
    assert sum(sl >= 0 for sl in post["slot_of"]) == len(held)

    # routes: every live pair runs on a slot holding its expert or on the CPU, nothing else
    for e, rt in zip(flat, route):
        if e < 0:
            assert rt == NO_EXPERT
        elif e in misses[q:]:
            assert rt == CPU
        else:
            assert rt >= 0 and post["id_of"][rt] == e
    assert {e for e, rt in zip(flat, route) if rt == CPU} == set(cpu_ids[:n_cpu])
    # the CPU branch's routes: the pair's id where it runs on the CPU, NO_EXPERT elsewhere
    assert out.cpu_route.reshape(-1).cpu().tolist() == [e if rt == CPU else NO_EXPERT for e, rt in zip(flat, route)]


# ---------------------------------------------------------------------------- kernel vs reference

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(0, 24, 4))
def test_kernel_equals_reference_fuzzed(policy, seed):
    """Consecutive calls (state carried) on fuzzed residency, routes, T 1-16, k 1-8, K, r;
    victim scan in one chunk or many, with tl.topk or the sort fallback."""
    for case in range(seed, seed + 4):
        g = torch.Generator().manual_seed(1000 * case + len(policy))
        layers = int(torch.randint(1, 4, (1,), generator=g))
        experts = int(torch.randint(8, 17, (1,), generator=g))
        n = layers * experts
        s = int(torch.randint(1, n + 5, (1,), generator=g))  # from one slot to more than N
        t = int(torch.randint(1, 17, (1,), generator=g))
        k = int(torch.randint(1, 9, (1,), generator=g))
        max_fill = int(torch.randint(1, min(t * k + 3, 24), (1,), generator=g))
        block_s = [None, 4, 16][case % 3]  # one chunk, or many
        topk = case % 2 == 0 or not hasattr(triton.language, "topk")
        ref = random_residency(g, n, s)
        got = to(ref, DEV)
        acc_a = torch.randint(0, 1000, (5,), generator=g)  # running statistics, not from zero
        acc_b = acc_a.clone().to(DEV)
        for call in range(3):
            ids, w = random_route(g, layers, experts, t, k, ref)
            r = SHARES[int(torch.randint(0, 4, (1,), generator=g))]
            peek = call == 2 and case % 2 == 1  # a lookahead step after a real one
            counted = case % 3 != 2 and not peek  # the cache counts its real calls in the same launch
            pre, before = ref.clone(), acc_a.clone()
            a = control_reference(ids, w, ref, share(r), max_fill, policy, peek=peek, acc=acc_a if counted else None)
            b = control_triton(ids, w, got, share(r), max_fill, policy, topk=topk, block_s=block_s, peek=peek,
                               acc=acc_b if counted else None)
            where = f"case {case} call {call}: n={n} s={s} t={t} k={k} K={max_fill} r={r} peek={peek}"
            assert same_out(a, b), where
            assert same_res(ref, got), where
            assert torch.equal(acc_a, acc_b.cpu()), where
            n_fill, n_cpu, n_hit = a.counts.tolist()
            live = int((ids >= 0).sum())
            assert (acc_a - before).tolist() == ([1, live, n_hit, n_fill, n_cpu] if counted else [0] * 5), where
            check_step(pre, ref, ids, w, a, max_fill, r, policy, peek)


def test_fill_share_is_kept_on_average():
    """q = (credit + m * r') // 1024, r' = r in 1/1024 (r clamped to [0, 1]), the remainder
    carried to the next call: fill-only fills every miss, r = 0 none, and over many calls with
    one or a few misses each the fills are the share of the misses (one miss a call at r = 0.3:
    about one call in three fills it; per-call rounding filled it every time). The reference
    over 40 calls per case; the kernel (slow under the interpreter) over a few, call for call."""
    for m in (1, 3, 5):
        for r in (0.0, 0.3, 0.5, 1.0, 1.5, -0.5):
            calls = 6 if (m, r) == (1, 0.3) else 40
            states = [(control_reference, Residency.empty(m * calls, 16 * calls, DEV))]
            if calls == 6:
                states.append((control_triton, Residency.empty(m * calls, 16 * calls, DEV)))
            credit, fills = 0, 0
            for call in range(calls):
                ids = torch.arange(call * m, (call + 1) * m, device=DEV)[:, None]  # m new misses
                w = torch.rand(m, 1).to(DEV) + 0.1
                q, credit = expected_q(m, r, 16, 16, credit)
                for impl, res in states:
                    got = impl(ids, w, res, share(r), 16, "gate").counts.tolist()
                    assert got == [q, m - q, 0] and int(res.credit[0]) == credit, (impl.__name__, m, r, call)
                fills += q
            rc = min(max(r, 0.0), 1.0)
            assert abs(fills - rc * m * calls) <= 1, (m, r, fills)
    # r = 0.3 with one miss a call: 0, 0, 0 (credit 921), then a fill (credit 205), ...
    assert [expected_q(1, 0.3, 16, 16, c)[0] for c in (0, 307, 614, 921)] == [0, 0, 0, 1]


def test_caps_full_pool_and_one_slot():
    """Misses with every slot holding a hit: no fill, all to the CPU; K and one slot cap q."""
    res = Residency.empty(10, 2, DEV)
    res.slot_of[[3, 7]] = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    res.id_of[[1, 0]] = torch.tensor([3, 7], dtype=torch.int32, device=DEV)
    ids = torch.tensor([[3, 7, 5], [7, 9, 3]], device=DEV)
    w = torch.rand(2, 3).to(DEV) + 0.1
    ref = res.clone()
    for impl, state in ((control_reference, ref), (control_triton, res)):
        out = impl(ids, w, state, share(1.0), 4, "recent")
        assert out.counts.tolist() == [0, 2, 2]
        assert out.route.tolist() == [[1, 0, CPU], [0, CPU, 1]]
        assert sorted(out.cpu_ids.tolist()[:2]) == [5, 9] and out.fill_src.tolist() == [-1] * 4
    one = Residency.empty(10, 1, DEV)
    for impl in (control_reference, control_triton):
        state = one.clone()
        out = impl(ids, w, state, share(1.0), 4, "gate")
        assert out.counts.tolist() == [1, 3, 0] and state.id_of.tolist() == [out.fill_src.tolist()[0]]


# ---------------------------------------------------------------------------- properties

@pytest.mark.parametrize("policy", POLICIES)
def test_no_expert_rows_touch_nothing(policy):
    """Rows that are not running change nothing: the same step with them removed gives the
    same residency and routes; a call with every row idle only advances the clock."""
    for case in range(3):
        g = torch.Generator().manual_seed(77 + case)
        res = random_residency(g, 24, 10)
        ids, w = random_route(g, 2, 12, 6, 3, res)
        dead = torch.tensor([True, False, True, False, False, True], device=DEV)
        ids[dead] = NO_EXPERT
        for impl in (control_reference, control_triton):
            full, live = res.clone(), res.clone()
            a = impl(ids, w, full, share(0.5), 8, policy)
            b = impl(ids[~dead], w[~dead], live, share(0.5), 8, policy)
            assert same_res(full, live)
            assert torch.equal(a.route[~dead], b.route) and bool((a.route[dead] == NO_EXPERT).all())
            assert torch.equal(a.fill_src, b.fill_src) and torch.equal(a.fill_dst, b.fill_dst)
            assert torch.equal(a.counts, b.counts)
            idle = res.clone()
            c = impl(torch.full_like(ids, NO_EXPERT), w, idle, share(0.5), 8, policy)
            assert c.counts.tolist() == [0, 0, 0] and bool((c.route == NO_EXPERT).all())
            assert bool((c.fill_src == -1).all() and (c.cpu_ids == -1).all())
            for f in ("slot_of", "id_of", "stamp", "seen"):
                assert torch.equal(getattr(idle, f), getattr(res, f))
            assert int(idle.clock) == int(res.clock) + 1


def test_hit_only_call_changes_only_stamps():
    for case in range(3):
        g = torch.Generator().manual_seed(300 + case)
        res = random_residency(g, 20, 20)
        while int((res.slot_of >= 0).sum()) < 2:  # at least two resident experts
            res = random_residency(g, 20, 20)
        resident = (res.slot_of >= 0).nonzero()[:, 0].cpu()
        ids = resident[torch.randint(0, resident.numel(), (5, 2), generator=g)].to(DEV)
        w = torch.rand(5, 2, generator=g).to(DEV) + 0.1
        for impl in (control_reference, control_triton):
            state = res.clone()
            out = impl(ids, w, state, share(1.0), 6, "recent")
            clock = int(res.clock) + 1
            assert out.counts.tolist() == [0, 0, ids.unique().numel()]
            assert torch.equal(state.slot_of, res.slot_of) and torch.equal(state.id_of, res.id_of)
            hit_slots = res.slot_of[ids.unique()].long()
            assert bool((state.stamp[hit_slots] == clock).all())
            other = torch.ones(20, dtype=torch.bool, device=DEV)
            other[hit_slots] = False
            assert torch.equal(state.stamp[other], res.stamp[other])
            assert torch.equal(out.route, res.slot_of[ids])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("r", SHARES)
def test_end_to_end_slots_plus_cpu_equal_all_resident(policy, r):
    """Fills copied into slot banks, routed pairs computed from slot banks (route >= 0) and
    from the host banks (route == CPU): exactly the all-resident output, step after step."""
    g = torch.Generator().manual_seed(int(r * 10) + 31 * len(policy))
    layers, experts, h, inter, s, t, k = 3, 8, 16, 8, 9, 4, 3
    n = layers * experts
    host_gu = torch.randn(n, 2 * inter, h, generator=g, dtype=torch.float64).to(DEV)
    host_dn = torch.randn(n, h, inter, generator=g, dtype=torch.float64).to(DEV)
    res = random_residency(g, n, s)
    slot_gu = torch.randn(s, 2 * inter, h, generator=g, dtype=torch.float64).to(DEV)  # free: garbage
    slot_dn = torch.randn(s, h, inter, generator=g, dtype=torch.float64).to(DEV)
    held = (res.id_of >= 0).nonzero()[:, 0]
    slot_gu[held], slot_dn[held] = host_gu[res.id_of[held].long()], host_dn[res.id_of[held].long()]
    for call in range(4):
        ids, w = random_route(g, layers, experts, t, k, res)
        ids = ids.long()
        w = w.double()
        x = torch.randn(t, h, generator=g, dtype=torch.float64).to(DEV)
        out = control(ids, w, res, share(r), 6, policy) if DEV == "cuda" else \
            control_triton(ids, w, res, share(r), 6, policy)
        copy = out.fill_dst >= 0  # the fused transfer: masked src/dst lists, every bank
        assert int(copy.sum()) == int(out.n_fill)
        slot_gu[out.fill_dst[copy].long()] = host_gu[out.fill_src[copy].long()]
        slot_dn[out.fill_dst[copy].long()] = host_dn[out.fill_src[copy].long()]

        # one pair per row: every pair's contribution, then each token's k in a fixed order
        xr, flat, wr = x.repeat_interleave(k, 0), ids.reshape(-1, 1), w.reshape(-1, 1)
        route = out.route.reshape(-1, 1).long()
        on_gpu = reference_experts(xr, torch.where(route >= 0, route, NO_EXPERT), wr, slot_gu, slot_dn)
        on_cpu = reference_experts(xr, torch.where(route == CPU, flat, NO_EXPERT), wr, host_gu, host_dn)
        resident = reference_experts(xr, flat, wr, host_gu, host_dn)
        got = (on_gpu + on_cpu).view(t, k, h).sum(1)
        assert torch.equal(got, resident.view(t, k, h).sum(1))
        assert torch.allclose(got, reference_experts(x, ids, w, host_gu, host_dn), rtol=1e-12, atol=1e-12)
        held = (res.id_of >= 0).nonzero()[:, 0]  # every held slot holds its expert's weights
        assert torch.equal(slot_gu[held], host_gu[res.id_of[held].long()])
        assert torch.equal(slot_dn[held], host_dn[res.id_of[held].long()])


@pytest.mark.parametrize("policy,calls", [(p, ((257, 1), (65, 4), (52, 5))) for p in POLICIES]
                         + [("lfu", ((1025, 1),))])
def test_kernel_large_buckets(policy, calls):
    """The kernel at the prefill buckets (257-260 pairs: P_PAD 1,024; 1,025: 4,096, 16 warps on a
    GPU), its fill list padded as the cache pads it (fill_pad), equals the reference on every
    output and the residency: one layer's experts, state carried, the third call a peek. (The
    interpreter takes ~15 s a 4,096-pair call: one.)"""
    g = torch.Generator().manual_seed(90 + len(policy) + len(calls))
    layers, experts, s = 2, 64, 48
    ref = random_residency(g, layers * experts, s)
    got = to(ref, DEV)
    for call, (t, k) in enumerate(calls):
        ids, w = random_route(g, layers, experts, t, k, ref)
        r, peek = share(SHARES[call % 4]), call == 2
        cap, pad = fill_cap(t * k, experts, s), fill_pad(t * k, experts, s)
        a = control_reference(ids, w, ref, r, cap, policy, peek=peek)
        b = control_triton(ids, w, got, r, cap, policy, k_pad=pad, peek=peek)
        assert same_out(a, b) and same_res(ref, got), f"call {call}: t={t} k={k}"


def test_control_dispatch_and_buffers_reused():
    """control() takes the reference for CPU tensors (the kernel on CUDA); `out` buffers
    holding stale values are overwritten entirely, in place."""
    g = torch.Generator().manual_seed(5)
    res = random_residency(g, 16, 6)
    ids, w = random_route(g, 2, 8, 3, 2, res)
    want = control_reference(ids, w, res.clone(), share(0.5), 4, "gate")
    for impl in (control_reference, control_triton):
        out = ControlOut.empty(3, 2, 4, DEV)
        for f in ("route", "fill_src", "fill_dst", "cpu_ids", "counts"):
            getattr(out, f).fill_(7)
        assert impl(ids, w, res.clone(), share(0.5), 4, "gate", out=out) is out
        assert same_out(out, want)
    assert same_out(control(ids, w, res.clone(), share(0.5), 4, "gate"), want)
    with pytest.raises(AssertionError):
        control(ids, w, res, share(0.5), 4, "clairvoyant")  # not a policy


def _compiled_variants(kernel) -> int:
    """Compiled variants of a Triton kernel across devices (Triton 3.x keeps one cache per device)."""
    caches = getattr(kernel, "device_caches", None) or {}
    return sum(len(c[0]) for c in caches.values())


def test_warm_up_compiles_every_prefill_call_size_in_advance():
    """The control kernel's prefill variants are compiled at load (warm_up_control): one per
    pair bucket (16, 64, 256, ...), on a scratch residency, the fill list padded as the cache
    pads it (fill_pad). On the GPU, calls of any pair count up to the bound then compile
    nothing more: before, the fill count was a compile-time constant and every prompt size
    compiled its own variant inside a request. Under the interpreter nothing compiles; the calls
    must still run and leave a real residency's invariants as the reference does."""
    from freetoken.experts.control import _control_kernel, warm_up_control
    layers, experts, s = 3, 32, 40
    n = layers * experts
    assert warm_up_control(n, s, DEV, "recent", torch.bfloat16, max_pairs=128,
                           layer_experts=experts) == [16, 64, 256]
    before = _compiled_variants(_control_kernel)
    g = torch.Generator().manual_seed(21)
    res, ref = Residency.empty(n, s, DEV), Residency.empty(n, s, "cpu")
    # with a statistics accumulator, as the cache calls it (and warm_up_control warms): a call
    # without one is another variant (ACC), which plan 91 compiled here on the H100 (176 == 173)
    acc, acc_ref = torch.zeros(5, dtype=torch.int64, device=DEV), torch.zeros(5, dtype=torch.int64)
    for pairs in (3, 12, 13, 31, 50, 64, 100, 128):  # bf16 gate weights, as a bf16 model's router gives them
        base = int(torch.randint(0, layers, (1,), generator=g)) * experts  # one layer's experts per call
        ids = base + torch.randint(0, experts, (pairs, 1), generator=g)
        w = torch.rand(pairs, 1, generator=g).to(torch.bfloat16)
        one, k, pad = torch.ones(1), fill_cap(pairs, experts, s), fill_pad(pairs, experts, s)
        a = control_triton(ids.to(DEV), w.to(DEV), res, one.to(DEV), k, "recent", k_pad=pad, acc=acc)
        b = control_reference(ids, w, ref, one, k, "recent", acc=acc_ref)
        assert same_out(to_cpu(a), b) and same_res(to(res, "cpu"), ref), pairs
        assert torch.equal(acc.cpu(), acc_ref), pairs
    if DEV == "cuda":
        assert _compiled_variants(_control_kernel) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_fill_cap_changes_no_output(policy):  # the reference's reasoning; the kernel: test_kernel_large_buckets
    """K = fill_cap(pairs, experts per layer, slots) fills exactly what K = pairs fills: a call's
    distinct misses are one layer's experts at most, and no call fills more than the pool's slots.
    Consecutive calls of one-layer routes, state carried, at every fill share; the fills compared
    as their first n_fill entries (the lists' lengths differ)."""
    assert fill_cap(4096, 256, 2048) == 256 and fill_cap(6, 256, 2048) == 6 and fill_cap(4096, None, 100) == 100
    # the static size: one per pair bucket (16, 64, 256, ...), within the layer's experts and the slots
    assert fill_pad(6, 256, 2048) == 16 and fill_pad(17, 256, 2048) == 64 and fill_pad(4096, 256, 2048) == 256
    assert fill_pad(2, 8, 2048) == 8 and fill_pad(3000, 256, 100) == 128
    for case in range(6):
        g = torch.Generator().manual_seed(70 + case)
        layers, experts = 3, int(torch.randint(4, 13, (1,), generator=g))
        n = layers * experts
        s = int(torch.randint(1, n + 3, (1,), generator=g))
        wide = Residency.empty(n, s, "cpu") if case % 2 == 0 else to(random_residency(g, n, s), "cpu")  # on CUDA it comes on DEV
        narrow = wide.clone()
        for call in range(4):
            t, k = int(torch.randint(1, 17, (1,), generator=g)), int(torch.randint(1, min(8, experts) + 1, (1,), generator=g))
            ids, w = (x.cpu() for x in random_route(g, layers, experts, t, k, wide))  # the residencies' device
            r = share(SHARES[int(torch.randint(0, 4, (1,), generator=g))], "cpu")
            if call == 0:  # every expert of a layer routed, fill-only: the call fills min(experts, slots)
                ids = (torch.arange(experts) + experts * (case % layers)).view(experts, 1)  # [T, 1]
                t, k, w, r = experts, 1, torch.rand(experts, 1, generator=g), share(1.0, "cpu")
            cap = fill_cap(t * k, experts, s)
            a = control_reference(ids, w, wide, r, t * k, policy)
            b = control_reference(ids, w, narrow, r, cap, policy)
            where = f"case {case} call {call}: n={n} s={s} t={t} k={k} cap={cap}"
            q = int(a.counts[0])
            assert int(b.counts[0]) == q and torch.equal(a.counts, b.counts), where
            assert torch.equal(a.route, b.route) and torch.equal(a.cpu_ids, b.cpu_ids), where
            assert torch.equal(a.fill_src[:q], b.fill_src[:q]) and torch.equal(a.fill_dst[:q], b.fill_dst[:q]), where
            assert same_res(wide, narrow), where
