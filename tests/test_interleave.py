"""Decode steps between the layers of a prefill forward (runtime/interleave.py): the streams
that decode meanwhile get exactly the tokens they get without it, the prompt too, and the
decision follows the layers queued at the cost it learns."""
import random

import pytest
import torch

import hf_models
from drive import drive, drive_with_arrivals_mid_forward
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.interleave import FIRST_TOKEN_FLOOR_TOKENS, GAP_CEILING, MIN_PREFILL, CostModel, Interleaver
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = tmp_path_factory.mktemp("interleave")
    hf_models.save(hf_models.qwen3_5(43, num_hidden_layers=4, max_position_embeddings=1024), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return Engine(str(d / "m.ftw"), EngineConfig(device="cpu", dtype="float32", prefill_chunk=32))


def greedy(p, n):
    return Request(list(p), SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True))


def serving(eng, interleave: bool, step_tokens: int = 96):
    srv = ServingEngine(eng, max_batch=4, max_queue=8, start=False)
    srv.sched.step_tokens = step_tokens  # a long prompt takes several steps of several chunks
    srv.mixed = False  # decode rows in a forward of their own, as with CUDA graphs
    srv.between = Interleaver(1.5 if interleave else 0.0)
    return srv


def same_tokens(a, b) -> None:
    """Two runs' ([output ids], [logprobs]) of the same requests: the same tokens, logprobs within
    fp32 noise (decode batches differ in shape)."""
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        assert max(abs(u - v) for u, v in zip(x, y)) < 1e-4


def spy_points(srv) -> tuple[list, list]:
    """(points where a decode step ran, every point the hook was called at), filled as srv runs."""
    points, hooks, real = [], [], srv._between_layers

    def spy(i):
        hooks.append(i)
        before = srv.between.steps
        real(i)
        if srv.between.steps > before:
            points.append(i)
    srv._between_layers = spy
    return points, hooks


def test_streams_and_prompt_get_the_same_tokens_with_decode_between_layers(eng):
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (20, 33, 300, 9)]
    runs = {}
    for on in (False, True):
        srv = serving(eng, on)
        # two streams decode; a 300-token prompt and a short one arrive while they do
        reqs = drive(srv, [greedy(ps[0], 40), greedy(ps[1], 40), greedy(ps[2], 5), greedy(ps[3], 5)],
                     arrive=[0, 0, 3, 4])
        runs[on] = ([r.output_ids for r in reqs], [r.logprobs for r in reqs], srv.between.steps)
        assert all(r.finish_reason == "length" for r in reqs)
        # each interleaved forward of the long prompt left its costliest layer as a sample, at its size
        assert (len(srv.between.samples) > 0) == on
        assert all(n <= 96 for n, _ in srv.between.samples.samples)
        assert not srv.sched.running and srv.state.pages.used == 0
    assert runs[False][2] == 0 and runs[True][2] > 0  # decode steps did run between layers
    same_tokens(runs[True], runs[False])


def test_decode_steps_also_run_between_a_layers_mixer_and_its_mlp(eng):
    """With mid_layer (interleave.MID_LAYER; off by default) the hook runs at i + 0.5 too, decode
    steps land there as well as before layers, and every token is the one whole-layer points
    give (fp32)."""
    g = torch.Generator().manual_seed(8)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (17, 250)]
    runs = {}
    for mid in (False, True):
        srv = serving(eng, True)
        srv.between.mid_layer = mid
        points, _ = spy_points(srv)
        reqs = drive(srv, [greedy(ps[0], 30), greedy(ps[1], 4)], arrive=[0, 3])
        assert points and any(p != int(p) for p in points) == mid
        assert all(p != int(p) or p in range(len(eng.model.layers)) for p in points)
        runs[mid] = [r.output_ids for r in reqs], [r.logprobs for r in reqs]
    same_tokens(runs[True], runs[False])


def test_decode_steps_also_run_between_the_key_pieces_of_a_long_attention(eng, monkeypatch):
    """On the CPU with key_points (interleave.KEY_POINTS) a prompt chunk's attention over more
    than a piece of context runs in key pieces (kernels/split_keys.py; 64 keys a piece here)
    with the hook at split_keys.point(i, n) between them: decode steps land there too, and every
    token is the one whole-layer points give (fp32)."""
    from freetoken.kernels import split_keys
    monkeypatch.setattr(split_keys, "KEY_PIECE", 64)
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (17, 400)]
    attn = [i for i, t in enumerate(eng.cfg.layer_types) if t == "full_attention"]
    runs = {}
    for keys in (False, True):
        srv = serving(eng, True)
        srv.between.key_points = keys
        points, hooks = spy_points(srv)
        reqs = drive(srv, [greedy(ps[0], 40), greedy(ps[1], 4)], arrive=[0, 3])
        fractional = {round(i - int(i), 6) for i in hooks if i != int(i)}
        if keys:  # hooks inside the attention layers only, at their key pieces
            assert fractional and all(0 < f < 0.5 for f in fractional)
            assert all(int(i) in attn for i in hooks if i != int(i))
            assert any(p != int(p) for p in points)  # and decode steps ran there
        else:
            assert not fractional
        runs[keys] = [r.output_ids for r in reqs], [r.logprobs for r in reqs]
    same_tokens(runs[True], runs[False])


def test_decode_steps_also_run_between_the_pieces_of_a_prompt_chunks_experts(eng, monkeypatch):
    """On the CPU executor (experts/split_experts.py; MIN_BYTES 0 here, its 16 experts are tiny) a
    prompt chunk's routed experts run in pieces with the hook at split_experts.point(i, n)
    between them: decode steps land there too, and every token is the one the whole blocks give
    (fp32: the C++ kernel's partial sums are added in fp32)."""
    from freetoken.experts import split_experts
    monkeypatch.setattr(split_experts, "MIN_BYTES", 0)
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (19, 260)]
    runs = {}
    for pieces in (False, True):
        monkeypatch.setattr(split_experts, "ENABLED", pieces)
        srv = serving(eng, True)
        points, hooks = spy_points(srv)
        reqs = drive(srv, [greedy(ps[0], 40), greedy(ps[1], 4)], arrive=[0, 3])
        expert = [i for i in hooks if split_experts.is_expert_point(i)]
        mids = {i for i in hooks if round(i - int(i), 3) == 0.5}
        if pieces:  # every MoE layer's pieces, each label one of its PIECES - 1 points
            assert {int(i) for i in expert} == set(eng.cfg.moe_layers)
            assert {round(i - int(i), 3) for i in expert} == {0.501, 0.502, 0.503}
            assert any(split_experts.is_expert_point(p) for p in points)  # and decode steps ran there
            assert {int(i) for i in mids} == set(range(len(eng.model.layers)))  # and a point before each MLP
        else:
            assert not expert and not mids
        runs[pieces] = [r.output_ids for r in reqs], [r.logprobs for r in reqs]
    same_tokens(runs[True], runs[False])


