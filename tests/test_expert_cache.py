"""The GPU expert cache's executor (slots that follow the router, misses filled or run on the
CPU): its output equals the all-resident experts' for any residency, fill share and policy,
and a model served through it equals transformers. On the CPU the slots are host memory: the
same control, transfers and merge, checked here; the GPU machine runs the CUDA path."""
import pytest
import torch

import hf_models
from drive import drive
from freetoken.cache.config import CacheConfig
from freetoken.experts.cached import CachedExpertExecutor
from freetoken.experts.cpu import CpuExpertExecutor
from freetoken.experts.executor import NO_EXPERT, reference_experts
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert


def banks(n, h, i, seed):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, 2 * i, h, generator=g) * h ** -0.5), (torch.randn(n, h, i, generator=g) * i ** -0.5))


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("policy", ["recent", "gate", "lfu"])
@pytest.mark.parametrize("slots", [3, 12, 64])
def test_cached_output_equals_all_resident(share, policy, slots):
    layers, e, h, i, k = 3, 16, 48, 24, 4
    gu, dn = banks(layers * e, h, i, seed=slots)
    ex = CachedExpertExecutor(gu, dn, slots, "cpu", torch.float32, CpuExpertExecutor(gu, dn), share, policy)
    g = torch.Generator().manual_seed(7)
    for step in range(12):  # decode steps across layers, a prefill chunk now and then
        layer = step % layers
        t = 37 if step % 5 == 4 else 1 + step % 4
        phase = "prefill" if t > 8 else "decode"
        x = torch.randn(t, h, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) + layer * e
        if phase == "decode" and t > 1:
            ids[0] = NO_EXPERT  # an idle batch row
        w = torch.softmax(torch.randn(t, k, generator=g), -1)
        got = ex(x, ids, w, phase=phase)
        ref = reference_experts(x, ids, w, gu, dn)
        assert rel(got, ref) < 1e-5, (step, phase)
        if phase == "decode" and t > 1:
            assert float(got[0].abs().max()) == 0.0
    st = ex.stats()
    assert st["slots"] == min(slots, layers * e) and 0 < st["slots_used"] <= st["slots"]
    assert st["fills"] > 0 and st["bytes_moved"] == st["fills"] * ex.pool.slot_bytes
    if slots >= k and share > 0:  # one route, again and again: the misses are filled, then all hit
        x, ids, w = torch.randn(1, h, generator=g), torch.arange(k)[None] + e, torch.full((1, k), 1 / k)
        for _ in range(k):
            ex(x, ids, w)
        before = ex.stats()["hits"]
        ex(x, ids, w)
        assert ex.stats()["hits"] == before + k
    if share == 0.0:  # decode misses all on the CPU (the prefill chunks still fill)
        assert st["cpu_experts"] > 0
        before = ex.stats()["fills"]
        ex(torch.randn(1, h, generator=g), torch.arange(k)[None] + 2 * e, torch.full((1, k), 1 / k))
        assert ex.stats()["fills"] == before


def test_cpu_share_is_joined_at_finish_and_slices_one_by_one(monkeypatch):
    """The split phase: a decode call's launch enqueues the control step, the fills and the GPU
    experts and leaves the CPU branch's join and the merge to finish, so the MoE block's shared
    expert runs in between (model/moe.py). A call of several slices (more pairs than one
    control call takes) joins each slice's CPU branch before the next starts: they share its
    buffers and, on CUDA, its one doorbell."""
    import freetoken.experts.cached as cached
    layers, e, h, i, k = 2, 16, 32, 16, 4
    gu, dn = banks(layers * e, h, i, seed=9)
    cpu = CpuExpertExecutor(gu, dn)
    ex = CachedExpertExecutor(gu, dn, 6, "cpu", torch.float32, cpu, 0.0, "recent")  # every miss on the CPU
    events = []
    real_launch = cpu.launch
    monkeypatch.setattr(cpu, "launch", lambda *a, **kw: events.append("cpu") or real_launch(*a, **kw))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, h, generator=g), torch.softmax(torch.randn(2, k, generator=g), -1)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(2)])
    pending = ex.launch(x, ids, w, phase="decode")
    assert events == [] and pending.join is not None  # the CPU share waits for finish
    got = ex.finish(pending)
    assert events == ["cpu"] and rel(got, reference_experts(x, ids, w, gu, dn)) < 1e-5
    events.clear()
    monkeypatch.setattr(cached, "MAX_PAIRS", 2 * k)  # slices of two tokens
    x5, w5 = torch.randn(5, h, generator=g), torch.softmax(torch.randn(5, k, generator=g), -1)
    ids5 = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(5)]) + e
    real_call = ex._call
    monkeypatch.setattr(ex, "_call", lambda *a, **kw: events.append("slice") or real_call(*a, **kw))
    pending = ex.launch(x5, ids5, w5, phase="decode")
    assert pending.join is None and events == ["slice", "cpu"] * 3  # three slices, each joined before the next
    assert rel(ex.finish(pending), reference_experts(x5, ids5, w5, gu, dn)) < 1e-5


