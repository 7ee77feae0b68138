"""The GPU expert cache over quantized expert banks (fp8_block, mxfp4, nvfp4): each slot holds a
complete expert as published (values, scales, NVFP4's scale_2, and the bias rows of experts that
have them, GPT-OSS's), fills copy every one of those tensors byte for byte, and the experts on the
slots run the resident quantized path with slot ids. Against the resident quantized executor on
fresh random banks and inputs, over many decode calls with evictions: fill-only (r = 1) gives the
very same bits; a split (r < 1) sends misses to the C++ executor over the host banks (the eager
CPU branch) and agrees within fp32 summation order. The torch paths run on the CPU; with the
Triton dispatch forced on, the quantized kernels (kernels/moe_quant.py) run under the
interpreter on the slots. A small quantized model served through the Engine with the cache
equals the same model with every expert resident."""
import statistics

import pytest
import torch

import hf_models
import quant_models
from drive import cpu_experts_in_passes, drive, torch_experts
from freetoken.cache.config import CacheConfig
from freetoken.experts import executor as executor_mod
from freetoken.experts.banks import ExpertBanks, QuantBank
from freetoken.experts.cached import CachedExpertExecutor, SlotPool
from freetoken.experts.cpu import CpuExpertExecutor
from freetoken.experts.executor import NO_EXPERT, Activation, TorchExpertExecutor
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert
from test_quant_kernels import random_bank  # edge values, weights of a trained layer's size

LAYERS, E, H, I, K = 3, 8, 256, 96, 4  # I = 96: a partial 128-row fp8 block in each half of gate_up
N = LAYERS * E
SCALE_DTYPE = {"fp8_block": torch.bfloat16, "mxfp4": None, "nvfp4": None}  # fp8: Qwen's bf16 scales
CASES = ["fp8_block", "mxfp4", "nvfp4", "mxfp4-swiglu-bias"]  # the last: GPT-OSS's expert function


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def make(case: str, seed: int):
    """Fresh random host banks of N experts and the expert function of the case."""
    fmt = case.split("-")[0]
    g = torch.Generator().manual_seed(seed)
    gu = random_bank(fmt, SCALE_DTYPE[fmt], N, 2 * I, H, 2, g)
    dn = random_bank(fmt, SCALE_DTYPE[fmt], N, H, I, 1, g)
    fn = {}
    if case.endswith("bias"):  # bf16 biases, as GPT-OSS publishes them
        fn = dict(activation=Activation("swiglu_clamp", 1.702, 7.0),
                  gate_up_bias=(torch.randn(N, 2 * I, generator=g) * 0.5).bfloat16(),
                  down_bias=(torch.randn(N, H, generator=g) * 0.1).bfloat16())
    return gu, dn, fn


def calls(steps: int, seed: int, prefill_every: int = 0):
    """Decode calls (1-3 tokens, an idle row now and then) cycling over the layers, each layer
    called twice in a row (hits); a prefill chunk of 21 tokens every `prefill_every` calls."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        layer = (step // 2) % LAYERS
        pre = prefill_every and step % prefill_every == prefill_every - 1
        t = 21 if pre else 1 + step % 3
        x = torch.randn(t, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) + layer * E
        if not pre and t > 1 and step % 4 == 1:
            ids[0] = NO_EXPERT  # a row that is not running
        w = torch.softmax(torch.randn(t, K, generator=g), -1)
        yield x, ids, w, "prefill" if pre else "decode"


class Counted:
    """Wraps a pool's transfer: counts the experts each fill list asks for (up to the first -1)."""

    def __init__(self, pool):
        self.fills, self.inner = 0, pool.transfer
        pool.transfer = self

    def __call__(self, src, dst):
        self.fills += int((src.long() >= 0).cumprod(0).sum())
        self.inner(src, dst)


