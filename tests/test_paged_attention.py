"""Paged KV attention: the Triton kernels against their torch references, and the references
against a dense masked softmax over a contiguous copy of the same keys, on fresh random inputs.

Every page or slot a kernel must not read (pages no row owns, the tail of a row's last page,
keys before a sliding window) holds NaN, and block-table entries past a row's length point
anywhere in the pool: a finite, matching output shows they were never used. On a CPU machine
the kernels run under TRITON_INTERPRET=1 (conftest.py).
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from freetoken.kernels.paged_attention import (  # noqa: E402
    default_splits, paged_decode_attention, paged_decode_attention_torch, paged_decode_attention_triton,
    paged_prefill_attention, paged_prefill_attention_torch, paged_prefill_attention_triton, write_kv)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the CPU interpreter rounds to bf16 by truncation, one ulp off torch's round-to-nearest
BF16_TOL = 3e-2 if DEV == "cpu" else 2e-2
TOL = {torch.float32: 1e-5, torch.bfloat16: BF16_TOL, torch.float16: 5e-3}
P = 16


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def make_pool(lens, kvh, hd, w, dtype, gen, window=None, extra=3):
    """A shuffled pool holding the rows' keys; everything no row may read is NaN.
    -> k_pages, v_pages [num_pages, kvh, P, hd], block_table [B, W] int32 (garbage past each
    row's pages), lens [B] int32."""
    need = [-(-n // P) for n in lens]
    assert max(need) <= w
    num_pages = sum(need) + extra
    k = torch.randn(num_pages, kvh, P, hd, generator=gen)
    v = torch.randn(num_pages, kvh, P, hd, generator=gen)
    bt = torch.randint(0, num_pages, (len(lens), w), generator=gen, dtype=torch.int32)  # garbage ids
    perm = torch.randperm(num_pages, generator=gen)
    owned = torch.zeros(num_pages, dtype=torch.bool)
    i = 0
    for r, (n, c) in enumerate(zip(lens, need)):
        bt[r, :c] = perm[i:i + c]
        owned[perm[i:i + c]] = True
        i += c
        j = torch.arange(c * P)
        dead = j >= n  # the last page's tail
        if window:
            dead |= j < n - window  # keys before the window
        pg, sl = bt[r, j[dead] // P].long(), j[dead] % P
        k[pg, :, sl] = float("nan")
        v[pg, :, sl] = float("nan")
    k[~owned] = float("nan")
    v[~owned] = float("nan")
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return k.to(DEV, dtype), v.to(DEV, dtype), bt.to(DEV), lens_t.to(DEV)


def contiguous_keys(pages, row, n):
    """Keys 0..n-1 of one row copied out one by one: [n, kvh, hd] (independent of the gather)."""
    j = torch.arange(n, device=pages.device)
    return pages[row[j // P].long(), :, j % P]


def dense_attention(q, k, v, visible, scale):
    """q [Tq, nh, hd]; k, v [S, kvh, hd]; visible [Tq, S] -> [Tq, nh, hd] in float64."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q.double(), k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v)


def dense_decode(q, k_pages, v_pages, bt, lens, scale, window):
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for r, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        lo = max(0, n - window) if window else 0
        k = contiguous_keys(k_pages, bt[r], n)[lo:]
        v = contiguous_keys(v_pages, bt[r], n)[lo:]
        vis = torch.ones(1, n - lo, dtype=torch.bool, device=q.device)
        out[r] = dense_attention(q[r][None], k, v, vis, scale)[0]
    return out


DECODE_CASES = [  # kvh, nh, hd, lens, W, window
    (2, 4, 64, [37, 0, 16, 100], 8, None),  # GQA group 2; an idle row; a length on a page edge
    (2, 2, 16, [1, 50, 33], 5, None),  # group 1, hd 16
    (1, 8, 64, [70, 0, 9], 6, None),  # group 8
    (2, 16, 16, [45, 100, 3, 0], 8, 20),  # sliding window, group 8
]


def decode_inputs(case, dtype):
    kvh, nh, hd, lens, w, window = case
    gen = torch.Generator().manual_seed(kvh * 1000 + nh * 100 + hd + sum(lens) + (window or 0))
    k_pages, v_pages, bt, lens_t = make_pool(lens, kvh, hd, w, dtype, gen, window)
    q = torch.randn(len(lens), nh, hd, generator=gen).to(DEV, dtype)
    return q, k_pages, v_pages, bt, lens_t, hd ** -0.5, window


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_reference_matches_dense(case, dtype):
    q, kp, vp, bt, lens, scale, window = decode_inputs(case, dtype)
    ref = paged_decode_attention_torch(q, kp, vp, bt, lens, scale, window)
    dense = dense_decode(q, kp, vp, bt, lens, scale, window)
    assert ref.dtype == dtype and ref.shape == q.shape
    assert rel(ref, dense) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert bool((ref[lens == 0] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits,block_n,min_keys", [(1, None, 128), (3, 16, 16), (5, 32, 32), (None, 16, 128)])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_triton(case, splits, block_n, min_keys, dtype):
    """splits 1 writes the output directly; 3 and 5 with short tiles and splits spread a row
    over several splits of one or more tiles (some splits empty, some tiles straddling the
    window's start); None takes the default from W."""
    q, kp, vp, bt, lens, scale, window = decode_inputs(case, dtype)
    got = paged_decode_attention_triton(q, kp, vp, bt, lens, scale, window, splits, block_n=block_n,
                                        min_split_keys=min_keys)
    ref = paged_decode_attention_torch(q, kp, vp, bt, lens, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    assert bool(torch.isfinite(got).all())
    assert rel(got, ref) < TOL[dtype]
    assert bool((got[lens == 0] == 0).all())  # idle rows


@pytest.mark.parametrize("dtype,hd", [(torch.float16, 32), (torch.float32, 80)])
def test_decode_triton_fp16_and_odd_head_dim(dtype, hd):
    """fp16, and a head dim that is no power of two (padded to one and masked)."""
    q, kp, vp, bt, lens, scale, window = decode_inputs((2, 4, hd, [29, 64, 0], 4, None), dtype)
    got = paged_decode_attention_triton(q, kp, vp, bt, lens, scale, splits=2, block_n=16, min_split_keys=16)
    assert rel(got, dense_decode(q, kp, vp, bt, lens, scale, None)) < TOL[dtype]


def test_decode_one_launch_serves_any_length():
    """Same shapes, lengths changed in place on the device (as a replayed CUDA graph sees
    them): each call follows the lengths it finds."""
    q, kp, vp, bt, lens, scale, _ = decode_inputs((2, 4, 16, [64, 64, 64], 4, None), torch.float32)
    for new in ([64, 1, 0], [17, 33, 48], [0, 0, 0]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        got = paged_decode_attention_triton(q, kp, vp, bt, lens, scale, splits=2, block_n=16, min_split_keys=16)
        assert rel(got, dense_decode(q, kp, vp, bt, lens, scale, None)) < 1e-5 or max(new) == 0
        assert bool((got[lens == 0] == 0).all())


def test_decode_dispatch_and_default_splits():
    q, kp, vp, bt, lens, scale, window = decode_inputs(DECODE_CASES[0], torch.float32)
    got = paged_decode_attention(q, kp, vp, bt, lens, scale, window)
    assert rel(got, paged_decode_attention_torch(q, kp, vp, bt, lens, scale, window)) < 1e-5
    assert default_splits(1, 2, 8192, 16) == 132  # 128k capacity at batch 1: two programs per SM
    assert default_splits(8, 2, 8192, 16) == 17
    assert default_splits(1, 2, 4, 16) == 1  # 64 keys: one split
    assert default_splits(0, 2, 4, 16) >= 1


PREFILL_CASES = [  # kvh, nh, hd, start, T, window
    (2, 4, 64, 0, 7, None),  # first chunk, group 2
    (2, 2, 16, 37, 20, None),  # after cached keys, group 1, chunk crossing pages
    (1, 8, 64, 40, 24, 16),  # sliding window, group 8
    (2, 16, 16, 5, 33, None),  # group 8, several query tiles
]


def prefill_inputs(case, dtype):
    kvh, nh, hd, start, t, window = case
    gen = torch.Generator().manual_seed(kvh * 1000 + nh * 100 + hd + start + t)
    n = start + t
    w = -(-n // P) + 2
    # keys before the first query's window are dead: NaN, as make_pool does for a decode row
    kp, vp, bt, _ = make_pool([n], kvh, hd, w, dtype, gen, window=(window + t - 1) if window else None)
    q = torch.randn(t, nh, hd, generator=gen).to(DEV, dtype)
    return q, kp, vp, bt[0], start, hd ** -0.5, window


def dense_prefill(q, kp, vp, row, start, scale, window):
    t = q.shape[0]
    n = start + t
    qp = torch.arange(start, n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None]
    vis = j <= qp
    if window:
        vis &= j > qp - window
    lo = int(j[vis.any(0)[None]].min())  # keys no query sees are dead (NaN): leave them out
    k = contiguous_keys(kp, row, n)[lo:]
    v = contiguous_keys(vp, row, n)[lo:]
    return dense_attention(q, k, v, vis[:, lo:], scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_reference_matches_dense(case, dtype):
    q, kp, vp, row, start, scale, window = prefill_inputs(case, dtype)
    if window:  # SDPA multiplies the dead (NaN) keys by zero weights: give it finite ones
        kp, vp = kp.nan_to_num(0.0), vp.nan_to_num(0.0)
    ref = paged_prefill_attention_torch(q, kp, vp, row, start, scale, window)
    assert ref.dtype == dtype and ref.shape == q.shape
    assert rel(ref, dense_prefill(q, kp, vp, row, start, scale, window)) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_m,block_n", [(None, None), (32, 16)])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_triton(case, block_m, block_n, dtype):
    """Default tiles, and short ones: several query tiles, tiles straddling the window's start."""
    q, kp, vp, row, start, scale, window = prefill_inputs(case, dtype)
    got = paged_prefill_attention_triton(q, kp, vp, row, start, scale, window, block_m=block_m, block_n=block_n)
    assert got.dtype == dtype and got.shape == q.shape
    assert bool(torch.isfinite(got).all())  # the dead keys were never read
    assert rel(got, dense_prefill(q, kp, vp, row, start, scale, window)) < TOL[dtype]


def test_prefill_dispatch():
    q, kp, vp, row, start, scale, window = prefill_inputs(PREFILL_CASES[1], torch.float32)
    got = paged_prefill_attention(q, kp, vp, row, start, scale, window)
    assert rel(got, dense_prefill(q, kp, vp, row, start, scale, window)) < 1e-5


def test_bad_shapes_are_refused():
    q, kp, vp, bt, lens, scale, _ = decode_inputs(DECODE_CASES[0], torch.float32)
    with pytest.raises(ValueError, match="heads"):
        paged_decode_attention_triton(q[:, :3], kp, vp, bt, lens, scale)
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention_triton(q.to(torch.bfloat16), kp, vp, bt, lens, scale)
    with pytest.raises(ValueError, match="batch"):
        paged_decode_attention_triton(q[:2], kp, vp, bt, lens, scale)


CPU_CASES = DECODE_CASES + [(1, 4, 80, [3001, 0, 700], 200, None),  # splits merged, hd 80, an idle row
                             (2, 8, 64, [2600, 33], 170, 1000)]  # a window longer than a split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("case", CPU_CASES)
def test_decode_cpu_kernel(case, sinks, dtype):
    """The C++ kernel over host pages (experts/cpu/attention.h) against the torch reference:
    GQA groups 1-8, idle rows, windows, sinks, contexts long enough to split the keys between
    threads; every page it must not read holds NaN."""
    from freetoken.experts.cpu import extension
    from freetoken.kernels.paged_attention import paged_decode_attention_cpu
    if extension() is None:
        pytest.skip("the C++ extension could not be built here")
    q, kp, vp, bt, lens, scale, window = (t.cpu() if isinstance(t, torch.Tensor) else t
                                           for t in decode_inputs(case, dtype))
    sk = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(3)) if sinks else None
    got = paged_decode_attention_cpu(q, kp, vp, bt, lens, scale, window, sk)
    ref = paged_decode_attention_torch(q, kp, vp, bt, lens, scale, window, sk)
    assert got.dtype == dtype and got.shape == q.shape and bool(torch.isfinite(got).all())
    assert rel(got, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    assert bool((got[lens == 0] == 0).all())  # idle rows, with a sink or not


def test_write_kv_then_decode():
    """Tokens scattered into the pool by write_kv are what the decode kernel then reads."""
    gen = torch.Generator().manual_seed(11)
    kvh, hd, nh = 2, 16, 4
    kp = torch.randn(6, kvh, P, hd, generator=gen).to(DEV)
    vp = torch.randn(6, kvh, P, hd, generator=gen).to(DEV)
    bt = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([20, 40], dtype=torch.int32, device=DEV)
    # each row's next token, at position lens[b]
    pages = bt[torch.arange(2, device=DEV), (lens // P).long()].long()
    offsets = (lens % P).long()
    k = torch.randn(2, kvh, hd, generator=gen).to(DEV)
    v = torch.randn(2, kvh, hd, generator=gen).to(DEV)
    write_kv(kp, vp, k, v, pages, offsets)
    assert torch.equal(kp[pages[0], :, offsets[0]], k[0]) and torch.equal(vp[pages[1], :, offsets[1]], v[1])
    lens += 1
    q = torch.randn(2, nh, hd, generator=gen).to(DEV)
    got = paged_decode_attention_triton(q, kp, vp, bt, lens, hd ** -0.5, splits=2, block_n=16, min_split_keys=16)
    assert rel(got, dense_decode(q, kp, vp, bt, lens, hd ** -0.5, None)) < 1e-5