@pytest.mark.parametrize("policy", ["recent", "lfu"])
def test_lookahead_prefetch_is_exact_and_its_right_guesses_hit(policy):
    """A decode call hands the next layer's predicted routes over (`ahead`): up to `prefetch` of
    the predicted misses are copied in after this call's experts have read their slots. Outputs
    stay exact whatever the prediction (right, partly wrong, idle rows); a right one turns the
    next layer's misses into hits, and the counters say how many prefetched experts were used."""
    layers, e, h, i, k, slots = 3, 16, 48, 24, 4, 10
    gu, dn = banks(layers * e, h, i, seed=5)
    ex = CachedExpertExecutor(gu, dn, slots, "cpu", torch.float32, CpuExpertExecutor(gu, dn), 0.5, policy, prefetch=3)
    plain = CachedExpertExecutor(gu, dn, slots, "cpu", torch.float32, CpuExpertExecutor(gu, dn), 0.5, policy)
    g = torch.Generator().manual_seed(11)
    t = 2
    routes = [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) + (s % layers) * e for s in range(13)]
    hits_gained = 0
    for s in range(12):
        x = torch.randn(t, h, generator=g)
        w = torch.softmax(torch.randn(t, k, generator=g), -1)
        nxt = routes[s + 1].clone()
        if s % 3 == 2:  # a partly wrong guess: other experts of the right layer
            nxt[0] = torch.randperm(e, generator=g)[:k] + ((s + 1) % layers) * e
        if s % 4 == 3:
            nxt[1] = NO_EXPERT  # an idle row predicts nothing
        ahead = None if (s + 1) % layers == 0 else (nxt, torch.softmax(torch.randn(t, k, generator=g), -1))
        before = ex.stats()["hits"], plain.stats()["hits"]
        got = ex.finish(ex.launch(x, routes[s], w, ahead=ahead))
        ref = reference_experts(x, routes[s], w, gu, dn)
        assert rel(got, ref) < 1e-5, s
        assert rel(plain(x, routes[s], w), ref) < 1e-5
        hits_gained += (ex.stats()["hits"] - before[0]) - (plain.stats()["hits"] - before[1])
    st = ex.stats()
    assert st["prefetch"] == 3 and 0 < st["prefetched"] <= 3 * 12
    assert 0 < st["prefetch_used"] <= st["prefetched"] and st["prefetch_accuracy"] > 0.5
    assert hits_gained > 0  # the right guesses were hits in the next layer
    assert st["slots_used"] <= slots and st["bytes_moved"] == (st["fills"] + st["prefetched"]) * ex.pool.slot_bytes
    assert st["hit_rate"] == round(st["hits"] / (st["hits"] + st["fills"] + st["cpu_experts"]), 4)
    with pytest.raises(ValueError, match="prefetch"):
        CachedExpertExecutor(gu, dn, slots, "cpu", torch.float32, CpuExpertExecutor(gu, dn), 0.5, prefetch=-1)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_model_served_through_the_cache_equals_transformers(tmp_path, prefetch):
    """Served through the cache, without and with the lookahead: exact either way."""
    model = hf_models.qwen3_5(23, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)
    hf_models.save(model, str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    # room for 10 of the 64 experts: most steps miss, fills evict, a share runs on the CPU
    eng = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", moe="cache", fill_share=0.5,
                                                       prefill_chunk=16, expert_prefetch=prefetch))
    assert eng.experts_on == "cache" and eng.describe()["expert_backend"] == "gpu-cache"
    assert eng.executor.warm_control  # the control kernel's call sizes compiled at allocate (on CUDA)
    if prefetch == 0:  # --no-warm-up skips that too
        cold = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", moe="cache", warm_up=False))
        assert cold.executor.warm_control is False
    slot = eng.executor.slot_bytes
    srv = ServingEngine(eng, max_batch=2, max_queue=4, start=False, record_logits=True,
                        cache=CacheConfig(enabled=False))
    assert srv.plan.expert_slots == 4 * 16  # the plan's default: every expert when they fit
    ex = eng.executor
    ex.pool = None
    ex.allocate(10)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (21, 9)]
    reqs = drive(srv, [Request(p, SamplingOptions(temperature=0, max_tokens=8, ignore_eos=True)) for p in prompts],
                 arrive=[0, 2])
    hf_models.assert_served_like(model, prompts, reqs)
    st = ex.stats()
    assert st["fills"] > 10 and st["cpu_experts"] > 0 and st["slots_used"] == 10
    assert slot * 10 == ex.pool.slot_bytes * 10
    if prefetch:  # the model's next-layer routers predicted routes, and the cache copied some in
        assert st["prefetched"] > 0 and 0 <= st["prefetch_used"] <= st["prefetched"]
        assert all(m.ahead for m in (layer[1] for layer in eng.model.layers[:-1]))


