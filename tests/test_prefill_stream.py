"""Layer-major prefill passes with the experts streamed per layer (runtime/prefill_stream.py,
experts/stream.py): the logits, KV and recurrent state a streamed prefill leaves equal the
regular chunked prefill's through the same expert cache, in every buffering mode and for prompts
of one token to several passes; prefix-cache checkpoints taken inside a pass restore to the
logits of a cold prefill; the loader loads only the routed experts of short prompts and whole
layers for long ones, uses experts already in the cache where they lie, and leaves the residency
consistent (its survivors seed the decode cache). On the CPU the slots are host memory and the
copies synchronous: the same code as on CUDA, without the streams."""
import logging

import pytest
import torch

import hf_models
from drive import drive
from freetoken.cache.config import CacheConfig
from freetoken.experts.stream import pick_mode, uniform_coverage
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.budget import work_bytes
from freetoken.runtime.prefill_stream import (EXPERT_SUB, MIXER_SUB, PrefillStream, expert_bytes_per_token,
                                             mixer_extra_bytes, pass_bytes_per_token, pass_reserve_bytes)
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.server.metrics import Metrics
from freetoken.weights.convert import convert

LAYERS, E, K, SUB = 4, 16, 4, 16  # every layer MoE: 64 flat experts; pieces of 16 tokens


