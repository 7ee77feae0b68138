"""A prompt chunk's MoE block and DeltaNet mixer replayed from graphs of its token bucket
(runtime/prefill_graphs.py): the padded, masked block equals the block on the chunk's rows
alone (the mixer's state too); a whole prefill through the graphs equals the eager one; on CUDA
the captured graphs replay what the eager blocks compute."""
import pytest
import torch

import hf_models
from freetoken.model.moe import MoE
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.model.deltanet import GatedDeltaNet
from freetoken.errors import FreeTokenError
from freetoken.runtime.prefill_graphs import BUCKETS, MAX_TOKENS, PrefillGraphs, bucket_for, buckets_upto, graphable
from freetoken.weights.convert import convert

CUDA = torch.cuda.is_available()


def build(tmp_path_factory, device: str, **kw) -> Engine:
    d = tmp_path_factory.mktemp("pgraphs")
    hf_models.save(hf_models.qwen3_5(61, num_hidden_layers=4, max_position_embeddings=2048), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return Engine(str(d / "m.ftw"), EngineConfig(device=device, dtype="float32", experts=("gpu" if device == "cuda" else "cpu"), **kw))


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    return build(tmp_path_factory, "cpu")


def moes(eng):
    return [layer[1] for layer in eng.model.layers if isinstance(layer[1], MoE)]


def mixers(eng):
    return [layer[0] for layer in eng.model.layers if isinstance(layer[0], GatedDeltaNet)]


def graphs_for(eng, buckets, kinds=("moe", "deltanet")):
    g = PrefillGraphs(eng.cfg.hidden_size, torch.device("cpu"), torch.float32, buckets=buckets)
    if "moe" in kinds:
        g.add("moe", moes(eng))
    if "deltanet" in kinds:
        g.add("deltanet", mixers(eng))
    return g


class ReplayEagerly:
    """A stand-in for a captured graph on the CPU: replay() computes what the graph records
    (the padded, masked block) into the shared output."""

    def __init__(self, graphs, block, b):
        self.graphs, self.block, self.b = graphs, block, b

    def replay(self):
        self.graphs.out[:self.b].copy_(self.graphs.padded(self.block, self.b))


def test_bucket_for_takes_the_smallest_bucket_that_holds_the_chunk():
    assert bucket_for(1, BUCKETS) == BUCKETS[0]
    assert bucket_for(BUCKETS[3], BUCKETS) == BUCKETS[3]
    assert bucket_for(BUCKETS[3] + 1, BUCKETS) == BUCKETS[4]
    assert bucket_for(BUCKETS[-1] + 1, BUCKETS) is None
    assert all(b / a <= 1.5 for a, b in zip(BUCKETS, BUCKETS[1:]))  # padding bounded


def test_the_buckets_reach_the_largest_chunk_asked_for():
    assert BUCKETS == buckets_upto(MAX_TOKENS) and BUCKETS[-1] == MAX_TOKENS
    assert buckets_upto(2048)[-1] == 2048 and buckets_upto(2000)[-1] == 2048  # the bucket holding it
    assert buckets_upto(10) == (16,) and buckets_upto(10 ** 6)[-1] == 4096
    with pytest.raises(FreeTokenError, match="prefill-graph-tokens"):
        EngineConfig(prefill_graph_tokens=0)


def test_graphable_says_why_not_on_the_cpu(eng):
    assert graphable(eng.executor, torch.device("cpu")) == "not on CUDA"
    if CUDA:  # a host executor behind a CUDA model is not the resident kernel chain
        assert "VRAM" in graphable(eng.executor, torch.device("cuda"))
    assert eng.prefill_graphs is None and eng.describe()["prefill_graphs"] is False


@pytest.mark.parametrize("t", [1, 5, 16, 23, 50])
def test_the_padded_masked_block_equals_the_block_on_the_chunk_alone(eng, t):
    m = moes(eng)[1]
    g = graphs_for(eng, (8, 16, 24, 64), ("moe",))
    try:
        gen = torch.Generator().manual_seed(t)
        g.x.copy_(torch.randn(g.x.shape, generator=gen) * 4)  # stale rows past the chunk: large, not zero
        x = torch.randn(t, eng.cfg.hidden_size, generator=gen)  # [T, H]
        b = bucket_for(t, g.buckets)
        g.stage(x, b)
        got = g.padded(m, b)[:t]
        want = m.forward(x, "prefill")
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert want.abs().max() > 0.01  # the experts did run
    finally:
        g.drop("moe")


@pytest.mark.parametrize("t", [1, 2, 5, 16, 23, 50])
def test_the_padded_mixer_equals_the_mixer_on_the_chunk_alone_state_included(eng, t):
    """A DeltaNet mixer on a chunk padded to its bucket (stale rows past it): the chunk's rows,
    the conv state (the inputs before the chunk's real end, also for a chunk shorter than the
    conv window) and the recurrent state equal the eager prefill's, from a state that is not zero."""
    m = mixers(eng)[0]
    g = graphs_for(eng, (8, 16, 24, 64), ("deltanet",))
    try:
        gen = torch.Generator().manual_seed(100 + t)
        st = eng.new_state(256)
        warm = torch.randn(37, eng.cfg.hidden_size, generator=gen)
        m.prefill_graphs = None
        m.prefill(warm, st, 0, 0)  # eager: a state that is not zero
        m.prefill_graphs = g
        conv0, rec0 = st.conv[m.layer][0].clone(), st.rec[m.layer][0].clone()
        x = torch.randn(t, eng.cfg.hidden_size, generator=gen)  # [T, H]
        g.x.copy_(torch.randn(g.x.shape, generator=gen) * 4)  # stale rows: large, not zero
        b = bucket_for(t, g.buckets)
        g.stage(x, b)
        g.conv.copy_(conv0)
        g.rec.copy_(rec0)
        got = g.padded(m, b)[:t]
        m.prefill_graphs = None
        want = m.prefill(x, st, 0, 37)  # eager from the same state
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g.conv, st.conv[m.layer][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g.rec, st.rec[m.layer][0], rtol=1e-5, atol=1e-5)
        assert (st.rec[m.layer][0] - rec0).abs().max() > 1e-3  # the chunk did move the state
    finally:
        g.drop("deltanet")


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_other_moe_families_padded_blocks_equal_their_eager_ones(tmp_path_factory, family):
    """The MoE blocks of the other families the graphs take (GPT-OSS: top-k-then-softmax router
    with a bias, clamped SwiGLU experts with biases; Qwen3-MoE: no shared expert), padded and
    masked as a graph records them, equal the block on the chunk's rows alone."""
    d = tmp_path_factory.mktemp(family)
    hf_models.save(getattr(hf_models, family)(7), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    e = Engine(str(d / "m.ftw"), EngineConfig(device="cpu", dtype="float32", experts="cpu"))
    ms = moes(e)
    assert ms
    g = PrefillGraphs(e.cfg.hidden_size, torch.device("cpu"), torch.float32, buckets=(8, 16, 32))
    g.add("moe", ms)
    try:
        gen = torch.Generator().manual_seed(4)
        for t in (3, 16, 21):
            x = torch.randn(t, e.cfg.hidden_size, generator=gen)  # [T, H]
            b = bucket_for(t, g.buckets)
            g.stage(x, b)
            want = ms[-1].forward(x, "prefill")
            torch.testing.assert_close(g.padded(ms[-1], b)[:t], want, rtol=1e-5, atol=1e-5)
            assert want.abs().max() > 1e-3
    finally:
        g.drop("moe")


def test_a_prefill_through_the_graphs_equals_the_eager_one(eng, monkeypatch):
    """Every MoE block of a whole prefill (chunks of several sizes, one past the largest
    bucket) through the graph dispatch, the graphs replayed eagerly: the same logits and state.
    The graphs are CUDA's, where the CPU's C++ rows kernel never runs: it is off here, so the
    padded and eager forms of a chunk's small GEMMs meet one implementation (with it, the 7-token
    chunk's eager GEMMs took it and the padded block's did not: 1.5e-4 apart in 2 of 28,800
    logits)."""
    from freetoken.experts import cpu
    monkeypatch.setattr(cpu, "DECODE_KERNELS", False)
    ms = moes(eng) + mixers(eng)
    g = graphs_for(eng, (8, 16, 32))
    try:
        g.x.normal_()
        for m in ms:
            for b in g.buckets:
                g.graphs[(id(m), b)] = ReplayEagerly(g, m, b)
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(5, eng.cfg.vocab_size, (90,), generator=gen)
        runs = {}
        for on in (False, True):
            g.enabled, g.replays = on, 0
            st = eng.new_state(128)
            out, s = [], 0
            for n in (7, 16, 30, 37):  # 37: past the largest bucket, eager
                out.append(eng.model.prefill(ids[s:s + n], st, 0, s, all_logits=True))
                s += n
            runs[on] = (torch.cat(out), st.rec[mixers(eng)[0].layer][0].clone(), g.replays)
        assert runs[False][2] == 0 and runs[True][2] == 3 * len(ms)  # three chunks of four through graphs
        assert mixers(eng) and moes(eng)  # both kinds ran through them
        torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-4)
    finally:
        g.drop("moe")
        g.drop("deltanet")


def test_several_prompts_in_one_forward_each_get_their_own_rows(eng):
    """A forward of several prompts' chunks calls each DeltaNet mixer once per prompt before it
    joins the results: each result must survive the next prompt's replay (the graphs share one
    output buffer). Two short prompts through the graphs equal the same forward eagerly."""
    ms = moes(eng) + mixers(eng)
    g = graphs_for(eng, (8, 16, 32))
    try:
        for m in ms:
            for b in g.buckets:
                g.graphs[(id(m), b)] = ReplayEagerly(g, m, b)
        gen = torch.Generator().manual_seed(21)
        a, b = (torch.randint(5, eng.cfg.vocab_size, (n,), generator=gen) for n in (13, 9))
        runs = {}
        for on in (False, True):
            g.enabled, g.replays = on, 0
            st = eng.new_state(64, slots=2)
            logits = eng.model.prefill_batch(torch.cat([a, b]), st, [(0, 0, 13, None, True), (1, 0, 9, None, True)])
            runs[on] = (logits, g.replays)
        assert runs[True][1] > 0
        torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-4)
    finally:
        g.drop("moe")
        g.drop("deltanet")


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_captured_graphs_replay_the_eager_block_on_cuda(tmp_path_factory):
    e = build(tmp_path_factory, "cuda", max_seq_len=2048)
    g = e.prefill_graphs
    assert g is not None and e.describe()["prefill_graphs"] is True
    assert len(g.graphs) == (len(moes(e)) + len(mixers(e))) * len(g.buckets)
    gen = torch.Generator().manual_seed(9)
    for m in moes(e)[:2]:
        for t in (1, 17, 100, 512):
            x = torch.randn(t, e.cfg.hidden_size, generator=gen).cuda()
            got = g.run(m, x).clone()
            want = m.forward(x, "prefill")
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert g.run(m, torch.randn(g.buckets[-1] + 1, e.cfg.hidden_size).cuda()) is None  # past the buckets: eager
    # a whole prompt through the graphs against the same engine with them off
    ids = torch.randint(5, e.cfg.vocab_size, (300,), generator=gen).cuda()
    runs = {}
    for on in (False, True):
        g.enabled, g.replays = on, 0
        st = e.new_state(512)
        out = [e.model.prefill(ids[s:s + 100], st, 0, s, all_logits=True) for s in range(0, 300, 100)]
        runs[on] = (torch.cat(out), g.replays)
    assert runs[True][1] == 3 * (len(moes(e)) + len(mixers(e)))
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-3, atol=1e-3)
