"""The quantized-expert Triton kernels (kernels/moe_quant.py: decode GEMV and grouped prefill GEMM
reading fp8_block / mxfp4 / nvfp4 banks in place) against their torch references (the engine's
torch paths on quant.py's dequantization), on fresh random banks with edge values.

On a CPU machine the kernels run under TRITON_INTERPRET=1 (conftest.py), on CUDA natively.
fp32 activations: within 1e-5 relative (the in-kernel weights are quant.py's bit for bit, only
the summation order differs); bf16 within 3e-2, as the bf16 kernels' tests (4e-2 under the
interpreter, which rounds bf16 by truncation). Shapes leave tails: partial 128 x 128 fp8 blocks
in each half of gate_up and along the columns, column steps cut short, more than one step a row.
"""
import math

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from freetoken.experts.banks import QuantBank  # noqa: E402
from freetoken.experts.executor import NO_EXPERT, Activation, TorchExpertExecutor  # noqa: E402
from freetoken.kernels.moe_quant import (_e2m1, _e4m3, _scale, moe_quant_decode_torch,  # noqa: E402
                                         moe_quant_decode_triton, moe_quant_grouped_torch, moe_quant_grouped_triton)
from freetoken.weights.quant import e8m0_to_float, unpack_fp4  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
N = 10
# name -> (format, fp8 scale dtype, hidden, intermediate)
CASES = {
    "fp8-s32": ("fp8_block", torch.float32, 200, 136),  # a partial column block; 2 row blocks a half
    "fp8-sbf16": ("fp8_block", torch.bfloat16, 328, 40),  # Qwen's scale dtype; 2 column steps a row
    "fp8-sf16": ("fp8_block", torch.float16, 136, 64),
    "mxfp4": ("mxfp4", None, 544, 96),  # 272 bytes a row: a full step of 256 and a tail
    "nvfp4": ("nvfp4", None, 272, 48),
}

# SiLU without biases, GPT-OSS's clamped SwiGLU with both bias banks; bf16 with the latter only
VARIANTS = [(torch.float32, "plain"), (torch.float32, "swiglu"), (torch.bfloat16, "swiglu")]


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def fp8_bytes(shape, g):
    """Random e4m3 bytes over every code but NaN: +-448 (0x7e/0xfe), subnormals, +-0."""
    v = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    v[(v & 0x7F) == 0x7F] = 0x7E
    return v