def test_a_prompt_with_no_stream_decoding_runs_its_layers_whole(eng, monkeypatch):
    """A prompt forward while nothing decodes keeps the layer points (a request that arrives can
    jump in) but no key or expert pieces: its sums are Engine.generate's; once a stream decodes,
    the next forward has them again."""
    from freetoken.experts import split_experts
    from freetoken.kernels import split_keys
    monkeypatch.setattr(split_experts, "MIN_BYTES", 0)
    monkeypatch.setattr(split_keys, "KEY_PIECE", 64)
    g = torch.Generator().manual_seed(12)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (200, 150, 19)]
    srv = serving(eng, True, step_tokens=512)
    _, hooks = spy_points(srv)
    splits = split_experts.SPLITS
    alone = drive(srv, [greedy(ps[0], 3)])[0]
    assert hooks and all(i == int(i) for i in hooks)  # layer points only
    assert split_experts.SPLITS == splits
    assert alone.output_ids == eng.generate(ps[0], 3, stop_at_eos=False).token_ids
    hooks.clear()
    drive(srv, [greedy(ps[2], 30), greedy(ps[1], 2)], arrive=[0, 3])  # the long prompt while a stream decodes
    assert any(split_experts.is_expert_point(i) for i in hooks) and split_experts.SPLITS > splits


def test_cpu_prompts_of_one_step_share_a_forward(eng, monkeypatch):
    """On the CPU a forward reads most of each layer's experts whatever its tokens: the step's
    chunks go in one varlen forward even where one of them finishes its prompt (with graphs
    those run in a forward of their own first, for their first token)."""
    srv = ServingEngine(eng, max_batch=4, max_queue=4, start=False)
    assert srv.between.enabled and not srv.mixed  # the CPU's default
    calls, real = [], eng.prefill_batch

    def spy(st, segs, **kw):
        calls.append(len(segs))
        return real(st, segs, **kw)
    monkeypatch.setattr(eng, "prefill_batch", spy)
    g = torch.Generator().manual_seed(13)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (20, 60)]
    drive(srv, [greedy(p, 2) for p in ps])
    assert calls[0] == 2  # the 20-token prompt whole and the 60-token one's first chunk


def test_key_points_of_a_batch_count_on_across_its_segments(eng, monkeypatch):
    """Two long segments in one prompt forward: each attention splits on its own, and the labels
    of a layer's key points go on increasing across them (never one label twice in a forward);
    the logits are those of the unsplit forward (fp32)."""
    from freetoken.kernels import split_keys
    monkeypatch.setattr(split_keys, "KEY_PIECE", 64)
    g = torch.Generator().manual_seed(10)
    ids = [torch.randint(5, eng.cfg.vocab_size, (330,), generator=g).tolist() for _ in range(2)]
    segs = [(ids[0][300:], 0, 300, None, True), (ids[1][300:], 1, 300, None, True)]

    def state():  # two sequences 300 tokens in
        st = eng.new_state(512, slots=2)
        for slot in (0, 1):
            eng.prefill(ids[slot][:300], st, slot, logits=False)
        return st
    seen, st = [], state()
    out = eng.prefill_batch(st, segs, between=seen.append, key_points=True)
    plain = eng.prefill_batch(state(), segs, between=lambda i: None, key_points=False)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
    keyed = [j for j in seen if split_keys.is_key_point(j)]
    attn = [i for i, t in enumerate(eng.cfg.layer_types) if t == "full_attention"]
    per_piece = len(split_keys.splits(300, st.page_size)) - 1  # points a segment's attention makes
    for i in attn:
        mine = [j for j in keyed if int(j) == i]
        assert mine == sorted(mine) and len(set(mine)) == len(mine) == 2 * per_piece, (i, mine)
    assert {int(j) for j in keyed} == set(attn)


def test_key_point_labels_stay_below_the_mid_layer_point_and_borrow_a_known_cost():
    from freetoken.kernels import split_keys
    assert split_keys.point(3, 1) == 3.001 and split_keys.point(3, 10_000) < 3.5
    assert split_keys.is_key_point(3.001) and not split_keys.is_key_point(3.5) and not split_keys.is_key_point(3)
    il = Interleaver(1.5)
    il.cost = {3: 0.004, 3.001: 0.002, 3.002: 0.003, 4: 0.001}
    assert il._cost(3.004) == 0.003  # a piece not met yet costs what the layer's latest earlier one does
    assert il._cost(4.001) is None and il._cost(5) is None  # no earlier piece of that layer: unknown


def test_no_eager_decode_step_between_the_layers_of_a_model_with_shared_forward_state(eng):
    """A model that keeps a forward's data in state its layers share (DeepSeek-V4, GLM) gets
    decode steps between a prompt's layers only where they replay a graph: an eager one (the
    CPU here, or a variant whose capture failed) would overwrite that state mid-forward. The
    streams then decode after the prompt forward, with the same tokens."""
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (15, 200)]
    runs = {}
    for shared in (False, True):
        srv = serving(eng, True)
        srv._shared_state = shared
        reqs = drive(srv, [greedy(ps[0], 20), greedy(ps[1], 3)], arrive=[0, 3])
        assert (srv.between.steps > 0) != shared and not srv.decode.replays(1)
        runs[shared] = [r.output_ids for r in reqs]
    assert runs[True] == runs[False]


def test_a_stream_that_finishes_between_layers_is_not_decoded_again(eng):
    g = torch.Generator().manual_seed(8)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 400)]
    ref = drive(serving(eng, False), [greedy(ps[0], 6), greedy(ps[1], 2)], arrive=[0, 2])
    srv = serving(eng, True, step_tokens=400)  # the long prompt in one step: the stream ends inside it
    reqs = drive(srv, [greedy(ps[0], 6), greedy(ps[1], 2)], arrive=[0, 2])
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert len(reqs[0].output_ids) == 6 and srv.between.steps > 0


