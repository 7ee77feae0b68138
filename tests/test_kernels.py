"""Triton kernels against their pure-torch references, on fresh random inputs.

On a CPU machine the kernels run under TRITON_INTERPRET=1 (set in conftest.py before Triton
is imported); on CUDA they run natively.
"""
import functools

import pytest
import torch

triton = pytest.importorskip("triton")

from freetoken.kernels.deltanet_decode import conv_update_triton, delta_step_triton  # noqa: E402
from freetoken.kernels.rmsnorm import gated_rms_norm_triton, rms_norm_triton  # noqa: E402
from freetoken.model.deltanet import l2norm, recurrent_gated_delta_step  # noqa: E402
from freetoken.model.layers import gated_rms_norm, gated_rms_norm_torch, rms_norm_torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the CPU interpreter rounds to bf16 by truncation, one ulp off torch's round-to-nearest
BF16_NORM_TOL = 2e-2 if DEV == "cpu" else 1e-2


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, BF16_NORM_TOL)])
@pytest.mark.parametrize("one_centered", [True, False])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96), (1, 256)])
def test_rms_norm(shape, one_centered, dtype, tol):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(DEV, dtype)
    w = torch.randn(shape[-1], generator=g).to(DEV, dtype)
    got = rms_norm_triton(x, w, 1e-6, one_centered)
    ref = rms_norm_torch(x, w, 1e-6, one_centered)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel(got, ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,h,d", [(5, 3, 128), (37, 2, 96), (1, 1, 64)])
def test_gated_rms_norm(n, h, d, dtype):
    """DeltaNet's output norm in one kernel against the torch form: x [N, Hv, dv] as _finish
    passes it, the gate a column slice of the fused in-projection's output (read in place), and
    a 2-D call."""
    g0 = torch.Generator().manual_seed(n * 31 + h * 7 + d)
    x = (torch.randn(n, h, d, generator=g0) * 3).to(DEV, dtype)
    z = (torch.randn(n, h * d + 9, generator=g0) * 2).to(DEV, dtype)[:, :h * d].view(n, h, d)
    w = (torch.rand(d, generator=g0) + 0.5).to(DEV, dtype)
    got, ref = gated_rms_norm_triton(x, z, w, 1e-6), gated_rms_norm_torch(x, z, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    else:  # rounded where torch rounds; a sum in another order or exp's last bit may tip one rounding
        assert float((got.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2 ** -7
        assert (got == ref).float().mean() > 0.97
    # each input matters: another gate, another weight, another row give other outputs
    assert not torch.allclose(gated_rms_norm_triton(x, -z, w, 1e-6).float(), got.float())
    assert not torch.allclose(gated_rms_norm_triton(x, z, w.flip(0), 1e-6).float(), got.float())
    assert not torch.allclose(gated_rms_norm_triton(x * 2 + 1, z, w, 1e-6).float(), got.float())
    # [N * Hv, dv] rows: the same values
    flat = gated_rms_norm_triton(x.reshape(n * h, d), z.reshape(n * h, d), w, 1e-6)
    assert torch.equal(flat.view(n, h, d), got)


def torch_conv_update(x, state, w):
    window = torch.cat([state, x[..., None]], dim=-1)
    out = torch.nn.functional.silu((window * w).sum(-1))
    state.copy_(window[..., 1:])
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,c,k", [(1, 300, 4), (3, 64, 3), (2, 520, 2)])
def test_conv_update(b, c, k, dtype, tol):
    g = torch.Generator().manual_seed(b * c + k)
    # x as the model passes it: a column slice of a wider fused-projection output
    x = torch.randn(b, c + 37, generator=g).to(DEV, dtype)[:, :c]
    state = torch.randn(b, c, k - 1, generator=g).to(DEV, dtype)
    w = torch.randn(c, k, generator=g).to(DEV, dtype)
    before = state.clone()
    ref = torch_conv_update(x.float(), before.float().clone(), w.float())
    got = conv_update_triton(x, state, w)
    assert rel(got, ref) < tol
    assert torch.equal(state[..., -1], x) and torch.equal(state[..., :-1], before[..., 1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,c,k,bias", [(1, 300, 4, False), (2, 64, 4, True), (3, 200, 4, False),
                                        (70, 130, 4, True), (37, 96, 3, False)])
def test_causal_conv(n, c, k, bias, dtype):
    """A prefill chunk's causal depthwise conv and SiLU in one kernel against the torch
    reference (the state's K-1 inputs before the chunk, F.conv1d, SiLU): chunks shorter and
    longer than the state, a bias or none, x a column slice of a wider fused-projection output;
    and the state after the chunk (its last K-1 inputs) from conv_state_after."""
    from freetoken.kernels.causal_conv import (causal_conv_silu_torch, causal_conv_silu_triton, conv_sequence,
                                               conv_state_after)
    g = torch.Generator().manual_seed(n * c + k)
    x = torch.randn(n, c + 21, generator=g).to(DEV, dtype)[:, :c]
    state = torch.randn(c, k - 1, generator=g).to(DEV, dtype)
    w = (torch.randn(c, k, generator=g) * 0.5).to(DEV, dtype)
    b = torch.randn(c, generator=g).to(DEV, dtype) if bias else None
    ref = causal_conv_silu_torch(x, state, w, b)
    got = causal_conv_silu_triton(x, state, w, b)
    assert got.dtype == dtype and got.shape == (n, c)
    # fp32: the same products summed in another order; bf16: one rounding of the conv's sum apart
    # at most (and the interpreter's truncating bf16 rounding on the CPU)
    assert rel(got, ref) < (1e-6 if dtype == torch.float32 else 2e-2)
    assert torch.equal(conv_state_after(x, state), conv_sequence(x, state)[:, -(k - 1):])


def torch_delta_step(mixed, z, b, a, neg_a, dt_bias, state, norm_w, eps, hk, hv, dk, dv):
    """Composition of the model's reference pieces (GatedDeltaNet._gates_and_heads/_finish)."""
    n = mixed.shape[0]
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = q.reshape(n, hk, dk).float().repeat_interleave(hv // hk, 1)
    k = k.reshape(n, hk, dk).float().repeat_interleave(hv // hk, 1)
    v = v.reshape(n, hv, dv).float()
    q, k = l2norm(q) * dk ** -0.5, l2norm(k)
    beta = b.sigmoid().float()
    g = neg_a * torch.nn.functional.softplus(a.float() + dt_bias)
    core, new = recurrent_gated_delta_step(q, k, v, g, beta, state)
    state.copy_(new)
    o = gated_rms_norm(core.to(mixed.dtype), z.view(n, hv, dv), norm_w, eps)
    return o.reshape(n, hv * dv)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bsz,hk,hv,dk,dv,bv", [(1, 2, 4, 16, 16, None), (3, 2, 2, 32, 16, None),
                                                (2, 1, 4, 16, 64, None), (2, 1, 4, 16, 64, 64),
                                                (1, 2, 2, 32, 32, 16)])
def test_delta_step(bsz, hk, hv, dk, dv, bv, dtype, tol):
    """The fused step against the torch path: one program per head (bv = dv, the norm fused)
    and value columns split over programs with the norm in its own kernel (the default at
    small batches: (2, 1, 4, 16, 64) splits by 4)."""
    g = torch.Generator().manual_seed(bsz + hk * 7 + hv * 13 + dk + dv)
    c = 2 * hk * dk + hv * dv
    mixed = torch.randn(bsz, c, generator=g).to(DEV, dtype)
    z = torch.randn(bsz, hv * dv, generator=g).to(DEV, dtype)
    b = torch.randn(bsz, hv, generator=g).to(DEV, dtype)
    a = (torch.randn(bsz, hv, generator=g) * 3).to(DEV, dtype)  # spans softplus' linear branch too
    neg_a = -torch.empty(hv).uniform_(0.5, 8.0, generator=g).to(DEV)
    dt_bias = torch.randn(hv, generator=g).to(DEV, dtype)
    state = torch.randn(bsz, hv, dk, dv, generator=g).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(DEV, dtype)
    s_ref = state.clone()
    ref = torch_delta_step(mixed, z, b, a, neg_a, dt_bias, s_ref, norm_w, 1e-6, hk, hv, dk, dv)
    got = delta_step_triton(mixed, z, b, a, neg_a, dt_bias, state, norm_w, 1e-6, hk, hv, dk, dv, bv=bv)
    assert rel(got, ref) < tol
    # fp32 state; in bf16 runs beta is rounded to bf16 first (1 ulp apart under the interpreter)
    assert rel(state, s_ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("t,k,h,i", [(1, 8, 256, 64), (3, 4, 96, 40), (2, 2, 130, 200)])
def test_moe_decode(t, k, h, i, dtype, tol):
    from freetoken.experts.executor import TorchExpertExecutor
    from freetoken.kernels.moe_decode import moe_decode_triton
    g = torch.Generator().manual_seed(t * 100 + h + i)
    n = 12
    gu = (torch.randn(n, 2 * i, h, generator=g) * h ** -0.5).to(DEV, dtype)
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(DEV, dtype)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)]).to(DEV)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(DEV, dtype)
    ref = TorchExpertExecutor(gu, dn)._static(x, ids, w)
    assert rel(moe_decode_triton(x, ids, w, gu, dn), ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,h", [(1, 8, 2048), (3, 1, 96), (2, 6, 1500)])
def test_sum_pairs(t, k, h, dtype):
    """The decode kernels' k-sum against torch's y.view(t, k, H).sum(1): fp32 accumulation, one
    rounding; an H that is not a multiple of the block, and k = 1."""
    from freetoken.kernels.moe_decode import sum_pairs_triton
    g = torch.Generator().manual_seed(t * 10 + k + h)
    y = (torch.randn(t * k, h, generator=g) * 3).to(DEV, dtype)
    ref = y.view(t, k, h).sum(1)
    got = sum_pairs_triton(y, t, k)
    assert got.dtype == dtype and got.shape == (t, h)
    # fp32: the same sums in another order; bf16: both round the fp32 sum once
    assert rel(got, ref) < (1e-6 if dtype == torch.float32 else 1e-3)
    # with ids: pairs routed to no expert (-1) count as zeros and are never read (the grouped
    # kernels leave their rows unwritten: NaN here would poison any sum that read them)
    ids = torch.randint(0, 5, (t, k), generator=g).to(DEV)
    ids[0, -1] = -1
    dead = (ids.reshape(-1) < 0)
    y2 = y.masked_fill(dead[:, None], float("nan"))
    ref2 = y.masked_fill(dead[:, None], 0).view(t, k, h).sum(1)
    got2 = sum_pairs_triton(y2, t, k, ids)
    assert not got2.isnan().any() and rel(got2, ref2) < (1e-6 if dtype == torch.float32 else 1e-3)
    assert rel(got2, ref) > 1e-3  # the dead pair's row did not count


@pytest.mark.parametrize("kernel", ["triton", "triton-m128", "grouped_mm"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("t,k,h,i,n,layer_experts", [(37, 3, 64, 32, 10, None), (5, 2, 96, 40, 24, 12),
                                                     (70, 4, 130, 72, 16, 8)])
def test_moe_grouped(t, k, h, i, n, layer_experts, dtype, tol, kernel):
    """Prefill-size batches: pairs sorted into expert tiles, experts read in place (both tile
    sizes: few and many pairs per expert; some experts unused; a second layer's experts); the
    same sums through torch's grouped GEMM (moe_grouped_mm: on CUDA where it has the dtype); tiles
    of 128 pairs, a long pass's option."""
    from freetoken.experts.executor import reference_experts
    from freetoken.kernels.moe_grouped import grouped_mm_supported, moe_grouped_mm, moe_grouped_triton
    g = torch.Generator().manual_seed(t + h + n)
    gu = (torch.randn(n, 2 * i, h, generator=g) * h ** -0.5).to(DEV, dtype)
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(DEV, dtype)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    span = layer_experts or n
    base = n - span  # route within the last layer's experts, as flat ids do
    ids = torch.stack([torch.randperm(span, generator=g)[:k] + base for _ in range(t)]).to(DEV)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(DEV, dtype)
    ref = reference_experts(x.float(), ids, w.float(), gu.float(), dn.float())
    if kernel == "grouped_mm" and not grouped_mm_supported(x, gu, dn):
        el = x.element_size()  # rows of 16-byte multiples: the only limit on the CPU
        assert (h * el) % 16 or (i * el) % 16 or DEV == "cuda"
        pytest.skip("torch's grouped GEMM does not take this dtype or shape here")
    fn = {"triton": moe_grouped_triton, "triton-m128": functools.partial(moe_grouped_triton, block_m=128),
          "grouped_mm": moe_grouped_mm}[kernel]
    got = fn(x, ids, w, gu, dn, max_experts=layer_experts)
    assert got.dtype == dtype and rel(got.float(), ref) < tol


def test_grouped_prefill_path_matches_reference():
    """The padded batched-GEMM grouping (used on CUDA for prefill chunks) is exact."""
    from freetoken.experts.executor import TorchExpertExecutor, reference_experts
    g = torch.Generator().manual_seed(5)
    n, h, i, t, k = 10, 64, 32, 37, 3
    gu = torch.randn(n, 2 * i, h, generator=g).to(DEV)
    dn = torch.randn(n, h, i, generator=g).to(DEV)
    x = torch.randn(t, h, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)]).to(DEV)
    w = torch.rand(t, k, generator=g).to(DEV)
    got = TorchExpertExecutor(gu, dn)._grouped(x, ids, w)
    assert rel(got, reference_experts(x, ids, w, gu, dn)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, BF16_NORM_TOL)])
@pytest.mark.parametrize("one_centered", [True, False])
def test_add_rms_norm(dtype, tol, one_centered):
    from freetoken.kernels.rmsnorm import add_rms_norm_triton
    g = torch.Generator().manual_seed(9)
    r = torch.randn(4, 80, generator=g).to(DEV, dtype)
    h = torch.randn(4, 80, generator=g).to(DEV, dtype)
    w = torch.randn(80, generator=g).to(DEV, dtype)
    s, out = add_rms_norm_triton(r, h, w, 1e-6, one_centered)
    # exact, except bf16 under the CPU interpreter (truncating, not rounding to nearest)
    assert torch.equal(s, r + h) if dtype == torch.float32 or DEV != "cpu" else rel(s, r + h) < 1e-2
    assert rel(out, rms_norm_torch(r + h, w, 1e-6, one_centered)) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,k,norm", [(1, 256, 8, True), (5, 20, 4, False), (3, 16, 2, True), (150, 64, 8, True)])
def test_router(t, e, k, norm, dtype):
    from types import SimpleNamespace
    from freetoken.kernels.router import route_triton
    from freetoken.model.moe import MoE
    g = torch.Generator().manual_seed(t * e + k)
    logits = (torch.randn(t, e, generator=g) * 2).to(DEV, dtype)
    moe = SimpleNamespace(top_k=k, norm_topk=norm, base=3 * e)
    ref_ids, ref_w = MoE.route_torch(moe, logits, dtype)
    ids, w = route_triton(logits, k, norm, 3 * e, dtype)
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
        assert rel(w, ref_w) < 1e-6
    else:  # bf16 logits tie often; any order among equals is a correct top-k
        kth = torch.topk(logits.float(), k).values[:, -1:]
        assert bool((logits.float().gather(1, ids - 3 * e) >= kth).all())
        assert rel(w.float().sort(-1).values, ref_w.float().sort(-1).values) < 1e-2


def test_inactive_rows_keep_their_state():
    """Decode rows of slots that are not decoding (mid-prefill, idle) must not touch state."""
    g = torch.Generator().manual_seed(17)
    b, hk, hv, dk, dv, k = 3, 1, 2, 16, 16, 4
    c = 2 * hk * dk + hv * dv
    active = torch.tensor([True, False, True], device=DEV)
    state = torch.randn(b, c, k - 1, generator=g).to(DEV)
    before = state.clone()
    conv_update_triton(torch.randn(b, c, generator=g).to(DEV), state, torch.randn(c, k, generator=g).to(DEV), active)
    assert torch.equal(state[1], before[1]) and not torch.equal(state[0], before[0])
    for bv in (dv, 8):  # one program per head; value columns split over programs
        rec = torch.randn(b, hv, dk, dv, generator=g).to(DEV)
        rbefore = rec.clone()
        delta_step_triton(torch.randn(b, c, generator=g).to(DEV), torch.randn(b, hv * dv, generator=g).to(DEV),
                          torch.randn(b, hv, generator=g).to(DEV), torch.randn(b, hv, generator=g).to(DEV),
                          -torch.ones(hv, device=DEV), torch.zeros(hv, device=DEV), rec, torch.ones(dv, device=DEV),
                          1e-6, hk, hv, dk, dv, active, bv=bv)
        assert torch.equal(rec[1], rbefore[1]) and not torch.equal(rec[2], rbefore[2])
    from freetoken.kernels.deltanet_decode import delta_value_block
    assert delta_value_block(b, hv, dv) == 16 and delta_value_block(1, 32, 128) == 32  # the latter: Qwen3.6
    assert delta_value_block(8, 32, 128) == 128  # 256 heads' programs: one block, the norm fused


@pytest.mark.parametrize("grouped", [False, True])
def test_rows_routed_to_no_expert_add_nothing(grouped):
    """Batch rows that are not running carry NO_EXPERT: both kernels skip them (zero rows) and
    the live rows are unchanged; the torch paths and the C++ executor agree."""
    from freetoken.experts.cpu import CpuExpertExecutor
    from freetoken.experts.executor import NO_EXPERT, TorchExpertExecutor, reference_experts
    from freetoken.kernels.moe_decode import moe_decode_triton
    from freetoken.kernels.moe_grouped import grouped_mm_supported, moe_grouped_mm, moe_grouped_triton
    g = torch.Generator().manual_seed(9)
    n, h, i, t, k = 12, 64, 32, 5, 4
    gu = (torch.randn(n, 2 * i, h, generator=g) * h ** -0.5).to(DEV)
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(DEV)
    x = torch.randn(t, h, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)]).to(DEV)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(DEV)
    idle = torch.tensor([False, True, False, True, False], device=DEV)
    routed = ids.masked_fill(idle[:, None], NO_EXPERT)
    live = reference_experts(x[~idle], ids[~idle], w[~idle], gu, dn)
    fn = moe_grouped_triton if grouped else moe_decode_triton
    extra = [moe_grouped_mm(x, routed, w, gu, dn)] if grouped and grouped_mm_supported(x, gu, dn) else []
    if grouped:  # tiles of 128 too; the pair rows the grouped kernels leave unwritten (torch.empty)
        # handed back NaN-filled, as the allocator recycles a freed block of the same size
        poison = torch.full((t * k, h), float("nan"), device=DEV)
        del poison
        extra.append(moe_grouped_triton(x, routed, w, gu, dn, block_m=128))
    for got in (fn(x, routed, w, gu, dn), *extra, TorchExpertExecutor(gu, dn)._static(x, routed, w),
                reference_experts(x, routed, w, gu, dn),
                CpuExpertExecutor(gu.cpu(), dn.cpu()).kernel(x.cpu(), routed.cpu(), w.cpu()).to(DEV)):
        assert float(got[idle].abs().max()) == 0.0
        assert rel(got[~idle], live) < 1e-5


