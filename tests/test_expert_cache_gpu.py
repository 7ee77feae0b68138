"""The GPU expert cache on CUDA (skipped elsewhere): a full-width model slice (the
Qwen3.6-35B-A3B expert and hidden sizes, random BF16), a third of its experts in slots,
teacher-forced decode at batch 1 and 4. Fill-only computes what all-resident computes, from the
same bytes with the same kernels (slot ids for flat ids): equal logits, eager and as a graph.
With a CPU share (the C++ executor runs part of the misses in fp32) and CPU-only, the logits
are those of all-resident within bf16 rounding."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def build(layers=4):
    from bench.decode import QWEN36_35B_A3B
    from bench.expert_cache import make_experts
    from freetoken.config import ModelConfig
    from freetoken.demo import random_tensor, weight_shapes
    mc = ModelConfig.from_hf(dict(QWEN36_35B_A3B, num_hidden_layers=layers, vocab_size=8192))
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = {n: random_tensor(n, s, g, device=dev, embed_std=0.02) for n, s in weight_shapes(mc, experts=False).items()}
    gu, dn = make_experts(mc, dev, seed=1)
    return mc, w, gu, dn, dev


def decode_logits(mc, w, ex, dev, tokens):
    """Teacher-forced eager decode: tokens [S, B] fed step by step -> logits [S, B, V] (fp32, host)."""
    from freetoken.model.registry import model_class
    from freetoken.model.state import DecodeState
    steps, batch = tokens.shape
    model = model_class(mc.arch)(mc, w, ex, dev, torch.bfloat16, 1024)
    st = DecodeState(mc, batch, 512, dev, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    for b in range(batch):
        st.reserve(b, 512)
        model.prefill(torch.randint(0, mc.vocab_size, (24,), generator=g).to(dev), st, b, 0)
    tok = torch.zeros(batch, dtype=torch.long, device=dev)
    pos = torch.full((batch,), 24, dtype=torch.long, device=dev)
    out = []
    for s in range(steps):
        tok.copy_(tokens[s])
        pos.fill_(24 + s)
        out.append(model.decode(tok, st, pos).float().cpu())
    return torch.stack(out)


def greedy_decode(mc, w, ex, dev, graph: bool, steps: int = 32):
    """Greedy decode of one row after a 24-token prompt, eagerly or replayed from one CUDA graph
    -> (tokens, logits [steps, 1, V] fp32 on the host)."""
    from bench.expert_cache import capture
    from freetoken.model.registry import model_class
    from freetoken.model.state import DecodeState
    model = model_class(mc.arch)(mc, w, ex, dev, torch.bfloat16, 1024)
    st = DecodeState(mc, 1, 512, dev, torch.bfloat16)
    st.reserve(0, 512)
    p = torch.randint(0, mc.vocab_size, (24,), generator=torch.Generator().manual_seed(4)).to(dev)
    tok = model.prefill(p, st, 0, 0)[-1:].argmax(-1)
    pos = torch.full((1,), 24, dtype=torch.long, device=dev)
    saved = [t.clone() for t in (*st.conv.values(), *st.rec.values())]
    step = lambda: model.decode(tok, st, pos)  # noqa: E731
    # one warm-up step either way (the capture runs one before recording), so the cache's
    # residency, and with it the CPU share of each step, evolves alike in both runs
    fn = capture(step, dev) if graph else step
    if not graph:
        step()
    for t, s in zip((*st.conv.values(), *st.rec.values()), saved):  # undo the warm-up
        t.copy_(s)
    toks, logits = [], []
    for s in range(steps):
        pos.fill_(24 + s)
        lg = fn()
        logits.append(lg.float().cpu())
        tok.copy_(lg.argmax(-1))
        toks.append(int(tok))
    return toks, torch.stack(logits)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("batch", [1, 4])
def test_cache_modes_agree(batch):
    from freetoken.experts.cached import CachedExpertExecutor
    from freetoken.experts.cpu import CpuExpertExecutor
    from freetoken.experts.executor import TorchExpertExecutor
    mc, w, gu, dn, dev = build()
    tokens = torch.randint(0, mc.vocab_size, (48, batch), generator=torch.Generator().manual_seed(9)).to(dev)
    slots = mc.num_flat_experts // 3
    resident = decode_logits(mc, w, TorchExpertExecutor(gu.to(dev), dn.to(dev), layer_experts=mc.num_experts),
                             dev, tokens)

    def cache(r):
        return CachedExpertExecutor(gu, dn, slots, dev, torch.bfloat16, CpuExpertExecutor(gu, dn, threads=4), r,
                                    "recent", mc.num_experts)
    fill = cache(1.0)
    assert fill.capturable and fill.pool.zero_copy
    got = decode_logits(mc, w, fill, dev, tokens)
    st = fill.stats()
    assert st["fills"] > 0 and st["hits"] > 0 and st["cpu_experts"] == 0
    assert torch.equal(got, resident)  # the same bytes through the same kernels
    # the lookahead (the next layer's router predicts, its misses are copied in on a side stream):
    # it moves bytes earlier and changes what is resident, never what is computed
    ahead = CachedExpertExecutor(gu, dn, slots, dev, torch.bfloat16, CpuExpertExecutor(gu, dn, threads=4), 1.0,
                                 "recent", mc.num_experts, prefetch=2)
    assert torch.equal(decode_logits(mc, w, ahead, dev, tokens), resident)
    st = ahead.stats()
    assert st["prefetched"] > 0 and 0 <= st["prefetch_used"] <= st["prefetched"]
    # a CPU share: the C++ executor's partial sums come back in fp32 and are added to the GPU's
    # in bf16, roundings the all-resident kernel does not make; through the model's recurrent
    # state they compound as CPU-only decoding's do. Held to CPU-only's distance here, and to
    # bf16 rounding per MoE call in test_split_within_bf16_rounding
    split = cache(0.5)
    got = decode_logits(mc, w, split, dev, tokens)
    assert split.stats()["cpu_experts"] > 0
    cpu = decode_logits(mc, w, CpuExpertExecutor(gu, dn, threads=4), dev, tokens)
    assert rel(got, resident) < max(5e-2, 2 * rel(cpu, resident))


def test_lookahead_copies_are_ordered(monkeypatch):
    """The lookahead's copies run on a side stream: made slow (a GPU spin before every copy, on
    whichever stream runs it) in a pool of a step's experts plus two, where each lookahead evicts
    slots the next layer may read, the logits still equal the same cache's without a lookahead,
    bit for bit: the next layer waits for the copies before it reads or overwrites a slot."""
    from freetoken.experts.cached import CachedExpertExecutor
    from freetoken.experts.cpu import CpuExpertExecutor
    mc, w, gu, dn, dev = build()
    tokens = torch.randint(0, mc.vocab_size, (12, 1), generator=torch.Generator().manual_seed(3)).to(dev)

    def cache(prefetch):
        return CachedExpertExecutor(gu, dn, mc.top_k + 2, dev, torch.bfloat16, CpuExpertExecutor(gu, dn, threads=4),
                                    1.0, "recent", mc.num_experts, prefetch=prefetch)
    plain = decode_logits(mc, w, cache(0), dev, tokens)
    ex = cache(2)
    copy = ex.pool.transfer

    def slow(src, dst):
        torch.cuda._sleep(20_000_000)  # ~10 ms: a copy still running when the next layer's work is queued
        copy(src, dst)
    monkeypatch.setattr(ex.pool, "transfer", slow)
    assert torch.equal(decode_logits(mc, w, ex, dev, tokens), plain)
    assert ex.stats()["prefetched"] > 0


def test_split_within_bf16_rounding():
    """One MoE call through the cache with a CPU share against an fp32 reference: no further
    from it than the all-resident bf16 kernel is (a wrong partial sum would be far off)."""
    from freetoken.experts.cached import CachedExpertExecutor
    from freetoken.experts.cpu import CpuExpertExecutor
    from freetoken.experts.executor import TorchExpertExecutor, reference_experts
    mc, _, gu, dn, dev = build(layers=1)
    g = torch.Generator().manual_seed(2)
    resident = TorchExpertExecutor(gu.to(dev), dn.to(dev), layer_experts=mc.num_experts)
    ex = CachedExpertExecutor(gu, dn, 64, dev, torch.bfloat16, CpuExpertExecutor(gu, dn, threads=4), 0.5,
                              "recent", mc.num_experts)
    gu32, dn32 = gu.float(), dn.float()
    for batch in (1, 4):
        for _ in range(4):
            x = torch.randn(batch, mc.hidden_size, generator=g).to(dev, torch.bfloat16)
            ids = torch.stack([torch.randperm(mc.num_experts, generator=g)[:mc.top_k] for _ in range(batch)]).to(dev)
            w = torch.softmax(torch.randn(batch, mc.top_k, generator=g), -1).to(dev)
            ref = reference_experts(x.float().cpu(), ids.cpu(), w.float().cpu(), gu32, dn32)
            err_res = rel(resident(x, ids, w).float().cpu(), ref)
            err_split = rel(ex(x, ids, w).float().cpu(), ref)
            assert err_split < max(2 * err_res, 1e-2), (batch, err_split, err_res)
    assert ex.stats()["cpu_experts"] > 0 and ex.stats()["fills"] > 0


@pytest.mark.parametrize("signal", ["hostfn", "doorbell"])
@pytest.mark.parametrize("mode", ["fill-only", "split", "cpu-only", "split+lookahead"])
def test_graph_equals_eager(mode, signal, monkeypatch):
    """The whole step replayed from one CUDA graph gives the eager step's logits: fill-only
    (control kernel, fused transfer from the host banks, slot experts), with a CPU share (the
    C++ executor called from a host-function node on a side stream), and CPU-only (the same
    host node for every routed expert). Fill-only greedy decoding follows all-resident's tokens.
    Both ways of signalling the CPU branch: the host-function node and the doorbell."""
    if mode == "fill-only" and signal == "doorbell":
        pytest.skip("fill-only has no CPU branch")
    monkeypatch.setenv("FREETOKEN_CPU_BRANCH", signal)
    from freetoken.experts.cached import CachedExpertExecutor
    from freetoken.experts.cpu import CpuExpertExecutor
    from freetoken.experts.cpu.hostcall import StreamedCpuExecutor
    from freetoken.experts.executor import TorchExpertExecutor
    mc, w, gu, dn, dev = build()
    slots = mc.num_flat_experts // 3

    def make():
        cpu = CpuExpertExecutor(gu, dn, threads=4)
        if mode == "cpu-only":
            return StreamedCpuExecutor(cpu, dev)
        ex = CachedExpertExecutor(gu, dn, slots, dev, torch.bfloat16, cpu, 1.0 if mode == "fill-only" else 0.5,
                                  "recent", mc.num_experts, prefetch=2 if mode == "split+lookahead" else 0)
        assert ex.host is not None
        return ex
    assert make().capturable
    eager_toks, eager = greedy_decode(mc, w, make(), dev, False)
    ex = make()
    graph_toks, graph = greedy_decode(mc, w, ex, dev, True)
    assert graph_toks == eager_toks and torch.equal(graph, eager)
    if mode.startswith("split"):
        assert ex.stats()["cpu_experts"] > 0 and ex.stats()["cpu_branch_calls"] > 0
    if mode == "split+lookahead":  # the side stream's copies were part of the replayed graph
        assert ex.stats()["prefetched"] > 0
    if mode == "fill-only":
        ref_toks, ref = greedy_decode(mc, w, TorchExpertExecutor(gu.to(dev), dn.to(dev), layer_experts=mc.num_experts), dev,
                                      False)
        assert eager_toks == ref_toks and torch.equal(eager, ref)