def test_the_switch_puts_decode_steps_between_layers_on_eager_steps(eng):
    """--decode-between-layers: auto interleaves where decode is its own forward (CUDA graphs)
    and on the CPU (eager CUDA alone shares the prompt chunk's forward); on: decode rows in
    forwards of their own between the prompt's layers; off: never, the decode rows share the
    prompt chunk's forward. A bad value is named."""
    from freetoken.errors import FreeTokenError
    got = {}
    for mode in ("auto", "on", "off"):
        e = Engine(eng.path, EngineConfig(device="cpu", dtype="float32", prefill_chunk=32, decode_between_layers=mode))
        srv = ServingEngine(e, max_batch=2, max_queue=2, start=False)
        got[mode] = (srv.mixed, srv.between.enabled)
    assert got == {"auto": (False, True), "on": (False, True), "off": (True, False)}
    e = Engine(eng.path, EngineConfig(device="cpu", dtype="float32", prefill_chunk=32, decode_slowdown=0))
    srv = ServingEngine(e, max_batch=2, max_queue=2, start=False)
    assert (srv.mixed, srv.between.enabled) == (True, False)  # no latency budget: nothing to pace
    with pytest.raises(FreeTokenError, match="--decode-between-layers must be auto, on or off"):
        EngineConfig(decode_between_layers="yes")