def test_linear_pads_cuda_rows_and_warms_each_padded_count():
    """model.linear: a CUDA GEMM's rows past ROW_GRANULE run padded to its next multiple (cuBLAS
    then meets few shapes); warm_gemm_rows runs every padded count up to a cap through each weight
    seen (every count up to it, then each multiple), and skips weights that are gone (it holds
    them weakly)."""
    import gc
    import weakref

    from freetoken.model import linear as lin
    assert [lin.padded_rows(m) for m in (1, 64, 65, 128, 129, 2046)] == [1, 64, 128, 128, 192, 2048]
    w = torch.randn(24, 16)
    saved = dict(lin.SEEN)
    lin.SEEN.clear()
    try:
        lin.SEEN[(24, 16, w.dtype, w.device, False)] = (weakref.ref(w), None)
        assert lin.warm_gemm_rows(200) == 64 + 3  # 1..64, then 128, 192, 256
        del w
        gc.collect()
        assert lin.warm_gemm_rows(200) == 0
    finally:
        lin.SEEN.clear()
        lin.SEEN.update(saved)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: rows are padded there only")
def test_linear_padded_rows_equal_the_plain_gemm_on_cuda():
    from freetoken.model import linear as lin
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(96, 64, device="cuda", generator=g)
    b = torch.randn(96, device="cuda", generator=g)
    for m in (5, 64, 65, 130):
        x = torch.randn(m, 64, device="cuda", generator=g)
        y = lin.linear(x, w, b)
        assert y.shape == (m, 96)
        # the GEMM ran at the padded row count: its output's storage holds those rows
        assert y.untyped_storage().nbytes() == lin.padded_rows(m) * 96 * 4
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert lin.SEEN[(96, 64, torch.float32, w.device, True)][0]() is w