def test_plan_sizes_the_cache(tmp_path):
    from freetoken.errors import FreeTokenError
    hf_models.save(hf_models.qwen3_5(24, num_hidden_layers=2), str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    eng = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", moe="cache",
                                                       expert_cache=str(40 * 1024)))
    srv = ServingEngine(eng, max_batch=1, start=False)
    slot = eng.executor.slot_bytes
    assert srv.plan.expert_slots == 40 * 1024 // slot and srv.plan.expert_cache == srv.plan.expert_slots * slot
    assert eng.executor.pool.slots == srv.plan.expert_slots and "expert cache" in srv.plan.summary()
    with pytest.raises(FreeTokenError, match="--expert-cache"):
        eng2 = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", moe="cache",
                                                            expert_cache="10"))
        ServingEngine(eng2, max_batch=1, start=False)
    with pytest.raises(FreeTokenError, match="contradicts"):
        EngineConfig(moe="cache", experts="gpu")


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)])
def test_fused_transfer_equals_reference(dtypes):
    """The fused transfer kernel (Triton; the interpreter on the CPU) copies exactly the listed
    experts, every bank, and stops at the first -1 of the fill list; rows not listed stay."""
    pytest.importorskip("triton")
    from freetoken.kernels.expert_transfer import transfer_reference, transfer_triton
    host_dt, slot_dt = dtypes
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(11)
    n, s, h, i = 20, 7, 40, 24  # rows of 1920 and 960 elements: partial last blocks
    host = [torch.randn(n, 2 * i, h, generator=g).to(host_dt), torch.randn(n, h, i, generator=g).to(host_dt)]
    if dev == "cuda":
        host = [t.pin_memory() for t in host]
    fill_src = torch.tensor([5, 17, 0, -1, -1], dtype=torch.int32, device=dev)
    fill_dst = torch.tensor([6, 1, 3, -1, -1], dtype=torch.int32, device=dev)
    first = [torch.randn(s, *t.shape[1:], generator=g).to(dev, slot_dt) for t in host]
    slots = [first, [t.clone() for t in first]]
    transfer_triton(host, slots[0], fill_src, fill_dst)
    assert transfer_reference(host, slots[1], fill_src, fill_dst) == 3
    for got, ref, hb in zip(slots[0], slots[1], host):
        assert torch.equal(got, ref)
        assert torch.equal(got[6].cpu(), hb[5].to(slot_dt)) and torch.equal(got[1].cpu(), hb[17].to(slot_dt))