def test_the_decision_counts_queued_layers_at_the_learned_cost(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("freetoken.runtime.interleave.time.perf_counter", lambda: clock[0])
    iv = Interleaver(2.0)  # prompt work between decode steps: about one decode step
    assert not iv.due(0.010)  # no decode step yet
    iv.decoded()
    assert not iv.due(0.010)  # nothing queued since
    iv.layer_queued()
    assert iv.due(0.010)  # cost unknown: one layer at a time
    clock[0] += 0.005 + 0.010  # the cycle: one layer of 5 ms, then the 10 ms decode step
    iv.cycle(0.010)
    assert iv.per_layer == pytest.approx(0.005) and iv.steps == 1 and iv.layers == 0
    for n in range(1, 4):
        iv.layer_queued()
        assert iv.due(0.010) == (n >= 2)  # 1 layer and a half: 7.5 ms; 2 and a half: past the 10 ms gap
    assert not Interleaver(0.0).enabled and not Interleaver(0.0).due(0.010)
    iv.running = True  # never from inside its own decode step
    assert not iv.due(0.010)


def test_the_chunk_is_sized_so_one_layer_fits_the_gap():
    iv = Interleaver(2.0)
    assert iv.budget(0.010) is None  # nothing measured yet: the step's own budget
    # before two cycles: whole prompt forwards spread over their 4 layers stand in
    assert iv.budget(0.010, [(64, 4 * (0.002 + 1e-5 * 64)), (512, 4 * (0.002 + 1e-5 * 512))], 4) == \
        pytest.approx(800, abs=1)
    for n in (64, 128, 256, 512):  # a layer: 2 ms fixed + 10 us a token
        iv.samples.add(n, 0.002 + 1e-5 * n)
    assert iv.budget(0.010) == pytest.approx(800, abs=1)  # (10 ms gap - 2 ms) / 10 us
    assert iv.budget(0.0015) == pytest.approx(200, abs=1)  # gap below the fixed part: the chunk costing as much
    assert Interleaver(0.0).budget(0.010) is None
    # a fixed part above the room: the floor's chunk (per-token part = fixed part, 8 ms a
    # layer) would take the gap past GAP_CEILING decode steps; the chunk stops where it does
    iv = Interleaver(1.5)
    for n in (64, 128, 256, 512):  # a layer: 4 ms fixed + 10 us a token
        iv.samples.add(n, 0.004 + 1e-5 * n)
    assert iv.budget(0.006) == pytest.approx(((GAP_CEILING - 1) * 0.006 - 0.004) / 1e-5, abs=1)
    assert iv.budget(0.010) == pytest.approx(350, abs=1)  # the floor's 400 would cost 8 ms, over 7.5
    assert iv.budget(0.020) == pytest.approx(600, abs=1)  # room 10 ms: the plain answer, above the floor
    # the fixed part alone past the ceiling (3.75 ms): no chunk meets it, and the floor stays
    # uncapped on purpose (the prompt keeps half its speed; tokens_within's docstring)
    assert iv.budget(0.005) == pytest.approx(400, abs=1)


def test_the_cost_model_separates_the_fixed_part_only_from_samples_of_different_sizes():
    cm = CostModel()
    assert cm.fit() is None and not cm
    for n in (64, 256, 128):
        cm.add(n, 0.003 + 2e-5 * n)
    fixed, per_token = cm.fit()
    assert fixed == pytest.approx(0.003) and per_token == pytest.approx(2e-5)
    # then the context grows: chunks of one size cost more each time (attention reads every
    # earlier token). The fixed part stands; the part per token follows the latest samples
    # (a fit over these would read the growth as a fixed part: an intercept near 0 or below,
    # or with noise anything)
    for i in range(8):
        cm.add(500 + i % 2, 0.003 + (1e-5 + 2e-6 * i) * 500)
    fixed, per_token = cm.fit()
    assert fixed == pytest.approx(0.003)
    assert per_token == pytest.approx(1e-5 + 2e-6 * 5.5, rel=0.01)  # the median of the last four
    assert cm.tokens_within(0.013) == pytest.approx(0.010 / 2.1e-5, rel=0.01)
    assert cm.tokens_within(0.002) == pytest.approx(0.003 / 2.1e-5, rel=0.01)  # below the fixed part: the floor
    cm.fixed = 0.5  # a fixed part the noise inflated: the floor stays within twice the chunks measured
    assert cm.tokens_within(0.002) == 1002
    cm.add(64, 0.0)  # no slower than a plain decode step: noise, not a sample
    assert len(cm) == 8 and cm.samples[-1][0] == 501
    cm2 = CostModel()
    for _ in range(4):  # one size only, never a spread: no fixed part is invented
        cm2.add(512, 0.020)
    assert cm2.fit() == (0.0, pytest.approx(0.020 / 512))
    assert cm2.tokens_within(0.0005) == MIN_PREFILL


def test_a_stalled_forward_does_not_shrink_the_chunks():
    """One forward in ten whose costliest layer took 50 ms more (a stall: an allocation, a
    compile, the host) must not read as a rate or erase the fixed part: the chunks stay where
    the layer's real cost puts them. Before, the fit through the stalls found no fixed part and
    a rate ~100x the real one, and the chunks fell to MIN_PREFILL for good."""
    rnd = random.Random(1)
    fixed, per_token, room = 0.003, 2e-6, 0.0028  # the gap is below the fixed part: the floor rule
    for stalls in (False, True):
        cm, sizes = CostModel(), []
        for i in range(60):
            n = (2048, 1024)[i] if i < 2 else min(2048, cm.tokens_within(room))
            t = (fixed + per_token * n) * (1 + 0.1 * rnd.random())
            cm.add(n, t + (0.05 if stalls and i % 10 == 5 else 0.0))
            sizes.append(n)
        assert min(sizes[-20:]) > 1000, (stalls, sizes)  # the floor rule: per-token part ~ fixed part
        assert cm.fit()[0] == pytest.approx(fixed, rel=0.15)


def test_the_rate_is_the_median_of_the_latest_samples_and_a_different_size_is_kept():
    """One stalled forward among the latest four does not set the rate (the median does not
    move with it), and a prompt's last, smaller chunk among chunks of one size is not dropped
    as a stall: it is what separates the fixed part from the rate."""
    cm = CostModel()
    for n in (2048,) * 7 + (256,):  # a layer: 3 ms fixed + 1 us a token
        cm.add(n, 0.003 + 1e-6 * n)
    assert cm.fit()[0] == pytest.approx(0.003, rel=0.01)
    cm.add(2048, 0.060)  # a stall
    fixed, per_token = cm.fit()
    assert fixed == pytest.approx(0.003, rel=0.05) and per_token == pytest.approx(1e-6, rel=0.05)


def test_chunks_stuck_at_one_small_size_grow_back():
    """Every recent chunk at one small size and no fixed part known: chunks of one size cannot
    tell a fixed part from slowness, so the chunk doubles, the spread separates the fixed part,
    and the floor rule (growing by doubling) brings the chunks back up."""
    cm = CostModel()
    for _ in range(4):
        cm.add(MIN_PREFILL, 0.0035)  # a fixed part read as a rate: ~110 us a token
    sizes = []
    for _ in range(16):
        n = cm.tokens_within(0.0028)
        sizes.append(n)
        cm.add(n, 0.003 + 1e-6 * n)
    assert sizes[0] == 2 * MIN_PREFILL
    grown = sizes[sizes.index(128):]
    assert sizes[-1] >= 2048 and grown == sorted(grown)  # doubling up
    assert cm.fit() == (pytest.approx(0.003), pytest.approx(1e-6))


def test_a_mixed_step_is_sized_from_its_prompt_part_beyond_a_decode_step(eng):
    """Eager steps that carry decode rows and a prompt chunk in one forward: the chunk is sized
    so the step takes about slowdown x a plain decode step, from the mixed steps' time beyond
    a decode step (their fixed part and part per token, CostModel): --decode-between-layers off
    on the CPU."""
    off = Engine(eng.path, EngineConfig(device="cpu", dtype="float32", prefill_chunk=32, decode_between_layers="off"))
    srv = ServingEngine(off, max_batch=2, max_queue=2, start=False)
    assert srv.mixed and not srv.between.enabled
    assert srv._prefill_budget() is None  # nothing decoding: no latency budget
    dec = greedy(list(range(5, 9)), 8)
    dec.slot, dec.computed = 0, 4  # its prompt is in: it decodes
    srv.sched.running[0] = dec
    srv._decode_s = 0.020
    assert srv._prefill_budget() is None  # no mixed step measured yet: the step's own budget
    for n in (64, 256, 128):  # beyond the decode step: 4 ms + 30 us a token
        srv._mixed.add(n, 0.004 + 3e-5 * n)
    assert srv._prefill_budget() == pytest.approx((0.5 * 0.020 - 0.004) / 3e-5, abs=1)
    srv.sched.running.clear()


def test_a_forward_of_first_tokens_allows_a_wider_gap(monkeypatch):
    """A forward whose prompts all finish in it (short prompts) waits for decode steps at
    FIRST_TOKEN_SLOWDOWN, and, up to FIRST_TOKEN_FLOOR_TOKENS prompt tokens, not more often than
    every FIRST_TOKEN_GAP_S: its time to first token is not tripled by them."""
    clock = [0.0]
    monkeypatch.setattr("freetoken.runtime.interleave.time.perf_counter", lambda: clock[0])
    iv = Interleaver(1.5)  # gap: half a 10 ms decode step
    iv.cost = {0: 0.003, 1: 0.003, 2: 0.003}
    iv.decoded()
    iv.layer_queued(0)
    iv.layer_queued(1)
    assert iv.due(0.010, 2)  # 6 ms queued + half of the next: past 5 ms
    iv.first_tokens = True
    assert not iv.due(0.010, 2)  # the gap is (2 - 1) x 10 ms here, and at least 50 ms
    iv.queued = [0, 1, 2] * 10  # 90 ms of a long prompt's layer costs queued (+ 1.5 of the next)
    assert not iv.due(0.100, 0)  # (2 - 1) x a 100 ms decode step: over the 50 ms floor
    assert iv.due(0.080, 0)
    iv.queued = [0, 1, 2] * 5  # 45 + 1.5 ms: under the floor, however short the decode step
    assert not iv.due(0.001, 0) and not iv.due(0.030, 0)
    iv.queued += [0, 1]  # 51 ms: past it
    assert iv.due(0.001, 2) and iv.due(0.030, 2)
    iv.queued = [0, 1, 2] * 5  # 46.5 ms again, in a forward past FIRST_TOKEN_FLOOR_TOKENS: no floor
    iv.tokens = FIRST_TOKEN_FLOOR_TOKENS + 1
    assert iv.due(0.030, 0) and not iv.due(0.050, 0)  # (2 - 1) x the decode step alone
    iv.tokens = FIRST_TOKEN_FLOOR_TOKENS
    assert not iv.due(0.030, 0)
    clock[0] += 0.016
    iv.queued = [0]
    iv.tokens = 50
    iv.cycle(0.010)
    iv.forward_done()
    assert len(iv.samples) == 0  # a short prompt's layer does not size the long prompt's chunks
    iv.first_tokens = False  # a long prompt's chunk: its costliest layer is a sample
    iv.decoded()
    for layers, ms in (([0], 2.0), ([1, 2], 9.0)):  # cycles: layer 0 alone, then layers 1 and 2
        iv.queued = layers
        clock[0] += ms / 1e3 + 0.010
        iv.cycle(0.010)
    iv.forward_done()
    assert iv.this_forward == {} and list(iv.samples.samples) == [(50, pytest.approx(0.0045))]


def test_by_clock_a_short_forward_goes_by_its_own_time(monkeypatch):
    """With by_clock (interleave.BY_CLOCK, off by default), a forward of short prompts that all
    finish in it, up to FIRST_TOKEN_FLOOR_TOKENS prompt tokens, takes decode steps not more often
    than every FIRST_TOKEN_GAP_S by the time it has taken (the learned costs are a long prompt's
    chunk's), and teaches no layer costs."""
    clock = [0.0]
    monkeypatch.setattr("freetoken.runtime.interleave.time.perf_counter", lambda: clock[0])
    iv = Interleaver(1.5)  # gap: half a 10 ms decode step
    iv.by_clock = True
    table = {0: 0.003, 1: 0.003, 2: 0.003}
    iv.cost = dict(table)
    iv.tokens = 200
    iv.decoded()
    iv.layer_queued(0)
    iv.layer_queued(1)
    assert iv.due(0.010, 2)  # 6 ms queued + half of the next: past 5 ms
    iv.first_tokens = True
    assert iv.floored and not iv.due(0.010, 2)  # 6 ms of learned costs, but no time spent
    iv.queued = [0, 1, 2] * 10  # 90 ms of a long prompt's layer costs queued: not what counts
    clock[0] += 0.030
    assert not iv.due(0.010, 0)  # 30 ms spent + half its mean point (0.5 ms): under 50 ms
    clock[0] += 0.019
    assert not iv.due(0.001, 0)  # 49 + 0.8 ms, however short the decode step
    clock[0] += 0.001
    assert iv.due(0.001, 0) and iv.due(0.030, 0)  # 50 ms spent
    assert not iv.due(0.100, 0)  # (2 - 1) x a 100 ms decode step: over the 50 ms floor
    iv.tokens = FIRST_TOKEN_FLOOR_TOKENS + 1  # past it: the learned costs, at FIRST_TOKEN_SLOWDOWN
    iv.decoded()
    iv.queued = [0, 1, 2] * 5  # 45 + 1.5 ms, none spent yet
    assert not iv.floored and iv.due(0.030, 0) and not iv.due(0.050, 0)
    iv.tokens = FIRST_TOKEN_FLOOR_TOKENS
    assert not iv.due(0.030, 0)
    clock[0] += 0.016
    iv.queued = [0]
    iv.tokens = 50
    iv.cycle(0.010)  # 6 ms of layer 0 of a short prompt: not layer 0's cost in a long one
    assert iv.cost == table
    iv.by_clock = False  # off: the same cycle teaches it
    clock[0] += 0.016
    iv.queued = [0]
    iv.cycle(0.010)
    assert iv.cost != table


def test_prompts_that_finish_run_before_a_long_chunk_when_decode_steps_interleave():
    a, b, c = (Request(list(range(n)), SamplingOptions(max_tokens=2)) for n in (5, 300, 7))
    ready = [(b, 0, 100), (a, 0, 5), (c, 0, 7)]
    assert ServingEngine._groups(ready) == [ready]  # one mixed forward: one group
    assert ServingEngine._groups(ready, first_tokens_first=True) == [[(a, 0, 5), (c, 0, 7)], [(b, 0, 100)]]
    assert ServingEngine._groups(ready[1:], first_tokens_first=True) == [ready[1:]]
    c.solo = True  # failed inside a shared forward before: alone, last
    assert ServingEngine._groups(ready, first_tokens_first=True) == [[(a, 0, 5)], [(b, 0, 100)], [(c, 0, 7)]]


def test_a_decode_step_comes_before_a_costly_layer(monkeypatch):
    """Layers differ (full attention reads the whole context): costs are learned per layer,
    and the decode step is taken before the costly one rather than after it."""
    clock = [0.0]
    monkeypatch.setattr("freetoken.runtime.interleave.time.perf_counter", lambda: clock[0])
    iv = Interleaver(1.5)  # gap: half a 10 ms decode step
    iv.decoded()
    for i, ms in enumerate((1, 1, 1, 8)):  # learn: one layer at a time
        iv.layer_queued(i)
        assert iv.due(0.010, (i + 1) % 4)
        clock[0] += ms / 1e3 + 0.010
        iv.cycle(0.010)
    assert [round(iv.cost[i] * 1e3, 3) for i in range(4)] == [1, 1, 1, 8]
    iv.layer_queued(0)
    assert not iv.due(0.010, 1)  # 1 ms queued, half the next: far from 5 ms
    iv.layer_queued(1)
    assert not iv.due(0.010, 2)
    iv.layer_queued(2)
    assert iv.due(0.010, 3)  # 3 ms queued + half of the 8 ms layer: past the gap
    iv.decoded()
    iv.layer_queued(0)
    assert not iv.due(0.010, 1)  # learned: 1 ms queued, half a 1 ms layer next
    clock[0] += 0.0046  # but layer 0 took 4.6 ms this time (a deeper context than it learned at)
    assert iv.due(0.010, 1)  # what elapsed counts where it is more: 4.6 + 0.5 past the 5 ms gap


def test_a_short_prompt_that_arrives_mid_forward_prefills_between_its_layers(eng):
    """A request that arrives while a long prompt's forward runs (added from inside it, before
    layer 1) prefills whole between two of its layers and has its first token before the long
    prompt's; every request gets the tokens it gets without interleaving. A prompt longer than
    one step's budget waits for the next step instead."""
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 400, 15, 500)]
    ref = drive(serving(eng, False), [greedy(p, 6) for p in ps], arrive=[0, 1, 2, 2])
    srv = serving(eng, True, step_tokens=400)  # the long prompt in one forward
    stream, long, short, longer = (greedy(p, 6) for p in ps)
    # short fits one step's budget (400): jumps in; longer (500) waits for the steps after
    added = drive_with_arrivals_mid_forward(srv, "_between_layers", stream, long, [short, longer])
    assert added and srv.jump_ins == 1 and srv.stats()["prompts_between_layers"] == 1
    assert short.first_token_at < long.first_token_at < longer.first_token_at
    assert [r.output_ids for r in (stream, long, short, longer)] == [r.output_ids for r in ref]
    assert not srv.sched.running and srv.state.pages.used == 0


