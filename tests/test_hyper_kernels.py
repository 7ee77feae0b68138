"""The fused hyper-connection kernels (kernels/hyper.py) against the torch references
(model/hyper.py) on fresh random inputs.

On a CPU machine the kernels run under TRITON_INTERPRET=1 (set in conftest.py before Triton is
imported); on CUDA they run natively.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from freetoken.kernels.hyper import hc_head_triton, hc_post_triton, hc_pre_triton  # noqa: E402
from freetoken.model.hyper import hc_head_torch, hc_post_torch, hc_pre_torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the CPU interpreter rounds to bf16 by truncation, one ulp off torch's round-to-nearest
BF16_TOL = 2e-2 if DEV == "cpu" else 1e-2
EPS, NORM_EPS = 1e-6, 1e-6

# (N, hc, H, iters, fuse_mix): ragged N and H (not multiples of the blocks), hc 4 as in
# V4-Flash, 2 and 1 as in the model tests, 3 for the padded (non power-of-two) layout; both
# projection paths (split-K kernel; cuBLAS / torch GEMM then the sums of squares in-kernel)
# (17 tokens with iters = 1 only: the interpreter runs each program's Sinkhorn loop in Python)
CASES = [(1, 4, 300, 20, True), (3, 4, 96, 20, False), (17, 4, 300, 1, None), (17, 2, 96, 1, True),
         (3, 1, 300, 20, True), (1, 2, 300, 1, False), (3, 3, 96, 20, True)]


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def inputs(n, hc, hd, mix, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hc, hd, generator=g) * 2 + 0.3).to(DEV, dtype)
    # the projection of the unit-RMS row lands around +-1..3, so the sigmoids and the softmax
    # are neither saturated nor flat
    fn = (torch.randn(mix, hc * hd, generator=g) * 2 / (hc * hd) ** 0.5).to(DEV)
    base = (torch.randn(mix, generator=g) * 0.5).to(DEV)
    return g, h, fn, base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,hc,hd,iters,fuse", CASES)
def test_hc_pre(n, hc, hd, iters, fuse, dtype):
    g, h, fn, base = inputs(n, hc, hd, (2 + hc) * hc, dtype, n * 100 + hc * 10 + hd + iters)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    post, comb, coll = hc_pre_triton(h, fn, base, scale, iters, EPS, NORM_EPS, fuse_mix=fuse)
    rpost, rcomb, rcoll = hc_pre_torch(h, fn, base, scale, iters, EPS, NORM_EPS)
    assert post.dtype == comb.dtype == torch.float32 and coll.dtype == dtype
    assert post.shape == (n, hc) and comb.shape == (n, hc, hc) and coll.shape == (n, hd)
    # post and comb only see h through the fp32 projection: tight for either dtype of h
    assert rel(post, rpost) < 1e-5
    assert rel(comb, rcomb) < 1e-5
    assert rel(coll, rcoll) < (1e-5 if dtype == torch.float32 else BF16_TOL)
    if hc > 1 and iters > 1:  # Sinkhorn really ran: columns sum to 1, rows nearly
        assert torch.allclose(comb.sum(-2), torch.ones(n, hc, device=DEV), atol=1e-4)
        assert torch.allclose(comb.sum(-1), torch.ones(n, hc, device=DEV), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,hc,hd,fuse", [(1, 4, 300, True), (17, 4, 96, None), (3, 2, 96, False),
                                          (3, 1, 300, True), (3, 3, 300, True)])
def test_hc_head(n, hc, hd, fuse, dtype):
    g, h, fn, base = inputs(n, hc, hd, hc, dtype, n * 100 + hc * 10 + hd + 7)
    scale = (torch.rand(1, generator=g) + 0.5).to(DEV)
    got = hc_head_triton(h, fn, base, scale, EPS, NORM_EPS, fuse_mix=fuse)
    ref = hc_head_torch(h, fn, base, scale, EPS, NORM_EPS)
    assert got.dtype == dtype and got.shape == (n, hd)
    assert rel(got, ref) < (1e-5 if dtype == torch.float32 else BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,hc,hd", [(1, 4, 300), (17, 4, 96), (3, 2, 300), (3, 1, 96), (3, 3, 300)])
def test_hc_post(n, hc, hd, dtype):
    g = torch.Generator().manual_seed(n * 100 + hc * 10 + hd)
    h = torch.randn(n, hc, hd, generator=g).to(DEV, dtype)
    # out as the model passes it: a column slice of a wider tensor (row stride != H)
    out = torch.randn(n, hd + 5, generator=g).to(DEV, dtype)[:, :hd]
    post = (2 * torch.rand(n, hc, generator=g)).to(DEV)
    comb = torch.softmax(torch.randn(n, hc, hc, generator=g), -1).to(DEV)
    got = hc_post_triton(h, out, post, comb)
    ref = hc_post_torch(h, out, post, comb)
    assert got.dtype == dtype and got.shape == h.shape
    assert rel(got, ref) < (1e-6 if dtype == torch.float32 else BF16_TOL)


def test_fused_decode_is_on_by_default_and_a_bad_value_is_named(monkeypatch):
    """The fused V4 / GLM-5 decode kernels run by default on CUDA tensors (never on CPU ones:
    there the torch path is the fast one), FREETOKEN_FUSED_DECODE=0 turns them off, any other
    value than 0/1 is one clear error."""
    from freetoken.errors import FreeTokenError
    from freetoken.kernels import fused_decode
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        t = torch.zeros(1, device=dev)
        monkeypatch.delenv("FREETOKEN_FUSED_DECODE", raising=False)
        assert fused_decode(t) == t.is_cuda
        monkeypatch.setenv("FREETOKEN_FUSED_DECODE", "0")
        assert not fused_decode(t)
        monkeypatch.setenv("FREETOKEN_FUSED_DECODE", "yes")
        with pytest.raises(FreeTokenError, match="FREETOKEN_FUSED_DECODE must be 0 or 1"):
            fused_decode(t)