def host_expert_bytes(gu, dn, fn) -> int:
    """One expert's bytes over every published tensor and bias row, counted from the host banks."""
    parts = gu.tensors() + dn.tensors() + [fn[k] for k in ("gate_up_bias", "down_bias") if k in fn]
    return sum(t[0].numel() * t.element_size() for t in parts)


def check_slot_bytes(ex):
    """Every slot that holds an expert holds exactly that expert's host bytes, in every bank."""
    pool = ex.pool
    id_of = pool.res.id_of.long()
    held = (id_of >= 0).nonzero()[:, 0]
    assert held.numel() > 0
    pairs = list(zip(ex.host_gate_up.tensors() + ex.host_down.tensors(), pool.gate_up.tensors() + pool.down.tensors()))
    if ex.gate_up_bias is not None:
        pairs += [(ex.gate_up_bias, pool.gate_up_bias), (ex.down_bias, pool.down_bias)]
    assert len(pairs) == len(pool.banks_slot)
    for host, slot in pairs:
        assert slot.dtype == host.dtype and slot.shape[1:] == host.shape[1:]
        a = slot[held].contiguous().view(torch.uint8).cpu()
        b = host[id_of[held].cpu()].contiguous().view(torch.uint8)
        assert torch.equal(a, b)


def cpu_for(gu, dn, fn, forbid: bool):
    """The C++ executor over the host banks (the cache's CPU branch); `forbid`: one that fails
    if called (fill-only must not reach it)."""
    class NoCpu(CpuExpertExecutor):
        def launch(self, *a, **kw):
            raise AssertionError("the CPU branch ran in fill-only mode")
    return (NoCpu if forbid else CpuExpertExecutor)(gu, dn, **fn)


@pytest.mark.parametrize("share", [1.0, 0.5])
@pytest.mark.parametrize("case", CASES)
def test_cache_equals_resident_quantized(case, share):
    """40 calls over 3 layers of 8 experts with 8 slots (fill-only: the pool holds one layer) or
    5 (split: misses on the CPU too): decode exactly equal at r = 1, within 1e-5 at r = 0.5; the
    slots hold the host bytes; fills and bytes counted over every bank."""
    gu, dn, fn = make(case, seed=CASES.index(case) + (10 if share < 1 else 0))
    fill_only = share == 1.0
    slots = E if fill_only else 5
    ex = CachedExpertExecutor(gu, dn, slots, "cpu", torch.float32, cpu_for(gu, dn, fn, fill_only), share,
                              layer_experts=E, **fn)
    res = TorchExpertExecutor(gu, dn, **fn)  # every expert resident: the reference
    assert ex.quantized and isinstance(ex.pool.gate_up, QuantBank) and ex.pool.gate_up.format == gu.format
    counted = Counted(ex.pool)
    for x, ids, w, phase in calls(40, seed=3, prefill_every=9):
        got, ref = ex(x, ids, w, phase=phase), res(x, ids, w, phase=phase)
        assert torch.isfinite(ref).all() and float(ref.abs().max()) > 0
        if fill_only and phase == "decode":  # the same kernels on the same bytes: the same bits
            assert torch.equal(got, ref)
        else:  # the CPU part, or a prefill's experts in slot order: another summation order
            assert rel(got, ref) < 1e-5, phase
        if (ids[0] == NO_EXPERT).all():
            assert float(got[0].abs().max()) == 0.0
        check_slot_bytes(ex)
    st = ex.stats()
    n_parts = {"fp8_block": 4, "mxfp4": 4, "nvfp4": 6}[gu.format] + (2 if fn else 0)
    assert len(ex.pool.banks_slot) == n_parts
    # a slot's bytes: every published tensor and bias row, a quarter of bf16's or less for fp4
    want = host_expert_bytes(gu, dn, fn)
    assert ex.slot_bytes == ex.pool.slot_bytes == want
    dense = 2 * (2 * I * H + H * I)
    assert want < (dense * 0.6 if gu.format == "fp8_block" else dense * 0.3)
    assert st["fills"] == counted.fills > slots and st["bytes_moved"] == counted.fills * want
    assert st["slots_used"] == slots and st["hits"] > 0
    assert (st["cpu_experts"] == 0) if fill_only else (st["cpu_experts"] > 0)