def test_chunks_recover_from_a_stalled_start_within_a_few_forwards():
    """The first eight samples of the H200's interleaved 32k prompt at c471646 (tokens, ms of
    the costliest layer: compiles and first-use stalls in the first four), then a device whose
    layer costs 5.5 ms + 0.7 us a token (nearly flat: the host's launches): the chunk must
    double out of 32 tokens from the latest RECENT forwards, not wait for the stalled ones
    to leave the window (it took 13 forwards to pass 1,024 tokens that way; 8 now)."""
    m = CostModel()
    for n, ms in [(244, 79.95), (49, 26.48), (47, 17.13), (32, 16.84), (32, 5.91), (32, 5.73), (32, 5.94), (32, 5.77)]:
        m.add(n, ms / 1e3)
    decode = 5.56e-3
    sizes = []
    for _ in range(8):
        n = m.tokens_within(0.5 * decode, (GAP_CEILING - 1) * decode)
        sizes.append(n)
        m.add(n, 5.5e-3 + 0.7e-6 * n)
    assert sizes[0] == 64 and sizes == sorted(sizes) and sizes[-1] >= 1024, sizes


def test_chunks_keep_and_grow_a_size_measured_under_the_ceiling():
    """HEADROOM: where the model asks for less than the largest recent chunk, and that chunk's
    costliest layer was measured under HEADROOM x the ceiling, the chunk keeps its size; it
    grows by GROW (once per RECENT forwards, never past the prefill graphs' cap from within it)
    only where GROW times its cost is within the ceiling; over HEADROOM the model decides."""
    from freetoken.runtime.interleave import GROW, HEADROOM, RECENT
    ceiling = 4e-3

    def model(cost_of_big, big=128):
        m = CostModel()
        for n in (64, 64, 64, big):
            m.add(n, 1e-3 if n != big else cost_of_big)
        return m
    m = model(1e-3)  # 1.5 x 1 ms is well within 4 ms: grows
    assert m._headroom(40, ceiling, None) == int(128 * GROW)
    assert m._headroom(40, ceiling, None) == int(128 * GROW)  # asked again before its sample: the same
    m.add(int(128 * GROW), 1.2e-3)
    assert m._headroom(40, ceiling, None) == int(128 * GROW)  # held, not grown again within RECENT forwards
    for _ in range(RECENT):
        m.add(int(128 * GROW), 1.2e-3)
    assert m._headroom(40, ceiling, None) == int(128 * GROW * GROW)
    assert model(1e-3)._headroom(40, ceiling, 160) == 160  # the graphs' largest chunk caps the growth
    assert model(1e-3, big=160)._headroom(40, ceiling, 160) == 160  # and holds there
    assert model(1e-3, big=600)._headroom(40, ceiling, 512) == 900  # a chunk already past it: not capped
    held = 0.8 * ceiling  # under HEADROOM, but 1.5x of it would pass the ceiling: held, not grown
    assert held <= HEADROOM * ceiling and model(held)._headroom(40, ceiling, None) == 128
    assert model(0.9 * ceiling)._headroom(40, ceiling, None) == 40  # over HEADROOM: the model's answer
    assert model(1e-3)._headroom(200, ceiling, None) == 200  # the model asks for more: its answer
    assert model(1e-3)._headroom(40, None, None) == 40  # no ceiling, no headroom
    # through tokens_within: grow=False (the loop's bootstrap model, rebuilt each call) never grows
    m = model(1e-3)
    want = m.tokens_within(0.5e-3, ceiling, grow=False)
    assert want < 128 and m.tokens_within(0.5e-3, ceiling) == int(128 * GROW)


