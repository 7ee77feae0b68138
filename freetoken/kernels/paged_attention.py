"""Attention over one paged KV pool: each sequence's keys are found through its block table.

Pool layout (per attention layer): k_pages, v_pages [num_pages, kvh, P, hd]; key j of a
sequence lives at page block_table[j // P], slot j % P. Block-table entries past a sequence's
end (or before its sliding window) are never dereferenced: the page allocator may point them at
anything, and recycled pages may hold anything (NaN included).

  decode split:   grid (B, kvh, splits). Flash-decoding: each program takes every query head
                  of one KV group (K/V read once per group, not once per head) against one
                  range of key tiles, online softmax in fp32, and writes a partial
                  (max, sum, unnormalized acc) per head; with one split it writes the output.
  decode reduce:  grid (B, nh): merges the partials of the splits that saw keys.
  prefill:        grid (query tiles, kvh): flash-attention forward, a tile's rows being
                  (query position, head of the group) pairs, causal (and windowed) over pages.
Attention sinks (GPT-OSS): an optional learned logit per query head, sinks [nh], joins each
softmax's denominator (a key whose value is zero): out = sum_j e^(s_j) v_j / (e^sink + sum_j
e^(s_j)); the kernels fold it in once, after the keys (decode: in the reduce, or in the split
kernel when there is one split). sinks=None leaves every path as it was.
Lengths are read inside the kernels and the split ranges are computed there, so the decode is
CUDA-graph capturable: one graph per (B, W) serves every length (lens[b] <= W * P, unchecked:
checking would need a host sync). Any head dim works: tiles pad it to a power of two >= 16 and
mask the rest (loads stay unmasked along it when it is one already).

References (the tests' ground truth): paged_decode_attention_torch (gather the pages, mask,
fp32 softmax) and paged_prefill_attention_torch (gather, then model.attention.prefill_attention,
also the CPU's prefill path). On the CPU, decode runs the C++ kernel of
experts/cpu/attention.h (pages read in place, online softmax in fp32, threads over rows, KV
heads and key splits): paged_decode_attention_cpu.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..model.attention import prefill_attention
from . import INTERPRET, split_keys, tl_dtype, use_triton
from .page_gather import gather_for_prefill, gather_pages

LOG2E = 1.4426950408889634
NEG = tl.constexpr(-1.0e30)  # running-max start: finite, so an all-masked tile gives exp2(-inf) = 0, never NaN
NO_WINDOW = 1 << 30  # "window" when there is none: every lower bound clamps to 0
MIN_SPLIT_KEYS = 128  # a split covers at least this many keys (fewer: partial traffic dominates)
REDUCE_CHUNK = 16  # splits merged per step of the reduce loop (bounds its registers)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_splits(b: int, kvh: int, w: int, page: int, sms: int = 132) -> int:
    """Splits per (row, KV head), from static shapes only (capturable: no look at lens).

    Enough programs for two per SM at batch 1, but no more splits than the block table's
    capacity (w * page keys) fills at MIN_SPLIT_KEYS each. The kernel sizes the splits from the
    actual length, so at short lengths the surplus splits find no tile and exit."""
    by_grid = _cdiv(2 * sms, max(1, b * kvh))
    by_work = _cdiv(w * page, MIN_SPLIT_KEYS)
    return max(1, min(by_grid, by_work, 512))


def _check(q, k_pages, v_pages, block_table):
    if k_pages.shape != v_pages.shape or k_pages.dim() != 4:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} must be the same "
                         "[num_pages, kvh, P, hd]")
    _, kvh, p, hd = k_pages.shape
    nh = q.shape[-2]
    if q.shape[-1] != hd or nh % kvh:
        raise ValueError(f"q heads/dim {tuple(q.shape[-2:])} do not fit kv heads {kvh} x head dim {hd}")
    if q.dtype != k_pages.dtype or q.dtype != v_pages.dtype:
        raise ValueError(f"q, k_pages, v_pages dtypes differ: {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block table must be int32 or int64, got {block_table.dtype}")
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("k_pages and v_pages need a contiguous head dim")
    return kvh, p, hd, nh


# --------------------------------------------------------------------------- torch references


def paged_decode_attention_torch(q, k_pages, v_pages, block_table, lens, scale, window=None, sinks=None):
    """q [B, nh, hd]; block_table [B, W]; lens [B]; sinks [nh] or None -> [B, nh, hd] in q's dtype.

    Eager: reads max(lens) (and with a window the shortest running row) back to the host (the
    CPU path and the tests' reference). Table entries past a row's length are gathered (they
    are valid page ids) but zeroed before use, so whatever those pages hold never reaches the
    output. With a window, pages before every row's window are not gathered at all: a sliding
    layer reads its window, not the context (the CPU decode's cost at a long context)."""
    kvh, p, hd, nh = _check(q, k_pages, v_pages, block_table)
    b = q.shape[0]
    out = torch.zeros_like(q)
    longest = int(lens.max()) if b else 0
    if longest == 0:
        return out
    first = 0  # the first page any row can see
    if window:
        running = lens[lens > 0]
        first = max(0, int(running.min()) - window) // p  # [B] rows' windows start at or after it
    ids = block_table[:, first:_cdiv(longest, p)]  # [B, n]
    k = gather_pages(k_pages, ids, longest - first * p)  # [B, kvh, L', hd]: keys first*p .. longest-1
    v = gather_pages(v_pages, ids, longest - first * p)
    j = torch.arange(first * p, longest, device=q.device)
    n = lens.to(q.device, torch.long)[:, None]
    mask = j[None] < n  # [B, L]
    if window:
        mask &= j[None] >= n - window
    keep = mask[:, None, :, None]
    k = torch.where(keep, k.float(), 0.0)
    v = torch.where(keep, v.float(), 0.0)
    qg = q.float().view(b, kvh, nh // kvh, hd)  # [B, kvh, g, hd]
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, kvh, g, L]
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    if sinks is not None:  # the sink's column joins the softmax, then is dropped (its value is 0)
        sk = sinks.float().view(1, kvh, nh // kvh, 1).expand(b, -1, -1, 1)
        pr = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]  # idle rows: all on the sink
    else:
        pr = torch.softmax(s, dim=-1)
        pr = torch.where(mask.any(-1)[:, None, None, None], pr, 0.0)  # idle rows: all -inf -> NaN -> 0
    return torch.matmul(pr, v).reshape(b, nh, hd).to(q.dtype)


def paged_prefill_attention_torch(q, k_pages, v_pages, block_table_row, start, scale, window=None, sinks=None):
    """q [T, nh, hd] at positions start..start+T-1 (their K/V already in the pages);
    block_table_row [W]; sinks [nh] or None -> [T, nh, hd]. Gathers the keys the chunk can see
    (0..start+T-1; with a window, from the page of the first query's first key on; on CUDA into
    buffers kept between calls, page_gather.py) and calls prefill_attention."""
    kvh, p, hd, nh = _check(q, k_pages, v_pages, block_table_row)
    if split_keys.wanted(q, start, window, sinks):  # in pieces, decode steps between them (CPU interleave)
        return split_keys.split_prefill_attention(q, k_pages, v_pages, block_table_row, start, scale)
    t = q.shape[0]
    s = start + t
    first = max(0, start - window + 1) // p if window else 0  # no key before this page is visible
    ids = block_table_row[first:_cdiv(s, p)]
    width = block_table_row.numel()
    k = gather_for_prefill(k_pages, ids, s - first * p, "k", width)  # [kvh, S', hd]: keys first*p .. s-1
    v = gather_for_prefill(v_pages, ids, s - first * p, "v", width)
    mask = None
    if window:
        qp = torch.arange(start, s, device=q.device)[:, None]
        j = torch.arange(first * p, s, device=q.device)[None]
        mask = (j <= qp) & (j > qp - window)  # [T, S']
    o = prefill_attention(q.transpose(0, 1), k, v, mask, scale, sinks)  # [nh, T, hd]
    return o.transpose(0, 1).contiguous()


def write_kv(k_pages, v_pages, k, v, pages, offsets) -> None:
    """Scatter N new tokens' K/V into the pool. k, v [N, kvh, hd]; pages, offsets [N] int64 on
    the device. One index_put each: no host sync, capturable."""
    k_pages[pages, :, offsets] = k  # indices split by a slice: the [N] dim leads, as in k
    v_pages[pages, :, offsets] = v


# --------------------------------------------------------------------------- decode kernels


@triton.jit
def _row_mask(rows, dm, HD: tl.constexpr, BLOCK_D: tl.constexpr):
    """The [rows, BLOCK_D] load mask. With no padding along the head dim, the mask is the
    row mask alone, constant along it, so the loads stay 16-byte vectors."""
    if HD == BLOCK_D:
        m = rows[:, None]
    else:
        m = rows[:, None] & dm[None, :]
    return m


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32. IEEE: in fp32 with no TF32 rounding, for fp32 inputs, and for
    bf16/fp16 ones under the CPU interpreter, whose dot mishandles them (the values are the
    same: both are exact in fp32)."""
    if IEEE:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, sinks_ptr,
                         qk_scale, window, n_splits,
                         stride_qb, stride_qh, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
                         stride_bt, stride_ob, stride_oh,
                         NH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                         BLOCK_D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                         MIN_TILES: tl.constexpr, IEEE: tl.constexpr, DTYPE: tl.constexpr,
                         SINKS: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    n_len = tl.load(lens_ptr + b)
    lo = tl.maximum(n_len - window, 0)  # first visible key (window = NO_WINDOW when none)
    # this split's tiles of BLOCK_N keys, sized from the actual length: every tile in
    # [t_lo, t_hi) holds at least one visible key; surplus splits get an empty range
    t_lo = lo // BLOCK_N
    t_hi = (n_len + BLOCK_N - 1) // BLOCK_N
    per = tl.maximum((t_hi - t_lo + n_splits - 1) // n_splits, MIN_TILES)
    t0 = t_lo + sp * per
    t1 = tl.minimum(t0 + per, t_hi)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    gm = g < G  # the group padded to tl.dot's 16 rows: extra rows are zero queries, never stored
    dm = d < HD
    heads = kh * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0)  # [G_PAD, BLOCK_D]
    m_i = tl.full([G_PAD], NEG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    kbase = k_ptr + kh * stride_kh
    vbase = v_ptr + kh * stride_vh
    row_bt = bt_ptr + b * stride_bt
    for t in range(t0, t1):
        j = t * BLOCK_N + tl.arange(0, BLOCK_N)
        jm = (j >= lo) & (j < n_len)  # keys outside: no table read, no page read
        page = tl.load(row_bt + j // P, mask=jm, other=0).to(tl.int64)
        slot = j % P
        lm = _row_mask(jm, dm, HD, BLOCK_D)
        k = tl.load(kbase + page[:, None] * stride_kp + slot[:, None] * stride_kt + d[None, :],
                    mask=lm, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = _dot(q, tl.trans(k), IEEE)
        s = tl.where(jm[None, :], s * qk_scale, float("-inf"))  # [G_PAD, BLOCK_N], log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vbase + page[:, None] * stride_vp + slot[:, None] * stride_vt + d[None, :],
                    mask=lm, other=0.0)
        pv = _dot(p.to(v.dtype), v, IEEE)  # p rounded to the K/V dtype, as flash attention does
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    sm = gm[:, None] & dm[None, :]
    if DIRECT:  # one split: the whole range was ours: normalize and write the output, no reduce
        if SINKS:
            m_i, l_i, acc = _fold_sink(sinks_ptr, heads, gm, m_i, l_i, acc)
        den = tl.where(l_i > 0, l_i, 1.0)  # idle rows (length 0): acc is 0, output 0
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 (acc / den[:, None]).to(DTYPE), mask=sm)
    else:
        part = (b * NH + heads) * n_splits + sp  # [G_PAD] rows of the [B, nh, splits] partials
        tl.store(m_ptr + part, m_i, mask=gm)
        tl.store(l_ptr + part, l_i, mask=gm)  # l == 0 marks a split that saw no key
        tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=sm)


@triton.jit
def _fold_sink(sinks_ptr, heads, hm, m_i, l_i, acc):
    """The sink logit of each row's head joins its running softmax (log2 domain, like the
    scores): a term e^sink in the denominator, nothing in the numerator."""
    sk = tl.load(sinks_ptr + heads, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sk)
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.math.exp2(sk - m_new), acc * alpha[:, None]


@triton.jit
def _decode_reduce_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, sinks_ptr, stride_ob, stride_oh, n_splits,
                          NH: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                          SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr, DTYPE: tl.constexpr,
                          SINKS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * NH + h) * n_splits
    s_all = tl.arange(0, SPLITS_PAD)
    l_all = tl.load(l_ptr + base + s_all, mask=s_all < n_splits, other=0.0)
    m_all = tl.load(m_ptr + base + s_all, mask=s_all < n_splits, other=NEG)
    m_max = tl.max(tl.where(l_all > 0, m_all, NEG), 0)
    if SINKS:
        sk = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sk)
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    num = tl.zeros([BLOCK_D], tl.float32)
    den = tl.sum(tl.zeros([CHUNK], tl.float32), 0)
    for c in range(0, n_splits, CHUNK):  # chunks of splits: [CHUNK, BLOCK_D] live at a time
        s = c + tl.arange(0, CHUNK)
        l = tl.load(l_ptr + base + s, mask=s < n_splits, other=0.0)
        live = l > 0  # empty splits' partials are skipped, not read
        m = tl.load(m_ptr + base + s, mask=live, other=NEG)
        w = tl.where(live, tl.math.exp2(m - m_max), 0.0)
        a = tl.load(acc_ptr + (base + s)[:, None] * HD + d[None, :], mask=live[:, None] & dm[None, :], other=0.0)
        num += tl.sum(a * w[:, None], 0)
        den += tl.sum(w * l, 0)
    if SINKS:
        den += tl.math.exp2(sk - m_max)
    den = tl.where(den > 0, den, 1.0)  # idle rows: num is 0, output 0
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, (num / den).to(DTYPE), mask=dm)


def paged_decode_attention_triton(q, k_pages, v_pages, block_table, lens, scale, window=None, splits=None,
                                  block_n: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None, min_split_keys: int = MIN_SPLIT_KEYS,
                                  sinks=None):
    """q [B, nh, hd]; k/v_pages [num_pages, kvh, P, hd]; block_table [B, W]; lens [B] on the
    device; sinks [nh] or None -> [B, nh, hd] in q's dtype. Shapes fix the launch; lengths only
    steer it inside the kernels (no host sync). block_n/num_warps/num_stages/min_split_keys are
    tuning knobs."""
    kvh, p, hd, nh = _check(q, k_pages, v_pages, block_table)
    b, w = block_table.shape
    if q.shape[0] != b or lens.shape != (b,):
        raise ValueError(f"q {tuple(q.shape)}, block_table {tuple(block_table.shape)}, lens {tuple(lens.shape)} "
                         "disagree on the batch")
    out = torch.empty_like(q)
    if b == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    lens = lens.to(torch.int32).contiguous()  # no-op in the engine; a copy kernel otherwise
    if splits is None:
        sms = _sm_count(q.device.index) if q.is_cuda else 132
        splits = default_splits(b, kvh, w, p, sms)
    splits = max(1, int(splits))
    g = nh // kvh
    g_pad = max(16, _pow2(g))  # tl.dot needs 16 rows
    block_d = max(16, _pow2(hd))
    if block_n is None:
        block_n = 32 if block_d > 128 else 64  # hd 256: 2 x 16 KiB per stage, two programs per SM
    block_n = max(16, block_n)
    min_tiles = max(1, _cdiv(min_split_keys, block_n))
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 2
    dt = tl_dtype(q.dtype)
    if splits > 1:
        m = torch.empty(b, nh, splits, dtype=torch.float32, device=q.device)
        l = torch.empty(b, nh, splits, dtype=torch.float32, device=q.device)
        acc = torch.empty(b, nh, splits, hd, dtype=torch.float32, device=q.device)
    else:
        # unused by the single-split kernel; not `out` itself: the CPU interpreter copies every
        # argument back after the launch, and an alias of `out` would overwrite the result
        m = l = acc = torch.empty(1, dtype=torch.float32, device=q.device)
    if sinks is not None and sinks.shape != (nh,):
        raise ValueError(f"sinks {tuple(sinks.shape)}: one per query head ({nh})")
    sk = sinks.contiguous() if sinks is not None else lens  # unread without sinks
    _decode_split_kernel[(b, kvh, splits)](
        q, k_pages, v_pages, block_table, lens, m, l, acc, out, sk,
        scale * LOG2E, int(window) if window else NO_WINDOW, splits,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        NH=nh, G=g, G_PAD=g_pad, HD=hd, BLOCK_D=block_d, P=p, BLOCK_N=block_n, DIRECT=splits == 1,
        MIN_TILES=min_tiles, IEEE=q.dtype == torch.float32 or INTERPRET, DTYPE=dt, SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        chunk = min(REDUCE_CHUNK, _pow2(splits))
        # splits are a runtime argument (one compiled kernel serves every table width); only
        # their power-of-two bound is compiled in
        _decode_reduce_kernel[(b, nh)](m, l, acc, out, sk, out.stride(0), out.stride(1), splits,
                                       NH=nh, HD=hd, BLOCK_D=block_d, SPLITS_PAD=_pow2(splits),
                                       CHUNK=chunk, DTYPE=dt, SINKS=sinks is not None,
                                       num_warps=4 if block_d >= 128 else 2)
    return out


def paged_decode_attention_cpu(q, k_pages, v_pages, block_table, lens, scale, window=None, sinks=None):
    """The C++ kernel (experts/cpu/attention.h) over host pages, read in place: shapes as
    paged_decode_attention_torch; float32 or bfloat16. None when the C++ extension is not
    available or the inputs are not what it takes (the caller then runs the reference)."""
    from ..experts.cpu import extension
    ext = extension()
    if ext is None or q.dtype not in (torch.float32, torch.bfloat16) or not (
            q.is_contiguous() and k_pages.is_contiguous() and v_pages.is_contiguous()):
        return None
    bt = block_table.to(torch.int32).contiguous()
    n = lens.to(torch.int32).contiguous()
    sk = sinks.float().contiguous() if sinks is not None else torch.empty(0)
    return ext.paged_decode(q, k_pages, v_pages, bt, n, float(scale), int(window or 0), sk)


def paged_decode_attention(q, k_pages, v_pages, block_table, lens, scale, window=None, splits=None, sinks=None):
    """Decode attention over the page pool: the Triton kernel for CUDA tensors, the C++ kernel
    for host tensors (the torch reference where it cannot run). See
    paged_decode_attention_triton for shapes."""
    if use_triton(q):
        return paged_decode_attention_triton(q, k_pages, v_pages, block_table, lens, scale, window, splits,
                                             sinks=sinks)
    if q.device.type == "cpu":
        out = paged_decode_attention_cpu(q, k_pages, v_pages, block_table, lens, scale, window, sinks)
        if out is not None:
            return out
    return paged_decode_attention_torch(q, k_pages, v_pages, block_table, lens, scale, window, sinks)


# --------------------------------------------------------------------------- prefill kernel


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, o_ptr, sinks_ptr, start, T, qk_scale, window,
                    stride_qt, stride_qh, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
                    stride_ot, stride_oh,
                    G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                    P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr, DTYPE: tl.constexpr, SINKS: tl.constexpr):
    pid = tl.program_id(0)
    kh = tl.program_id(1)
    # rows are (query, head of the group) pairs: one K/V tile serves BLOCK_T queries x G heads
    r = tl.arange(0, BLOCK_T * G_PAD)
    t = pid * BLOCK_T + r // G_PAD
    hg = r % G_PAD
    rm = (t < T) & (hg < G)
    heads = kh * G + hg
    qpos = start + t  # [M]
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    q = tl.load(q_ptr + t[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rm[:, None] & dm[None, :], other=0.0)  # [M, BLOCK_D]
    first = start + pid * BLOCK_T  # this tile's first and last query positions
    last = tl.minimum(first + BLOCK_T, start + T) - 1
    lo = tl.maximum(first - window + 1, 0)  # no query of the tile sees a key before lo
    m_i = tl.full([BLOCK_T * G_PAD], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_T * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_T * G_PAD, BLOCK_D], tl.float32)
    kbase = k_ptr + kh * stride_kh
    vbase = v_ptr + kh * stride_vh
    for j0 in range((lo // BLOCK_N) * BLOCK_N, last + 1, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = (j >= lo) & (j <= last)
        page = tl.load(bt_ptr + j // P, mask=jm, other=0).to(tl.int64)
        slot = j % P
        lm = _row_mask(jm, dm, HD, BLOCK_D)
        k = tl.load(kbase + page[:, None] * stride_kp + slot[:, None] * stride_kt + d[None, :], mask=lm, other=0.0)
        s = _dot(q, tl.trans(k), IEEE)
        vis = (j[None, :] <= qpos[:, None]) & (j[None, :] > qpos[:, None] - window) & jm[None, :]
        s = tl.where(vis, s * qk_scale, float("-inf"))  # [M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vbase + page[:, None] * stride_vp + slot[:, None] * stride_vt + d[None, :], mask=lm, other=0.0)
        pv = _dot(p.to(v.dtype), v, IEEE)  # p rounded to the K/V dtype, as flash attention does
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SINKS:
        m_i, l_i, acc = _fold_sink(sinks_ptr, heads, rm, m_i, l_i, acc)
    den = tl.where(l_i > 0, l_i, 1.0)  # only padding rows (never stored) can see no key
    tl.store(o_ptr + t[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             (acc / den[:, None]).to(DTYPE), mask=rm[:, None] & dm[None, :])


def paged_prefill_attention_triton(q, k_pages, v_pages, block_table_row, start, scale, window=None,
                                   block_m: int | None = None, block_n: int | None = None,
                                   num_warps: int | None = None, num_stages: int | None = None, sinks=None):
    """q [T, nh, hd] at positions start..start+T-1; block_table_row [W]; sinks [nh] or None
    -> [T, nh, hd].
    block_m (rows per tile: queries x padded group), block_n, num_warps, num_stages: tuning."""
    kvh, p, hd, nh = _check(q, k_pages, v_pages, block_table_row)
    t = q.shape[0]
    out = torch.empty_like(q)
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_table_row = block_table_row.contiguous()
    g = nh // kvh
    g_pad = _pow2(g)
    block_d = max(16, _pow2(hd))
    if block_m is None:
        block_m = 64 if block_d > 128 else 128
    min_t = _cdiv(16, g_pad)  # tl.dot needs >= 16 rows
    block_t = max(min_t, min(block_m // g_pad, _pow2(t)))  # a short chunk gets a short tile
    if block_n is None:
        block_n = 32 if block_d > 128 else 64
    block_n = max(16, block_n)
    if num_warps is None:
        num_warps = 8 if block_t * g_pad * block_d >= 128 * 128 else 4
    if num_stages is None:
        num_stages = 2
    if sinks is not None and sinks.shape != (nh,):
        raise ValueError(f"sinks {tuple(sinks.shape)}: one per query head ({nh})")
    _prefill_kernel[(triton.cdiv(t, block_t), kvh)](
        q, k_pages, v_pages, block_table_row, out, sinks.contiguous() if sinks is not None else block_table_row,
        int(start), t, scale * LOG2E,
        int(window) if window else NO_WINDOW,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), out.stride(0), out.stride(1),
        G=g, G_PAD=g_pad, HD=hd, BLOCK_D=block_d, P=p, BLOCK_T=block_t, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32 or INTERPRET, DTYPE=tl_dtype(q.dtype), SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages)
    return out


def paged_prefill_attention(q, k_pages, v_pages, block_table_row, start, scale, window=None, sinks=None):
    """A prefill chunk over the page pool. Gathering the pages and running SDPA's flash kernel
    beats the Triton kernel above on the H200 (2048-token chunk: 93 us against 321 us from an
    empty cache, 3.6 ms against 9.9 ms after 32k tokens; benchmarks/results/paged_attention-gpu.json),
    and the gather is a small copy next to it, so that is the path on every device; the Triton
    kernel stays, tested, for when it is tuned.

    With sinks, SDPA has no way to add the sink to its denominator: on CUDA the Triton kernel runs
    (in place, reading only the window's keys; not yet measured on a GPU), on the CPU the written-
    out reference (model.attention.prefill_attention)."""
    if sinks is not None and use_triton(q):
        return paged_prefill_attention_triton(q, k_pages, v_pages, block_table_row, start, scale, window,
                                              sinks=sinks)
    return paged_prefill_attention_torch(q, k_pages, v_pages, block_table_row, start, scale, window, sinks)