def pinned(bank: QuantBank) -> QuantBank:
    """The bank's tensors in page-locked host memory (the engine pins the host banks, so the
    fused transfer reads them in place)."""
    pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
    return QuantBank(bank.format, pin(bank.values), pin(bank.scale), pin(bank.scale_2), bank.halves)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("share", [1.0, 0.5])
@pytest.mark.parametrize("case", CASES)
def test_cache_equals_resident_quantized_on_cuda(case, share):
    """The executor alone on the GPU, as the engine runs it (pinned host banks, the fused
    zero-copy transfer, the quantized Triton kernels over bf16 activations): each call within
    bf16 rounding of every expert resident on the GPU, the slots holding the host bytes after
    every call. Where the engine's served logits drift from all-resident, this says whether the
    executor (transfer, kernels over slots) or the engine around it is off."""
    gu, dn, fn = make(case, seed=CASES.index(case) + (10 if share < 1 else 0))
    gu, dn = pinned(gu), pinned(dn)
    dev = torch.device("cuda")
    ex = CachedExpertExecutor(gu, dn, E if share == 1.0 else 5, dev, torch.bfloat16,
                              cpu_for(gu, dn, fn, share == 1.0), share, layer_experts=E, **fn)
    assert ex.pool.zero_copy
    on_dev = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in fn.items()}
    res = TorchExpertExecutor(gu.to(dev), dn.to(dev), **on_dev)
    errs = []
    for x, ids, w, phase in calls(40, seed=3, prefill_every=9):
        x, ids, w = x.to(dev, torch.bfloat16), ids.to(dev), w.to(dev)
        got, ref = ex(x, ids, w, phase=phase), res(x, ids, w, phase=phase)
        errs.append((phase, round(rel(got, ref), 4)))
        check_slot_bytes(ex)
    assert max(e for _, e in errs) < 2e-2, errs


INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels on host tensors "
                                      "(interpreter); on a GPU test_gpu_engine_serves_a_quantized_model covers them")


@INTERPRETER_ONLY
@pytest.mark.parametrize("case", CASES)
def test_quantized_kernels_on_the_slots(case, monkeypatch):
    """The Triton dispatch forced on (the CUDA path, under the interpreter): the decode and
    grouped quantized kernels read the slot banks with slot ids, as they read the resident
    banks; fill-only decode equal bit for bit, the split and the prefill chunk within 1e-5."""
    from freetoken.kernels import moe_quant
    ran = {"decode": 0, "grouped": 0}

    def spy(kind, fn):
        def call(*a, **kw):
            ran[kind] += 1
            return fn(*a, **kw)
        return call
    monkeypatch.setattr(executor_mod, "use_triton", lambda t: True)
    monkeypatch.setattr(moe_quant, "moe_quant_decode_triton", spy("decode", moe_quant.moe_quant_decode_triton))
    monkeypatch.setattr(moe_quant, "moe_quant_grouped_triton", spy("grouped", moe_quant.moe_quant_grouped_triton))
    gu, dn, fn = make(case, seed=20 + CASES.index(case))
    res = TorchExpertExecutor(gu, dn, **fn)
    for share, slots in ((1.0, E), (0.5, 5)):
        ex = CachedExpertExecutor(gu, dn, slots, "cpu", torch.float32, cpu_for(gu, dn, fn, share == 1.0), share,
                                  layer_experts=E, **fn)
        # 4 decode calls (1, 2 with an idle row, 3, 1 tokens) over two layers: the 8 slots of
        # r = 1 and the 5 of r = 0.5 both evict and refill within them; then a 21-token prefill
        for x, ids, w, phase in calls(5, seed=int(share * 10), prefill_every=5):
            got, ref = ex(x, ids, w, phase=phase), res(x, ids, w, phase=phase)
            if share == 1.0 and phase == "decode":
                assert torch.equal(got, ref)
            else:
                assert rel(got, ref) < 1e-5
        check_slot_bytes(ex)
        assert ex.stats()["fills"] > slots
    assert ran["decode"] == 2 * 2 * 4 and ran["grouped"] == 2 * 2  # cache and resident, both shares


