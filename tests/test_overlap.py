"""Decode steps alongside a prompt forward (runtime/overlap.py, --decode-overlap): launched from
the loop's own thread at the prompt's hooks (polled, the default) or stepped by a worker thread
while the loop's thread runs the prompt, on the CPU here (the same code as on the GPU, with the
torch expert path). The streams and the prompts get exactly the
tokens they get without it, a stream that finishes on the worker is finished after the prompt
forward, and engines where it would be unsafe refuse it with a reason."""
import pytest
import torch

import hf_models
from drive import drive, drive_with_arrivals_mid_forward, torch_experts
from freetoken.runtime import overlap
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    d = tmp_path_factory.mktemp("overlap")
    hf_models.save(hf_models.qwen3_5(47, num_hidden_layers=4, max_position_embeddings=1024), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return str(d / "m.ftw")


def engine(path, on: bool) -> Engine:
    eng = Engine(path, EngineConfig(device="cpu", dtype="float32", prefill_chunk=32, decode_overlap=on))
    return torch_experts(eng)


def greedy(p, n):
    return Request(list(p), SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True))


def serving(eng, step_tokens=96, polled=True):
    srv = ServingEngine(eng, max_batch=4, max_queue=8, start=False)
    srv.sched.step_tokens = step_tokens  # a long prompt takes several steps of several chunks
    srv.mixed = False  # decode rows in a forward of their own (graphs); overlap sets it too
    if srv.overlap is not None:
        srv.overlap.polled = polled
    return srv


MODES = pytest.mark.parametrize("polled", [True, False], ids=["polled", "worker"])


@MODES
def test_streams_and_prompts_get_the_same_tokens_alongside(path, polled):
    g = torch.Generator().manual_seed(9)
    vocab = 320
    ps = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (21, 34, 300, 9)]
    runs = {}
    for on in (False, True):
        srv = serving(engine(path, on), polled=polled)
        assert srv.describe()["decode_overlap"] is on
        # two streams decode; a 300-token prompt and a short one arrive while they do
        reqs = drive(srv, [greedy(ps[0], 40), greedy(ps[1], 40), greedy(ps[2], 5), greedy(ps[3], 5)],
                     arrive=[0, 0, 3, 4])
        runs[on] = ([r.output_ids for r in reqs], [r.logprobs for r in reqs], srv.stats())
        assert all(r.finish_reason == "length" for r in reqs)
        assert not srv.sched.running and srv.state.pages.used == 0
    assert runs[True][2]["decode_steps_alongside_prompts"] > 0  # the streams did step on the worker
    assert runs[False][2]["decode_steps_alongside_prompts"] == 0
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4  # fp32; decode batches differ in shape


def test_polled_steps_carry_sampled_rows_and_a_failing_step_fails_only_its_rows(path):
    """The polled overlap's steps defer a sampled row too (its logits come over with the
    step): a seeded sampled stream gets the tokens it gets without overlap. A step whose
    launch fails fails its rows, finished after the prompt forward; the prompt is unharmed."""
    g = torch.Generator().manual_seed(12)
    ps = [torch.randint(5, 320, (n,), generator=g).tolist() for n in (17, 300)]

    def run(srv):
        req = Request(list(ps[0]), SamplingOptions(temperature=0.8, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True))
        srv._gens[req.id] = torch.Generator().manual_seed(5)  # what submit() does (drive adds to the queue)
        return drive(srv, [req, greedy(ps[1], 4)], arrive=[0, 2])
    ref = run(serving(engine(path, False)))
    srv = serving(engine(path, True))
    srv.slowdown = 0.0
    out = run(srv)
    assert srv.stats()["decode_steps_alongside_prompts"] > 0
    assert [r.output_ids for r in out] == [r.output_ids for r in ref]

    srv = serving(engine(path, True))
    srv.slowdown = 0.0
    real = srv.decode

    def broken(*a):
        if srv._prompt_forward:
            raise RuntimeError("a decode step failed")
        return real(*a)
    srv.decode = broken
    out = drive(srv, [greedy(ps[0], 30), greedy(ps[1], 4)], arrive=[0, 2])
    assert out[0].finish_reason == "error" and "a decode step failed" in out[0].error
    assert out[1].finish_reason == "length" and out[1].output_ids == ref[1].output_ids
    assert srv.overlap.deferred == [] and not srv.sched.running and srv.state.pages.used == 0

    # an error outside a step's launch (taking the row's next page): the steps stop for that
    # forward, the stream decodes after it, and every token is the one it gets without overlap
    greedy_ref = drive(serving(engine(path, False)), [greedy(ps[0], 30), greedy(ps[1], 4)], arrive=[0, 2])
    srv = serving(engine(path, True))
    srv.slowdown = 0.0
    real_grow, calls = srv._grow_now, []

    def grow(req):
        if srv._prompt_forward and not calls:
            calls.append(req)
            raise RuntimeError("the page table broke")
        return real_grow(req)
    srv._grow_now = grow
    out = drive(srv, [greedy(ps[0], 30), greedy(ps[1], 4)], arrive=[0, 2])
    assert calls and srv.overlap.failures == 1
    assert [r.output_ids for r in out] == [r.output_ids for r in greedy_ref]
    assert all(r.finish_reason == "length" for r in out) and srv.state.pages.used == 0


