"""Expert pieces (experts/pieces.py): experts cut along their intermediate dimension compute the
same routed output as whole ones, through the torch reference, the C++ executor and the expert
cache, with biases and the clamped activations; the in-place re-layout composes."""
import pytest
import torch

from freetoken.experts.cached import CachedExpertExecutor
from freetoken.experts.cpu import CpuExpertExecutor
from freetoken.experts.executor import NO_EXPERT, Activation, TorchExpertExecutor, reference_experts
from freetoken.experts.pieces import PiecedExecutor, expand_routes, split_banks_, split_biases


def banks(n, h, i, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, 2 * i, h, generator=g) * h ** -0.5).to(dtype),
            (torch.randn(n, h, i, generator=g) * i ** -0.5).to(dtype))


def routes(t, e, k, g, layer=0):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) + layer * e  # [T, k]
    return ids, torch.softmax(torch.randn(t, k, generator=g), -1)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("pieces", [2, 3, 4])
@pytest.mark.parametrize("kind", ["silu", "swiglu_clamp", "silu_clamp"])
def test_pieces_compute_the_whole_experts(pieces, kind):
    n, h, i, k, t = 12, 40, 24, 3, 9
    gu, dn = banks(n, h, i, seed=pieces)
    g = torch.Generator().manual_seed(11)
    gub, dnb = torch.randn(n, 2 * i, generator=g) * 0.3, torch.randn(n, h, generator=g) * 0.3
    act = Activation(kind, limit=1.5)  # a low limit: the clamps bite
    x = torch.randn(t, h, generator=g)
    ids, w = routes(t, n, k, g)
    ids[2, 1] = NO_EXPERT  # a pair that runs nowhere
    ids[5] = NO_EXPERT  # an idle row
    ref = reference_experts(x, ids, w, gu, dn, act, gub, dnb)
    pgu, pdn = split_banks_(gu.clone(), dn.clone(), pieces)
    pgub, pdnb = split_biases(gub, dnb, pieces)
    assert pgu.shape == (n * pieces, 2 * i // pieces, h) and pdn.shape == (n * pieces, h, i // pieces)
    pids, pw = expand_routes(ids, w, pieces)
    got = reference_experts(x, pids, pw, pgu, pdn, act, pgub, pdnb)
    assert rel(got, ref) < 1e-5
    assert float(got[5].abs().max()) == 0.0
    assert (pids[2, pieces:2 * pieces] == NO_EXPERT).all() and (pids[0] >= 0).all()


def test_split_in_place_keeps_the_memory_and_composes():
    gu, dn = banks(6, 32, 16, seed=1)
    p_gu, p_dn = split_banks_(gu.clone(), dn.clone(), 4)
    a_gu, a_dn = gu.clone(), dn.clone()
    ptr = a_gu.data_ptr()
    two_gu, two_dn = split_banks_(a_gu, a_dn, 2)
    four_gu, four_dn = split_banks_(two_gu, two_dn, 2)  # each half cut in two again
    assert four_gu.data_ptr() == ptr and torch.equal(four_gu, p_gu) and torch.equal(four_dn, p_dn)
    # piece j of expert e: gate rows j*Ip.., up rows I + j*Ip.., down columns j*Ip..
    e, j, ip = 3, 2, 4
    assert torch.equal(p_gu[e * 4 + j, :ip], gu[e, j * ip:(j + 1) * ip])
    assert torch.equal(p_gu[e * 4 + j, ip:], gu[e, 16 + j * ip:16 + (j + 1) * ip])
    assert torch.equal(p_dn[e * 4 + j], dn[e, :, j * ip:(j + 1) * ip])


def test_bad_pieces_are_refused_with_the_reason():
    gu, dn = banks(2, 16, 12, seed=2)
    with pytest.raises(ValueError, match="divisor of the experts' intermediate size 12"):
        split_banks_(gu, dn, 5)
    with pytest.raises(ValueError, match="divisor"):
        split_banks_(gu, dn, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_executor_over_pieces_equals_whole_experts(dtype):
    n, h, i, k = 16, 64, 32, 4
    gu, dn = banks(n, h, i, seed=5, dtype=dtype)
    whole = CpuExpertExecutor(gu, dn)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, h, generator=g)
    ids, w = routes(3, n, k, g)
    ref = whole(x, ids, w)
    pgu, pdn = split_banks_(gu.clone(), dn.clone(), 2)
    got = PiecedExecutor(CpuExpertExecutor(pgu, pdn), 2)(x, ids, w)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: per-piece partial sums rounded apart
    assert rel(got, ref) < tol


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_cache_over_pieces_equals_all_resident(share):
    """The cache's slots hold pieces: a missed expert is p misses, some filled, some on the CPU."""
    layers, e, h, i, k, pieces = 3, 8, 48, 24, 2, 4
    gu, dn = banks(layers * e, h, i, seed=9)
    ref_gu, ref_dn = gu.clone(), dn.clone()
    pgu, pdn = split_banks_(gu, dn, pieces)
    inner = CachedExpertExecutor(pgu, pdn, 10, "cpu", torch.float32, CpuExpertExecutor(pgu, pdn), share, "recent",
                                 layer_experts=e * pieces)
    ex = PiecedExecutor(inner, pieces)
    assert ex.capturable == inner.capturable and ex.backend == "gpu-cache" and ex.pool is inner.pool
    g = torch.Generator().manual_seed(3)
    for step in range(10):
        layer = step % layers
        t = 1 + step % 3
        x = torch.randn(t, h, generator=g)
        ids, w = routes(t, e, k, g, layer)
        if t > 1:
            ids[-1] = NO_EXPERT
        got = ex(x, ids, w)
        assert rel(got, reference_experts(x, ids, w, ref_gu, ref_dn)) < 1e-5, step
    st = ex.stats()
    assert st["expert_pieces"] == pieces and st["slots"] == 10
    assert st["bytes_moved"] == st["fills"] * (ref_gu[0].numel() + ref_dn[0].numel()) * 4 // pieces
    if share == 0.5:  # misses shared between the fills and the CPU
        assert st["fills"] > 0 and st["cpu_experts"] > 0


def test_the_wrapper_copies_keeps_its_own_pieces_and_runs():
    """copy/pickle-style construction finds no attribute rather than failing; `pieces` and `inner`
    belong to the wrapper, every other attribute set goes to the inner executor; run() expands."""
    import copy
    n, h, i = 8, 32, 16
    gu, dn = banks(n, h, i, seed=8)
    pgu, pdn = split_banks_(gu.clone(), dn.clone(), 2)
    inner = TorchExpertExecutor(pgu, pdn, layer_experts=2 * n)
    ex = PiecedExecutor(inner, 2)
    twin = copy.copy(ex)
    assert twin.pieces == 2 and twin.inner is inner
    ex.warm_control = False
    assert inner.warm_control is False and "warm_control" not in ex.__dict__
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, h, generator=g)
    ids, w = routes(3, n, 2, g)
    ref = reference_experts(x, ids, w, gu, dn)
    assert rel(ex.run(x, ids, w, "decode"), ref) < 1e-5
    ex.pieces = 1  # the wrapper's own: the inner executor is untouched
    assert "pieces" not in inner.__dict__