def test_the_bootstrap_model_does_not_grow_chunks(monkeypatch):
    """Before two forwards' samples, budget() sizes the chunk from the recent forwards' costs
    with a model it rebuilds each call: growth on headroom there (its once-per-RECENT limit
    reset each call) would compound call after call. Only the interleaver's own model grows."""
    grows = []
    real = CostModel.tokens_within

    def spy(self, room, ceiling=None, cap=None, grow=True):
        grows.append(grow)
        return real(self, room, ceiling, cap, grow)
    monkeypatch.setattr(CostModel, "tokens_within", spy)
    iv = Interleaver(1.5)
    costs = [(64, 40e-3), (128, 41e-3), (64, 40e-3), (64, 40e-3)]  # whole forwards of 40 layers
    assert iv.budget(0.006, costs, 40) is not None and grows == [False]
    for n in (64, 128):
        iv.samples.add(n, 1e-3)
    iv.budget(0.006, costs, 40, cap=512)
    iv.budget(0.006, costs, 40)  # no prefill graphs (the CPU): no headroom rule either
    assert grows == [False, True, False]


def test_graphed_and_eager_forwards_keep_their_own_layer_costs():
    """Where prefill graphs take chunks up to `cap` tokens, a layer of such a chunk costs a
    fraction of an eager one: a short prompt's forward (200 tokens, graphed) is judged at the
    graphed layers' costs, not at the long prompt's eager ones (which gave it a decode step
    every layer or two); before any graphed forward was measured, at the eager costs."""
    iv = Interleaver(1.5)
    iv.cap = 512
    decode = 0.006
    iv.tokens = 2000  # a long prompt's eager chunk
    iv.cost = {i: 4e-3 for i in range(4)}
    iv.tokens = 200  # a short prompt's chunk, through the graphs (not its whole prompt: FIRST_TOKEN_GAP_S)
    assert iv.graphed and iv.cost == {}
    iv.decoded()
    iv.layer_queued(0)
    assert iv.due(decode, 1)  # no graphed cost yet: judged at the eager ones (4 + 2 ms >= 6 ms)
    iv.cost = {i: 0.6e-3 for i in range(4)}
    iv.decoded()
    iv.layer_queued(0)
    assert not iv.due(decode, 1)  # 0.6 + 0.3 ms, far within the gap
    iv.tokens = 2000
    assert not iv.graphed and iv.cost == {i: 4e-3 for i in range(4)}  # the eager table kept
    iv.cap = None  # no graphs: one table whatever the size
    iv.tokens = 200
    assert not iv.graphed and iv.cost == {i: 4e-3 for i in range(4)}
    # the short prompt's whole forward (first_tokens), at its own table too: 12 points queued
    iv.first_tokens = True
    iv.decoded()
    iv.queued = [0, 1, 2, 3] * 3
    assert iv.due(decode, 0)  # at the eager costs: 48 + 2 ms reaches the 50 ms floor
    iv.cap = 512
    assert iv.graphed and not iv.due(decode, 0)  # at the graphed ones: 7.2 + 0.3 ms