def random_bank(fmt, scale_dtype, n, rows, cols, halves, g) -> QuantBank:
    """A bank in the layout experts/banks.py documents, with edge values: every e2m1 code, whole
    blocks of 0 and of +-6, e8m0 scales 0 (2^-127, subnormal) and 1, e4m3 scales 0, subnormal
    and 448 (the maximum), fp8 block scales 0 and subnormal in their dtype; weights of a trained
    layer's size."""
    def pick(shape, p):
        return torch.rand(shape, generator=g) < p

    if fmt == "fp8_block":
        v = fp8_bytes((n, rows, cols), g).view(torch.float8_e4m3fn)
        per = -(-(rows // halves) // 128)
        s = torch.rand(n, halves * per, -(-cols // 128), generator=g) * 2e-3 + 2e-4
        s[pick(s.shape, 0.05)] = 0.0
        bank = scaled(QuantBank(fmt, v, s.to(scale_dtype), None, halves), cols)
        bank.scale[pick(s.shape, 0.05)] = torch.finfo(scale_dtype).tiny / 4  # subnormal
        return bank
    blk = 32 if fmt == "mxfp4" else 16
    v = torch.randint(0, 256, (n, rows, cols // 2), generator=g, dtype=torch.uint8)
    v[pick((n, rows, cols // blk), 0.04).repeat_interleave(blk // 2, -1)] = 0  # whole blocks of +0
    v[pick((n, rows, cols // blk), 0.04).repeat_interleave(blk // 2, -1)] = 0xF7  # +6, -6
    if fmt == "mxfp4":
        s = torch.randint(118, 124, (n, rows, cols // 32), generator=g, dtype=torch.uint8)
        s[pick(s.shape, 0.03)] = 0
        s[pick(s.shape, 0.03)] = 1
        return scaled(QuantBank(fmt, v, s, None, halves), cols)
    s = torch.randint(0x28, 0x50, (n, rows, cols // 16), generator=g, dtype=torch.uint8)
    s[pick(s.shape, 0.03)] = 0x00  # zero
    s[pick(s.shape, 0.03)] = 0x03  # subnormal e4m3
    s[pick(s.shape, 0.01)] = 0x7E  # 448
    s2 = torch.rand(n, halves, generator=g) * 2e-2 + 1e-3  # the gate's and the up's differ
    return scaled(QuantBank(fmt, v, s.view(torch.float8_e4m3fn), s2, halves), cols)


def scaled(bank: QuantBank, cols: int) -> QuantBank:
    """The bank with weights of standard deviation ~ cols^-1/2, as a trained layer's (outputs of
    order one; bf16's error would otherwise be cancellation in huge sums): the fp8 block scales or
    nvfp4's scale_2 multiplied, mxfp4's e8m0 exponents shifted (their 0 and 1 edges kept)."""
    f = cols ** -0.5 / float(bank.dequant(torch.arange(bank.values.shape[0])).std())
    if bank.format == "fp8_block":
        bank.scale = (bank.scale.float() * f).to(bank.scale.dtype)
    elif bank.format == "nvfp4":
        bank.scale_2 = bank.scale_2 * f
    else:
        shift = round(math.log2(f))
        shifted = (bank.scale.int() + shift).clamp(2, 254)
        bank.scale = torch.where(bank.scale > 1, shifted, bank.scale.int()).to(torch.uint8)
    return bank


def make(name, t, k, seed, dtype, n=N, span=None, fn_kind="plain"):
    """Banks on DEV, inputs of t tokens routed to k of the last `span` experts, and the expert
    function: "plain" SiLU, or GPT-OSS's clamped SwiGLU with both bias banks."""
    fmt, sdt, h, i = CASES[name]
    g = torch.Generator().manual_seed(seed)
    gu = random_bank(fmt, sdt, n, 2 * i, h, 2, g).to(DEV)
    dn = random_bank(fmt, sdt, n, h, i, 1, g).to(DEV)
    span = span or n
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    ids = torch.stack([torch.randperm(span, generator=g)[:k] + n - span for _ in range(t)]).to(DEV)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(DEV, dtype)
    fn = {}
    if fn_kind == "swiglu":
        fn = dict(activation=Activation("swiglu_clamp", 1.702, 2.0),
                  gate_up_bias=(torch.randn(n, 2 * i, generator=g) * 0.5).to(DEV, dtype),
                  down_bias=(torch.randn(n, h, generator=g) * 0.01).to(DEV, dtype))
    return gu, dn, x, ids, w, fn


def tol(dtype):
    """bf16: 3e-2 as the bf16 kernels' tests; 4e-2 under the interpreter, whose truncating bf16
    rounding alone costs the bf16 kernels (moe_decode/moe_grouped) up to ~2.7% on these inputs."""
    if dtype == torch.float32:
        return 1e-5
    return 3e-2 if DEV == "cuda" else 4e-2


@triton.jit
def _decode_every_byte(b_ptr, o_ptr):
    r = tl.arange(0, 256)
    b = tl.load(b_ptr + r).to(tl.int32)
    tl.store(o_ptr + r, _e4m3(b))
    tl.store(o_ptr + 256 + r, _e2m1(b & 0xF))
    tl.store(o_ptr + 512 + r, _scale(b.to(tl.uint8), 1))  # e8m0
    tl.store(o_ptr + 768 + r, _scale(b.to(tl.uint8), 2))  # e4m3 scale


def test_in_kernel_decoders_are_bit_exact():
    """Every byte through the kernels' e4m3, e2m1 and e8m0 decoders equals quant.py's in fp32 bits
    (signed zeros, subnormals and 448 included; e8m0 255 NaN in both; e4m3's NaN codes, never
    published, left out)."""
    b = torch.arange(256, dtype=torch.uint8, device=DEV)
    out = torch.empty(4, 256, device=DEV)
    _decode_every_byte[(1,)](b, out)
    ok = (b & 0x7F) != 0x7F
    e4m3 = b.view(torch.float8_e4m3fn).float()
    assert torch.equal(out[0][ok].view(torch.int32), e4m3[ok].view(torch.int32))
    assert torch.equal(out[3][ok].view(torch.int32), e4m3[ok].view(torch.int32))
    e2m1 = unpack_fp4(b & 0xF)[0::2]  # [256]: low nibbles
    assert torch.equal(out[1].view(torch.int32), e2m1.view(torch.int32))
    e8m0 = e8m0_to_float(b)
    assert torch.equal(out[2][:255].view(torch.int32), e8m0[:255].view(torch.int32))
    assert torch.isnan(out[2][255]) and torch.isnan(e8m0[255])


@pytest.mark.parametrize("dtype,fn_kind", VARIANTS, ids=["f32-silu", "f32-swiglu-bias", "bf16-swiglu-bias"])
@pytest.mark.parametrize("name", list(CASES))
def test_decode_kernel(name, dtype, fn_kind):
    """Decode batches (3 tokens x top-4), a row that is not running and one NO_EXPERT pair."""
    gu, dn, x, ids, w, fn = make(name, 3, 4, seed=len(name), dtype=dtype, fn_kind=fn_kind)
    ids[1] = NO_EXPERT
    ids[2, 0] = NO_EXPERT
    got = moe_quant_decode_triton(x, ids, w, gu, dn, **fn)
    ref = moe_quant_decode_torch(x, ids, w, gu, dn, **fn)
    assert got.dtype == dtype and got.shape == x.shape
    assert float(got[1].abs().max()) == 0.0  # skipped: no weights read, nothing added
    assert rel(got, ref) < tol(dtype)


@pytest.mark.parametrize("dtype,fn_kind", VARIANTS, ids=["f32-silu", "f32-swiglu-bias", "bf16-swiglu-bias"])
@pytest.mark.parametrize("name", list(CASES))
def test_grouped_kernel(name, dtype, fn_kind):
    """A prefill chunk (21 tokens x top-3 over 10 experts: tiles of 16 pairs, some experts
    unused), NO_EXPERT rows and pairs among them."""
    gu, dn, x, ids, w, fn = make(name, 21, 3, seed=7 + len(name), dtype=dtype, fn_kind=fn_kind)
    ids[4] = NO_EXPERT
    ids[9, 1] = NO_EXPERT
    # the NO_EXPERT pairs' rows stay unwritten: hand their memory back NaN-filled, as the allocator
    # recycles a freed block of the same size, so a sum that read them would show it
    poison = torch.full((21 * 3, x.shape[1]), float("nan"), dtype=dtype, device=x.device)
    del poison
    got = moe_quant_grouped_triton(x, ids, w, gu, dn, max_experts=N, **fn)
    ref = moe_quant_grouped_torch(x, ids, w, gu, dn, **fn)
    assert got.dtype == dtype and got.shape == x.shape
    assert float(got[4].abs().max()) == 0.0
    assert rel(got, ref) < tol(dtype)


@pytest.mark.parametrize("name", ["fp8-s32", "mxfp4", "nvfp4"])
def test_grouped_kernel_large_tiles_second_layer(name):
    """Many pairs per expert (tiles of 64), routed within a second layer's experts (flat ids
    l*E + e; max_experts bounds the tile grid)."""
    gu, dn, x, ids, w, fn = make(name, 40, 4, seed=3, dtype=torch.float32, n=8, span=4)
    got = moe_quant_grouped_triton(x, ids, w, gu, dn, max_experts=4)
    assert rel(got, moe_quant_grouped_torch(x, ids, w, gu, dn)) < 1e-5


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_nan_scale_propagates(name):
    """An e8m0 scale of 255 is NaN (quant.py): the expert's outputs are NaN in kernel and
    reference alike, and other tokens stay finite. nvfp4 has no NaN scale: finite throughout."""
    gu, dn, x, ids, w, fn = make(name, 2, 2, seed=11, dtype=torch.float32)
    ids.copy_(torch.tensor([[0, 1], [2, 3]], device=DEV))
    if name == "mxfp4":
        gu.scale[0] = 255
    got = moe_quant_decode_triton(x, ids, w, gu, dn)
    ref = moe_quant_decode_torch(x, ids, w, gu, dn)
    assert torch.equal(got[0].isnan(), ref[0].isnan()) and bool(got[0].isnan().all()) == (name == "mxfp4")
    assert bool(torch.isfinite(got[1]).all()) and rel(got[1], ref[1]) < 1e-5


@pytest.mark.parametrize("phase,t", [("decode", 2), ("decode", 9), ("prefill", 12)])
def test_executor_takes_the_kernels(monkeypatch, phase, t):
    """TorchExpertExecutor on quantized banks: where Triton runs (CUDA; forced here on the CPU
    through the interpreter) decode goes to the decode kernel up to static_max_pairs pairs, the
    rest to the grouped kernel; both equal the torch path (the CPU's, kept as it was)."""
    import freetoken.experts.executor as executor
    import freetoken.kernels.moe_quant as mq
    gu, dn, x, ids, w, fn = make("nvfp4", t, 4, seed=t, dtype=torch.float32, fn_kind="swiglu")
    ex = TorchExpertExecutor(gu, dn, static_max_pairs=16, layer_experts=N, **fn)
    monkeypatch.setattr(executor, "use_triton", lambda _: False)
    torch_path = ex.run(x, ids, w, phase)
    calls = []
    for kernel in ("moe_quant_decode_triton", "moe_quant_grouped_triton"):
        real = getattr(mq, kernel)
        monkeypatch.setattr(mq, kernel, lambda *a, _real=real, _name=kernel, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.setattr(executor, "use_triton", lambda _: True)
    got = ex.run(x, ids, w, phase)
    assert calls == ["moe_quant_decode_triton" if phase == "decode" and t * 4 <= 16 else "moe_quant_grouped_triton"]
    assert rel(got, torch_path) < 1e-5


@pytest.mark.parametrize("phase,t", [("decode", 3), ("prefill", 12)])
def test_executor_takes_int32_routes(monkeypatch, phase, t):
    """The expert cache hands its int32 slot routes over as they are (CPU -2 and NO_EXPERT -1
    pairs among them, both skipped): the executor widens them for every path (the autotuner
    tuned int32 routes apart from int64 ones: another summation order on an H100), so every path
    equals the same routes in int64."""
    import freetoken.experts.executor as executor
    gu, dn, x, ids, w, fn = make("mxfp4", t, 4, seed=20 + t, dtype=torch.float32, fn_kind="swiglu")
    ids[0, 1], ids[1, 2] = -2, NO_EXPERT
    ex = TorchExpertExecutor(gu, dn, static_max_pairs=16, layer_experts=N, **fn)
    g = torch.Generator().manual_seed(t)  # and dense bf16 banks (the moe_decode kernels), as a bf16 cache's slots
    dense = TorchExpertExecutor((torch.randn(N, 64, 32, generator=g) * 0.2).to(torch.bfloat16).to(DEV),
                                (torch.randn(N, 32, 32, generator=g) * 0.2).to(torch.bfloat16).to(DEV),
                                static_max_pairs=16, layer_experts=N)
    xd = torch.randn(t, 32, generator=g).to(torch.bfloat16).to(DEV)
    for triton_path in (False, True):
        monkeypatch.setattr(executor, "use_triton", lambda _, on=triton_path: on)
        for e, xx in ((ex, x), (dense, xd)):
            want = e.run(xx, ids.long(), w.to(xx.dtype), phase)
            got = e.run(xx, ids.to(torch.int32), w.to(xx.dtype), phase)
            assert torch.equal(got, want), (triton_path, xx.dtype)
            assert float(want.abs().max()) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_torch_path_sums_in_a_fixed_order(dtype):
    """The executor's torch grouped path (CUDA without Triton: prefill chunks): two equal calls
    bit-equal (it summed each token's pairs with index_add_, whose CUDA atomics gave the last bits
    in any order: plan 106), within rounding of the per-pair static path, rows whose pairs are all
    skipped (NO_EXPERT, the cache's CPU mark -2) exactly zero."""
    g = torch.Generator().manual_seed(31)
    t, k = 40, 4
    ex = TorchExpertExecutor((torch.randn(N, 64, 32, generator=g) * 0.2).to(dtype).to(DEV),
                             (torch.randn(N, 32, 32, generator=g) * 0.2).to(dtype).to(DEV), layer_experts=N)
    x = torch.randn(t, 32, generator=g).to(dtype).to(DEV)
    ids = torch.randint(0, N, (t, k), generator=g)
    ids[3] = NO_EXPERT
    ids[5] = torch.tensor([-2, NO_EXPERT, -2, -2])
    ids[7, 1] = -2
    ids, w = ids.to(DEV), torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype).to(DEV)
    a, b = ex._grouped(x, ids, w), ex._grouped(x, ids, w)
    assert torch.equal(a, b)
    assert not a[3].any() and not a[5].any() and a[7].abs().sum() > 0
    ref = ex._static(x, ids, w)
    assert rel(a, ref) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_executor_capturable_only_with_the_kernels():
    gu, dn, *_ = make("mxfp4", 1, 1, seed=1, dtype=torch.float32)
    assert TorchExpertExecutor(gu, dn).capturable == (DEV == "cuda")
    assert not TorchExpertExecutor(gu.to("cpu"), dn.to("cpu")).capturable
    assert TorchExpertExecutor(torch.zeros(2, 4, 8), torch.zeros(2, 8, 2)).capturable  # dense: as before


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_decode_kernel_in_a_cuda_graph(name):
    """Captured once, replayed on new activations and routing (NO_EXPERT included): the same
    result as an eager call, so no host copy or sync hides in the decode kernel."""
    gu, dn, x, ids, w, fn = make(name, 4, 8, seed=5, dtype=torch.bfloat16, fn_kind="swiglu")
    moe_quant_decode_triton(x, ids, w, gu, dn, **fn)  # autotune before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_quant_decode_triton(x, ids, w, gu, dn, **fn)
    g = torch.Generator().manual_seed(6)
    x.copy_(torch.randn(x.shape, generator=g).to(DEV, x.dtype))
    ids.copy_(torch.stack([torch.randperm(N, generator=g)[:8] for _ in range(4)]).to(DEV))
    ids[2] = NO_EXPERT
    graph.replay()
    assert torch.equal(out, moe_quant_decode_triton(x, ids, w, gu, dn, **fn))
    assert rel(out, moe_quant_decode_torch(x, ids, w, gu, dn, **fn)) < 3e-2