def build(tmp_path_factory, name: str, seed: int, positions: int):
    """The test shape (LAYERS layers, E experts of top-K) as an FTW: (path, the transformers model)."""
    d = tmp_path_factory.mktemp(name)
    model = hf_models.qwen3_5(seed, num_hidden_layers=LAYERS, num_experts=E, num_experts_per_tok=K,
                              max_position_embeddings=positions)
    hf_models.save(model, str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return str(d / "m.ftw"), model


@pytest.fixture(scope="module")
def ftw(tmp_path_factory):
    return build(tmp_path_factory, "stream", 41, 1024)


def engine(path, stream: bool = True, slots: int | None = None, **kw) -> Engine:
    eng = Engine(path, EngineConfig(device="cpu", dtype="float32", moe="cache", prefill_chunk=SUB))
    if not stream:
        eng.prefill_stream = None  # the regular chunked prefill through the cache
    elif kw:
        eng.prefill_stream = PrefillStream(eng.model, eng.cfg, eng.executor, SUB, **kw)
    if slots is not None:
        eng.executor.allocate(slots)
    return eng


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def prompt(n, seed=0):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def residency_ok(ex) -> bool:
    res = ex.pool.res
    slot_of, id_of = res.slot_of.long(), res.id_of.long()
    held = (id_of >= 0).nonzero()[:, 0]
    return bool((slot_of[id_of[held]] == held).all()) and int((slot_of >= 0).sum()) == held.numel()


@pytest.fixture(autouse=True)
def _torch_gemms(monkeypatch):
    """Streaming is the subject: both engines on torch's GEMMs (a pass's pieces of up to 16 tokens
    would take the CPU's C++ rows kernel, the whole prompt torch's; that kernel has its own tests)."""
    from freetoken.experts import cpu
    monkeypatch.setattr(cpu, "DECODE_KERNELS", False)


def check_same_state(ref, eng, a, b, n, tol=1e-5):
    """Logits of a decode step after the prefill (through each engine's cache), the recurrent
    state and the K/V of the prompt's pages."""
    tok, pos = torch.tensor([7]), torch.tensor([n])
    assert rel(eng.model.decode(tok, b, pos), ref.model.decode(tok, a, pos)) < tol
    for l in a.rec:
        assert rel(b.rec[l], a.rec[l]) < tol and rel(b.conv[l], a.conv[l]) < tol
    p = torch.arange(n + 1)  # the prompt's positions and the decoded one
    page, off = a.block_table[0, p // a.page_size].long(), p % a.page_size
    assert torch.equal(page, b.block_table[0, p // b.page_size].long())
    for l in a.k:
        ka, kb = a.k[l][page, :, off], b.k[l][page, :, off]  # [n + 1, heads, hd]
        va, vb = a.v[l][page, :, off], b.v[l][page, :, off]
        assert rel(kb, ka) < tol and rel(vb, va) < tol


@pytest.mark.parametrize("buffering", ["triple", "double", "single", "on-demand"])
def test_streamed_prefill_equals_regular(ftw, buffering):
    """1 token, a few, one pass of several pieces, and three passes (48 tokens each, the last
    short): the same logits, KV and recurrent state as chunked prefill through the cache. The
    experts in sub-chunks of the mixers' 16 tokens, of 32 (a pass's last one short) and whole."""
    path, _ = ftw
    ref = engine(path, stream=False)
    esub = {"triple": 32, "double": 32, "single": SUB, "on-demand": 8192}[buffering]
    eng = engine(path, max_pass_tokens=48, buffering=buffering, expert_sub=esub)
    for n in (1, 5, 37, 100):
        ids = prompt(n, seed=n)
        a, b = ref.new_state(128), eng.new_state(128)
        la, lb = ref.prefill(ids, a), eng.prefill(ids, b)
        assert lb.shape == la.shape == (1, 320) and rel(lb, la) < 1e-5, (buffering, n)
        assert residency_ok(eng.executor)
        check_same_state(ref, eng, a, b, n)
    st = eng.prefill_stream.stats()
    assert st[f"passes_{buffering.replace('-', '_')}"] == st["passes"] == 1 + 1 + 1 + 3
    assert st["tokens"] == 1 + 5 + 37 + 100 and st["pass_tokens"] == 48 and st["expert_sub"] == esub


def test_sync_free_passes_equal_regular(ftw):
    """experts/stream.py sync_free_tokens (SYNC_FREE_TOKENS, 4,096 by default): passes this long skip
    the host read of a fully loaded layer's routed set. The same logits and state, whole layers
    loaded, no coverage measured from them (the prediction stays the pass length's)."""
    path, _ = ftw
    ref = engine(path, stream=False)
    eng = engine(path, max_pass_tokens=48, buffering="double")
    eng.prefill_stream.loader.sync_free_tokens = 40
    ids = prompt(100, seed=9)  # passes of 48, 48 (sync-free) and 4 (synced, routed)
    a, b = ref.new_state(128), eng.new_state(128)
    assert rel(eng.prefill(ids, b), ref.prefill(ids, a)) < 1e-5
    check_same_state(ref, eng, a, b, 100)
    st = eng.prefill_stream.stats()
    assert st["passes"] == 3 and st["layers_full"] >= 2 * LAYERS and residency_ok(eng.executor)


@pytest.fixture(scope="module")
def ftw_long(tmp_path_factory):
    """The same shape with room for 16k-token prompts."""
    return build(tmp_path_factory, "stream16k", 42, 16400)[0]


@pytest.mark.parametrize("buffering", ["double", "on-demand"])
def test_streamed_prefill_equals_regular_at_16k(ftw_long, buffering):
    """16,384 tokens in two passes of 8,192: the logits, KV and recurrent state of the regular
    chunked prefill through the cache (2,048-token chunks), and the logits of the plain CPU engine
    (every expert in host memory, `--moe cpu`: the CPU's all-resident path), within fp32 rounding."""
    n = 16384
    ref = Engine(ftw_long, EngineConfig(device="cpu", dtype="float32", moe="cache", prefill_chunk=2048))
    ref.prefill_stream = None
    resident = Engine(ftw_long, EngineConfig(device="cpu", dtype="float32", moe="cpu", prefill_chunk=2048))
    eng = Engine(ftw_long, EngineConfig(device="cpu", dtype="float32", moe="cache", prefill_chunk=2048))
    eng.prefill_stream = PrefillStream(eng.model, eng.cfg, eng.executor, 2048, max_pass_tokens=8192,
                                       buffering=buffering)
    ids = prompt(n, seed=16)
    a, b, c = ref.new_state(n + 8), eng.new_state(n + 8), resident.new_state(n + 8)
    la, lb, lc = ref.prefill(ids, a), eng.prefill(ids, b), resident.prefill(ids, c)
    assert rel(lb, la) < 1e-5 and rel(lb, lc) < 1e-4 and float(la.abs().max()) > 0
    assert residency_ok(eng.executor)
    # the later layers' K/V differ by ~3e-5: a pass runs each layer's attention over its 8,192
    # tokens at once, the regular prefill over 2,048-token chunks (other pieces of the keys, other
    # fp32 roundings, compounded over the layers)
    check_same_state(ref, eng, a, b, n, tol=1e-4)
    st = eng.prefill_stream.stats()
    assert st["passes"] == st[f"passes_{buffering.replace('-', '_')}"] == 2 and st["tokens"] == n


def test_tiny_pool_loads_in_groups(ftw):
    """10 slots, fewer than a layer's 16 experts: on-demand in groups of 10, whatever was asked
    (a warning says so), still exact; the pool is never outgrown."""
    path, _ = ftw
    ref = engine(path, stream=False)
    eng = engine(path, slots=10, max_pass_tokens=64, buffering="double")
    ids = prompt(60, seed=3)
    a, b = ref.new_state(128), eng.new_state(128)
    assert rel(eng.prefill(ids, b), ref.prefill(ids, a)) < 1e-5
    check_same_state(ref, eng, a, b, 60)
    st = eng.prefill_stream.stats()
    assert st["last_mode"] == "on-demand" and st["passes_on_demand"] == 1 and st["layers_routed"] == LAYERS
    assert eng.executor.pool.slots == 10 and residency_ok(eng.executor)


def test_short_prompts_load_routed_experts_long_ones_whole_layers(ftw):
    path, _ = ftw
    eng = engine(path, max_pass_tokens=64, buffering="double")
    st = eng.new_state(128)
    slot_bytes = eng.executor.pool.slot_bytes
    eng.prefill(prompt(2, seed=1), st)  # 8 pairs per layer: at most 8 of 16 experts
    s = eng.prefill_stream.stats()
    assert s["layers_full"] == 0 and s["layers_routed"] == LAYERS
    assert s["experts_skipped"] >= LAYERS * (E - 2 * K)
    assert s["experts_h2d"] + s["experts_resident"] + s["experts_skipped"] == LAYERS * E
    assert s["bytes_h2d"] == s["experts_h2d"] * slot_bytes
    eng.prefill(prompt(64, seed=2), eng.new_state(128))  # 256 pairs per layer: every expert
    s2 = eng.prefill_stream.stats()
    assert s2["last_layers_full"] == LAYERS and s2["last_layers_routed"] == 0
    assert s2["experts_skipped"] == s["experts_skipped"]
    assert (s2["experts_h2d"] + s2["experts_resident"]) - (s["experts_h2d"] + s["experts_resident"]) == LAYERS * E


def test_cached_experts_used_in_place_and_survivors_seed_the_cache(ftw):
    """48 slots: 16 kept for the cache, two regions of 16. A cold pass fills the free kept slots
    first (layer 0 stays there), the regions end holding layers 2 and 3; decoding hits all three
    (the pass seeded the cache). The next pass uses what the cache holds where it lies and
    copies only the rest."""
    path, _ = ftw
    ref = engine(path, stream=False)
    eng = engine(path, slots=48, max_pass_tokens=64, buffering="double")
    ids = prompt(64, seed=5)
    a, b = ref.new_state(256), eng.new_state(256)
    ref.prefill(ids, a)
    eng.prefill(ids, b)
    ex = eng.executor
    s1 = eng.prefill_stream.stats()
    assert s1["last_layers_full"] == LAYERS and s1["experts_h2d"] == LAYERS * E and s1["experts_resident"] == 0
    id_of = ex.pool.res.id_of.long()
    assert torch.equal(id_of, torch.cat([torch.arange(0, E), torch.arange(2 * E, 4 * E)])) and residency_ok(ex)
    before = ex.stats()
    tok, pos = torch.tensor([9]), torch.tensor([64])
    assert rel(eng.model.decode(tok, b, pos), ref.model.decode(tok, a, pos)) < 1e-5
    after = ex.stats()
    assert after["hits"] - before["hits"] == 3 * K and after["fills"] - before["fills"] == K  # layer 1 missed
    for step in (1, 2):
        assert rel(eng.model.decode(tok, b, pos + step), ref.model.decode(tok, a, pos + step)) < 1e-5
    kept = int((ex.pool.res.id_of[:E] >= 0).sum())
    assert kept == E and residency_ok(ex)
    more = prompt(64, seed=6)
    ref.prefill(more, a, start=67)
    eng.prefill(more, b, start=67)
    s2 = eng.prefill_stream.stats()
    assert s2["experts_resident"] - s1["experts_resident"] == kept
    assert s2["experts_h2d"] - s1["experts_h2d"] == LAYERS * E - kept
    check_same_state(ref, eng, a, b, 64 + 3 + 64)


def serve_an_edited_conversation(eng, cold_eng, tol):
    """A conversation served through eng's streamed passes (checkpoints at anchors inside them),
    then an edited one: it restores from a checkpoint taken during a pass and gives cold_eng's
    logits (a cold prefill, no streaming) within tol. Returns the warm ServingEngine."""
    tk = eng.tokenizer
    sp = {t: tk.token_id(t) for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")}

    def turn(role, *parts):
        ids = [sp["<|im_start|>"]] + tk.encode(role + "\n")
        for p in parts:
            ids += [sp[p]] if p in sp else tk.encode(p)
        return ids + [sp["<|im_end|>"]] + tk.encode("\n")
    system = turn("system", "You are a careful agent. " * 3)
    first = system + turn("user", "Read the file.") + turn("assistant", "<tool_call>", "read(x)", "</tool_call>")
    second = system + turn("user", "Summarise the repository instead, briefly.")
    warm = ServingEngine(eng, max_batch=2, max_queue=4, record_logits=True, start=False,
                         cache=CacheConfig(page_size=4, checkpoint_policy="anchors", min_gap=8))
    assert warm.sched.chunk == 32 and not warm.mixed  # a prompt's chunk is a pass, run alone
    cold = ServingEngine(cold_eng, max_batch=2, max_queue=4, record_logits=True, start=False,
                         cache=CacheConfig(enabled=False))
    opts = dict(temperature=0, max_tokens=3, ignore_eos=True)
    drive(warm, [Request(list(first), SamplingOptions(**opts))])
    assert warm.cache.stats()["checkpoints"] > 0
    got = drive(warm, [Request(list(second), SamplingOptions(**opts))])[0]
    ref = drive(cold, [Request(list(second), SamplingOptions(**opts))])[0]
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert warm.cache.stats()["checkpoint_hits"] > 0 and len(system) - 8 <= got.cached_tokens <= shared
    assert got.output_ids == ref.output_ids
    for x, y in zip(got.logits, ref.logits):
        assert rel(x, y) < tol
    return warm


def test_checkpoints_in_streamed_passes_restore(ftw, caplog):
    """A conversation served through streamed passes (two passes of 32 tokens each; checkpoints
    at anchors inside them), then an edited one: it restores from a checkpoint taken during a
    pass and gives the logits of a cold prefill. The log and /metrics say which mode ran."""
    caplog.set_level(logging.INFO, logger="freetoken.engine")
    path, _ = ftw
    eng = engine(path, max_pass_tokens=32)
    warm = serve_an_edited_conversation(eng, engine(path, stream=False), 1e-4)
    st = warm.stats()
    assert st["experts_prefill_passes"] >= 3 and st["experts_prefill_passes_double"] == st["experts_prefill_passes"]
    assert all(isinstance(v, (int, float)) for k, v in st.items() if k.startswith("experts_prefill_"))
    passes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefill pass:")]
    assert len(passes) == st["experts_prefill_passes"] and all("double buffering" in m for m in passes)
    metrics = Metrics()
    metrics.attach(warm, eng.describe())
    text = metrics.render().decode()  # what a scrape of /metrics reads
    for mode, n in (("double", st["experts_prefill_passes"]), ("single", 0), ("on_demand", 0)):
        assert f'freetoken_expert_executor{{counter="prefill_passes_{mode}"}} {float(n)}' in text, mode


def test_served_through_streamed_passes_equals_transformers(ftw):
    """Two requests, the second arriving while the first decodes: prompt passes and decode
    steps alternate (never one forward), the outputs are transformers'."""
    path, model = ftw
    eng = engine(path, max_pass_tokens=32)
    srv = ServingEngine(eng, max_batch=2, max_queue=4, record_logits=True, start=False,
                        cache=CacheConfig(enabled=False))
    prompts = [prompt(45, seed=11), prompt(9, seed=12)]
    reqs = drive(srv, [Request(p, SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts],
                 arrive=[0, 2])
    hf_models.assert_served_like(model, prompts, reqs)
    assert eng.prefill_stream.stats()["passes"] == 3  # 32 + 13 tokens, then 9


@pytest.mark.parametrize("slots,mode", [(None, "double"), (40, "double"), (24, "single"), (12, "on-demand")])
def test_decode_steps_inside_a_streamed_pass(ftw, slots, mode):
    """A stream decodes while a long prompt streams its passes: its decode steps run between
    the passes' layers with the cache frozen (hits where they lie, misses on the CPU, no fill),
    both requests get transformers' tokens, and the residency the passes write back is
    consistent. Pools of 64 experts (E = 16 per layer): all of them; 40 (two regions and 8 keep
    slots); 24 (one region, 8 keep slots); 12 (on demand, in groups)."""
    path, model = ftw
    eng = engine(path, slots=slots, max_pass_tokens=64)
    srv = ServingEngine(eng, max_batch=2, max_queue=4, record_logits=True, start=False,
                        cache=CacheConfig(enabled=False))
    assert srv.between.enabled and srv.streamed
    fills = []
    real = eng.executor._call

    def spy(*args, **kw):  # fills of every decode call made inside a pass (the cache frozen)
        before = int(eng.executor._acc[3])
        out = real(*args, **kw)
        if eng.executor.is_frozen:
            fills.append(int(eng.executor._acc[3]) - before)
        return out
    eng.executor._call = spy
    prompts = [prompt(9, seed=13), prompt(150, seed=14)]
    reqs = drive(srv, [Request(prompts[0], SamplingOptions(temperature=0, max_tokens=24, ignore_eos=True)),
                       Request(prompts[1], SamplingOptions(temperature=0, max_tokens=3, ignore_eos=True))],
                 arrive=[0, 3])
    assert srv.between.steps > 0 and eng.prefill_stream.stats()["passes"] >= 3
    assert eng.prefill_stream.stats()["last_mode"] == mode
    assert fills and set(fills) == {0}  # no decode call inside a pass filled a slot
    assert not eng.executor.is_frozen and float(eng.executor.fill_share) == 1.0  # r restored
    assert residency_ok(eng.executor)
    hf_models.assert_served_like(model, prompts, reqs)


def test_streams_that_end_inside_a_pass(ftw):
    """Inside a streamed pass one stream is cancelled (its next decode step skips it) and
    another reaches max_tokens in a decode step between the pass's layers: both end there, the
    long prompt's tokens are still transformers', and every page and slot comes back."""
    path, model = ftw
    eng = engine(path, slots=40, max_pass_tokens=64)
    srv = ServingEngine(eng, max_batch=3, max_queue=4, record_logits=True, start=False,
                        cache=CacheConfig(enabled=False))
    opts = lambda n: SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    gone, short, long = Request(prompt(7, seed=17), opts(200)), Request(prompt(8, seed=18), opts(7)), \
        Request(prompt(180, seed=19), opts(3))
    seen, inside, real = [], [], srv._between_layers

    def hook(i):
        running = short.finished_at is None
        real(i)
        if running and short.finished_at is not None:
            inside.append(i)  # short ended in the decode step just run between a pass's layers
        if long.slot is not None and long.prefilling and not gone.cancelled and srv.between.steps >= 2:
            srv.cancel(gone)  # mid-pass: the client went away
            seen.append(len(gone.output_ids))
    srv._between_layers = hook
    drive(srv, [gone, short, long], arrive=[0, 0, 2])
    assert seen and gone.finish_reason == "cancelled" and len(gone.output_ids) <= seen[0] + 1
    assert short.finish_reason == "length" and len(short.output_ids) == 7 and inside
    ref = hf_models.reference_logits(model, long.prompt_ids + long.output_ids)
    assert long.output_ids == ref[len(long.prompt_ids) - 1:-1].argmax(-1).tolist()
    assert not srv.sched.running and srv.state.pages.used == 0 and residency_ok(eng.executor)


def test_decode_rows_do_not_shorten_a_pass(ftw):
    """A prompt of two passes' tokens beside a decoding stream prefills in two passes, where
    the step's budget equals a pass (CUDA: 2,048-token steps, 32k passes): the rows' tokens had
    cut each pass short by one token per row and left a pass of a few tokens that streamed
    every layer again."""
    path, _ = ftw
    eng = engine(path, max_pass_tokens=256)
    eng.ecfg.max_step_tokens = 256
    srv = ServingEngine(eng, max_batch=2, max_queue=4, start=False, cache=CacheConfig(enabled=False))
    drive(srv, [Request(prompt(9, seed=15), SamplingOptions(temperature=0, max_tokens=12, ignore_eos=True)),
                Request(prompt(512, seed=16), SamplingOptions(temperature=0, max_tokens=2, ignore_eos=True))],
          arrive=[0, 2])
    assert eng.prefill_stream.stats()["passes"] == 3  # the stream's prompt, then 256 + 256


def test_frozen_cache_reads_kept_experts_and_runs_misses_on_the_cpu(ftw):
    """Inside a pass (after begin), a frozen decode call through the loader hits the keep
    slots' experts (and only them), fills nothing, changes no expert's slot, and equals the
    resident output; a prefill call while frozen is refused."""
    path, _ = ftw
    eng = engine(path, slots=40, max_pass_tokens=64)
    ex, ps = eng.executor, eng.prefill_stream
    eng.prefill(prompt(30), eng.new_state(64))  # the pool holds what that pass left
    res = ex.pool.res
    ps.loader.begin(64)
    try:
        slot_of, id_of = res.slot_of.clone(), res.id_of.clone()
        assert int((id_of[ps.loader.base:] >= 0).sum()) == 0  # the regions read as empty
        kept = id_of[:ps.loader.base][id_of[:ps.loader.base] >= 0].long()  # flat ids in keep slots
        assert kept.numel() > 0
        layer = int(kept[0]) // E
        mine = kept[kept // E == layer]  # the kept experts of that layer
        others = torch.tensor([layer * E + e for e in range(E) if layer * E + e not in mine.tolist()])
        g = torch.Generator().manual_seed(5)
        pick = lambda pool: pool[torch.randperm(pool.numel(), generator=g)[:K // 2]]  # noqa: E731
        ids = torch.stack([torch.cat([pick(mine), pick(others)])[:K] for _ in range(3)])  # [3, <=k] flat ids
        k = ids.shape[1]
        x = torch.randn(3, eng.cfg.hidden_size, generator=g)  # [3, H]
        w = torch.rand(3, k, generator=g).softmax(-1)  # [3, k]
        before = ex._acc.clone()
        with ex.frozen():
            st = ex.stats()  # /metrics meanwhile: the split serving chose, and that the cache is frozen
            assert st["fill_share"] == 1.0 and st["frozen"] == 1 and float(ex.fill_share) == 0.0
            out = ps.loader.finish(ps.loader.launch(x, ids, w, layer=layer, phase="decode"))
            with pytest.raises(RuntimeError, match="frozen"):
                ex.launch(x, ids, w, layer=layer, phase="prefill")
        acc = ex._acc - before  # calls, pairs, hits, fills, cpu experts
        hit = int(torch.isin(torch.unique(ids), mine).sum())
        assert hit > 0 and int(acc[2]) == hit and int(acc[3]) == 0
        assert int(acc[4]) == torch.unique(ids).numel() - hit  # every miss on the CPU
        assert torch.equal(res.slot_of, slot_of) and torch.equal(res.id_of, id_of)
        ref = ex.cpu.finish(ex.cpu.launch(x, ids, w, layer, "decode"))
        assert rel(out, ref) < 1e-5
    finally:
        ps.loader.end()
    assert residency_ok(ex) and float(ex.fill_share) == 1.0


def test_no_decode_inside_passes_for_models_with_shared_forward_state(ftw, caplog):
    """A model that keeps a forward's data in state its layers share (DeepSeek-V4, GLM) cannot
    run an eager decode forward between a pass's layers: without decode graphs (the CPU) its
    streams decode between passes, said in the log."""
    path, _ = ftw
    eng = engine(path, max_pass_tokens=64)
    eng.model.per_forward_state = True
    srv = ServingEngine(eng, max_batch=2, max_queue=4, start=False, cache=CacheConfig(enabled=False))
    assert not srv.between.enabled and "no decode steps inside streamed prefill passes" in caplog.text


def test_failed_pass_restores_the_model(ftw):
    path, _ = ftw
    eng = engine(path, max_pass_tokens=64)
    st = eng.new_state(128)
    ps = eng.prefill_stream
    calls = []

    def boom(j):
        calls.append(j)
        if j == 2:
            raise RuntimeError("boom")
    real = ps.loader.before_layer
    ps.loader.before_layer = lambda j: (real(j), boom(j))
    with pytest.raises(RuntimeError, match="boom"):
        eng.prefill(prompt(40), st)
    assert all(mlp.executor is eng.executor for _, mlp, _, _ in eng.model.layers)
    assert residency_ok(eng.executor) and ps.stats()["passes"] == 1
    ps.loader.before_layer = real
    ref = engine(path, stream=False)
    a, b = ref.new_state(128), eng.new_state(128)
    assert rel(eng.prefill(prompt(40), b), ref.prefill(prompt(40), a)) < 1e-5


def test_pass_size_follows_the_budget(ftw, monkeypatch, caplog):
    """On CUDA a pass takes what the budget has left beside one sub-chunk's work (here the
    allocator's reading is faked): a multiple of the sub-chunk, at least one, said in the log.
    What the pass leaves buys its experts larger sub-chunks (up to EXPERT_SUB), then its token
    mixers larger pieces (MIXER_SUB, else half), never a shorter pass: more budget never shortens
    one. Asking (as /metrics does) changes nothing."""
    from types import SimpleNamespace
    path, _ = ftw
    eng = engine(path)
    ps = eng.prefill_stream
    assert ps.sizes() == (32768, EXPERT_SUB, SUB)  # the CPU: the caps, the mixers in --prefill-chunk pieces
    ps.model = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, layers=[])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 5 << 30)
    bf = torch.bfloat16
    fixed = (5 << 30) + work_bytes(eng.cfg, SUB, 1, bf)
    per = pass_bytes_per_token(eng.cfg, bf)
    ebpt = expert_bytes_per_token(eng.cfg, bf)
    ps.budget = fixed + 100 * per
    # the pass first; the 4 tokens' room its rounding left to the experts' sub-chunk
    assert ps.sizes() == (96, SUB + (4 * per // ebpt) // SUB * SUB, SUB) and "limited to 96 tokens" in caplog.text
    ps.budget = fixed + 3 * per
    assert ps.sizes() == (SUB, SUB, SUB)
    ps.budget = fixed + 32768 * per  # room for the longest pass and nothing more: the mixers' sub-chunk
    assert ps.sizes() == (32768, SUB, SUB)
    ps.budget += (EXPERT_SUB - SUB) * ebpt  # and for the larger sub-chunk
    assert ps.sizes() == (32768, EXPERT_SUB, SUB)
    ps.budget += mixer_extra_bytes(eng.cfg, bf, SUB, MIXER_SUB)  # and for the larger mixer pieces: what the plan reserves
    assert ps.sizes() == (32768, EXPERT_SUB, MIXER_SUB)
    assert ps.budget - fixed == pass_reserve_bytes(eng.cfg, bf, 10 ** 6, SUB)
    ps.budget -= mixer_extra_bytes(eng.cfg, bf, SUB, MIXER_SUB) // 2  # half of that room: pieces of half
    assert ps.sizes() == (32768, EXPERT_SUB, MIXER_SUB // 2)
    ps.budget = fixed + 32768 * per + (EXPERT_SUB - SUB) * ebpt // 2  # half of the sub-chunk's: a multiple of SUB between
    n, esub, msub = ps.sizes()
    assert n == 32768 and SUB < esub < EXPERT_SUB and esub % SUB == 0 and msub == SUB
    last = 0
    for extra in range(0, 40000 * per, 997 * per + 12345):  # more room never shortens a pass
        ps.budget = fixed + extra
        n, esub, msub = ps.sizes()
        assert n >= last and SUB <= esub <= EXPERT_SUB and SUB <= msub <= min(n, MIXER_SUB) and msub <= esub
        assert n == ps.pass_tokens()
        last = n
    assert ps.loader.sub == SUB  # no pass ran: the sub-chunk the loader was made with


def test_mode_choice():
    assert pick_mode("auto", 512, 256) == "double" and pick_mode("auto", 511, 256) == "single"
    assert pick_mode("auto", 255, 256) == "on-demand" and pick_mode("double", 300, 256) == "single"
    assert pick_mode("single", 600, 256) == "single" and pick_mode("on-demand", 600, 256) == "on-demand"
    with pytest.raises(ValueError):
        pick_mode("quadruple", 600, 256)
    # a third region: only where asked for and where it fits; auto stays with two
    assert pick_mode("triple", 768, 256) == "triple" and pick_mode("triple", 767, 256) == "double"
    assert pick_mode("auto", 5000, 256) == "double" and pick_mode("double", 5000, 256) == "double"
    # 44 tokens of top-8 over 256 experts cover 75% under uniform routing, 72 tokens 90%
    assert uniform_coverage(1, 8, 256) == 8 / 256 and 0.74 < uniform_coverage(44, 8, 256) < 0.76
    assert uniform_coverage(72, 8, 256) > 0.89 and uniform_coverage(4096, 8, 256) > 0.999


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("buffering,pass_tokens,table_on_copy", [
    ("double", 32768, True), ("double", 2048, True), ("single", 4096, True), ("on-demand", 32768, True),
    ("triple", 32768, True), ("double", 32768, False), ("on-demand", 32768, False)])
def test_cuda_streamed_prefill_equals_resident(tmp_path_factory, buffering, pass_tokens, table_on_copy):
    """On the GPU (copy stream, events, bf16): 1, 511, 4,096 and 16,384 tokens, one pass or several,
    against the all-resident experts and the regular prefill through the cache, within bf16
    rounding; then a decode step through the cache the pass left behind. table_on_copy: the slot
    tables go up on the copy stream (experts/stream.py TABLE_ON_COPY, the default) or on the
    compute stream. Passes of 4,096 tokens or more skip the routed-set sync (SYNC_FREE_TOKENS)."""
    path = build(tmp_path_factory, "cuda", 43, 16400)[0]

    def make(moe):
        return Engine(path, EngineConfig(device="cuda", dtype="bfloat16", moe=moe))
    resident, regular, eng = make("resident"), make("cache"), make("cache")
    regular.prefill_stream = None
    eng.prefill_stream = PrefillStream(eng.model, eng.cfg, eng.executor, eng.ecfg.prefill_chunk,
                                       max_pass_tokens=pass_tokens, buffering=buffering)
    eng.prefill_stream.loader.table_on_copy = table_on_copy
    for n in (1, 511, 4096, 16384):
        ids = prompt(n, seed=n)
        states = [x.new_state(n + 8) for x in (resident, regular, eng)]
        la, lr, lb = (x.prefill(ids, st) for x, st in zip((resident, regular, eng), states))
        assert rel(lb.cpu(), la.cpu()) < 2e-2 and rel(lb.cpu(), lr.cpu()) < 2e-2, (buffering, n)
        tok, pos = torch.tensor([7], device="cuda"), torch.tensor([n], device="cuda")
        da = resident.model.decode(tok, states[0], pos)
        db = eng.model.decode(tok, states[2], pos)
        assert rel(db.cpu(), da.cpu()) < 2e-2
        assert residency_ok(eng.executor)
    st = eng.prefill_stream.stats()
    assert st["passes"] == 2 + (-(-4096 // pass_tokens)) + (-(-16384 // pass_tokens))
    if buffering == "triple" and eng.executor.pool.slots >= 3 * eng.prefill_stream.loader.experts:
        assert st["passes_triple"] == st["passes"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("slots", [48, 24])
def test_cuda_decode_steps_inside_streamed_passes(tmp_path_factory, slots):
    """Served on the GPU with a pool of 48 of 64 experts (double buffering beside 16 keep slots) or
    24 (one region beside 8): a stream
    decodes from graphs between the layers of a 3,000-token prompt's passes (the frozen cache's
    variant captured at start-up, the pass's copies on their own stream); every token's logits
    of both requests equal the all-resident engine's under the same tokens. In float32: in bf16
    this random model's own rounding drifts a decode 2-10% from a prefill over 15 tokens (H200,
    264ce62), as large as what a slot read mid-copy would do."""
    path = build(tmp_path_factory, "cuda-serve", 44, 16400)[0]
    cfg = dict(device="cuda", dtype="float32")
    resident = Engine(path, EngineConfig(moe="resident", **cfg))
    size = str(slots * Engine(path, EngineConfig(moe="cache", **cfg)).executor.slot_bytes)
    eng = Engine(path, EngineConfig(moe="cache", expert_cache=size, **cfg))
    eng.prefill_stream = PrefillStream(eng.model, eng.cfg, eng.executor, eng.ecfg.prefill_chunk, max_pass_tokens=1024)
    srv = ServingEngine(eng, max_batch=2, max_queue=4, record_logits=True, start=False,
                        cache=CacheConfig(enabled=False))
    assert srv.decode.path == "cuda-graphs" and srv.between.enabled and eng.executor.pool.slots == slots
    assert not srv.decode._failed and any(v == eng.executor.graph_variant() for v, _ in srv.decode._captured)
    with eng.executor.frozen():  # the frozen variant's graphs were captured at start-up
        assert any(v == eng.executor.graph_variant() for v, _ in srv.decode._captured)
    prompts = [prompt(20, seed=21), prompt(3000, seed=22)]
    reqs = drive(srv, [Request(prompts[0], SamplingOptions(temperature=0, max_tokens=40, ignore_eos=True)),
                       Request(prompts[1], SamplingOptions(temperature=0, max_tokens=3, ignore_eos=True))],
                 arrive=[0, 3])
    assert srv.between.steps > 0 and eng.prefill_stream.stats()["passes"] >= 3
    assert residency_ok(eng.executor)
    for p, r in zip(prompts, reqs):
        ids = p + r.output_ids
        ref = resident.prefill(ids, resident.new_state(len(ids) + 1), all_logits=True).cpu()  # [n, V]
        errs = [rel(lg, ref[len(p) - 1 + j]) for j, lg in enumerate(r.logits)]
        assert max(errs) < 1e-3, (len(p), [round(e, 5) for e in errs])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_checkpoints_in_streamed_passes_restore(tmp_path_factory):
    """The checkpoint test above on the GPU (copy stream, events, decode graphs; float32, as the
    served-decode test, so the random model's own bf16 drift does not hide a wrong restore)."""
    path = build(tmp_path_factory, "cuda-ckpt", 45, 1024)[0]
    cfg = dict(device="cuda", dtype="float32", moe="cache", prefill_chunk=SUB)  # passes of 32 in pieces of 16
    eng = Engine(path, EngineConfig(**cfg))
    eng.prefill_stream = PrefillStream(eng.model, eng.cfg, eng.executor, SUB, max_pass_tokens=32)
    cold = Engine(path, EngineConfig(**cfg))
    cold.prefill_stream = None
    warm = serve_an_edited_conversation(eng, cold, 1e-3)
    assert warm.stats()["experts_prefill_passes"] >= 3