@INTERPRETER_ONLY
def test_fused_transfer_moves_every_bank_as_bytes():
    """The fused transfer kernel (Triton interpreter) over a quantized pool's banks and over more
    banks than one launch takes (11, of every dtype): exactly the listed experts' bytes land in
    their slots, fp8 bytes that are NaN codes included (copied, never converted); other slots
    keep their bytes; the reference copy agrees."""
    pytest.importorskip("triton")
    from freetoken.kernels.expert_transfer import MAX_BANKS, transfer_reference, transfer_triton
    gu, dn, fn = make("nvfp4-swiglu-bias", seed=31)
    pool = SlotPool(gu, dn, 6, "cpu", torch.float32, fn["gate_up_bias"], fn["down_bias"])
    g = torch.Generator().manual_seed(32)

    def raw(n, *shape, dtype):  # every byte pattern, NaN codes of fp8 / bf16 / f32 included
        return torch.randint(0, 256, (n, *shape, torch.empty((), dtype=dtype).element_size()), generator=g,
                             dtype=torch.uint8).view(dtype)[..., 0]
    many = [raw(N, 7 + j, 33, dtype=dt) for j, dt in enumerate(
        [torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float16, torch.int32] * 2)][:11]
    assert len(many) > MAX_BANKS
    src = torch.tensor([5, 17, 0, 23, -1, -1], dtype=torch.int32)
    dst = torch.tensor([4, 1, 3, 0, -1, -1], dtype=torch.int32)
    for host in (pool.banks_host, many):
        slots = [raw(6, *h.shape[1:], dtype=h.dtype) for h in host]
        before = [s.clone() for s in slots]
        ref = [s.clone() for s in slots]
        transfer_triton(host, slots, src, dst)
        assert transfer_reference(host, ref, src, dst) == 4
        for h, s, r, b in zip(host, slots, ref, before):
            u = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
            assert torch.equal(u(s), u(r))
            assert torch.equal(u(s[dst[:4].long()]), u(h[src[:4].long()]))
            assert torch.equal(u(s[[2, 5]]), u(b[[2, 5]]))  # not listed: untouched


# ------------------------------------------------------------------------ through the Engine

DIMS = dict(hidden_size=128, moe_intermediate_size=64, head_dim=32, intermediate_size=96)
@pytest.fixture(scope="module")
def quant_ftw(tmp_path_factory):
    """Per format: a small Qwen3-MoE checkpoint with its routed experts quantized as published
    (3 layers x 16 experts), converted to FTW."""
    out = {}
    for j, fmt in enumerate(("fp8_block", "mxfp4", "nvfp4")):
        d = tmp_path_factory.mktemp(fmt)
        model = hf_models.qwen3_moe(60 + j, **DIMS)
        quant_models.write(model, str(d / "hf"), fmt, "experts", scale_dtype=torch.float32)
        convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
        out[fmt] = str(d / "m.ftw")
    return out


def serve(eng: Engine, prompts, slots: int | None = None):
    """Greedy requests through the serving loop (streamed prefill passes with the cache);
    `slots`: the cache re-sized to that many slots after the plan sized it."""
    srv = ServingEngine(eng, max_batch=2, max_queue=4, start=False, record_logits=True,
                        cache=CacheConfig(enabled=False))
    if slots is not None:
        eng.executor.pool = None
        eng.executor.allocate(slots)
    reqs = [Request(p, SamplingOptions(temperature=0, max_tokens=10, ignore_eos=True)) for p in prompts]
    return srv, drive(srv, reqs, arrive=[0, 2])


