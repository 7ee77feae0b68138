"""The CPU decode step's C++ kernels against their torch references: the dense rows kernel
(experts/cpu/dense.h, model/linear.py host_gemv) and a gated DeltaNet layer's decode step
(deltanet.h, GatedDeltaNet._decode_host against the layer's torch path)."""
import pytest
import torch
import torch.nn.functional as F

from freetoken.experts.cpu import extension
from freetoken.model.layers import lm_head
from freetoken.model.linear import HOST_ROWS, host_gemv, linear

pytestmark = pytest.mark.skipif(extension() is None, reason="the C++ extension could not be built here")


def _ref(x, w, b=None):
    """x @ w^T + b in float64 from the same values."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


# (rows, N, K): N not a multiple of 4 (tail rows), K not a multiple of 16 / 32 (tail columns),
# one thread's share of blocks cut at odd places
SHAPES = [(1, 1281, 2048), (3, 7, 100), (8, 2050, 4096), (2, 4, 33), (5, 515, 256), (1, 1, 1)]


@pytest.mark.parametrize("isa", [3, 2, 1, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_dense_gemv_equals_the_float64_product(m, n, k, dtype, isa):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    for bias in (b, None):
        got = extension().dense_gemv(x, w, bias if bias is not None else torch.empty(0), isa)  # [m, n] fp32
        assert got.dtype == torch.float32 and got.shape == (m, n)
        ref = _ref(x, w, bias)
        # fp32 sums of k exact products: error within a few ulp of the sum of |terms|
        scale = _ref(x.abs(), w.abs()) + (bias.abs().double() if bias is not None else 0)
        assert ((got.double() - ref).abs() <= 4 * k ** 0.5 * 2 ** -24 * scale + 1e-30).all()


@pytest.mark.parametrize("isa", [3, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [512, 515])
def test_dense_gemv_rows_are_independent_of_the_batch(k, dtype, isa):
    """A row's result has the same bits alone or among others, in a pair or the odd one out (the
    2-row kernels sum each row as the 1-row ones do), with and without a tail of columns."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, k, generator=g).to(dtype)
    w = torch.randn(302, k, generator=g).to(dtype)
    all_rows = extension().dense_gemv(x, w, torch.empty(0), isa)
    for i in range(7):
        assert torch.equal(extension().dense_gemv(x[i:i + 1], w, torch.empty(0), isa)[0], all_rows[i]), i