def test_fill_only_runs_nothing_on_the_cpu():
    """r = 1 with a pool that holds a call's distinct experts: no pair reaches the CPU executor
    (the step can then be captured in a CUDA graph), and the output is still exact."""
    layers, e, h, i, k = 2, 16, 32, 16, 4

    class NoCpu(CpuExpertExecutor):
        def launch(self, *a, **kw):
            raise AssertionError("the CPU branch ran in fill-only mode")

    gu, dn = banks(layers * e, h, i, seed=5)
    ex = CachedExpertExecutor(gu, dn, 8, "cpu", torch.float32, NoCpu(gu, dn), 1.0, "recent", layer_experts=e)
    g = torch.Generator().manual_seed(2)
    for step in range(10):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(2)]) + (step % layers) * e
        x, w = torch.randn(2, h, generator=g), torch.softmax(torch.randn(2, k, generator=g), -1)
        assert rel(ex(x, ids, w), reference_experts(x, ids, w, gu, dn)) < 1e-5
    st = ex.stats()
    assert st["cpu_experts"] == 0 and st["calls"] == 10 and st["pairs"] == 80
    assert st["hits"] + st["fills"] > 0 and 0 <= st["hit_rate"] <= 1


def test_share_tuner_finds_the_fastest_split():
    """The adaptive split climbs from fill-only to the fastest r of measured step times (noisy,
    with a transient after each change) and holds it; each batch size climbs on its own, even
    when sizes interleave as continuous batching makes them; it re-checks after the hold."""
    import random
    from freetoken.experts.share import ShareTuner
    rng = random.Random(0)
    costs = {1: {1.0: 10.0, 0.9: 9.0, 0.8: 8.5, 0.7: 8.9, 0.6: 9.5, 0.5: 11.0},  # ms per step, best 0.8
             4: {1.0: 30.0, 0.9: 31.0, 0.8: 33.0, 0.7: 35.0, 0.6: 36.0, 0.5: 40.0}}  # best 1.0
    t = ShareTuner(probe=20, settle=5, hold=400)
    r, since = 1.0, 0
    for step in range(1200):
        batch = 1 if (step // 7) % 3 else 4  # sizes alternate in runs of 7 steps
        ms = costs[batch][r] * (1 + 0.01 * rng.random()) + (30.0 if since < 3 else 0.0)  # cache transient
        new = t.observe(batch, ms / 1e3)
        since += 1
        if new is not None:
            r, since = new, 0
        if all(b in t.climbs and not t.climbs[b].climbing for b in (1, 4)):
            break
    assert t.cands[t.climbs[1].cur] == 0.8 and t.cands[t.climbs[4].cur] == 1.0
    t.observe(4, 0.030)  # a batch-4 step (at 1.0), then
    assert t.observe(1, 0.0085) == 0.8  # back at batch 1: its own r for the next step
    plateau = ShareTuner(probe=10, settle=2, hold=10_000)  # 0.9 ties fill-only; 0.8 is faster
    for _ in range(200):
        plateau.observe(1, {1.0: 0.010, 0.9: 0.010, 0.8: 0.0085}.get(plateau.share, 0.012))
    assert plateau.share == 0.8 and not plateau.climbing
    # each probe recorded: fill-only, the tie at 0.9, 0.8, then 0.7 (slower) and one more before
    # stopping; then the confirmation round: 0.8's neighbour 0.9 and 0.8 again (0.7, 41% slower
    # than 0.8, over FAR, is not probed again)
    assert [(b, r) for b, r, _ in plateau.history] == [(1, 1.0), (1, 0.9), (1, 0.8), (1, 0.7), (1, 0.6),
                                                       (1, 0.9), (1, 0.8)]
    # one unlucky probe at the fastest r (0.7 first measures 8.7 ms, slower than 0.8's 8.5) stops
    # the climb past it; the confirmation round measures it again (7.6, beating 8.5 by more than
    # the margin) and keeps it
    visits = {}
    noisy = ShareTuner(probe=10, settle=2, hold=10_000)
    for _ in range(200):
        r = noisy.share
        first = visits.setdefault(r, len(noisy.history)) == len(noisy.history)
        ms = {1.0: 10.0, 0.9: 9.0, 0.8: 8.5, 0.7: 8.7 if first else 7.6}.get(r, 9.5)
        noisy.observe(1, ms / 1e3)
    assert noisy.share == 0.7 and not noisy.climbing
    # contention in the confirmation round (the H200 with a host-memory hog beside it: 0.5 probed
    # 7.05 ms in the climb, 10.28 in the confirmation; 0.4 7.30 and 7.53): slow probes say less
    # than fast ones, r stays at 0.5 (a mean of each candidate's probes moved it to 0.4)
    probes = {1.0: [9.0], 0.6: [8.0], 0.5: [7.05, 10.28], 0.4: [7.30, 7.53], 0.3: [7.7]}
    hog = ShareTuner(probe=10, settle=2, hold=10_000, start=0.5)
    while hog.climbing:
        r = hog.share
        k = sum(rr == r for _, rr, _ in hog.history)  # this candidate's probes so far
        hog.observe(1, probes[r][min(k, len(probes[r]) - 1)] / 1e3)
    assert [r for _, r, _ in hog.history] == [0.6, 0.5, 0.4, 0.3, 0.6, 0.4, 0.5]
    assert hog.share == 0.5
    slow = ShareTuner(probe=10, settle=2, hold=5)  # the CPU never helps: stays fill-only
    # a climb with its confirmation round (4 probes of 10 steps: 0.9, twice fill-only's step, is
    # not probed again), the hold (4x the climb's 40 steps, over hold=5), then the re-check's climb
    for _ in range(320):
        slow.observe(1, 0.010 if slow.share == 1.0 else 0.020)
    assert slow.decisions >= 2 and slow.climbs[1].cur in (0, 1)
    for _ in range(12):  # whatever the re-check probes, it comes back to fill-only
        slow.observe(1, 0.010 if slow.share == 1.0 else 0.020)
    assert slow.share == 1.0 or slow.climbs[1].climbing


def test_share_tuner_does_not_probe_a_far_slower_neighbour_again():
    """The confirmation round skips a neighbour of the best measured over FAR slower: plan 83's
    step times (H100, 14 threads, a memory hog on 4 of the CPU branch's cores: fill-only 12.2 ms,
    r = 0.9 34.1, 0.8 31.3) made the climb 1.0, 0.9, 0.8, 0.9, 1.0 (three probes at 2.6-2.9x
    fill-only's step); now 1.0, 0.9, 0.8, 1.0, at the first climb and at each periodic re-check.
    The climb itself keeps its patience past a far slower probe: the H200's 14-thread climb (its
    first CPU-branch probe, 0.9, 66% over fill-only, then faster and faster) still reaches 0.5."""
    import random
    from freetoken.experts.share import PROBE, ShareTuner
    ms = {1.0: 12.2, 0.9: 34.1, 0.8: 31.3, 0.7: 35.0}
    rng = random.Random(5)
    t = ShareTuner(hold=2048)
    slow_steps = 0
    for _ in range(3 * 2048):
        slow_steps += t.share < 1.0
        t.observe(1, ms.get(t.share, 40.0) * (1 + 0.1 * (2 * rng.random() - 1)) / 1e3)
    assert [r for _, r, _ in t.history][:4] == [1.0, 0.9, 0.8, 1.0]
    assert t.share == 1.0 and t.decisions >= 3
    assert slow_steps <= 2 * t.decisions * PROBE, (slow_steps, t.decisions)  # two slow probes a climb, not three
    old = ShareTuner(hold=10**6, far=float("inf"))  # FAR off: the climb as it was
    while old.climbing:
        old.observe(1, ms.get(old.share, 40.0) / 1e3)
    assert [r for _, r, _ in old.history] == [1.0, 0.9, 0.8, 0.9, 1.0]
    # expert_cache-llamacpp-gpu.json's probes (H200, 14 threads): one far slower probe, then the best
    h200 = {1.0: 9.75, 0.9: 16.18, 0.8: 8.1, 0.7: 7.45, 0.6: 6.78, 0.5: 5.99, 0.4: 5.89, 0.3: 6.07, 0.2: 6.5, 0.1: 7.0}
    climb = ShareTuner(hold=10**6)
    while climb.climbing:
        climb.observe(1, h200[climb.share] / 1e3)
    assert climb.share in (0.5, 0.4)


def test_plan_reserves_a_prefill_pass():
    """The memory plan keeps room for a streamed prefill pass before sizing the expert cache and
    the KV pool, at most a tenth of what the fixed parts leave; without it nothing changes."""
    from freetoken.config import ModelConfig
    from freetoken.runtime.budget import plan_memory
    cfg = ModelConfig.from_hf(hf_models.qwen3_5(1, num_hidden_layers=2).config.to_dict())
    args = dict(cfg=cfg, device=torch.device("cpu"), dtype=torch.float32, budget=1 << 30, weights=100 << 20,
                slots=2, max_len=4096, chunk=256, page_size=16, checkpoint_slots=0, expert_slot_bytes=1 << 20,
                num_experts=10_000)
    base = plan_memory(**args)
    small = plan_memory(**args, prefill_pass=8 << 20)
    assert base.prefill_pass == 0 and small.prefill_pass == 8 << 20 and "prefill pass" in small.summary()
    assert small.expert_slots < base.expert_slots  # the pass's room comes out of the cache's
    huge = plan_memory(**args, prefill_pass=1 << 40)
    fixed = base.weights + base.work + base.state + base.checkpoints
    assert huge.prefill_pass == ((1 << 30) - fixed) // 10 and huge.kv_pages >= 2


def test_share_tuner_starts_from_a_prediction():
    """With a predicted r (a bandwidth profile), the climb starts one candidate above it."""
    from freetoken.experts.share import ShareTuner
    t = ShareTuner(probe=4, settle=1, start=0.8)
    assert t.share == 1.0 and t.observe(1, 0.01) == 0.9  # the first step ran at 1: move to the start
    assert ShareTuner(start=1.0).start == 0 and ShareTuner(start=0.0).start == len(ShareTuner().cands) - 2


def test_share_tuner_goes_back_up_from_a_low_prediction():
    """A prediction below the best r: the climb starts one candidate above it and only steps
    down, so the confirmation round probes the best's upper neighbour although the climb never
    did, and keeps it when it is faster."""
    from freetoken.experts.share import ShareTuner
    cost = {1.0: 10.0, 0.9: 9.0, 0.8: 8.0, 0.7: 8.6, 0.6: 9.0, 0.5: 9.5, 0.4: 10.0}
    t = ShareTuner(probe=10, settle=2, hold=10_000, start=0.6)
    while t.climbing:
        t.observe(1, cost[t.share] / 1e3)
    assert [r for _, r, _ in t.history] == [0.7, 0.6, 0.5, 0.8, 0.6, 0.7]
    assert t.share == 0.8


def test_share_tuner_probes_noisy_steps_longer():
    """Step times that swing by +-30% from step to step (replayed routing: each token misses a
    different number of experts) with candidates 4-5% apart: probes extended until their medians
    can be ranked land within 5% of the best r on every seed; fixed 24-step probes do not."""
    import random
    from freetoken.experts.share import ShareTuner
    cost = {1.0: 10.0, 0.9: 9.6, 0.8: 9.2, 0.7: 8.8, 0.6: 8.4, 0.5: 8.0, 0.4: 8.5, 0.3: 9.0, 0.2: 9.5, 0.1: 10.0}

    def chosen(extend: int, seed: int) -> float:
        rng = random.Random(seed)
        t = ShareTuner(hold=1_000_000, extend=extend)
        for _ in range(20_000):
            t.observe(1, cost[t.share] * (1 + 0.3 * (2 * rng.random() - 1)) / 1e3)
            if not t.climbing:
                return t.share
        raise AssertionError("the climb did not end")
    seeds = range(8)
    assert all(cost[chosen(8, s)] <= 1.05 * 8.0 for s in seeds)
    assert any(cost[chosen(1, s)] > 1.05 * 8.0 for s in seeds)


def test_share_tuner_ends_probes_of_clearly_slower_candidates_early():
    """Step times swinging +-30% (as GLM-5's 12-layer slice on the H200: a tie at r=0.6/0.7,
    0.5 12% slower, 0.4 34% slower): a probe whose median is already further from the best's
    plus the margin and two standard errors ends there instead of running its full extension,
    so the split is decided in far fewer steps, on the same r, on every seed."""
    import random
    from freetoken.experts import share as share_mod
    from freetoken.experts.share import ShareTuner
    cost = {1.0: 30.0, 0.9: 26.0, 0.8: 23.0, 0.7: 20.57, 0.6: 20.54, 0.5: 23.05, 0.4: 27.5, 0.3: 31.0,
            0.2: 35.0, 0.1: 40.0}

    def run(seed: int) -> tuple[float, int, dict]:
        rng = random.Random(seed)
        t = ShareTuner(hold=1_000_000, start=0.561)
        steps, per = 0, {}
        while t.climbing:
            r = t.share
            per[r] = per.get(r, 0) + 1
            t.observe(1, cost[r] * (1 + 0.3 * (2 * rng.random() - 1)) / 1e3)
            steps += 1
            assert steps < 20_000
        return t.share, steps, per
    seeds = range(8)
    early = [run(s) for s in seeds]
    slower = share_mod._clearly_slower
    try:  # the same climbs with every noisy probe run to its tie-level precision
        share_mod._clearly_slower = lambda *a: False
        full = [run(s) for s in seeds]
    finally:
        share_mod._clearly_slower = slower
    assert all(cost[r] <= 1.02 * 20.54 for r, _, _ in early), early
    # 0.4 (34% slower) is left after a short probe: under 2 x PROBE steps per visit on every seed
    assert all(per.get(0.4, 0) < 2 * share_mod.PROBE * 2 for _, _, per in early), [p for *_, p in early]
    assert sum(n for _, n, _ in early) < 0.7 * sum(n for _, n, _ in full), ([n for _, n, _ in early],
                                                                          [n for _, n, _ in full])


def test_share_tuner_goes_to_fill_only_when_the_host_slows_down():
    """The hold watches its steps: when the CPU branch becomes slow in the middle of a run (on
    an H100 its call went from ~105 us to 300-900 us; the split stayed at r = 0.7 and ran a third
    of fill-only's speed), the split is measured again from fill-only at once (the periodic
    re-check is off here: hold=1e6) and lands there. Steps that swing +-30% around the held r's
    cost, with one step in twenty twice as slow, never start such a climb; a slowdown the split
    is not the cause of (every r 30% slower) starts one climb, which keeps its r and mutes the
    watch instead of climbing again and again."""
    import random
    from freetoken.experts.share import ShareTuner
    fast = {1.0: 10.0, 0.9: 9.4, 0.8: 8.8, 0.7: 8.2, 0.6: 8.6, 0.5: 9.2, 0.4: 9.8, 0.3: 10.4, 0.2: 11.0, 0.1: 11.6}
    rng = random.Random(3)

    def noisy(ms: float) -> float:  # +-30%, and a step in twenty twice as slow (a hiccup)
        return ms * (1 + 0.3 * (2 * rng.random() - 1)) * (2.0 if rng.random() < 0.05 else 1.0) / 1e3
    t = ShareTuner(hold=1_000_000)
    while t.climbing:
        t.observe(1, noisy(fast[t.share]))
    chosen = t.share
    assert fast[chosen] <= 1.05 * fast[0.7] and t.drifts == 0
    for _ in range(3000):  # held: its own steps, noisy, never a drift
        t.observe(1, noisy(fast[chosen]))
    assert t.share == chosen and not t.climbing and t.drifts == 0

    for n in range(1, 2000):  # the CPU's share now costs 3x per unit: fill-only is fastest
        t.observe(1, noisy(10.0 + (1.0 - t.share) * 60.0))
        if t.drifts and not t.climbing:
            break
    assert t.drifts == 1 and t.share == 1.0 and not t.climbing
    assert n < 600, f"{n} steps to get back to fill-only"

    # a slowdown of every r alike that keeps growing (not the split's doing: a context growing
    # long, other work on the device), 1x to 2.5x: one climb, which keeps the r, then the watch
    # is muted (without that, each further 20% started another full climb)
    t2 = ShareTuner(hold=1_000_000)
    while t2.climbing:
        t2.observe(1, fast[t2.share] / 1e3)
    held = t2.share
    for _ in range(100):
        t2.observe(1, fast[t2.share] / 1e3)
    for k in range(4000):
        t2.observe(1, (1 + 1.5 * k / 4000) * fast[t2.share] / 1e3)
    assert t2.drifts == 1 and t2.share == held and not t2.climbing