def fp32_logits(ref32: Engine, req) -> torch.Tensor:
    """The fp32 CPU engine's logits at each of the request's decode steps, teacher-forced on
    the tokens the request produced: [steps, vocab]."""
    ids = req.prompt_ids + req.output_ids[:-1]
    st = ref32.new_state(len(ids))
    return ref32.prefill(ids, st, all_logits=True)[len(req.prompt_ids) - 1:]


def assert_near_tie(truth: torch.Tensor, pick: int, ref_pick: int, ref_logits: torch.Tensor, step: int) -> None:
    """Two bf16 paths picked different greedy tokens at `step` from the same prefix: `pick` the
    path under test's, `ref_pick` the reference's (no cache). truth: fp32's logits there [V];
    ref_logits: the reference's [V]. Where fp32 ranks `pick` at or above `ref_pick`, the path under
    test followed fp32 at least as well as the reference: nothing to check (its parting is the
    reference's rounding). Otherwise `pick` must be a near-tie: fp32 puts it below `ref_pick` by no
    more than twice bf16's rounding at this step, measured on the reference as its largest
    distance from fp32."""
    below = float(truth[ref_pick]) - float(truth[pick])
    if below <= 0:
        return
    noise = float((ref_logits.float() - truth.float()).abs().max())
    assert below <= 2 * noise, (
        f"bf16 greedy tokens part at step {step}: {pick} against the reference's {ref_pick}; fp32 gives "
        f"them {float(truth[pick]):.4f} and {float(truth[ref_pick]):.4f} (its max {float(truth.max()):.4f}), "
        f"{below:.4f} apart: not a near-tie for bf16 (the reference is at most {noise:.4f} off fp32 here)")


def test_near_tie_rule():
    """The bf16 parting rule of the GPU engine test, on made-up logits: a pick fp32 ranks above the
    reference's passes; one below it passes within twice the reference's distance from fp32 and
    fails past it."""
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(64, generator=g) * 4
    order = truth.argsort(descending=True)
    a, b, c = int(order[0]), int(order[1]), int(order[2])
    ref = truth.clone()
    ref[b] = truth[a] + 0.5  # the reference moved to fp32's runner-up
    assert_near_tie(truth, a, b, ref, 0)  # the path under test kept fp32's argmax: nothing to check
    for factor, ok in ((1.9, True), (2.1, False)):
        # the reference picks fp32's best, a; the path under test c, `below` under a in fp32;
        # the reference is off fp32 by `noise` (one logit far from both, so the picks stay put)
        below = float(truth[a] - truth[c])
        ref = truth.clone()
        ref[int(order[-1])] += below / factor  # noise = below / factor
        if ok:
            assert_near_tie(truth, c, a, ref, 0)
        else:
            with pytest.raises(AssertionError, match="not a near-tie"):
                assert_near_tie(truth, c, a, ref, 0)


def check_slots(ex) -> None:
    """Every slot the residency says holds expert e holds e's bytes, every bank (values, scales,
    scale_2, biases): what a fill, a streamed prefill pass or an eviction must never break."""
    pool = ex.pool
    ids = pool.res.id_of.cpu().tolist()
    assert sorted(i for i in ids if i >= 0) == sorted(set(i for i in ids if i >= 0))
    for s, e in enumerate(ids):
        if e >= 0:
            assert int(pool.res.slot_of[e]) == s
            for host, slot in zip(pool.banks_host, pool.banks_slot):
                assert torch.equal(slot[s].cpu().view(torch.uint8), host[e].cpu().view(torch.uint8)), (s, e)