def test_deferred_decode_steps_give_the_same_tokens(eng):
    """A decode step between a prompt's layers whose tokens are read at the next hook
    (runtime/deferred_step.py, on by default on CUDA; forced on here): every stream and the
    prompt get the tokens and log-probabilities the waiting steps give, sampled rows included
    (their logits come over deferred too), and each step's cycle covers only the points queued
    before it."""
    deferred_against_waiting(eng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: decode graphs, copies in flight")
@pytest.mark.parametrize("step_stream", [False, True])
def test_deferred_decode_steps_give_the_same_tokens_on_cuda(eng, step_stream):
    """The same on CUDA, where the steps replay decode graphs and the picks and logits reach
    pinned host memory while the next layer is queued behind them; with step_stream, the steps
    on a stream of their own, ordered against the prompt's layers by events."""
    cuda = Engine(eng.path, EngineConfig(device="cuda", dtype="float32", prefill_chunk=32))
    deferred_against_waiting(cuda, step_stream)


def test_device_costs_time_the_points_between_deferred_steps(eng):
    """With device_costs (on by default with deferred steps: CUDA) a deferred step's cycle is charged the time from the
    previous step's end mark to its own start mark: only the points queued between them (on the
    CPU the marks are host clock readings). The first cycle of each forward stays on the wall
    clock, or with start_marks (off by default) is timed from a mark at the forward's start; the
    tokens are the same as without."""
    g = torch.Generator().manual_seed(13)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 250)]
    runs = {}
    assert serving(eng, True).device_costs == serving(eng, True).defer_steps  # the default: with deferral (CUDA)
    for costs, marks in ((False, False), (True, False), (True, True)):
        srv = serving(eng, True)
        srv.defer_steps, srv.device_costs, srv.start_marks = True, costs, marks
        works, real = [], srv.between.cycle

        def spy(decode_s, ran=None, work_s=None, until=None, real=real, works=works):
            works.append(work_s)
            real(decode_s, ran, work_s, until)
        srv.between.cycle = spy
        out = drive(srv, [greedy(ps[0], 30), greedy(ps[1], 3)], arrive=[0, 2])
        given = [w for w in works if w is not None]
        assert bool(given) == costs and all(w > 0 for w in given)
        assert (len(given) == len(works)) == marks or not costs  # each forward's first cycle: its mark
        runs[costs, marks] = [r.output_ids for r in out]
    assert runs[True, True] == runs[True, False] == runs[False, False]


@pytest.mark.parametrize("hook_sleep", [0.0, 0.06])
def test_tail_cycles_teach_the_points_after_a_forwards_last_step(eng, hook_sleep):
    """With tail_cycles (interleave.TAIL_CYCLES, off by default) the points queued after an
    interleaved forward's last decode step learn their costs at the forward's end, on the host's
    clock (waited steps, the CPU) or the device's (deferred steps with device_costs: here host
    marks): every point of a forward with a step in it has a cost from that forward. Without it
    those points learn nothing in it. The tokens are the same either way.
    hook_sleep: each point's hook made that much slower, as a loaded machine makes the layers
    between two steps: a stretch learned twice (a forward's first deferred step timed on the
    host's clock up to its cycle's end, the next from the step's own end mark) then shows past
    the window bound, as it did in two CI runs under two test processes."""
    g = torch.Generator().manual_seed(19)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 250)]
    runs = {}
    import time
    for tail, defer in ((False, False), (True, False), (True, True)):
        srv = serving(eng, True)
        srv.tail_cycles = tail
        srv.defer_steps = srv.device_costs = defer
        iv, seen, missed, spans = srv.between, [], [], []
        real_done, real_queued, real_prefill = iv.forward_done, iv.layer_queued, srv.engine.prefill_batch
        at_start = {}

        def queued(i, seen=seen, real=real_queued):
            seen.append(i)
            time.sleep(hook_sleep)
            real(i)

        def prefill(*a, at_start=at_start, real=real_prefill, iv=iv, **kw):
            # a forward's first cycle spans from where the host clock's last cycle ended (the
            # decode step before the forward, or a tail): its window starts there, not here
            start = time.perf_counter() if iv.learn_from is None else iv.learn_from
            at_start.update(t=start, steps=iv.steps)
            return real(*a, **kw)

        def done(iv=iv, seen=seen, missed=missed, real=real_done, at_start=at_start, spans=spans):
            if iv.steps > at_start["steps"] and not iv.first_tokens:  # a long prompt's forward with a step
                missed.append(sorted(set(seen) - set(iv.this_forward)))
                # what its points learned is time inside its window
                spans.append(sum(iv.this_forward.values()) - (time.perf_counter() - at_start["t"]))
            seen.clear()
            real()
        iv.layer_queued, iv.forward_done, srv.engine.prefill_batch = queued, done, prefill
        try:
            out = drive(srv, [greedy(ps[0], 40), greedy(ps[1], 3)], arrive=[0, 2])
        finally:
            del srv.engine.prefill_batch  # the engine is the module's: its own method again
        assert missed, "no interleaved forward of the long prompt"
        # no point learns time from outside its forward's window, nor a stretch twice
        assert max(spans) < 0.05, (tail, defer, spans)  # which clock learned past its window
        if tail:
            assert all(m == [] for m in missed), missed
        else:
            assert any(m for m in missed)  # its last points learned nothing in some forward
        runs[tail, defer] = [r.output_ids for r in out]
    assert runs[True, False] == runs[False, False] == runs[True, True]
    # a forward with no decode step in it (no stream decoding) learns nothing at its end: the
    # host's time since the last decode step holds the server's idle time
    srv = serving(eng, True)
    srv.tail_cycles = True
    drive(srv, [greedy(ps[0], 4)])
    table, samples = dict(srv.between.cost), len(srv.between.samples)
    time.sleep(0.3)
    drive(srv, [greedy(ps[1], 2)])
    assert srv.between.cost == table and len(srv.between.samples) == samples


def test_a_step_before_an_eagerly_launched_point_waits_for_its_tokens(eng):
    """wait_before_eager (off by default): a decode step before a point whose prompt work
    launches eagerly waits for its tokens instead of deferring them. Without prefill graphs
    (the CPU) every point is eager: no step defers, the tokens are the same; with graphs, the
    points they do not take (full attention here) are the eager ones."""
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(17)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 250)]
    runs = {}
    for wait in (False, True):
        srv = serving(eng, True)
        srv.defer_steps, srv.wait_before_eager = True, wait
        out = drive(srv, [greedy(ps[0], 30), greedy(ps[1], 3)], arrive=[0, 2])
        assert srv.between.steps > 0 and (srv.deferred_steps == 0) == wait
        runs[wait] = [r.output_ids for r in out]
    assert runs[True] == runs[False]
    srv = serving(eng, True)
    kinds = eng.cfg.layer_types  # Qwen3.5: DeltaNet layers with a full-attention one every fourth
    att, lin = kinds.index("full_attention"), kinds.index("linear_attention")
    engine, old = srv.engine, getattr(srv.engine, "prefill_graphs", None)
    try:
        engine.prefill_graphs = SimpleNamespace(enabled=True, blocks={"deltanet": [], "moe": []}, buckets=[64])
        srv.between.cap, srv.between.tokens = 64, 48  # a chunk the graphs take
        assert srv._eager_point(att) and not srv._eager_point(lin) and not srv._eager_point(att + 0.5)
        srv.between.tokens = 96  # past their cap: the whole forward is eager
        assert srv._eager_point(lin) and srv._eager_point(lin + 0.5)
        srv.between.tokens = 48
        engine.prefill_graphs.blocks = {"deltanet": []}  # the MoE blocks eager: every point
        assert srv._eager_point(lin) and srv._eager_point(att + 0.5)
        srv.between.mid_layer = True  # point i is then the mixer alone
        assert not srv._eager_point(lin) and srv._eager_point(lin + 0.5) and srv._eager_point(att)
    finally:
        engine.prefill_graphs = old


