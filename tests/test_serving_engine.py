"""The serving loop as users run it: greedy rows decided on the device (the production path,
not the recorded-logits one), top log-probabilities, seeded sampling, a failing request
isolated from the batch, and shutdown ending every request in flight with an error."""
import asyncio

import pytest
import torch

import hf_models
from drive import drive
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.sampler import SamplingParams, greedy_rows, sample
from freetoken.runtime.serving import ServingEngine, ShuttingDown
from freetoken.weights.convert import convert


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = tmp_path_factory.mktemp("serving")
    hf_models.save(hf_models.qwen3_5(41, num_hidden_layers=4, max_position_embeddings=1024), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return Engine(str(d / "m.ftw"), EngineConfig(device="cpu", dtype="float32", prefill_chunk=32))


def prompts(eng, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in lens]


def greedy(p, n=6, top=0):
    return Request(list(p), SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True, top_logprobs=top))


def test_greedy_rows_match_host_sampler():
    logits = torch.randn(5, 300) * 3
    rows = [4, 0, 2]
    for (tok, lp, tops), r in zip(greedy_rows(logits, rows, top_n=7), rows):
        t2, lp2, tops2 = sample(logits[r], SamplingParams(temperature=0), None, top_n=7)
        assert tok == t2 and abs(lp - lp2) < 1e-5
        assert [i for i, _ in tops] == [i for i, _ in tops2] and tops[0][0] == tok
        assert all(a[1] >= b[1] for a, b in zip(tops, tops[1:]))
        ref = torch.log_softmax(logits[r], -1)
        assert all(abs(ref[i] - v) < 1e-5 for i, v in tops)


def test_production_greedy_path_matches_generate(eng):
    """Serving without recorded logits (greedy picked on the device) = Engine.generate."""
    ps = prompts(eng, (37, 5, 70))
    srv = ServingEngine(eng, max_batch=3, max_queue=4, start=False)
    reqs = drive(srv, [greedy(p, top=3) for p in ps], arrive=[0, 1, 3])
    for r, p in zip(reqs, ps):
        g = eng.generate(p, 6, SamplingParams(temperature=0), stop_at_eos=False)
        assert r.output_ids == g.token_ids and r.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(r.logprobs, g.logprobs)) < 1e-4
        assert len(r.top_logprobs) == 6 and all(len(t) == 3 for t in r.top_logprobs)
        for tok, lp, tops in zip(r.output_ids, r.logprobs, r.top_logprobs):
            assert tops[0][0] == tok and abs(tops[0][1] - lp) < 1e-6  # greedy: the top entry
            assert tops[0][1] >= tops[1][1] >= tops[2][1]


def test_top_logprobs_of_sampled_rows(eng):
    p = prompts(eng, (20,), seed=1)[0]
    srv = ServingEngine(eng, max_batch=2, max_queue=4, record_logits=True, start=False)
    r = Request(p, SamplingOptions(temperature=0.8, seed=5, max_tokens=5, ignore_eos=True, top_logprobs=4))
    drive(srv, [r])
    for logits, tok, lp, tops in zip(r.logits, r.output_ids, r.logprobs, r.top_logprobs):
        ref = torch.log_softmax(logits, -1)
        assert abs(float(ref[tok]) - lp) < 1e-5
        assert [i for i, _ in tops] == torch.topk(ref, 4).indices.tolist()


def test_seeded_requests_are_reproducible_with_a_running_engine_thread(eng):
    p = prompts(eng, (12,), seed=2)[0]

    async def go():
        srv = ServingEngine(eng, max_batch=4, max_queue=8)
        try:
            outs = []
            for _ in range(2):
                reqs = [Request(p, SamplingOptions(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True))
                        for _ in range(3)]
                queues = [srv.submit(r) for r in reqs]
                for q in queues:
                    while (await asyncio.wait_for(q.get(), 60)).finish_reason is None:
                        pass
                outs += [r.output_ids for r in reqs]
            return outs
        finally:
            srv.shutdown()
    outs = asyncio.run(go())
    assert all(o == outs[0] for o in outs) and len(outs[0]) == 8