def check_served(cache_eng, ref_eng, prompts, slots):
    srv, got = serve(cache_eng, prompts, slots)
    check_slots(cache_eng.executor)
    _, want = serve(ref_eng, prompts)
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids
        for la, lb in zip(a.logits, b.logits):
            assert rel(la, lb) < 1e-5
    st = cache_eng.executor.stats()
    assert st["slots"] == st["slots_used"] == slots and st["fills"] > slots
    assert st["bytes_moved"] == st["fills"] * cache_eng.executor.slot_bytes
    return srv, st


@pytest.mark.parametrize("share", ["1", "0.5"])
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4"])
def test_engine_serves_a_quantized_model_through_the_cache(quant_ftw, fmt, share):
    """--moe cache takes the quantized model (nothing refuses it): the plan sizes the pool by the
    published bytes of every bank, and the served logits equal the all-resident engine's with
    12 slots of 48 experts (evictions every step; at r = 0.5 the CPU branch runs too)."""
    path = quant_ftw[fmt]
    eng = Engine(path, EngineConfig(device="cpu", dtype="float32", moe="cache", fill_share=share,
                                    prefill_chunk=16))
    assert eng.experts_on == "cache" and eng.describe()["expert_backend"] == "gpu-cache"
    assert eng.describe()["expert_format"] == fmt and eng.executor.quantized
    banks = eng.executor
    want = host_expert_bytes(banks.host_gate_up, banks.host_down, {})
    meta_banks = ExpertBanks(fmt, banks.host_gate_up, banks.host_down)
    assert banks.slot_bytes == want == meta_banks.expert_bytes  # values + scales (+ scale_2), not bf16
    ref = torch_experts(Engine(path, EngineConfig(device="cpu", dtype="float32", moe="cpu", prefill_chunk=16)))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (23, 9)]
    in_passes = cpu_experts_in_passes(eng.executor)
    srv, st = check_served(eng, ref, prompts, slots=12)
    outside = st["cpu_experts"] - sum(in_passes)  # CPU experts of the calls outside streamed passes
    assert srv.plan.expert_slots == 3 * 16 and srv.plan.expert_cache == 3 * 16 * want  # the plan: every expert
    # at r = 0.5 the CPU branch runs; fill-only runs experts on the CPU only in decode steps
    # inside streamed passes (the cache frozen there)
    assert (outside > 0) == (share == "0.5")
    assert eng.prefill_stream.stats()["bytes_h2d"] == eng.prefill_stream.stats()["experts_h2d"] * want


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_engine_serves_quantized_pieces_through_the_cache(quant_ftw, fmt):
    """--expert-pieces 2 over quantized banks: each expert's 64 intermediate rows cut into two
    pieces of whole scale blocks, in place; the slots hold pieces (half an expert's bytes), the
    CPU branch runs pieces in the C++ executor, and the served logits equal the all-resident
    engine's over whole experts."""
    path = quant_ftw[fmt]
    eng = Engine(path, EngineConfig(device="cpu", dtype="float32", moe="cache", fill_share="0.5",
                                    prefill_chunk=16, expert_pieces=2))
    ex = eng.executor
    assert ex.pieces == 2 and ex.quantized and eng.describe()["expert_pieces"] == 2
    assert ex.host_down.shape[-1] == DIMS["moe_intermediate_size"] // 2
    gu, dn = ex.host_gate_up, ex.host_down
    cut = sum(t.numel() * t.element_size() for t in (gu.values, gu.scale, dn.values, dn.scale))  # the same bytes, re-laid
    assert ex.slot_bytes == cut // gu.values.shape[0] + (12 if fmt == "nvfp4" else 0)  # nvfp4: scale_2 [2] + [1] a piece
    ref = torch_experts(Engine(path, EngineConfig(device="cpu", dtype="float32", moe="cpu", prefill_chunk=16)))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (19, 8)]
    _, st = check_served(eng, ref, prompts, slots=20)
    assert st["expert_pieces"] == 2 and st["cpu_experts"] > 0


