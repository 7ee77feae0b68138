"""The fused DeepSeek-V4 attention kernels (kernels/csa_decode.py) against the torch references
(model/csa.py) on fresh random inputs: the norms and RoPE at positions, decode's sink attention
and the compressor's entries read from paged rows.

On a CPU machine the kernels run under TRITON_INTERPRET=1 (set in conftest.py before Triton is
imported); on CUDA they run natively.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from freetoken.kernels.csa_decode import (NORM_NONE, NORM_PLAIN, NORM_WEIGHTED,  # noqa: E402
                                          compress_entries_triton, norm_rope_triton, sink_attention_triton)
from freetoken.model import csa  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: an ulp where fp32 summation order flips a rounding (the kernels round to nearest under
# the interpreter too, whose own bf16 cast truncates)
BF16_TOL = 1e-2
EPS = 1e-6


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else BF16_TOL


def tables(g, p, half, dtype):
    ang = torch.rand(p, half, generator=g) * 6.28
    return ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [NORM_NONE, NORM_WEIGHTED, NORM_PLAIN])
@pytest.mark.parametrize("n,r,d,rd,inverse", [(1, 0, 96, 32, False), (3, 5, 48, 16, True),
                                               (5, 0, 300, 64, True), (2, 3, 64, 64, False)])
def test_norm_rope(n, r, d, rd, inverse, norm, dtype):
    """r 0: x [N, D], a column slice of a wider tensor (the fused GEMM's outputs); else [N, R, D].
    rd == d: every dim rotated; ragged D (not a power of two)."""
    g = torch.Generator().manual_seed(n * 1000 + d + rd + norm)
    shape = (n, d + 6) if r == 0 else (n, r, d)
    x = (torch.randn(*shape, generator=g) * 3 + 0.5).to(DEV, dtype)[..., :d]
    w = (torch.rand(d, generator=g) + 0.5).to(DEV)
    cos, sin = tables(g, 50, rd // 2, dtype)
    pos = torch.randint(0, 50, (n,), generator=g).to(DEV)
    ref_norm = {NORM_NONE: lambda t: t, NORM_WEIGHTED: lambda t: csa.rms_weighted_torch(t, w, EPS),
                NORM_PLAIN: lambda t: csa.rms_plain_torch(t, EPS)}[norm]
    # the norm alone (no RoPE)
    if norm != NORM_NONE:
        got = norm_rope_triton(x, w, EPS, norm)
        assert got.dtype == dtype and got.shape == x.shape
        assert rel(got, ref_norm(x)) < tol(dtype)
    # the norm then the rotation at each row's position
    got = norm_rope_triton(x, w, EPS, norm, cos, sin, pos, inverse)
    ref = csa.rope_at_torch(ref_norm(x), cos, sin, pos, inverse)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel(got, ref) < tol(dtype)
    if dtype == torch.float32:  # the unrotated leading dims untouched (norm none: bit-equal)
        lead = (got[..., :d - rd] - ref[..., :d - rd]).abs().max() if d > rd else torch.tensor(0.0)
        assert float(lead) <= (0.0 if norm == NORM_NONE else 1e-5 * float(ref.abs().max()))


def test_norm_rope_dispatch_falls_back_on_cpu():
    """The model's entry points take the torch path for CPU tensors (use_triton is CUDA only)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, generator=g)
    cos, sin = tables(g, 10, 8, torch.float32)
    pos = torch.tensor([1, 7])
    if DEV == "cpu":
        assert torch.equal(csa.rms_rope(x, None, EPS, cos, sin, pos),
                           csa.rope_at_torch(csa.rms_plain_torch(x, EPS), cos, sin, pos))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,nh,k,k2,d", [(1, 5, 37, 0, 48), (3, 20, 40, 30, 64), (2, 16, 8, 25, 96)])
def test_sink_attention(n, nh, k, k2, d, dtype):
    """Per-row keys of one source, or two (the window's keys, the compressed entries) read as if
    concatenated; the unselected rows hold NaN (unwritten pages), which must not enter; an
    idle row (nothing selected) gives zeros; the same whether the keys run in one program per
    head block or split over several (a split with no selected key, one across both sources)."""
    g = torch.Generator().manual_seed(n * 100 + nh + k + d)
    q = torch.randn(n, nh, d, generator=g).to(DEV, dtype)
    keys = torch.randn(n, k + k2, d, generator=g).to(DEV, dtype)
    sel = torch.rand(n, k + k2, generator=g) < 0.7
    sel[0, k - 1] = True
    if n > 1:
        sel[-1] = False
    sel = sel.to(DEV)
    sinks = torch.randn(nh, generator=g).to(DEV)
    scale = d ** -0.5 * 3  # peaked enough that the softmax is not flat
    ref = csa.sink_attention_torch(q, torch.where(sel[..., None], keys, 0.0), sel, sinks, scale)
    nan = torch.where(sel[..., None], keys, float("nan"))
    # the default (here: keys split over programs), one kernel over all keys, and splits that
    # are not a multiple of the key block and straddle the two sources
    for split in (None, 10 ** 6, 7):
        if k2:
            got = sink_attention_triton(q, nan[:, :k], sel[:, :k], sinks, scale, nan[:, k:], sel[:, k:], split=split)
        else:
            got = sink_attention_triton(q, nan, sel, sinks, scale, split=split)
        assert got.dtype == dtype and got.shape == (n, nh, d)
        assert rel(got, ref) < (1e-5 if dtype == torch.float32 else BF16_TOL), split
        if n > 1:
            assert float(got[-1].abs().max()) == 0.0
    if k2:  # the model's entry point (torch path on CPU tensors) agrees with the kernel
        dec = csa.sink_attention_decode(q, nan[:, :k], sel[:, :k], nan[:, k:], sel[:, k:], sinks, scale)
        assert rel(dec, ref) < 1e-6


@pytest.mark.parametrize("split", [None, 0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("o,m,dim,rd,stride", [(2, 4, 48, 16, 1), (1, 6, 64, 16, 1), (2, 3, 96, 32, 2),
                                               (1, 16, 40, 40, 1), (1, 64, 160, 16, 1)])
def test_compress_entries(o, m, dim, rd, stride, dtype, split):
    """Paged rows (pages in a shuffled block table, kv and gate at column offsets of one wider
    row), ends before a full window (slots before position 0 drop out), at 0 and later; one
    program per row (split 0), the features split over programs (16: dim 40 and 48 leave a
    partial block), and the default (the split form for windows of SPLIT_SLOTS slots or more:
    the last shape, HCA-like; one program below)."""
    g = torch.Generator().manual_seed(o * 100 + m * 10 + dim + stride)
    ps, pages, b = 8, 24, 5
    width = 2 * o * dim + 3
    buf = (torch.randn(pages, ps, width, generator=g) * 2).to(DEV, dtype)
    table = torch.stack([torch.randperm(pages, generator=g)[:12] for _ in range(b)]).int().to(DEV)
    kvp = (buf, table, slice(1, 1 + o * dim), stride)
    gp = (buf, table, slice(1 + o * dim, 1 + 2 * o * dim), stride)
    ends = torch.tensor([0, 2, o * m - 1, 37, 12 * ps // stride - 1])[:b].to(DEV)
    w = (torch.rand(dim, generator=g) + 0.5).to(DEV)
    comp = csa.Compressor({"position_bias": torch.zeros(m, o * dim, device=DEV), "kv_norm.weight": w},
                          "", m, o, dim, EPS, ("kv", "gate", "entry"))
    cos, sin = tables(g, 100, rd // 2, dtype)

    def rows(name, p):  # as CompressedAttention.decode's
        bb, t, cols, st = kvp if name == "kv" else gp
        pg = t[:b].gather(1, p.reshape(b, -1) // ps).long().view(p.shape)
        return bb[..., cols][pg, p % ps // st]

    got = compress_entries_triton(kvp, gp, ps, ends, m, o, dim, w, EPS, cos, sin, dtype, split=split)
    ref = comp.entries(rows, ends, cos, sin, dtype)
    assert got.dtype == dtype and got.shape == (b, dim)
    assert rel(got, ref) < (1e-5 if dtype == torch.float32 else BF16_TOL)


def test_sink_splits_fill_the_programs():
    """Decode at batch 1 with DeepSeek-V4-Flash's 64 heads and 640 keys: the keys split until
    about 128 programs run; a batch that fills the GPU by itself keeps one split."""
    from freetoken.kernels.csa_decode import sink_splits
    split = sink_splits(1, 64, 640, 16)
    assert 120 <= 4 * -(-640 // split) <= 136  # 4 head blocks x splits: about 128 programs
    assert sink_splits(64, 64, 640, 16) >= 640  # 256 programs already: one split
    assert sink_splits(1, 5, 37, 16) == 16  # at least 16 keys a split
    # an empty batch is an empty result, a split of no keys an error
    q, keys = torch.zeros(0, 4, 16, device=DEV), torch.zeros(0, 8, 16, device=DEV)
    sel, sinks = torch.zeros(0, 8, dtype=torch.bool, device=DEV), torch.zeros(4, device=DEV)
    assert sink_attention_triton(q, keys, sel, sinks, 1.0).shape == (0, 4, 16)
    with pytest.raises(ValueError, match="split"):
        sink_attention_triton(q[:0].new_zeros(1, 4, 16), keys.new_zeros(1, 8, 16), sel.new_ones(1, 8), sinks, 1.0,
                              split=0)