def test_pieced_torch_executor_runs_the_gpu_kernels_path():
    n, h, i, k = 8, 32, 16, 2
    gu, dn = banks(n, h, i, seed=6)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, h, generator=g)
    ids, w = routes(5, n, k, g)
    ref = TorchExpertExecutor(gu, dn)(x, ids, w, phase="prefill")
    pgu, pdn = split_banks_(gu.clone(), dn.clone(), 2)
    got = PiecedExecutor(TorchExpertExecutor(pgu, pdn, layer_experts=2 * n), 2)(x, ids, w, phase="prefill")
    assert rel(got, ref) < 1e-5


QUANT_CASES = [("fp8_block", 256, 2), ("mxfp4", 96, 3), ("nvfp4", 96, 2), ("nvfp4", 96, 6)]  # format, I, pieces


def quant_banks(fmt, n, h, i, seed):
    from test_quant_kernels import random_bank  # edge values: zero and subnormal scales, whole blocks of +-6
    g = torch.Generator().manual_seed(seed)
    sdt = torch.bfloat16 if fmt == "fp8_block" else None  # fp8: Qwen's bf16 block scales
    return random_bank(fmt, sdt, n, 2 * i, h, 2, g), random_bank(fmt, sdt, n, h, i, 1, g)


@pytest.mark.parametrize("fmt,i,pieces", QUANT_CASES)
def test_quantized_pieces_hold_the_whole_experts_bytes(fmt, i, pieces):
    """Each piece of a quantized expert dequantizes to exactly its rows of the whole expert:
    gate_j and up_j of gate_up (fp8: its 128-row block scales with them; nvfp4: the expert's
    scale_2 for each piece), columns I_j of down with their scales."""
    n, h = 5, 256
    gu, dn = quant_banks(fmt, n, h, i, seed=pieces)
    w_gu, w_dn = gu.dequant(torch.arange(n)), dn.dequant(torch.arange(n))  # [N, 2I, H], [N, H, I]
    before = gu.values.data_ptr(), dn.scale.data_ptr()
    pgu, pdn = split_banks_(gu, dn, pieces)
    assert (pgu.values.data_ptr(), pdn.scale.data_ptr()) == before  # in place, same memory
    assert pgu.format == fmt and pgu.shape == (n * pieces, 2 * i // pieces, h) and pdn.shape == (n * pieces, h, i // pieces)
    ip = i // pieces
    got_gu, got_dn = pgu.dequant(torch.arange(n * pieces)), pdn.dequant(torch.arange(n * pieces))
    for e in range(n):
        for j in range(pieces):
            f = e * pieces + j
            assert torch.equal(got_gu[f, :ip], w_gu[e, j * ip:(j + 1) * ip]), (e, j)
            assert torch.equal(got_gu[f, ip:], w_gu[e, i + j * ip:i + (j + 1) * ip]), (e, j)
            assert torch.equal(got_dn[f], w_dn[e, :, j * ip:(j + 1) * ip]), (e, j)


def test_quantized_pieces_must_hold_whole_scale_blocks():
    gu, dn = quant_banks("mxfp4", 2, 64, 96, seed=1)
    with pytest.raises(ValueError, match=r"whole 32-value scale blocks: 96 intermediate rows in 2 pieces are 48 "
                                         r"each; pick one that leaves whole blocks, e.g. 3$"):
        split_banks_(gu, dn, 2)
    gu, dn = quant_banks("fp8_block", 2, 64, 192, seed=1)  # 192 = 1.5 blocks of 128: no cut holds whole blocks
    with pytest.raises(ValueError, match="192 rows cannot be cut into whole blocks: leave pieces at 1"):
        split_banks_(gu, dn, 2)
    one_gu, one_dn = split_banks_(gu, dn, 1)  # 1 is no cut, whatever the blocks
    assert torch.equal(one_gu.dequant(torch.arange(2)), gu.dequant(torch.arange(2)))


@pytest.mark.parametrize("fmt,i,pieces", QUANT_CASES[:3])
def test_cpp_executor_over_quantized_pieces_equals_whole_experts(fmt, i, pieces):
    """The C++ executor dequantizing pieces in its kernels gives the whole experts' output
    (fp32 accumulation; only the order of the sum differs), GPT-OSS's biased clamped SwiGLU too."""
    from freetoken.experts.banks import ExpertBanks
    n, h, k = 8, 256, 3
    gu, dn = quant_banks(fmt, n, h, i, seed=7)
    g = torch.Generator().manual_seed(12)
    fn = dict(activation=Activation("swiglu_clamp", 1.702, 7.0),
              gate_up_bias=torch.randn(n, 2 * i, generator=g) * 0.3, down_bias=torch.randn(n, h, generator=g) * 0.1)
    x = torch.randn(4, h, generator=g)
    ids, w = routes(4, n, k, g)
    ids[1, 2] = NO_EXPERT
    ref = CpuExpertExecutor(ExpertBanks(fmt, gu, dn), **fn)(x, ids, w)
    gub, dnb = split_biases(fn["gate_up_bias"], fn["down_bias"], pieces)
    pgu, pdn = split_banks_(gu, dn, pieces)
    got = PiecedExecutor(CpuExpertExecutor(ExpertBanks(fmt, pgu, pdn), activation=fn["activation"],
                                           gate_up_bias=gub, down_bias=dnb), pieces)(x, ids, w)
    assert rel(got, ref) < 1e-5


PIECED_QUANT = [("mxfp4", 3), ("nvfp4", 2), ("mxfp4-swiglu-bias", 3)]  # test_expert_cache_quant's cases (I = 96)


def pieced_quant_cache(case: str, pieces: int, share: float, dev, dtype, pin: bool = False):
    """(the pieced cache over a quantized case's banks cut in place, every expert resident
    whole on `dev` as the reference, the calls to make)."""
    from test_expert_cache_quant import E, N, calls, make, pinned
    gu, dn, fn = make(case, seed=pieces + (10 if share < 1 else 0))
    if pin:
        gu, dn = pinned(gu), pinned(dn)
    whole = torch.arange(N)
    on_dev = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in fn.items()}
    res = TorchExpertExecutor(gu.select(whole).to(dev), dn.select(whole).to(dev), layer_experts=E, **on_dev)
    gub, dnb = split_biases(fn.get("gate_up_bias"), fn.get("down_bias"), pieces)
    pfn = dict(fn, gate_up_bias=gub, down_bias=dnb) if fn else {}
    pgu, pdn = split_banks_(gu, dn, pieces)  # in place: pinned memory stays pinned
    slots = (E if share == 1.0 else 5) * pieces  # fill-only: a layer's pieces fit (a prefill's too), as the engine plans
    inner = CachedExpertExecutor(pgu, pdn, slots, dev, dtype, CpuExpertExecutor(pgu, pdn, **pfn), share,
                                 layer_experts=E * pieces, **pfn)
    return PiecedExecutor(inner, pieces), res, calls(40, seed=3, prefill_every=9)