def test_engine_refuses_quantized_pieces_that_cut_a_scale_block(quant_ftw):
    from freetoken.errors import FreeTokenError
    with pytest.raises(FreeTokenError, match="--expert-pieces 2: fp8_block expert pieces must hold whole 128-value.*"
                                             "cannot be cut into whole blocks: leave pieces at 1"):
        Engine(quant_ftw["fp8_block"], EngineConfig(device="cpu", dtype="float32", moe="cache", expert_pieces=2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("share,graphs", [("1", "eager-too"), ("0.5", "graphs")])
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4"])
def test_gpu_engine_serves_a_quantized_model(quant_ftw, fmt, share, graphs):
    """On the GPU, the real path: slots in VRAM filled by the fused transfer kernel from pinned
    host banks, the quantized Triton kernels over the slots, decode steps replayed from CUDA
    graphs (with the CPU branch in them at r = 0.5). In fp32, the served logits equal every
    expert resident in VRAM within 1e-4; in bf16 (what users run) the same greedy tokens up to
    any near-tie, and logits as close to fp32 as all-resident's, step for step in the median.

    Why bf16 tokens may part at a near-tie: a small random model has near-ties in its routers and
    logits, which bf16 rounding flips one way or the other at a step now and then (on the CPU the
    plain bf16 engine, no cache at all, is 0.18 off fp32 at one step of these prompts with
    fp8_block), so any two bf16 paths that sum in another order can differ there; fp32 rounding
    moves scores a million times less, and there the cache must agree. Where the bf16 tokens part,
    the cache's pick must be one fp32 ranks at least as high as the resident path's, or below it
    by no more than twice the resident bf16 path's own distance from fp32 at that step
    (assert_near_tie); the steps up to there are compared. (Plan 116, fp8_block at r = 0.5 on an
    H100: they part at step 7, where the cache picked fp32's argmax, 15.697, and the resident path
    a token fp32 puts at 15.595: the resident path's rounding, not the cache's.)"""
    path = quant_ftw[fmt]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (23, 9)]

    def engines(dtype, **kw):
        cfg = dict(device="cuda", dtype=dtype, moe="cache", fill_share=share, prefill_chunk=16)
        slot = Engine(path, EngineConfig(**cfg)).executor.slot_bytes
        # 12 slots of 48 experts, sized by the plan before the decode graphs are captured
        eng = Engine(path, EngineConfig(**cfg, expert_cache=str(12 * slot), **kw))
        ref = Engine(path, EngineConfig(device="cuda", dtype=dtype, moe="resident", prefill_chunk=16))
        return eng, ref

    eng, ref = engines("float32")
    in_passes = cpu_experts_in_passes(eng.executor)
    srv, got = serve(eng, prompts)
    _, want = serve(ref, prompts)
    check_slots(eng.executor)  # the slots hold what the residency says
    assert eng.executor.pool.zero_copy and eng.executor.pool.slots == 12  # banks registered, however small
    assert srv.decode.path == "cuda-graphs"
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids
        errs = [round(rel(la.cpu(), lb.cpu()), 6) for la, lb in zip(a.logits, b.logits)]
        assert max(errs) < 1e-4, errs
    st = eng.executor.stats()
    # fill-only runs experts on the CPU only in the decode steps inside the second prompt's
    # streamed pass (the cache frozen there)
    assert st["fills"] > 12 and (st["cpu_experts"] - sum(in_passes) > 0) == (share == "0.5")

    eng, ref = engines("bfloat16")
    _, got = serve(eng, prompts)
    _, want = serve(ref, prompts)
    if graphs == "eager-too":  # eagerly too, the slots checked against the residency after every call
        eager, _ = engines("bfloat16", cuda_graphs=False)
        launch = eager.executor.launch

        def checked(*a, **kw):
            out = launch(*a, **kw)
            check_slots(eager.executor)
            return out
        eager.executor.launch = checked
        _, eag = serve(eager, prompts)
        assert [r.output_ids for r in eag] == [r.output_ids for r in got]
    ref32 = Engine(path, EngineConfig(device="cpu", dtype="float32", moe="cpu", prefill_chunk=16))
    for a, b in zip(got, want):
        truth = fp32_logits(ref32, a)  # the fp32 logits of the cache's tokens
        steps = len(a.output_ids)
        if a.output_ids != b.output_ids:  # where they part, both saw the same tokens: truth[i] is both's
            i = next(j for j, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y)
            # plan 116 (H100, fp8_block r = 0.5): step 7, cache 15.6970 (fp32's max), resident 15.5952
            assert_near_tie(truth[i], a.output_ids[i], b.output_ids[i], b.logits[i].cpu(), i)
            steps = i + 1  # past it the two requests run on different tokens
        e_cache = [rel(la.cpu(), lb) for la, lb in zip(a.logits[:steps], truth)]
        e_res = [rel(la.cpu(), lb) for la, lb in zip(b.logits[:steps], truth)]
        med = statistics.median
        assert med(e_cache) <= max(2 * med(e_res), 2e-2), ([round(e, 3) for e in e_cache], [round(e, 3) for e in e_res])


def test_plan_sizes_a_quantized_cache_by_its_bytes(quant_ftw):
    """--expert-cache as bytes: as many slots as the quantized experts' bytes fit (not bf16's)."""
    path, room = quant_ftw["mxfp4"], 100 * 1024
    eng = Engine(path, EngineConfig(device="cpu", dtype="float32", moe="cache", expert_cache=str(room)))
    srv = ServingEngine(eng, max_batch=1, start=False)
    slot = eng.executor.slot_bytes
    h, i = DIMS["hidden_size"], DIMS["moe_intermediate_size"]
    assert slot == 3 * h * i // 2 + 3 * h * i // 32  # fp4 pairs and one e8m0 scale per 32, both banks
    assert srv.plan.expert_slots == room // slot == 7  # the same room holds one f32 expert: 3 * h * i * 4
    assert eng.executor.pool.slots == 7 and eng.executor.pool.slot_bytes == slot
    assert srv.plan.expert_cache == 7 * slot


@pytest.fixture(scope="module")
def gptoss_ftw(tmp_path_factory):
    """GPT-OSS with its routed experts in MXFP4 as openai publishes them, bias banks in BF16."""
    from test_gpt_oss import write_mxfp4
    d = tmp_path_factory.mktemp("gptoss-cache")
    write_mxfp4(hf_models.gpt_oss(5), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return str(d / "m.ftw")


def test_engine_serves_gpt_oss_mxfp4_through_the_cache(gptoss_ftw):
    """The clamped SwiGLU with bias banks: the bias rows travel into the slots with each expert,
    and the served logits equal the all-resident engine's (split r = 0.5, 10 slots of 64)."""
    eng = Engine(gptoss_ftw, EngineConfig(device="cpu", dtype="float32", moe="cache", fill_share="0.5",
                                          prefill_chunk=16))
    ex = eng.executor
    assert eng.experts_on == "cache" and ex.quantized and ex.activation.kind == "swiglu_clamp"
    assert ex.gate_up_bias is not None and ex.down_bias is not None
    want = host_expert_bytes(ex.host_gate_up, ex.host_down,
                             {"gate_up_bias": ex.gate_up_bias, "down_bias": ex.down_bias})
    assert ex.slot_bytes == want
    ref = torch_experts(Engine(gptoss_ftw, EngineConfig(device="cpu", dtype="float32", moe="cpu", prefill_chunk=16)))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (21, 11)]
    _, st = check_served(eng, ref, prompts, slots=10)
    assert st["cpu_experts"] > 0
    assert len(ex.pool.banks_slot) == 6 and ex.pool.gate_up_bias.dtype == ex.gate_up_bias.dtype