def test_dense_gemv_refuses_bad_arguments():
    ext = extension()
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="one K"):
        ext.dense_gemv(torch.randn(1, 15), w, torch.empty(0), 3)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.dense_gemv(torch.randn(1, 8), w.t(), torch.empty(0), 3)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        ext.dense_gemv(torch.randn(65, 16), w, torch.empty(0), 3)
    with pytest.raises(RuntimeError, match="b \\[N\\]"):
        ext.dense_gemv(torch.randn(1, 16), w, torch.randn(7), 3)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ext.dense_gemv(torch.randn(1, 16).half(), w.half(), torch.empty(0), 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_the_rows_kernel_for_decode_rows_only(dtype, monkeypatch):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    calls = []
    real = extension().dense_gemv

    def spy(*a):
        calls.append(a[0].shape[0])
        return real(*a)
    import freetoken.experts.cpu as cpu_mod
    fake = type("Ext", (), {"dense_gemv": staticmethod(spy)})
    monkeypatch.setattr(cpu_mod, "_ext", fake)
    top = HOST_ROWS
    for shape in [(1, 64), (2, 3, 64), (top, 64), (top + 1, 64), (40, 64)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        got = linear(x, w, b)
        assert got.shape == (*shape[:-1], 96) and got.dtype == dtype
        rows = x.numel() // 64
        if rows <= top:
            assert calls and calls[-1] == rows
            # x's dtype at the end, rounded once from the fp32 sums
            ref = _ref(x, w, b).to(dtype)
            assert torch.allclose(got.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
        else:  # prefill chunks: torch's GEMM, bit for bit
            assert calls[-1:] != [rows]
            assert torch.equal(got, F.linear(x, w, b))
    n = len(calls)
    monkeypatch.setattr(cpu_mod, "DECODE_KERNELS", False)  # FREETOKEN_CPU_KERNELS=0
    x = torch.randn(1, 64, generator=g).to(dtype)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b)) and len(calls) == n


def test_host_gemv_declines_what_it_does_not_serve():
    w = torch.randn(16, 8)
    assert host_gemv(torch.randn(1, 8).bfloat16(), w) is None  # mixed dtypes: F.linear's business
    assert host_gemv(torch.randn(1, 8).half(), w.half()) is None
    assert host_gemv(torch.randn(1, 16), w.t()) is None  # not contiguous
    assert host_gemv(torch.randn(1, 256), torch.randn(256, 1).t()) is None  # [1, 256] with strides (1, 1)
    assert host_gemv(torch.randn(1, 8, requires_grad=True), w) is None  # autograd
    assert host_gemv(torch.randn(1, 8), w, torch.randn(16, requires_grad=True)) is None
    assert host_gemv(torch.randn(1, 8), w, torch.randn(1, 16)) is None  # a broadcast bias
    assert host_gemv(torch.randn(1, 8).bfloat16(), w.bfloat16(), torch.randn(16)) is None  # F.linear refuses it
    assert host_gemv(torch.randn(HOST_ROWS + 1, 8), w) is None
    for x, ww, b in [(torch.randn(1, 256), torch.randn(256, 1).t(), None), (torch.randn(2, 8), w, torch.randn(1, 16))]:
        assert torch.equal(linear(x, ww, b), F.linear(x, ww, b))  # served by torch, as before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_lm_head_rows(n, dtype, monkeypatch):
    """layers.lm_head's decode rows through the rows kernel (seen to run), equal to F.linear
    within the dtype's rounding."""
    import freetoken.model.layers as layers
    ran = []
    monkeypatch.setattr(layers, "host_gemv", lambda *a: ran.append(1) or host_gemv(*a))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(n, 128, generator=g).to(dtype)
    w = torch.randn(1000, 128, generator=g).to(dtype)
    tol = dict(rtol=1e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    assert torch.allclose(lm_head(h, w).float(), F.linear(h, w).float(), **tol) and ran


def test_results_do_not_depend_on_the_thread_count():
    """The rows kernel (threads split the weight's blocks) and the DeltaNet step (threads take
    (row, head) tasks and channel ranges) give the same bits on one thread as on two."""
    g = torch.Generator().manual_seed(4)
    old = torch.get_num_threads()
    try:
        for n in (127, 130, 515, 1281, 4099):
            x, w = torch.randn(3, 96, generator=g).bfloat16(), torch.randn(n, 96, generator=g).bfloat16()
            outs = []
            for t in (1, 2):
                torch.set_num_threads(t)
                outs.append(extension().dense_gemv(x, w, torch.randn(n, generator=g) * 0, 3))
            assert torch.equal(outs[0], outs[1]), n
        from freetoken.model.state import DecodeState
        mc, layer, li, g2 = _deltanet(torch.float32, False)
        x = torch.randn(2, mc.hidden_size, generator=g2)
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            st = DecodeState(mc, 2, 64, torch.device("cpu"), torch.float32)
            for v in list(st.conv.values()) + list(st.rec.values()):
                v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(5)))
            outs.append((layer.decode(x, st, None), st.rec[li].clone()))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    finally:
        torch.set_num_threads(old)


def _deltanet(dt, conv_bias: bool, **over):
    from bench.llamacpp import TINY
    from freetoken.config import ModelConfig
    from freetoken.demo import random_tensor, weight_shapes
    from freetoken.model.deltanet import GatedDeltaNet
    mc = ModelConfig.from_hf(dict(TINY, **over))
    g = torch.Generator().manual_seed(0)
    w = {n: random_tensor(n, s, g, embed_std=0.5) for n, s in weight_shapes(mc).items()}
    layer = mc.linear_layers[0]
    if conv_bias:
        w[f"model.layers.{layer}.linear_attn.conv1d.bias"] = torch.randn(mc.conv_dim, generator=g) * 0.1
    w = {n: t.to(dt) if t.is_floating_point() else t for n, t in w.items()}
    return mc, GatedDeltaNet(mc, w, layer), layer, g