@MODES
def test_a_stream_that_finishes_alongside_is_finished_after_the_prompt(path, polled):
    g = torch.Generator().manual_seed(10)
    ps = [torch.randint(5, 320, (n,), generator=g).tolist() for n in (12, 400)]
    ref = drive(serving(engine(path, False)), [greedy(ps[0], 6), greedy(ps[1], 2)], arrive=[0, 2])
    srv = serving(engine(path, True), step_tokens=400, polled=polled)  # the long prompt in one step: the stream ends in it
    if polled:
        srv.slowdown = 0.0  # steps back to back: the 4-layer forward has only 4 hooks for them
    finished_during = []
    real = srv._prefill_alongside

    def spy(segs):
        out = real(segs)
        finished_during.append(srv.stats()["decode_steps_alongside_prompts"])
        return out
    srv._prefill_alongside = spy
    reqs = drive(srv, [greedy(ps[0], 6), greedy(ps[1], 2)], arrive=[0, 2])
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert len(reqs[0].output_ids) == 6 and reqs[0].finish_reason == "length"
    assert finished_during and max(finished_during) > 0
    assert srv.overlap.deferred == [] and not srv.sched.running and srv.state.pages.used == 0


@MODES
def test_a_short_prompt_jumps_in_between_the_overlapped_prompts_layers(path, polled):
    """A request that arrives while an overlapped prompt forward runs (added from inside it,
    before layer 1) prefills whole between two of its layers, with the decode steps paused for
    it (the worker's; the polled ones are launched by the same thread), and has its first token
    before the long prompt's; a prompt longer than one step's budget waits. Every request gets
    the tokens it gets without overlap."""
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(5, 320, (n,), generator=g).tolist() for n in (12, 400, 15, 500)]
    ref = drive(serving(engine(path, False)), [greedy(p, 6) for p in ps], arrive=[0, 1, 2, 2])
    srv = serving(engine(path, True), step_tokens=400, polled=polled)  # the long prompt in one forward
    srv.slowdown = 0.0  # polled: a step at every hook
    stream, long, short, longer = (greedy(ps[0], 40), greedy(ps[1], 6), greedy(ps[2], 6), greedy(ps[3], 6))
    jumping, clashes = [], []
    real_jump = srv._jump_in_admitted
    real_step = srv._side_poll if polled else srv._overlap_step_locked

    def jump(items):  # the loop's thread, the worker held off
        jumping.append(True)
        try:
            real_jump(items)
        finally:
            jumping.pop()

    def step():  # the worker: never while a short prompt jumps in
        clashes.append(bool(jumping))
        return real_step()
    srv._jump_in_admitted = jump
    setattr(srv, "_side_poll" if polled else "_overlap_step_locked", step)

    # short fits one step's budget (400): jumps in; longer (500) waits for the steps after
    added = drive_with_arrivals_mid_forward(srv, "_alongside_layers", stream, long, [short, longer])
    assert added and srv.stats()["prompts_between_layers"] == 1
    assert short.first_token_at < long.first_token_at < longer.first_token_at
    assert [r.output_ids for r in (short, long, longer)] == [ref[2].output_ids, ref[1].output_ids, ref[3].output_ids]
    assert stream.output_ids[:6] == ref[0].output_ids
    assert srv.stats()["decode_steps_alongside_prompts"] > 0 and clashes and not any(clashes)
    assert srv.overlap.deferred == [] and not srv.sched.running and srv.state.pages.used == 0


def test_engines_where_it_is_unsafe_refuse_it(path, caplog):
    eng = Engine(path, EngineConfig(device="cpu", dtype="float32", decode_overlap=True))
    if eng.executor is not None and eng.executor.backend == "torch":
        pytest.skip("the C++ executor was not built: the experts are on the torch path")
    srv = ServingEngine(eng, max_batch=2, max_queue=2, start=False)
    assert srv.overlap is None and srv.describe()["decode_overlap"] is False
    assert "--decode-overlap is off" in caplog.text and "not reentrant" in caplog.text
    assert overlap.eligible(torch_experts(eng), srv.decode) is None