def _inject(eng, bad, calls):
    """Make every forward that holds a chunk of the prompt `bad` raise (both forward kinds)."""
    def faulty(toks):
        return toks[:5] == bad[:5] or toks == bad[-len(toks):]
    real_batch, real_mixed = eng.prefill_batch, eng.forward_mixed

    def prefill_batch(st, segs, **kw):  # kw: the interleaved forward's hook (between=)
        calls.append(len(segs))
        if any(faulty(seg[0]) for seg in segs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return real_batch(st, segs, **kw)

    def forward_mixed(st, tokens, pos, active, segs):
        calls.append(len(segs) + 1)
        if any(faulty(seg[0]) for seg in segs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return real_mixed(st, tokens, pos, active, segs)
    eng.prefill_batch, eng.forward_mixed = prefill_batch, forward_mixed


@pytest.mark.parametrize("mixed", [False, True], ids=["interleaved", "mixed"])
def test_failing_prefill_fails_only_its_request(eng, mixed):
    """The faulty prompt shares a forward with others (prompt chunks; mixed, with
    --decode-between-layers off on the CPU, decode rows too; interleaved, the CPU's default, the
    streams decode between its layers): they all start over alone, only the faulty one fails,
    and the others' outputs are unchanged."""
    from freetoken.runtime.interleave import Interleaver
    ps = prompts(eng, (30, 50, 9), seed=3)
    ref = drive(ServingEngine(eng, max_batch=3, max_queue=4, start=False), [greedy(p) for p in ps])
    srv = ServingEngine(eng, max_batch=3, max_queue=4, start=False)
    assert srv.mixed is False  # the CPU's default: decode steps between the prompt's layers
    if mixed:
        srv.mixed, srv.between = True, Interleaver(0.0)
    calls = []
    _inject(eng, ps[1], calls)
    try:
        reqs = drive(srv, [greedy(p) for p in ps], arrive=[0, 1, 1])
    finally:
        del eng.prefill_batch, eng.forward_mixed
    assert max(calls) >= 2  # the faulty prompt was in a shared forward first
    assert reqs[1].finish_reason == "error" and reqs[1].output_ids == [] and "out of memory" in reqs[1].error
    for i in (0, 2):
        assert reqs[i].finish_reason == "length" and reqs[i].output_ids == ref[i].output_ids
    assert not srv.sched.running and len(srv.sched.free) == 3  # every slot came back
    assert srv.state.pages.used == 0  # and every page


def test_failing_decode_step_fails_its_rows_only(eng):
    ps = prompts(eng, (10, 80), seed=4)
    ref = drive(ServingEngine(eng, max_batch=2, max_queue=4, start=False), [greedy(p) for p in ps])
    srv = ServingEngine(eng, max_batch=2, max_queue=4, start=False)
    real, calls = srv.decode, []

    def decode(*a):  # decode-only forwards: the first one fails
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected decode failure")
        return real(*a)
    srv.decode = decode
    reqs = drive(srv, [greedy(p) for p in ps], arrive=[0, 4])
    # request 0 decodes alone at step 1 and fails there; request 1 arrives later and is served
    assert reqs[0].finish_reason == "error" and len(reqs[0].output_ids) == 1
    assert reqs[1].finish_reason == "length" and reqs[1].output_ids == ref[1].output_ids


def test_shutdown_ends_requests_in_flight_with_an_error(eng):
    p = prompts(eng, (16,), seed=5)[0]

    async def go():
        srv = ServingEngine(eng, max_batch=1, max_queue=4)
        reqs = [greedy(p, n=10_000) for _ in range(3)]  # one running, two waiting
        queues = [srv.submit(r) for r in reqs]
        while not reqs[0].output_ids:
            await asyncio.sleep(0.01)
        srv.begin_shutdown()
        with pytest.raises(ShuttingDown):
            srv.submit(greedy(p))
        last = []
        for q in queues:
            ev = await asyncio.wait_for(q.get(), 60)
            while ev.finish_reason is None:
                ev = await asyncio.wait_for(q.get(), 60)
            last.append(ev)
        srv.shutdown()
        return last
    for ev in asyncio.run(go()):
        assert ev.finish_reason == "error" and "shutting down" in ev.error


def test_decode_path_says_why_it_is_eager(eng):
    srv = ServingEngine(eng, max_batch=1, max_queue=1, start=False)
    d = srv.describe()
    assert d["decode_path"] == "eager" and d["eager_reason"] == "no CUDA device"
    assert d["expert_backend"] in ("cpp", "torch-fallback") and d["memory_plan"]["kv_pages"] >= 2


def test_a_request_past_the_context_fails_alone_with_a_clear_error(eng):
    """The server checks prompt + max_tokens at the door; a request that reaches the loop past
    the context anyway (an embedding caller, a bench) fails alone, saying why, and the loop
    keeps serving the others."""
    srv = ServingEngine(eng, max_batch=2, max_queue=4, start=False)
    too_long = greedy(prompts(eng, (srv.max_len + 40,), seed=9)[0], n=2)
    ok = greedy(prompts(eng, (12,), seed=10)[0], n=3)
    drive(srv, [too_long, ok])
    assert too_long.finish_reason == "error" and "context holds" in too_long.error
    assert ok.finish_reason == "length" and len(ok.output_ids) == 3
    assert srv.state.pages.used == 0


def test_the_load_time_warm_up_leaves_no_trace(eng):
    """Engine._warm_up_prefill (run at load on CUDA with resident experts) prefills scratch
    prompts on a state of its own: a request's logits after it are what they were before, to
    the bit, and the lengths it uses stay within the chunk."""
    p = prompts(eng, [45], seed=7)[0]
    st = eng.new_state(64)
    before = eng.prefill(p, st, all_logits=True).clone()  # [45, V]
    seen, real = [], eng.model.prefill

    def record(tokens, *a, **k):
        seen.append(len(tokens))
        return real(tokens, *a, **k)
    eng.model.prefill = record
    try:
        eng._warm_up_prefill()
    finally:
        del eng.model.prefill  # the class's method again
    # the FP8 row tiles and the MoE tile switch (16 x 16 experts / top-4 + 1 = 65), all within the
    # 32-token chunk of this engine
    assert seen == [16, 32], seen
    st2 = eng.new_state(64)
    after = eng.prefill(p, st2, all_logits=True)
    assert torch.equal(before, after)
    assert not torch.equal(before[:-1], before[1:])  # fresh logits at each position, not a constant