@pytest.mark.parametrize("share", [1.0, 0.5])
@pytest.mark.parametrize("case,pieces", PIECED_QUANT)
def test_quantized_pieced_cache_equals_whole_resident(case, pieces, share):
    """The cache over quantized pieces (fill-only: one layer's worth of slots of three; split:
    5 experts' worth, the C++ executor running pieces on the host banks; evictions every few
    calls) against every whole expert resident: equal within fp32 summation order, decode and
    prefill calls alike."""
    ex, res, steps = pieced_quant_cache(case, pieces, share, "cpu", torch.float32)
    for x, ids, w, phase in steps:
        got, ref = ex(x, ids, w, phase=phase), res(x, ids, w, phase=phase)
        assert torch.isfinite(ref).all() and rel(got, ref) < 1e-5, phase
    st = ex.stats()
    assert st["expert_pieces"] == pieces and st["fills"] > st["slots"]
    assert (st["cpu_experts"] > 0) == (share < 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("share", [1.0, 0.5])
@pytest.mark.parametrize("case,pieces", PIECED_QUANT)
def test_quantized_pieced_cache_on_cuda(case, pieces, share):
    """The same on the GPU as the engine runs it: pinned host banks cut in place, the fused
    zero-copy transfer, the quantized Triton kernels over the pieces' slots in bf16: each call
    within bf16 rounding of every whole expert resident on the GPU."""
    dev = torch.device("cuda")
    ex, res, steps = pieced_quant_cache(case, pieces, share, dev, torch.bfloat16, pin=True)
    assert ex.pool.zero_copy
    errs = []
    for x, ids, w, phase in steps:
        x, ids, w = x.to(dev, torch.bfloat16), ids.to(dev), w.to(dev)
        errs.append((phase, round(rel(ex(x, ids, w, phase=phase).float(), res(x, ids, w, phase=phase).float()), 4)))
    assert max(e for _, e in errs) < 2e-2, errs


@pytest.mark.parametrize("prefetch", [0, 1])
def test_model_served_through_pieced_cache_equals_transformers(tmp_path, prefetch):
    """--expert-pieces 4: the banks re-laid in place, the cache over pieces, prompts through the
    streamed prefill passes (the loader over pieces), decode steps split between fills and the
    CPU, the lookahead over pieces: the served tokens and logits are transformers'."""
    import hf_models
    from drive import drive
    from freetoken.cache.config import CacheConfig
    from freetoken.runtime.engine import Engine, EngineConfig
    from freetoken.runtime.request import Request, SamplingOptions
    from freetoken.runtime.serving import ServingEngine
    from freetoken.weights.convert import convert
    model = hf_models.qwen3_5(29, num_hidden_layers=4, num_experts=16, num_experts_per_tok=2)
    hf_models.save(model, str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    eng = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", moe="cache", fill_share=0.5,
                                                       prefill_chunk=16, expert_pieces=4, expert_prefetch=prefetch))
    ex = eng.executor
    assert ex.pieces == 4 and ex.num_experts == 4 * 16 * 4 and eng.prefill_stream.loader.experts == 16 * 4
    assert eng.describe()["expert_pieces"] == 4 and eng.describe()["expert_backend"] == "gpu-cache"
    srv = ServingEngine(eng, max_batch=2, max_queue=4, start=False, record_logits=True,
                        cache=CacheConfig(enabled=False))
    assert srv.plan.expert_slots == 4 * 16 * 4  # every piece fits: the plan counts pieces
    ex.pool = None
    ex.allocate(24)  # 6 experts' worth of pieces of the 64 experts
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (23, 7)]
    reqs = drive(srv, [Request(p, SamplingOptions(temperature=0, max_tokens=8, ignore_eos=True)) for p in prompts],
                 arrive=[0, 2])
    hf_models.assert_served_like(model, prompts, reqs)
    st = ex.stats()
    assert st["expert_pieces"] == 4 and st["fills"] > 0 and st["cpu_experts"] > 0 and st["slots_used"] <= 24