def test_eligibility_reasons():
    """Models that keep a forward's data in state their layers share (GLM-DSA, DeepSeek-V4)
    cannot run two eager forwards at once; streamed passes and non-reentrant experts refuse."""
    from types import SimpleNamespace as NS
    from freetoken.model.deepseek_v4 import DeepseekV4Model
    from freetoken.model.glm_moe_dsa import GlmMoeDsaModel
    runner = NS(path="eager")
    eng = lambda model, backend="torch", stream=None: NS(  # noqa: E731
        device=torch.device("cpu"), executor=NS(backend=backend), model=model, prefill_stream=stream)
    plain = NS(layers=[], per_forward_state=False)
    assert overlap.eligible(eng(plain), runner) is None
    for cls in (GlmMoeDsaModel, DeepseekV4Model):
        assert cls.per_forward_state
        model = NS(layers=[], per_forward_state=cls.per_forward_state)
        assert "layers share" in overlap.eligible(eng(model), runner)
    assert "not reentrant" in overlap.eligible(eng(plain, "cpu"), runner)
    assert "streamed passes" in overlap.eligible(eng(plain, stream=object()), runner)


def test_the_pacer_keeps_the_host_two_layers_ahead():
    """LayerPacer (CUDA: the overlapped prompt forward's hooks must come as the device reaches
    each layer): before each layer the host waits for the mark of two layers back, and only
    for that one. Fake events stand for the device: each completes after a few polls."""
    from freetoken.runtime.overlap import LayerPacer
    polls, marks = [], []

    class Mark:
        def __init__(self):
            self.n, self.left = len(marks), 3
            marks.append(self)

        def record(self, stream):
            pass

        def query(self):
            polls.append(self.n)
            self.left -= 1
            return self.left <= 0

    pacer = LayerPacer(torch.device("cpu"), ahead=2, event=Mark)
    for i in range(6):
        pacer.before_layer()
        assert len(pacer.events) == min(i + 1, 2)  # never more in flight
    assert sorted(set(polls)) == [0, 1, 2, 3]  # waited for marks 0..3 (the last two still in flight)
    assert polls == sorted(polls) and all(polls.count(n) == 3 for n in range(4))


def test_the_gil_switch_interval_is_short_only_while_a_prompt_overlaps():
    """DecodeOverlap.alongside shortens Python's GIL switch interval for the worker's lifetime
    (the prompt's thread waits at most that long for the GIL back) and restores it after, also
    when the prompt forward fails; switch_s=None leaves it alone."""
    import sys
    import time

    from freetoken.runtime.overlap import DecodeOverlap
    default = sys.getswitchinterval()
    seen = []

    def step():
        seen.append(sys.getswitchinterval())
        time.sleep(0.001)
        return True
    ov = DecodeOverlap(torch.device("cpu"))
    with ov.alongside(step):
        inside = sys.getswitchinterval()
        time.sleep(0.01)
    assert inside == pytest.approx(DecodeOverlap.SWITCH_S) and seen and sys.getswitchinterval() == default
    with pytest.raises(RuntimeError), DecodeOverlap(torch.device("cpu")).alongside(step):
        raise RuntimeError("the prompt forward failed")
    assert sys.getswitchinterval() == default
    with DecodeOverlap(torch.device("cpu"), switch_s=None).alongside(step):
        assert sys.getswitchinterval() == default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: decode graphs on the high-priority stream")
@MODES
def test_streams_and_prompts_get_the_same_tokens_alongside_on_cuda(path, polled):
    """The same on CUDA, where the decode graphs replay on the high-priority stream while the
    prompt's layers run on the default one (polled: launched from the loop's thread, their
    tokens read a poll after the device ran them)."""
    g = torch.Generator().manual_seed(14)
    ps = [torch.randint(5, 320, (n,), generator=g).tolist() for n in (21, 34, 300, 9)]
    runs = {}
    for on in (False, True):
        eng = Engine(path, EngineConfig(device="cuda", dtype="float32", prefill_chunk=32, decode_overlap=on))
        srv = serving(eng, polled=polled)
        assert (srv.overlap is not None) is on, "overlap refused on CUDA"
        if on:
            srv.slowdown = 0.0  # a step whenever the last one's tokens are out
        reqs = drive(srv, [greedy(ps[0], 40), greedy(ps[1], 40), greedy(ps[2], 5), greedy(ps[3], 5)],
                     arrive=[0, 0, 3, 4])
        runs[on] = ([r.output_ids for r in reqs], [r.logprobs for r in reqs], srv.stats())
        assert not srv.sched.running and srv.state.pages.used == 0
    assert runs[True][2]["decode_steps_alongside_prompts"] > 0
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3  # fp32 (TF32 GEMMs may differ by batch shape)
