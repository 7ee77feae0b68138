"""The shared expert's fused elementwise kernels (kernels/shared_expert.py) against the torch ops
they replace, on fresh random inputs: column slices of one wider projection (as the MoE layer's
joined in_proj hands them over), fp32 and bf16, a width that is not a multiple of the block."""
import pytest
import torch

pytest.importorskip("triton")

from freetoken.kernels.shared_expert import (gated_add_torch, gated_add_triton, silu_mul_torch,  # noqa: E402
                                             silu_mul_triton)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def ulps(a, b):
    """Largest difference in units of b's dtype's epsilon relative to |b| (1 = one rounding)."""
    a, b = a.float(), b.float()
    eps = torch.finfo(torch.bfloat16 if b.dtype == torch.bfloat16 else torch.float32).eps
    return float(((a - b).abs() / (b.abs() * eps).clamp_min(1e-30)).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,n", [(1, 512), (3, 1500)])
def test_silu_mul(t, n, dtype):
    g0 = torch.Generator().manual_seed(t * 7 + n)
    parts = (torch.randn(t, 2 * n + 5, generator=g0) * 3).to(DEV, dtype)  # [T, 2N + 5]: g, u, more
    g, u = parts[:, :n], parts[:, n:2 * n]
    got, ref = silu_mul_triton(g, u), silu_mul_torch(g, u)
    assert got.dtype == dtype and got.shape == (t, n) and got.is_contiguous()
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    else:  # each op rounded to bf16 as torch does; exp's last bit may tip one rounding
        assert float((got.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2 ** -7
        assert (got == ref).float().mean() > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h", [(1, 2048), (4, 1000)])
def test_gated_add(t, h, dtype):
    g0 = torch.Generator().manual_seed(t * 11 + h)
    routed = torch.randn(t, h, generator=g0).to(DEV, dtype)
    y = torch.randn(t, h, generator=g0).to(DEV, dtype)
    proj = (torch.randn(t, 9, generator=g0) * 4).to(DEV, dtype)
    sg = proj[:, 8:9]  # the gate: the last column of the joined projection
    got, ref = gated_add_triton(routed, sg, y), gated_add_torch(routed, sg, y)
    assert got.dtype == dtype and got.shape == (t, h)
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    else:
        assert float((got.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2 ** -7
        assert (got == ref).float().mean() > 0.98
    # the gate matters: another sg gives another sum
    assert not torch.equal(gated_add_triton(routed, -sg, y), got)
