"""The C++ CPU expert executor computing GPT-OSS experts: the clamped SwiGLU
    g' = min(g, limit), u' = clamp(u, -limit, limit), h = (u' + 1) * g' * sigmoid(alpha * g')
over gate_up products plus their bias [N, 2I], and the down product plus its bias [N, H], against
the torch reference (executor.reference_experts) on fresh random data: bf16 and f32 banks, and
quantized banks (mxfp4 as GPT-OSS ships, fp8_block and nvfp4 too), every ISA this CPU has, batch
sizes 1..33, NO_EXPERT pairs, values large enough that both clamps act.

fp32 activations: within 1e-5 relative (the weights are exact in fp32, only the summation order
differs). bf16 activations: the reference runs in fp32 on the bf16-rounded activations and biases;
on the VDPBF16PS paths (bf16 banks or fp4 banks on avx512-bf16: h rounded to bf16) within 2e-2,
elsewhere within 1e-5. The thread count never changes a bit.
"""
import pytest
import torch

from freetoken.experts.cpu import ISA_NAMES, CpuExpertExecutor, extension
from freetoken.experts.executor import NO_EXPERT, SILU, Activation, reference_experts
from test_cpu_quantized import random_banks

pytestmark = pytest.mark.skipif(extension() is None, reason="the C++ executor could not be built")

N, K = 16, 4
BATCHES = [1, 2, 3, 5, 8, 17, 33]
GPT_OSS = Activation("swiglu_clamp", 1.702, 7.0)


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def inputs(t, h, seed, scale=1.0, n=N, k=K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * scale
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])
    if t > 2:
        ids[1] = NO_EXPERT  # a row that is not running: zero, biases included
        ids[t - 1, 0] = NO_EXPERT
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return x, ids, w


def biases(n, h, i, dtype, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2 * i, generator=g) * scale).to(dtype), (torch.randn(n, h, generator=g) * scale).to(dtype)


def clamp_acts(x, ids, gu, gub, limit):
    """Whether the gate clamp and both sides of the up clamp act on these inputs."""
    i = gu.shape[1] // 2
    sel = ids.clamp(min=0)
    pre = torch.einsum("th,tkrh->tkr", x, gu[sel]) + gub[sel]  # [T, K, 2I]
    g, u = pre[..., :i], pre[..., i:]
    return bool((g > limit).any() and (u > limit).any() and (u < -limit).any() and (g < limit).any())


def check(exs, banks_f32, fn, x, ids, w, dp, act_scale):
    """exs: executors at 1 and 2 threads; banks_f32: the exact float banks (the reference's)."""
    gu, dn = banks_f32
    ref = reference_experts(x, ids, w, gu, dn, **fn)
    one, two = (ex.kernel(x, ids, w) for ex in exs)
    assert torch.equal(one, two), "the thread count changed the result"
    assert torch.isfinite(one).all()
    assert rel(one, ref) < 1e-5, rel(one, ref)
    if ids.shape[0] > 2:
        assert not one[1].any(), "a NO_EXPERT row gets nothing, not even the down bias"
    # bf16 activations (a bf16 model): the reference on the values the kernel sees
    fb = {k: (v.bfloat16().float() if isinstance(v, torch.Tensor) else v) for k, v in fn.items()}
    ref_b = reference_experts(x.bfloat16().float(), ids, w, gu, dn, **fb)
    one_b, two_b = (ex.kernel(x.bfloat16(), ids, w) for ex in exs)
    assert torch.equal(one_b, two_b)
    assert rel(one_b, ref_b) < (2e-2 if dp else 1e-5), rel(one_b, ref_b)


@pytest.mark.parametrize("isa", [0, 1, 2, 3], ids=ISA_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_banks(dtype, isa):
    n, h, i = N, 200, 72  # tails: 200 = 12 x 16 + 8 columns; 72 rows = 4 blocks of 16 + 8
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(n, 2 * i, h, generator=g) * 3 * h ** -0.5).to(dtype)  # gate/up ~ 3x limit-sized
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(dtype)
    gub, dnb = biases(n, h, i, dtype, seed=2)
    fn = dict(activation=Activation("swiglu_clamp", 1.702, 2.0), gate_up_bias=gub, down_bias=dnb)
    exs = [CpuExpertExecutor(gu, dn, threads=t, isa_cap=isa, **fn) for t in (1, 2)]
    if exs[0].isa != ISA_NAMES[isa]:
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    assert exs[0].backend == "cpp" and exs[0].activation == fn["activation"]
    dp = isa == 3 and dtype == torch.bfloat16
    f32 = (gu.float(), dn.float())
    for t in BATCHES:
        x, ids, w = inputs(t, h, seed=t)
        if t >= 5:
            assert clamp_acts(x, ids, f32[0], gub.float(), 2.0)
        check(exs, f32, fn, x, ids, w, dp, 1.0)