def test_engine_refuses_pieces_that_do_not_divide(tmp_path):
    import hf_models
    from freetoken.errors import FreeTokenError
    from freetoken.runtime.engine import Engine, EngineConfig
    from freetoken.weights.convert import convert
    model = hf_models.qwen3_5(31, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    hf_models.save(model, str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    with pytest.raises(FreeTokenError, match="--expert-pieces 5: .*divisor of the experts' intermediate size 32"):
        Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", moe="cache", expert_pieces=5))
    with pytest.raises(FreeTokenError, match="--expert-pieces must be >= 1"):
        EngineConfig(expert_pieces=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("share", [1.0, 0.5])
def test_pieced_cache_on_cuda_within_bf16_rounding_and_graph_equals_eager(share):
    """The full-width slice (test_expert_cache_gpu.build), experts cut in 2 on their registered
    host banks: one MoE call through the pieced cache is no further from an fp32 reference than
    the all-resident bf16 kernel; a whole decode step replayed from one CUDA graph (the routes
    expanded inside it) gives the eager step's logits."""
    from test_expert_cache_gpu import build, greedy_decode
    mc, w, gu, dn, dev = build(layers=2)
    g = torch.Generator().manual_seed(2)
    calls = []  # (x, ids, weights, fp32 reference, the resident kernel's output) before the banks are cut
    resident = TorchExpertExecutor(gu.to(dev), dn.to(dev), layer_experts=mc.num_experts)
    for batch in (1, 4):
        x = torch.randn(batch, mc.hidden_size, generator=g).to(dev, torch.bfloat16)
        ids = torch.stack([torch.randperm(mc.num_experts, generator=g)[:mc.top_k] for _ in range(batch)])
        wt = torch.softmax(torch.randn(batch, mc.top_k, generator=g), -1).to(dev)
        used, local = ids.unique(return_inverse=True)  # the reference over just the routed experts, in fp32
        ref = reference_experts(x.float().cpu(), local, wt.float().cpu(), gu[used].float(), dn[used].float())
        calls.append((x, ids.to(dev), wt, ref, resident(x, ids.to(dev), wt).float().cpu()))
    del resident
    pgu, pdn = split_banks_(gu, dn, 2)  # in place: the registered memory stays registered

    def make():
        cpu = CpuExpertExecutor(pgu, pdn, threads=4)
        inner = CachedExpertExecutor(pgu, pdn, None, dev, torch.bfloat16, cpu, share, "recent", mc.num_experts * 2)
        inner.warm_control = False  # the prefill call sizes' variants (a minute of compiles) are not met here
        inner.allocate(mc.num_flat_experts // 3 * 2)
        assert inner.pool.zero_copy and inner.capturable
        return PiecedExecutor(inner, 2)
    ex = make()
    for x, ids, wt, ref, res in calls:
        assert rel(ex(x, ids, wt).float().cpu(), ref) < max(2 * rel(res, ref), 1e-2)

    eager_toks, eager = greedy_decode(mc, w, make(), dev, False, steps=12)
    ex = make()
    graph_toks, graph = greedy_decode(mc, w, ex, dev, True, steps=12)
    assert graph_toks == eager_toks and torch.equal(graph, eager)
    st = ex.stats()
    assert st["fills"] > 0 and (share == 1.0 or st["cpu_experts"] > 0)