@pytest.mark.parametrize("conv_bias", [False, True])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("over", [{}, dict(linear_key_head_dim=128, linear_value_head_dim=128)])
def test_deltanet_decode_equals_the_torch_path(dt, conv_bias, over):
    """GatedDeltaNet.decode through the C++ kernel against its torch path, step after step, on
    random conv windows and states: outputs of the running rows, conv windows and recurrent
    states (an idle row's untouched by both)."""
    from freetoken.model.state import DecodeState
    mc, layer, li, g = _deltanet(dt, conv_bias, **over)
    states = [DecodeState(mc, 3, 64, torch.device("cpu"), dt) for _ in range(2)]
    for t in list(states[0].conv.values()) + list(states[0].rec.values()):
        t.normal_(generator=g)
    for a, b in zip(list(states[0].conv.values()) + list(states[0].rec.values()),
                    list(states[1].conv.values()) + list(states[1].rec.values())):
        b.copy_(a)
    idle_rec, idle_conv = states[0].rec[li][1].clone(), states[0].conv[li][1].clone()
    calls = []
    host = layer._decode_host
    tol = dict(rtol=1e-2, atol=1e-2) if dt == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for step, active in enumerate([torch.tensor([True, False, True]), None, torch.tensor([False, True, True])]):
        x = torch.randn(3, mc.hidden_size, generator=g).to(dt)
        layer._decode_host = lambda *a: calls.append(1) or host(*a)
        got = layer.decode(x, states[0], None, active)
        layer._decode_host = lambda *a: None  # the torch path
        ref = layer.decode(x, states[1], None, active)
        rows = torch.arange(3) if active is None else active.nonzero()[:, 0]
        assert torch.allclose(got[rows].float(), ref[rows].float(), **tol), step
        if dt == torch.bfloat16:  # the torch path's rounding points kept: equal but for a rare last bit
            diff = (got[rows].float() - ref[rows].float()).abs()
            assert (diff == 0).float().mean() > 0.98, step
            assert (diff <= ref[rows].float().abs() * 2 ** -7 + 1e-6).all(), step
        assert torch.allclose(states[0].rec[li], states[1].rec[li], rtol=1e-4, atol=1e-5)
        assert torch.equal(states[0].conv[li], states[1].conv[li])
        if step == 0:  # the idle row kept its window and state
            assert torch.equal(states[0].rec[li][1], idle_rec) and torch.equal(states[0].conv[li][1], idle_conv)
    assert len(calls) == 3


def test_deltanet_decode_refuses_bad_arguments():
    mc, layer, li, g = _deltanet(torch.float32, False)
    ext = extension()
    c = mc.conv_dim
    hv, dv = mc.linear_num_value_heads, mc.linear_value_head_dim
    mixed, z = torch.randn(1, c), torch.randn(1, hv * dv)
    ba = torch.randn(1, 2 * hv)
    b, a = ba[:, :hv], ba[:, hv:]
    conv_state = torch.zeros(1, c, mc.linear_conv_kernel_dim - 1)
    state = torch.zeros(1, hv, mc.linear_key_head_dim, dv)
    good = [mixed, z, b, a, conv_state, layer.conv_w.contiguous(), torch.empty(0), layer.neg_a.float(),
            layer.dt_bias.float(), state, layer.norm_w.float(), False, 1e-6, mc.linear_num_key_heads,
            mc.linear_key_head_dim, torch.empty(0, dtype=torch.bool)]
    ext.deltanet_decode(*good)
    for i, bad, msg in [(0, mixed.bfloat16(), "share the activation dtype"),
                        (9, torch.zeros(1, hv, mc.linear_key_head_dim, dv + 1), "state \\[>= B"),
                        (4, torch.zeros(1, c, 7), "conv_state"),
                        (13, 3, "2 hk dk \\+ hv dv"),
                        (15, torch.ones(2, dtype=torch.bool), "active")]:
        args = list(good)
        args[i] = bad
        with pytest.raises(RuntimeError, match=msg):
            ext.deltanet_decode(*args)