@pytest.mark.parametrize("isa", [0, 1, 2, 3], ids=ISA_NAMES)
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_block", "nvfp4"])
def test_quantized_banks(fmt, isa):
    """GPT-OSS's own constants (alpha 1.702, limit 7) with activations scaled so the clamps act."""
    h, i = (288, 96) if fmt != "fp8_block" else (328, 136)
    banks = random_banks(fmt, torch.bfloat16 if fmt == "fp8_block" else None, N, h, i, seed=5)
    gub, dnb = biases(N, h, i, torch.bfloat16, seed=6, scale=4.0)  # bf16, as GPT-OSS publishes them
    fn = dict(activation=GPT_OSS, gate_up_bias=gub, down_bias=dnb)
    exs = [CpuExpertExecutor(banks, threads=t, isa_cap=isa, **fn) for t in (1, 2)]
    if exs[0].isa != ISA_NAMES[isa]:
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    assert exs[0].quantized and exs[0].backend == "cpp"
    dp = isa == 3 and fmt != "fp8_block"
    f32 = banks.dequant(torch.arange(N))
    scale = {"mxfp4": 20.0, "nvfp4": 8.0, "fp8_block": 4.0}[fmt]
    for t in BATCHES:
        x, ids, w = inputs(t, h, seed=10 + t, scale=scale)
        if t >= 5:
            assert clamp_acts(x, ids, f32[0], gub.float(), 7.0), "the clamps must act"
        check(exs, f32, fn, x, ids, w, dp, scale)


def test_each_part_on_its_own_and_f32_biases_in_a_bf16_model():
    """Only a gate_up bias, only a down bias, SiLU with biases, the clamp without biases; f32 biases
    with bf16 activations are rounded to bf16 as the reference's bias.to(x.dtype)."""
    n, h, i = 10, 64, 48
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(n, 2 * i, h, generator=g) * 3 * h ** -0.5
    dn = torch.randn(n, h, i, generator=g) * i ** -0.5
    gub, dnb = biases(n, h, i, torch.float32, seed=4)
    x, ids, w = inputs(6, h, seed=6, n=n)
    for fn in (dict(activation=GPT_OSS, gate_up_bias=gub), dict(activation=GPT_OSS, down_bias=dnb),
               dict(activation=SILU, gate_up_bias=gub, down_bias=dnb), dict(activation=Activation("swiglu_clamp", 1.0, 0.5))):
        ex = CpuExpertExecutor(gu, dn, **fn)
        assert rel(ex.kernel(x, ids, w), reference_experts(x, ids, w, gu, dn, **fn)) < 1e-5, fn
    fn = dict(activation=GPT_OSS, gate_up_bias=gub + 1e-3, down_bias=dnb)  # not bf16-exact
    fb = {k: (v.bfloat16().float() if isinstance(v, torch.Tensor) else v) for k, v in fn.items()}
    ex = CpuExpertExecutor(gu, dn, isa_cap=2, **fn)  # the f32 dot path: no other rounding
    want = reference_experts(x.bfloat16().float(), ids, w, gu, dn, **fb)
    assert rel(ex.kernel(x.bfloat16(), ids, w), want) < 1e-5
    # mixed bias dtypes are read as f32; f16 too
    for a, b in ((gub.bfloat16(), dnb), (gub.half(), dnb.half())):
        ex = CpuExpertExecutor(gu, dn, activation=GPT_OSS, gate_up_bias=a, down_bias=b)
        ref = reference_experts(x, ids, w, gu, dn, GPT_OSS, a.float(), b.float())
        assert rel(ex.kernel(x, ids, w), ref) < 1e-5


def test_large_batches_take_the_torch_path_with_the_same_function():
    n, h, i = 8, 64, 32
    g = torch.Generator().manual_seed(8)
    gu = torch.randn(n, 2 * i, h, generator=g) * 3 * h ** -0.5
    dn = torch.randn(n, h, i, generator=g) * i ** -0.5
    gub, dnb = biases(n, h, i, torch.bfloat16, seed=9)
    fn = dict(activation=GPT_OSS, gate_up_bias=gub, down_bias=dnb)
    ex = CpuExpertExecutor(gu, dn, torch_batch_threshold=4, **fn)
    x, ids, w = inputs(9, h, seed=9, n=n)
    ref = reference_experts(x, ids, w, gu, dn, **fn)
    assert rel(ex(x, ids, w), ref) < 1e-6  # 9 tokens > 4: the torch reference
    assert rel(ex.kernel(x, ids, w), ref) < 1e-5
    assert ex.gate_up_bias.dtype == torch.bfloat16  # kept as published: no f32 copy


def test_bad_expert_function_arguments_are_rejected():
    n, h, i = 4, 32, 16
    gu, dn = torch.randn(n, 2 * i, h), torch.randn(n, h, i)
    x, ids, w = torch.randn(1, h), torch.tensor([[1]]), torch.ones(1, 1)
    ex = CpuExpertExecutor(gu, dn)
    ext = extension()
    with pytest.raises(RuntimeError, match="activation code"):
        ext.forward(ex.handle, x, ids, w, gu, dn, False, act=7)
    with pytest.raises(RuntimeError, match="gate_up_bias"):
        ext.forward(ex.handle, x, ids, w, gu, dn, False, act=1, gate_up_bias=torch.zeros(n, i))
    with pytest.raises(RuntimeError, match="share a dtype"):
        ext.forward(ex.handle, x, ids, w, gu, dn, False, act=1, gate_up_bias=torch.zeros(n, 2 * i),
                    down_bias=torch.zeros(n, h, dtype=torch.bfloat16))