def test_deltanet_layer_with_the_conv_kernel(tmp_path, monkeypatch):
    """GatedDeltaNet.prefill and prefill_padded with FREETOKEN_PREFILL_KERNELS=1 (the conv kernel and
    the output norm's;
    on the CPU through the interpreter, use_triton forced) against the torch path, on one layer of
    a small Qwen3.5-MoE: chunks shorter and longer than the conv's K-1, a capture with
    checkpoints inside them. The conv states, the captured states and the recurrent state are the
    same bits (they hold the raw inputs, never the kernel's output); the outputs agree within the
    conv's rounding."""
    import hf_models
    from freetoken.model import deltanet
    from freetoken.model.deltanet import GatedDeltaNet
    from freetoken.runtime.engine import Engine, EngineConfig
    from freetoken.weights.convert import convert
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    hf_models.save(hf_models.qwen3_5(11, num_hidden_layers=2), str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    eng = Engine(str(tmp_path / "m.ftw"), EngineConfig(device=DEV, dtype=str(dtype).split(".")[1]))
    layer = next(m for m, *_ in eng.model.layers if isinstance(m, GatedDeltaNet))
    layer.prefill_graphs = None
    if DEV == "cpu":  # the conv kernel and the output norm's, through the interpreter
        from freetoken.model import layers
        monkeypatch.setattr(deltanet, "use_triton", lambda t: True)
        monkeypatch.setattr(layers, "use_triton", lambda t: True)

    class Capture:  # cache.prefix.StateCapture's interface: checkpoints at fixed positions
        def __init__(self, positions):
            self.positions, self.saved = positions, {}

        def offsets(self, start, t):
            return [p - start for p in self.positions if start < p <= start + t]

        def store(self, layer, pos, conv, rec):
            self.saved[pos] = (conv.clone(), rec.clone())

    g = torch.Generator().manual_seed(2)
    chunks = [torch.randn(n, eng.cfg.hidden_size, generator=g).to(DEV, dtype) for n in (1, 2, 5, 1, 9)]
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FREETOKEN_PREFILL_KERNELS", flag)
        st = eng.new_state(64)
        cap, outs, start = Capture([2, 3, 6, 15]), [], 0
        for x in chunks:
            outs.append(layer.prefill(x, st, 0, start, cap))
            start += x.shape[0]
        conv, rec = st.conv[layer.layer][0].clone(), st.rec[layer.layer][0].clone()
        xp = torch.randn(8, eng.cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
        padded = layer.prefill_padded(xp, torch.tensor(3, device=DEV), torch.arange(8, device=DEV), conv.clone(),
                                      rec.clone())
        runs[flag] = (torch.cat(outs), conv, rec, cap.saved, padded)
    (o0, c0, r0, s0, p0), (o1, c1, r1, s1, p1) = runs["0"], runs["1"]
    assert torch.equal(c0, c1) and sorted(s0) == sorted(s1) == [2, 3, 6, 15]
    assert all(torch.equal(s0[p][0], s1[p][0]) for p in s0)  # captured conv states: the raw inputs
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel(o1, o0) < tol and rel(r1, r0) < tol and rel(p1[:3], p0[:3]) < tol
