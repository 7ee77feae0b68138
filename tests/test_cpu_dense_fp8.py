"""FP8 block dense weights on the CPU, read as published (issue 12): the C++ rows kernel
(experts/cpu/dense.h dense_gemv_fp8, model/linear.py host_gemv_fp8) against the fp32 rows kernel on
the weight Fp8BlockWeight.dequantize() builds (bit for bit: the kernel dequantizes each block of
rows exactly as the reference does and sums it as dense_gemv does) and against a float64 product;
linear() past the kernel's rows (fp8_blocks_linear, blocks of rows dequantized per call) against
F.linear on the dequantized weight; the engine's --dense-fp8 auto keeping FP8 on the CPU."""
import pytest
import torch
import torch.nn.functional as F

from freetoken.experts.cpu import extension
from freetoken.model import linear as lin
from freetoken.model.linear import FP8_HOST_ROWS, fp8_blocks_linear, host_gemv_fp8, linear
from freetoken.weights.dense_fp8 import Fp8BlockWeight

pytestmark = pytest.mark.skipif(extension() is None, reason="the C++ extension could not be built here")

FINITE = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes: no NaN


def random_fp8(n: int, k: int, scale_dtype, g: torch.Generator) -> Fp8BlockWeight:
    """Random e4m3 bytes with every finite code (subnormals, +-0, +-448) in the first rows, and
    random positive block scales spanning many binades in scale_dtype."""
    v = FINITE[torch.randint(0, len(FINITE), (n, k), generator=g)]
    flat = v.view(-1)
    flat[:min(len(FINITE), flat.numel())] = FINITE[:flat.numel()]
    s = torch.exp2(torch.randint(-20, 4, (-(-n // 128), -(-k // 128)), generator=g).float()) \
        * (1 + torch.rand(-(-n // 128), -(-k // 128), generator=g))
    return Fp8BlockWeight(v.view(torch.float8_e4m3fn), s.to(scale_dtype), torch.float32)


# (rows, N, K): N not a multiple of 4 or 128 (tail rows, a short last scale block), K not a
# multiple of 16 / 32 / 128 (tail columns in the conversion and the dots); on AVX-512 up to 4 rows
# of x with K a multiple of 16 take the fused form (dense.h FP8_FUSED_ROWS), the rest the scratch
SHAPES = [(1, 300, 2048), (3, 130, 256), (4, 7, 64), (2, 515, 144), (3, 7, 100), (8, 1030, 520), (2, 4, 33),
          (17, 129, 257), (1, 1, 1)]


@pytest.mark.parametrize("isa", [3, 2, 1, 0])
@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_rows_equal_the_rows_kernel_on_the_dequantized_weight(m, n, k, sdt, isa):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = random_fp8(n, k, sdt, g)
    deq = w.dequantize(torch.float32)  # [n, k] the reference's weights
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g)
    ext = extension()
    for bias in (b, torch.empty(0)):
        got = ext.dense_gemv_fp8(x, w.values, w.scale_inv, bias, isa)  # [m, n] fp32
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert torch.equal(got, ext.dense_gemv(x, deq, bias, isa))
        ref = F.linear(x.double(), deq.double(), bias.double() if bias.numel() else None)
        scale = F.linear(x.abs().double(), deq.abs().double()) + (bias.abs().double() if bias.numel() else 0)
        assert ((got.double() - ref).abs() <= 4 * k ** 0.5 * 2 ** -24 * scale + 1e-30).all()


@pytest.mark.parametrize("k", [300, 256])
def test_fp8_rows_do_not_depend_on_the_batch_or_the_threads(k):
    """A row alone (the fused form where K allows) has the bits it has among 7 (the scratch)."""
    g = torch.Generator().manual_seed(5)
    w = random_fp8(515, k, torch.bfloat16, g)
    x = torch.randn(7, k, generator=g)
    ext = extension()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        all_rows = ext.dense_gemv_fp8(x, w.values, w.scale_inv, torch.empty(0), 3)
        torch.set_num_threads(1)
        for i in range(7):
            one = ext.dense_gemv_fp8(x[i:i + 1], w.values, w.scale_inv, torch.empty(0), 3)
            assert torch.equal(one[0], all_rows[i]), i
    finally:
        torch.set_num_threads(before)


def test_dense_gemv_fp8_refuses_bad_arguments():
    ext = extension()
    g = torch.Generator().manual_seed(6)
    w = random_fp8(130, 200, torch.float32, g)
    v, s, none = w.values, w.scale_inv, torch.empty(0)
    with pytest.raises(RuntimeError, match="one K"):
        ext.dense_gemv_fp8(torch.randn(1, 199), v, s, none, 3)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        ext.dense_gemv_fp8(torch.randn(65, 200), v, s, none, 3)
    with pytest.raises(RuntimeError, match=r"\[ceil\(N/128\), ceil\(K/128\)\]"):
        ext.dense_gemv_fp8(torch.randn(1, 200), v, s[:1], none, 3)
    with pytest.raises(RuntimeError, match="scale_inv float32, bfloat16 or float16"):
        ext.dense_gemv_fp8(torch.randn(1, 200), v, s.double(), none, 3)
    with pytest.raises(RuntimeError, match="contiguous float8_e4m3fn"):
        ext.dense_gemv_fp8(torch.randn(1, 130), v.view(torch.uint8).t(), s.t().contiguous(), none, 3)
    with pytest.raises(RuntimeError, match="contiguous float8_e4m3fn"):  # another 1-byte type is not e4m3
        ext.dense_gemv_fp8(torch.randn(1, 200), v.view(torch.int8), s, none, 3)
    with pytest.raises(RuntimeError, match="x float32 or bfloat16"):
        ext.dense_gemv_fp8(torch.randn(1, 200).half(), v, s, none, 3)
    with pytest.raises(RuntimeError, match=r"b \[N\]"):
        ext.dense_gemv_fp8(torch.randn(1, 200), v, s, torch.randn(7), 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_reads_fp8_in_place_for_decode_rows_and_dequantizes_blocks_past_them(dtype, monkeypatch):
    g = torch.Generator().manual_seed(7)
    w = random_fp8(300, 160, torch.bfloat16, g)
    b = torch.randn(300, generator=g)
    deq = w.dequantize(torch.float32)
    calls = []
    real = extension()
    fake = type("Ext", (), {"dense_gemv_fp8": staticmethod(lambda *a: calls.append(a[0].shape[0]) or
                                                          real.dense_gemv_fp8(*a)),
                            "dense_dequant_fp8": staticmethod(real.dense_dequant_fp8)})
    import freetoken.experts.cpu as cpu_mod
    monkeypatch.setattr(cpu_mod, "_ext", fake)
    monkeypatch.setattr(lin, "WIDEN_ELEMENTS", 160 * 128)  # blocks of 128 rows: three blocks, the last short
    for shape in [(1, 160), (2, 3, 160), (FP8_HOST_ROWS, 160), (FP8_HOST_ROWS + 1, 160), (70, 160)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        got = linear(x, w, b)
        assert got.shape == (*shape[:-1], 300) and got.dtype == dtype
        rows = x.numel() // 160
        ref = F.linear(x.float(), deq, b)  # what the dequantized load computes, in fp32
        assert torch.allclose(got.float(), ref.to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                              atol=1e-3)
        assert (calls[-1:] == [rows]) == (rows <= FP8_HOST_ROWS), rows
    x = torch.randn(70, 160, generator=g)
    # the blocks' GEMMs give the rows of the whole weight's GEMM (each row's sums alike)
    assert torch.allclose(fp8_blocks_linear(x, w, b), F.linear(x, deq, b), rtol=1e-5, atol=1e-5)
    n = len(calls)
    monkeypatch.setattr(cpu_mod, "DECODE_KERNELS", False)  # FREETOKEN_CPU_KERNELS=0: no kernel
    assert host_gemv_fp8(x[:1], w, b) is None
    assert torch.allclose(linear(x[:1], w, b), F.linear(x[:1], deq, b), rtol=1e-5, atol=1e-5) and len(calls) == n


def test_host_gemv_fp8_declines_what_it_does_not_serve():
    g = torch.Generator().manual_seed(8)
    w = random_fp8(16, 8, torch.float32, g)
    assert host_gemv_fp8(torch.randn(1, 8).half(), w) is None
    assert host_gemv_fp8(torch.randn(FP8_HOST_ROWS + 1, 8), w) is None
    assert host_gemv_fp8(torch.randn(1, 8, requires_grad=True), w) is None
    assert host_gemv_fp8(torch.randn(1, 8), w, torch.randn(1, 16)) is None  # a broadcast bias
    assert host_gemv_fp8(torch.randn(1, 8), w, torch.randn(16, requires_grad=True)) is None  # autograd
    assert host_gemv_fp8(torch.randn(1, 8), w, torch.randn(16)) is not None
    # scales of a dtype the kernels do not read: the torch way, the reference's result
    w64 = Fp8BlockWeight(w.values, w.scale_inv.double(), torch.float32)
    x = torch.randn(2, 8)
    assert host_gemv_fp8(x, w64) is None
    assert torch.allclose(linear(x, w64), F.linear(x, w.dequantize(torch.float32)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_dequant_fp8_is_the_reference_bit_for_bit(sdt):
    """The prompt chunks' dequantization (fp8_blocks_linear) by the C++ kernel: Fp8BlockWeight's
    own values, every finite code, rows and columns past a block's end."""
    g = torch.Generator().manual_seed(9)
    for n, k in [(300, 2048), (129, 257), (1, 1), (4, 15)]:
        w = random_fp8(n, k, sdt, g)
        assert torch.equal(extension().dense_dequant_fp8(w.values, w.scale_inv), w.dequantize(torch.float32))
    with pytest.raises(RuntimeError, match="scale_inv must be contiguous"):
        extension().dense_dequant_fp8(w.values, w.scale_inv[:, :0])