def deferred_against_waiting(eng, step_stream: bool = False):
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (14, 21, 260, 17)]

    def reqs():  # greedy streams in slots 0 and 2, the sampled one between them (a strided pick)
        sampled = Request(list(ps[1]), SamplingOptions(temperature=0.8, top_p=0.9, max_tokens=25, ignore_eos=True,
                                                        top_logprobs=2))
        return [greedy(ps[0], 25), sampled, greedy(ps[3], 25), greedy(ps[2], 4)]
    runs = {}
    for defer in (False, True):
        srv = serving(eng, True)
        srv.defer_steps, srv.step_stream = defer, step_stream
        cycles, real = [], srv.between.cycle

        def spy(decode_s, ran=None, work_s=None, until=None, real=real, srv=srv, cycles=cycles):
            cycles.append((list(srv.between.queued), ran))
            real(decode_s, ran, work_s, until)
        srv.between.cycle = spy
        rs = reqs()
        srv._gens[rs[1].id] = torch.Generator().manual_seed(5)  # as the server seeds it (serving.py)
        from freetoken.runtime.deferred_step import DeferredStep
        real_launch, spans = DeferredStep.launch, []

        def launch(reqs, logits, t0, start=None, blocking=False, real_launch=real_launch, spans=spans):
            d = real_launch(reqs, logits, t0, start, blocking)
            spans.append(sorted(r.slot for r in d.greedy))
            return d
        DeferredStep.launch = launch
        try:
            out = drive(srv, rs, arrive=[0, 0, 0, 3])
        finally:
            DeferredStep.launch = real_launch
        assert (any(len(sl) == 2 and sl[1] - sl[0] > 1 for sl in spans)) == defer  # a strided pick ran
        assert all(r.finish_reason == "length" for r in out)
        assert srv.between.steps > 0 and (srv.deferred_steps > 0) == defer
        assert srv._deferred is None and not srv.sched.running and srv.state.pages.used == 0
        assert (srv._step_stream is not None) == (defer and step_stream and eng.device.type == "cuda")
        if defer:  # each cycle ran the points queued before its step; the one queued after stays
            assert all(ran is not None and len(queued) <= 1 for queued, ran in cycles)
        runs[defer] = [r.output_ids for r in out], [r.logprobs for r in out], [r.top_logprobs for r in out]
    assert runs[True][0] == runs[False][0]
    assert runs[True][2][1] and runs[True][2][1] == runs[False][2][1]  # the sampled row's alternatives
    for a, b in zip(runs[True][1], runs[False][1]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4  # fp32; decode batches may differ in shape


def test_a_deferred_step_that_fails_fails_its_rows_and_the_prompt_goes_on(eng):
    """The deferred step's copies fail when its tokens are read: its rows end with an error,
    the prompt forward finishes and its request gets its tokens; the loop keeps serving."""
    from freetoken.runtime import deferred_step
    g = torch.Generator().manual_seed(12)
    ps = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (10, 230)]
    srv = serving(eng, True)
    srv.defer_steps = True
    real = deferred_step.DeferredStep.wait
    calls = []

    def failing(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device copy failed")
        return real(self)
    deferred_step.DeferredStep.wait = failing
    try:
        out = drive(srv, [greedy(ps[0], 30), greedy(ps[1], 3)], arrive=[0, 3])
    finally:
        deferred_step.DeferredStep.wait = real
    assert calls and out[0].finish_reason == "error" and "device copy failed" in out[0].error
    assert out[1].finish_reason == "length" and len(out[1].output_ids) == 3
    assert srv._deferred is None and not srv.sched.running and srv.state.pages.used == 0


def test_a_deferred_steps_cycle_charges_the_points_before_it_and_keeps_the_one_after():
    """Interleaver.cycle(decode_s, ran): the cycle's time goes to the points queued before the
    step (ran), in proportion to their known costs; the point queued after it (launched while
    the step ran) stays queued, uncharged, for the next cycle."""
    import time
    il = Interleaver(1.5)
    il.decoded()
    il.cost.update({0: 0.001, 1: 0.003})
    il.layer_queued(0)
    il.layer_queued(1)
    ran, il.queued = il.queued, []  # what the loop does when the step is deferred
    il.layer_queued(2)
    time.sleep(0.02)
    il.cycle(0.0, ran)
    assert il.queued == [2] and 2 not in il.cost and 2 not in il.this_forward
    assert il.this_forward[1] == pytest.approx(3 * il.this_forward[0])  # shared by known cost
    assert il.this_forward[0] + il.this_forward[1] >= 0.02
    assert il.steps == 1
    il.cycle(0.0)  # a waiting step: every queued point, nothing kept
    assert il.queued == [] and 2 in il.cost


def test_the_stall_filter_keeps_a_stalled_point_out_of_the_chunk_sizing():
    """STALL_FILTER: a point that cost over OUTLIER times the median of its kind's points in one
    forward (the H200's layer 3 after a decode step, the host blocked meanwhile) is not the
    forward's sample; layers of a dearer kind (full attention at a deep context) still are."""
    kinds = {i: "full_attention" if i % 4 == 3 else "linear_attention" for i in range(12)}
    for on, want in ((False, 0.0084), (True, 0.0034)):
        iv = Interleaver(1.5)
        iv.stall_filter, iv.kinds, iv.tokens = on, kinds, 2046
        iv.this_forward = {i: 0.0033 if i % 4 == 3 else 0.0021 for i in range(12)}
        iv.this_forward[3], iv.this_forward[7] = 0.0084, 0.0034  # a stall; a dearer full layer
        iv.forward_done()
        assert list(iv.samples.samples) == [(2046, pytest.approx(want))]
        assert iv.stalls_dropped == (1 if on else 0)
    iv.this_forward = {i: 0.0095 if i % 4 == 3 else 0.0021 for i in range(12)}  # attention 4.5x the rest
    iv.forward_done()  # every full layer as dear: their own kind's median, none dropped
    assert iv.samples.samples[-1] == (2046, pytest.approx(0.0095)) and iv.stalls_dropped == 1
    iv.kinds = {}  # one kind, three equal points: none is a stall
    iv.this_forward = {0: 0.009, 1: 0.009, 2: 0.009}
    iv.forward_done()
    assert iv.samples.samples[-1] == (2046, pytest.approx(0.009))

