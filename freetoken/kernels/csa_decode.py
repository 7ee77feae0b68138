"""Fused kernels for DeepSeek-V4 attention's small ops (model/csa.py), which at decode are each a
chain of tiny launches:

  - norm_rope_triton: RMSNorm (weighted, fp32 weight, or plain) and / or the interleaved RoPE of
    the trailing rd dims at each row's position, the table gather included: one kernel instead
    of ~7 (a norm) + ~10 (gather cos/sin, float, slices, 4 multiply-adds, stack, cat, cast).
  - sink_attention_triton: decode's attention of each query row over its own keys (= values)
    with the per-head sink logit: one kernel instead of ~9 (bmm, cast, scale, masked_fill,
    expand + cat, softmax, slice, cast, bmm).
  - compress_entries_triton: Compressor.entries at decode, straight from the paged / ring rows
    (block-table lookups in the kernel): the gathers, the overlapping-window split, the gated
    softmax average, the RMSNorm and the RoPE at the window start in one kernel (~35 launches).

References (and the CPU path): csa.rms_weighted_torch, rms_plain_torch, rope_at_torch,
sink_attention_torch and Compressor.entries.

Rounding: statistics and softmaxes in fp32, rounded to the activation dtype exactly where the
references round (the normed value before the RoPE, the bmm's scores, the probabilities before
the value product, the gated products before their sum). What differs: fp32 summation order
(mean square, the softmax denominators, dot products), 1 / sqrt(x) computed as div_rn(1, sqrt_rn)
(torch's CUDA rsqrt is within 2 ulp of that, its CPU one equal), Triton's exp (the fast ex2
approximation, a couple of ulp) and the online rescaling of the softmax sums. The RoPE's
multiply-adds are not contracted into FMAs (enable_fp_fusion=False), so with equal inputs they
round as torch's separate multiplies and adds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, graph_us, tl_dtype
from .rounding import NO_FMA as _NO_FMA
from .rounding import emu as _emu
from .rounding import round_to as _round

NORM_NONE, NORM_WEIGHTED, NORM_PLAIN = 0, 1, 2
MAX_BLOCK = 16384  # one row in one program's registers; wider rows take the torch path


@triton.jit
def _norm_rope(x, cols, D, RD, w_ptr, cos_ptr, sin_ptr, pos, stride_c, eps,
               NORM: tl.constexpr, ROPE: tl.constexpr, SIGN: tl.constexpr, BLOCK: tl.constexpr,
               DTYPE: tl.constexpr, EMU: tl.constexpr):
    """x [BLOCK] fp32 (0 past D) -> [BLOCK] fp32 holding DTYPE values: normed as the reference
    (rounded to DTYPE), then its last RD of D columns rotated as adjacent pairs at table row pos."""
    dm = cols < D
    if NORM != 0:
        ms = tl.div_rn(tl.sum(x * x, axis=0), D.to(tl.float32))
        r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))  # as torch.rsqrt, rounded to nearest
        if NORM == 1:  # rms_weighted: fp32 weight times the fp32 normed value, rounded once
            w = tl.load(w_ptr + cols, mask=dm, other=0.0).to(tl.float32)
            x = w * (x * r)
        else:  # rms_plain: the factor rounded to DTYPE, the product rounded in DTYPE
            x = x * _round(r, DTYPE, EMU)
        x = _round(x, DTYPE, EMU)
    if ROPE:
        # columns (2i, 2i + 1) as pairs (a, b); pair i is rotary pair j = i - (D - RD) / 2
        a, b = tl.split(tl.reshape(x, [BLOCK // 2, 2]))  # [BLOCK / 2] each
        i = tl.arange(0, BLOCK // 2)
        j = i - (D - RD) // 2
        rot = (j >= 0) & (i < D // 2)
        jj = tl.where(rot, j, 0)
        c = tl.load(cos_ptr + pos * stride_c + jj, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_c + jj, mask=rot, other=0.0).to(tl.float32) * SIGN
        a2 = tl.where(rot, a * c - b * s, a)
        b2 = tl.where(rot, b * c + a * s, b)
        x = _round(tl.reshape(tl.join(a2, b2), [BLOCK]), DTYPE, EMU)
    return x


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, R, D, RD,
                      stride_xn, stride_xr, stride_c, eps,
                      NORM: tl.constexpr, ROPE: tl.constexpr, SIGN: tl.constexpr, BLOCK: tl.constexpr,
                      DTYPE: tl.constexpr, OUT: tl.constexpr, EMU: tl.constexpr):
    """One program per row (n, r) of x [N, R, D] (unit last stride); out [N, R, D] contiguous."""
    row = tl.program_id(0).to(tl.int64)
    n = row // R
    r = row % R
    cols = tl.arange(0, BLOCK)
    dm = cols < D
    x = tl.load(x_ptr + n * stride_xn + r * stride_xr + cols, mask=dm, other=0.0).to(tl.float32)  # [BLOCK]
    if ROPE:
        pos = tl.load(pos_ptr + n).to(tl.int64)
        y = _norm_rope(x, cols, D, RD, w_ptr, cos_ptr, sin_ptr, pos, stride_c, eps, NORM, True, SIGN, BLOCK, DTYPE, EMU)
    else:
        y = _norm_rope(x, cols, D, RD, w_ptr, cos_ptr, sin_ptr, 0, stride_c, eps, NORM, False, SIGN, BLOCK, DTYPE, EMU)
    tl.store(out_ptr + row * D + cols, y.to(DTYPE).to(OUT), mask=dm)


def norm_rope_triton(x: torch.Tensor, w: torch.Tensor | None, eps: float, norm: int,
                     cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                     pos: torch.Tensor | None = None, inverse: bool = False) -> torch.Tensor:
    """x [N, D] or [N, R, D] (any row strides, unit last stride) -> a new contiguous tensor of x's
    shape and dtype: normed (norm: NORM_WEIGHTED with the weight w [D], NORM_PLAIN, NORM_NONE),
    then, with tables cos, sin [P, rd/2] and positions pos [N], rotated at each row's position
    (inverse: by the conjugate, as rope_tail with -sin)."""
    shape = x.shape
    if x.dim() == 2:
        x = x[:, None]
    elif x.dim() != 3:
        x = x.reshape(shape[0], -1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, r, d = x.shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    rope = cos is not None
    rd = 2 * cos.shape[-1] if rope else 0
    block = max(16, triton.next_power_of_2(d))
    _norm_rope_kernel[(n * r,)](x, w if w is not None else x, cos if rope else x, sin if rope else x,
                                pos if rope else x, out, r, d, rd, x.stride(0), x.stride(1),
                                cos.stride(0) if rope else 0, eps, NORM=norm, ROPE=rope,
                                SIGN=-1.0 if inverse else 1.0, BLOCK=block, DTYPE=tl_dtype(x.dtype),
                                OUT=tl_dtype(x.dtype), EMU=_emu(x.dtype), num_warps=min(8, max(1, block // 256)), **_NO_FMA)
    return out


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32. UPCAST (the CPU interpreter, whose bf16 tl.dot returns garbage
    in Triton 3.9): through fp32 operands, the same math (bf16 products are exact in fp32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _max_sum(q, k_ptr, stride_kk, sel_ptr, LO, K, d, dm, scale, m_i, l_i, BK: tl.constexpr,
             PREC: tl.constexpr, UPCAST: tl.constexpr, DTYPE: tl.constexpr, EMU: tl.constexpr):
    """Pass 1 over one source's keys LO..K-1 (k_ptr, sel_ptr: this row's): the running max and sum."""
    for k0 in range(LO, K, BK):
        kk = k0 + tl.arange(0, BK)
        sel = tl.load(sel_ptr + kk, mask=kk < K, other=0) != 0  # [BK]
        kt = tl.load(k_ptr + kk[:, None] * stride_kk + d[None, :], mask=sel[:, None] & dm[None, :],
                     other=0.0)  # [BK, BD]: 0 where not selected, so an unwritten row's NaN never enters
        # the reference's bmm rounds the scores to DTYPE before the fp32 scale
        s = _round(_dot(q, tl.trans(kt), PREC, UPCAST), DTYPE, EMU) * scale  # [BH, BK]
        s = tl.where(sel[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing selected yet: no NaN
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _weighted(q, k_ptr, stride_kk, sel_ptr, LO, K, d, dm, scale, m_i, l_i, acc, BK: tl.constexpr,
              PREC: tl.constexpr, UPCAST: tl.constexpr, DTYPE: tl.constexpr, EMU: tl.constexpr):
    """Pass 2 over one source's keys LO..K-1: the normalised probabilities, rounded to DTYPE,
    times the keys."""
    for k0 in range(LO, K, BK):
        kk = k0 + tl.arange(0, BK)
        sel = tl.load(sel_ptr + kk, mask=kk < K, other=0) != 0
        kt = tl.load(k_ptr + kk[:, None] * stride_kk + d[None, :], mask=sel[:, None] & dm[None, :], other=0.0)
        s = _round(_dot(q, tl.trans(kt), PREC, UPCAST), DTYPE, EMU) * scale
        s = tl.where(sel[None, :], s, float("-inf"))
        p = tl.div_rn(tl.exp(s - m_i[:, None]), l_i[:, None])  # [BH, BK], 0 where not selected
        acc += _dot(_round(p, DTYPE, EMU).to(DTYPE), kt, PREC, UPCAST)  # [BH, BD]
    return acc


@triton.jit
def _sink_attn_kernel(q_ptr, k_ptr, sel_ptr, k2_ptr, sel2_ptr, sink_ptr, out_ptr, NH, K, K2, D,
                      stride_qn, stride_qh, stride_kn, stride_kk, stride_sn,
                      stride_k2n, stride_k2k, stride_s2n, scale,
                      BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, DTYPE: tl.constexpr,
                      PREC: tl.constexpr, UPCAST: tl.constexpr, HAS2: tl.constexpr, EMU: tl.constexpr):
    """Program (query row n, block of BH heads): softmax over the row's selected keys (of one
    source, or two: the window's keys and the compressed entries, as if concatenated) and the
    head's sink logit, then the probabilities times the keys (= values). Two passes over the
    keys (they sit in L2): the max and sum first, so the probabilities are normalised before
    being rounded to DTYPE, as the reference rounds them; out [N, NH, D] contiguous."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < NH
    d = tl.arange(0, BD)
    dm = d < D
    q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :],
                mask=hm[:, None] & dm[None, :], other=0.0)  # [BH, BD]
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)  # [BH]
    k1, s1 = k_ptr + n * stride_kn, sel_ptr + n * stride_sn
    k2, s2 = k2_ptr + n * stride_k2n, sel2_ptr + n * stride_s2n
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    m_i, l_i = _max_sum(q, k1, stride_kk, s1, 0, K, d, dm, scale, m_i, l_i, BK, PREC, UPCAST, DTYPE, EMU)
    if HAS2:
        m_i, l_i = _max_sum(q, k2, stride_k2k, s2, 0, K2, d, dm, scale, m_i, l_i, BK, PREC, UPCAST, DTYPE, EMU)
    m_new = tl.maximum(m_i, sink)  # the sink joins the softmax (finite)
    l_i = l_i * tl.exp(m_i - m_new) + tl.exp(sink - m_new)
    m_i = m_new
    acc = tl.zeros([BH, BD], tl.float32)
    acc = _weighted(q, k1, stride_kk, s1, 0, K, d, dm, scale, m_i, l_i, acc, BK, PREC, UPCAST, DTYPE, EMU)
    if HAS2:
        acc = _weighted(q, k2, stride_k2k, s2, 0, K2, d, dm, scale, m_i, l_i, acc, BK, PREC, UPCAST, DTYPE, EMU)
    tl.store(out_ptr + (n * NH + h[:, None]) * D + d[None, :], _round(acc, DTYPE, EMU).to(DTYPE),
             mask=hm[:, None] & dm[None, :])


@triton.jit
def _split_range(LO, HI, K, K2):
    """The keys LO..HI-1 of the concatenated sources as a range in each: [a1, b1) of the first,
    [a2, b2) of the second (empty ranges where the split misses a source)."""
    a1 = tl.minimum(LO, K)
    b1 = tl.minimum(HI, K)
    a2 = tl.maximum(LO - K, 0)
    b2 = tl.minimum(tl.maximum(HI - K, 0), K2)
    return a1, b1, a2, b2


@triton.jit
def _split_program(NH, D, BH: tl.constexpr, BD: tl.constexpr):
    """The split kernels' program: row n, its block of BH heads h (hm: which exist), split sp,
    the head dims d (dm: which exist)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    d = tl.arange(0, BD)
    return n, h, tl.program_id(2), h < NH, d, d < D


@triton.jit
def _sink_split_stats_kernel(q_ptr, k_ptr, sel_ptr, k2_ptr, sel2_ptr, m_ptr, l_ptr, NH, K, K2, D, S, SPLIT,
                             stride_qn, stride_qh, stride_kn, stride_kk, stride_sn,
                             stride_k2n, stride_k2k, stride_s2n, scale,
                             BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, DTYPE: tl.constexpr,
                             PREC: tl.constexpr, UPCAST: tl.constexpr, HAS2: tl.constexpr, EMU: tl.constexpr):
    """Program (row n, BH heads, split s): the max and sum of the split's selected keys alone
    (-inf and 0 where it has none) -> m, l [N, S, NH] fp32."""
    n, h, sp, hm, d, dm = _split_program(NH, D, BH, BD)
    a1, b1, a2, b2 = _split_range(sp * SPLIT, sp * SPLIT + SPLIT, K, K2)
    q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :],
                mask=hm[:, None] & dm[None, :], other=0.0)  # [BH, BD]
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    m_i, l_i = _max_sum(q, k_ptr + n * stride_kn, stride_kk, sel_ptr + n * stride_sn, a1, b1, d, dm, scale,
                        m_i, l_i, BK, PREC, UPCAST, DTYPE, EMU)
    if HAS2:
        m_i, l_i = _max_sum(q, k2_ptr + n * stride_k2n, stride_k2k, sel2_ptr + n * stride_s2n, a2, b2, d, dm, scale,
                            m_i, l_i, BK, PREC, UPCAST, DTYPE, EMU)
    o = (n * S + sp) * NH + h
    tl.store(m_ptr + o, m_i, mask=hm)
    tl.store(l_ptr + o, l_i, mask=hm)


@triton.jit
def _sink_split_weighted_kernel(q_ptr, k_ptr, sel_ptr, k2_ptr, sel2_ptr, sink_ptr, m_ptr, l_ptr, part_ptr,
                                NH, K, K2, D, S, SPLIT,
                                stride_qn, stride_qh, stride_kn, stride_kk, stride_sn,
                                stride_k2n, stride_k2k, stride_s2n, scale,
                                BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
                                DTYPE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, HAS2: tl.constexpr,
                                EMU: tl.constexpr):
    """Program (row n, BH heads, split s): the row's max and sum from every split's and the
    sink's, then this split's normalised probabilities (rounded to DTYPE, as the reference
    rounds them) times its keys -> part [N, S, NH, D] fp32."""
    n, h, sp, hm, d, dm = _split_program(NH, D, BH, BD)
    ss = tl.arange(0, BS)
    o = (n * S + ss[:, None]) * NH + h[None, :]  # [BS, BH]
    pm = (ss[:, None] < S) & hm[None, :]
    m_s = tl.load(m_ptr + o, mask=pm, other=float("-inf"))
    l_s = tl.load(l_ptr + o, mask=pm, other=0.0)
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)  # [BH]
    m_i = tl.maximum(tl.max(m_s, axis=0), sink)  # finite: the sink joins the softmax
    l_i = tl.sum(l_s * tl.exp(m_s - m_i[None, :]), axis=0) + tl.exp(sink - m_i)
    a1, b1, a2, b2 = _split_range(sp * SPLIT, sp * SPLIT + SPLIT, K, K2)
    q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :],
                mask=hm[:, None] & dm[None, :], other=0.0)  # [BH, BD]
    acc = tl.zeros([BH, BD], tl.float32)
    acc = _weighted(q, k_ptr + n * stride_kn, stride_kk, sel_ptr + n * stride_sn, a1, b1, d, dm, scale,
                    m_i, l_i, acc, BK, PREC, UPCAST, DTYPE, EMU)
    if HAS2:
        acc = _weighted(q, k2_ptr + n * stride_k2n, stride_k2k, sel2_ptr + n * stride_s2n, a2, b2, d, dm, scale,
                        m_i, l_i, acc, BK, PREC, UPCAST, DTYPE, EMU)
    tl.store(part_ptr + ((n * S + sp) * NH + h[:, None]) * D + d[None, :], acc, mask=hm[:, None] & dm[None, :])


@triton.jit
def _sink_split_sum_kernel(part_ptr, out_ptr, S, ROW, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
                           EMU: tl.constexpr):
    """out[n] = the splits' partial outputs summed in fp32, rounded once to DTYPE; part
    [N, S, ROW] -> out [N, ROW] (ROW = NH * D)."""
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < ROW
    acc = tl.zeros([BLOCK], tl.float32)
    for sp in range(0, S):
        acc += tl.load(part_ptr + (n * S + sp) * ROW + c, mask=cm, other=0.0)
    tl.store(out_ptr + n * ROW + c, _round(acc, DTYPE, EMU).to(DTYPE), mask=cm)


SINK_PROGRAMS = 128  # split the keys until about this many programs run (an H200 has 132 SMs)


def sink_splits(n: int, nh: int, keys: int, bh: int, programs: int = SINK_PROGRAMS) -> int:
    """Keys per split so that n * head blocks * splits reaches about `programs` (at least 16
    keys a split; a split need not be a whole number of key blocks: its last block is masked);
    all the keys (one split) where the rows and heads already fill the GPU."""
    want = max(1, -(-programs // (n * -(-nh // bh))))
    return max(16, -(-keys // want))


def sink_attention_triton(q: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor, sinks: torch.Tensor,
                          scale: float, keys2: torch.Tensor | None = None,
                          sel2: torch.Tensor | None = None, split: int | None = None) -> torch.Tensor:
    """As csa.sink_attention_torch with per-row keys: q [N, nh, D]; keys [N, K, D] (= values);
    sel [N, K] bool; sinks [nh] fp32 -> [N, nh, D] in q's dtype. keys2 [N, K2, D], sel2 [N, K2]:
    a second source, as if concatenated after the first (so no cat). Unselected keys are never
    read (they may hold anything). With few rows (decode at a small batch) the keys split over
    programs, `split` keys each (default sink_splits: ~SINK_PROGRAMS programs), in three
    launches (each split's max and sum; its weighted keys with the row's; the fp32 sum); with
    one split, one kernel."""
    def prep(k, s):
        return (k if k.stride(-1) == 1 else k.contiguous()), s.contiguous().view(torch.uint8)
    if q.stride(-1) != 1:
        q = q.contiguous()
    keys, sel = prep(keys, sel)
    has2 = keys2 is not None
    keys2, sel2 = prep(keys2, sel2) if has2 else (keys, sel)
    n, nh, d = q.shape
    out = torch.empty(n, nh, d, dtype=q.dtype, device=q.device)
    bd = max(16, triton.next_power_of_2(d))
    bh = 16  # tl.dot's smallest M
    bk = 32 if bd <= 512 else 16
    if n == 0 or nh == 0:
        return out
    k1n, k2n = keys.shape[1], keys2.shape[1] if has2 else 0
    if split is not None and split < 1:
        raise ValueError(f"sink_attention_triton: split must be >= 1 keys, got {split}")
    split = sink_splits(n, nh, k1n + k2n, bh) if split is None else split
    n_split = triton.cdiv(k1n + k2n, split)
    if n_split > 1:  # few rows: the keys split over programs, their partial sums merged
        common = dict(BH=bh, BK=bk, BD=bd, DTYPE=tl_dtype(q.dtype), PREC="ieee" if q.dtype == torch.float32 else "tf32",
                      UPCAST=INTERPRET and q.dtype != torch.float32, HAS2=has2, EMU=_emu(q.dtype), num_warps=4)
        strides = (q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), sel.stride(0), keys2.stride(0),
                   keys2.stride(1), sel2.stride(0), scale)
        grid = (n, triton.cdiv(nh, bh), n_split)
        m = torch.empty(n, n_split, nh, dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
        _sink_split_stats_kernel[grid](q, keys, sel, keys2, sel2, m, lsum, nh, k1n, k2n, d, n_split, split,
                                       *strides, **common)
        part = torch.empty(n, n_split, nh, d, dtype=torch.float32, device=q.device)
        _sink_split_weighted_kernel[grid](q, keys, sel, keys2, sel2, sinks.float().contiguous(), m, lsum, part,
                                          nh, k1n, k2n, d, n_split, split, *strides,
                                          BS=max(2, triton.next_power_of_2(n_split)), **common)
        block = 1024
        _sink_split_sum_kernel[(n, triton.cdiv(nh * d, block))](part, out, n_split, nh * d, BLOCK=block,
                                                                DTYPE=tl_dtype(q.dtype), EMU=_emu(q.dtype))
        return out
    _sink_attn_kernel[(n, triton.cdiv(nh, bh))](
        q, keys, sel, keys2, sel2, sinks.float().contiguous(), out, nh, keys.shape[1],
        keys2.shape[1] if has2 else 0, d, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        sel.stride(0), keys2.stride(0), keys2.stride(1), sel2.stride(0), scale, BH=bh, BK=bk, BD=bd,
        DTYPE=tl_dtype(q.dtype), PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=INTERPRET and q.dtype != torch.float32, HAS2=has2, EMU=_emu(q.dtype), num_warps=4)
    return out


@triton.jit
def _window_sum(b, end, d, dm, kv_ptr, kv_sp, kv_sr, kv_tab, kv_ts, KV_STRIDE,
                g_ptr, g_sp, g_sr, g_tab, g_ts, G_STRIDE, PS, M, D,
                O: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, DTYPE: tl.constexpr, EMU: tl.constexpr):
    """Features d [BD] (dm: those < D) of row b's window closing at `end`, before the norm: its
    S = O * M token slots are positions end - S + 1 .. end (those < 0 drop out); slot i reads the
    first series (columns 0..D) when O == 1 or i < M, else the second (D..2D). A position p of
    row b lives at row (p % PS) // STRIDE of page table[b, p // PS] (kv_ptr, g_ptr: the part's
    first column). Per feature: softmax of the gates over the slots (fp32), the kv rows times
    those weights (each product rounded to DTYPE, as the reference multiplies in DTYPE) summed
    in fp32 -> [BD] fp32 holding DTYPE values (0 past D)."""
    S = O * M
    sr = tl.arange(0, BS)
    m_i = tl.full([BD], float("-inf"), tl.float32)
    l_i = tl.zeros([BD], tl.float32)
    for s0 in range(0, S, BS):  # pass 1: each feature's max and sum over the slots
        i = s0 + sr
        p = end - S + 1 + i  # [BS]
        ok = (i < S) & (p >= 0)
        pc = tl.where(ok, p, 0)
        col = (i >= M).to(tl.int64) * D * (O - 1)  # [BS]: the second series' columns (O == 2)
        pg = tl.load(g_tab + b * g_ts + pc // PS, mask=ok, other=0).to(tl.int64)
        g = tl.load(g_ptr + pg[:, None] * g_sp + ((pc % PS) // G_STRIDE)[:, None] * g_sr + col[:, None] + d[None, :],
                    mask=ok[:, None] & dm[None, :], other=float("-inf")).to(tl.float32)  # [BS, BD]
        m_new = tl.maximum(m_i, tl.max(g, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(g - m_safe[None, :]), axis=0)
        m_i = m_new
    m_i = tl.where(dm, m_i, 0.0)  # padded features: no slot, keep them finite
    l_i = tl.where(dm, l_i, 1.0)
    acc = tl.zeros([BD], tl.float32)
    for s0 in range(0, S, BS):  # pass 2: the normalised weights, rounded, times the kv rows
        i = s0 + sr
        p = end - S + 1 + i
        ok = (i < S) & (p >= 0)
        pc = tl.where(ok, p, 0)
        col = (i >= M).to(tl.int64) * D * (O - 1)
        tile = ok[:, None] & dm[None, :]
        pg = tl.load(g_tab + b * g_ts + pc // PS, mask=ok, other=0).to(tl.int64)
        g = tl.load(g_ptr + pg[:, None] * g_sp + ((pc % PS) // G_STRIDE)[:, None] * g_sr + col[:, None] + d[None, :],
                    mask=tile, other=float("-inf")).to(tl.float32)
        wgt = _round(tl.div_rn(tl.exp(g - m_i[None, :]), l_i[None, :]), DTYPE, EMU)  # [BS, BD]
        pk = tl.load(kv_tab + b * kv_ts + pc // PS, mask=ok, other=0).to(tl.int64)
        kv = tl.load(kv_ptr + pk[:, None] * kv_sp + ((pc % PS) // KV_STRIDE)[:, None] * kv_sr + col[:, None] + d[None, :],
                     mask=tile, other=0.0).to(tl.float32)  # [BS, BD]
        acc += tl.sum(_round(kv * wgt, DTYPE, EMU), axis=0)
    return tl.where(dm, _round(acc, DTYPE, EMU), 0.0)


@triton.jit
def _compress_kernel(ends_ptr, kv_ptr, kv_sp, kv_sr, kv_tab, kv_ts, KV_STRIDE,
                     g_ptr, g_sp, g_sr, g_tab, g_ts, G_STRIDE, PS,
                     w_ptr, cos_ptr, sin_ptr, stride_c, out_ptr, M, D, RD, eps,
                     O: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, DTYPE: tl.constexpr,
                     OUT: tl.constexpr, EMU: tl.constexpr):
    """Program b: the entry of the window closing at ends[b] -> out [B, D] (_window_sum over all
    D features, then the weighted RMS norm and the rotation at the window's first position)."""
    b = tl.program_id(0).to(tl.int64)
    end = tl.load(ends_ptr + b).to(tl.int64)
    d = tl.arange(0, BD)
    dm = d < D
    e = _window_sum(b, end, d, dm, kv_ptr, kv_sp, kv_sr, kv_tab, kv_ts, KV_STRIDE, g_ptr, g_sp, g_sr, g_tab, g_ts,
                    G_STRIDE, PS, M, D, O, BS, BD, DTYPE, EMU)
    start = tl.maximum(end - M + 1, 0)  # the window's first position: its rotation
    y = _norm_rope(e, d, D, RD, w_ptr, cos_ptr, sin_ptr, start, stride_c, eps, 1, True, 1.0, BD, DTYPE, EMU)
    tl.store(out_ptr + b * D + d, y.to(DTYPE).to(OUT), mask=dm)


@triton.jit
def _compress_split_kernel(ends_ptr, kv_ptr, kv_sp, kv_sr, kv_tab, kv_ts, KV_STRIDE,
                           g_ptr, g_sp, g_sr, g_tab, g_ts, G_STRIDE, PS, e_ptr, M, D,
                           O: tl.constexpr, BS: tl.constexpr, BDC: tl.constexpr, DTYPE: tl.constexpr,
                           EMU: tl.constexpr):
    """Program (b, c): features c*BDC .. of row b's window sum (a long window's rows spread over
    D / BDC programs instead of one) -> e [B, D] fp32; _entry_norm_kernel finishes the entry."""
    b = tl.program_id(0).to(tl.int64)
    end = tl.load(ends_ptr + b).to(tl.int64)
    d = tl.program_id(1) * BDC + tl.arange(0, BDC)
    dm = d < D
    e = _window_sum(b, end, d, dm, kv_ptr, kv_sp, kv_sr, kv_tab, kv_ts, KV_STRIDE, g_ptr, g_sp, g_sr, g_tab, g_ts,
                    G_STRIDE, PS, M, D, O, BS, BDC, DTYPE, EMU)
    tl.store(e_ptr + b * D + d, e, mask=dm)


@triton.jit
def _entry_norm_kernel(ends_ptr, e_ptr, w_ptr, cos_ptr, sin_ptr, stride_c, out_ptr, M, D, RD, eps,
                       BD: tl.constexpr, DTYPE: tl.constexpr, OUT: tl.constexpr, EMU: tl.constexpr):
    """Program b: the split window sum e[b] normed and rotated at its window's first position."""
    b = tl.program_id(0).to(tl.int64)
    end = tl.load(ends_ptr + b).to(tl.int64)
    d = tl.arange(0, BD)
    dm = d < D
    e = tl.load(e_ptr + b * D + d, mask=dm, other=0.0)
    y = _norm_rope(e, d, D, RD, w_ptr, cos_ptr, sin_ptr, tl.maximum(end - M + 1, 0), stride_c, eps, 1, True, 1.0,
                   BD, DTYPE, EMU)
    tl.store(out_ptr + b * D + d, y.to(DTYPE).to(OUT), mask=dm)


# Windows of at least this many token slots take the split form (a [S, D] window in one
# program is a long serial loop at batch 1: HCA's 128 x 512 took 35 us a call in the H200
# profile of V4's step, 17 calls = 0.6 ms a 12-layer step). Timed on the H200 (c1de6eb,
# `python -m freetoken.kernels.csa_decode 1`): HCA's 128-slot window 11.1 us split against 69.5
# in one program; CSA's 8-slot window stays in one program (7.2 us). 0 turns the split off.
SPLIT_SLOTS = 64


def compress_entries_triton(kv_part, gate_part, page_size: int, ends: torch.Tensor, m: int, o: int, dim: int,
                            norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                            dtype: torch.dtype, split: int | None = None) -> torch.Tensor:
    """As Compressor.entries at decode, reading the rows where they live. kv_part, gate_part:
    DecodeState.part's (buf [pages, rows, width], table [slots, W], cols slice, positions per
    row); ends [B]: row b's closing position (of slot b); cos, sin [P, rd/2] -> [B, dim] dtype.
    split: features per program of the split form (a power of two >= 16; 0: one program per
    row; None: 64 where SPLIT_SLOTS is set and the window has that many slots, else 0). The two forms agree up
    to rounding (their fp32 partial sums are grouped differently)."""
    if split is not None and split < 0:
        raise ValueError(f"compress_entries_triton: split must be >= 0 features a program, got {split}")
    kb, kt, kc, ks = kv_part
    gb, gt, gc, gs = gate_part
    assert kb.stride(-1) == 1 and gb.stride(-1) == 1
    b = ends.shape[0]
    out = torch.empty(b, dim, dtype=dtype, device=ends.device)
    kv0, g0 = kb[..., kc], gb[..., gc]  # views starting at the parts' first columns
    bd = max(16, triton.next_power_of_2(dim))
    if split is None:
        split = 64 if SPLIT_SLOTS and o * m >= SPLIT_SLOTS else 0
    rows = (kv0, kb.stride(0), kb.stride(1), kt, kt.stride(0), ks, g0, gb.stride(0), gb.stride(1), gt, gt.stride(0),
            gs, page_size)
    if split:
        bdc = min(bd, max(16, triton.next_power_of_2(split)))
        bs = max(2, min(triton.next_power_of_2(o * m), max(2, 8192 // bdc)))
        e = torch.empty(b, dim, dtype=torch.float32, device=ends.device)
        _compress_split_kernel[(b, triton.cdiv(dim, bdc))](ends, *rows, e, m, dim, O=o, BS=bs, BDC=bdc,
                                                           DTYPE=tl_dtype(kb.dtype), EMU=_emu(kb.dtype),
                                                           num_warps=4, **_NO_FMA)
        _entry_norm_kernel[(b,)](ends, e, norm, cos, sin, cos.stride(0), out, m, dim, 2 * cos.shape[-1], eps,
                                 BD=bd, DTYPE=tl_dtype(kb.dtype), OUT=tl_dtype(dtype), EMU=_emu(kb.dtype),
                                 num_warps=min(8, max(1, bd // 256)), **_NO_FMA)
        return out
    bs = max(2, min(triton.next_power_of_2(o * m), max(2, 8192 // bd)))  # a [BS, BD] tile ~8K values
    _compress_kernel[(b,)](ends, *rows, norm, cos, sin, cos.stride(0), out, m, dim, 2 * cos.shape[-1], eps,
                           O=o, BS=bs, BD=bd, DTYPE=tl_dtype(kb.dtype), OUT=tl_dtype(dtype),
                           EMU=_emu(kb.dtype), num_warps=4, **_NO_FMA)
    return out


def _bench(b: int = 1, reps: int = 200):
    """Old (torch) vs new (Triton) per call on CUDA at DeepSeek-V4-Flash's shapes, each timed
    from a CUDA graph: python -m freetoken.kernels.csa_decode [B]"""
    from ..model import csa
    dev, dt = "cuda", torch.bfloat16
    nh, hd, rd, win, topk, m = 64, 512, 64, 128, 512, 4
    g = torch.Generator(device=dev).manual_seed(0)
    cos = torch.rand(4096, rd // 2, device=dev, generator=g).to(dt)
    sin = torch.rand(4096, rd // 2, device=dev, generator=g).to(dt)
    pos = torch.randint(0, 4096, (b,), device=dev, generator=g)
    q = torch.randn(b, nh, hd, device=dev, generator=g).to(dt)
    kv = torch.randn(b, hd, device=dev, generator=g).to(dt)
    lat = torch.randn(b, 1024, device=dev, generator=g).to(dt)
    w = torch.rand(1024, device=dev, generator=g) + 0.5
    wk = torch.rand(hd, device=dev, generator=g) + 0.5
    keys = torch.randn(b, win + topk, hd, device=dev, generator=g).to(dt)
    sel = torch.rand(b, win + topk, device=dev, generator=g) < 0.9
    sinks = torch.randn(nh, device=dev, generator=g)
    # a paged part: 64 pages of 16 rows, kv and gate side by side, each slot's table a permutation
    ps, width = 16, 4 * hd
    buf = torch.randn(64, ps, width, device=dev, generator=g).to(dt)
    table = torch.stack([torch.randperm(64, device=dev, generator=g) for _ in range(b)]).int()
    ends = (pos % 1000).clamp(min=8)
    kvp, gp = (buf, table, slice(0, 2 * hd), 1), (buf, table, slice(2 * hd, 4 * hd), 1)
    comp = csa.Compressor({"position_bias": torch.zeros(m, 2 * hd, device=dev), "kv_norm.weight": wk},
                          "", m, 2, hd, 1e-6, ("kv", "gate", "entry"))
    hca = csa.Compressor({"position_bias": torch.zeros(128, hd, device=dev), "kv_norm.weight": wk},
                         "", 128, 1, hd, 1e-6, ("kv", "gate", "entry"))

    def rows(name, p):
        bb, t, cols, _ = kvp if name == "kv" else gp
        pg = t[:b].gather(1, p.reshape(b, -1) // ps).long().view(p.shape)
        return bb[..., cols][pg, p % ps]

    kvp1, gp1 = (buf, table, slice(0, hd), 1), (buf, table, slice(2 * hd, 3 * hd), 1)  # HCA: one series

    def rows1(name, p):
        bb, t, cols, _ = kvp1 if name == "kv" else gp1
        pg = t[:b].gather(1, p.reshape(b, -1) // ps).long().view(p.shape)
        return bb[..., cols][pg, p % ps]

    cases = {
        "rms_weighted torch": lambda: csa.rms_weighted_torch(lat, w, 1e-6),
        "rms_weighted triton": lambda: norm_rope_triton(lat, w, 1e-6, NORM_WEIGHTED),
        "q rms_plain+rope torch": lambda: csa.rope_at_torch(csa.rms_plain_torch(q, 1e-6), cos, sin, pos),
        "q rms_plain+rope triton": lambda: norm_rope_triton(q, None, 1e-6, NORM_PLAIN, cos, sin, pos),
        "kv rms+rope torch": lambda: csa.rope_at_torch(csa.rms_weighted_torch(kv, wk, 1e-6), cos, sin, pos),
        "kv rms+rope triton": lambda: norm_rope_triton(kv, wk, 1e-6, NORM_WEIGHTED, cos, sin, pos),
        "o rope^-1 torch": lambda: csa.rope_at_torch(q, cos, sin, pos, inverse=True),
        "o rope^-1 triton": lambda: norm_rope_triton(q, None, 0.0, NORM_NONE, cos, sin, pos, inverse=True),
        "sink_attention torch": lambda: csa.sink_attention_torch(q, keys, sel, sinks, hd ** -0.5),
        "sink_attention triton": lambda: sink_attention_triton(q, keys, sel, sinks, hd ** -0.5),
        "sink_attention triton 1 kernel": lambda: sink_attention_triton(q, keys, sel, sinks, hd ** -0.5, split=1 << 30),
        # the model's decode call: window keys and compressed entries, two sources
        "sink_attn_decode torch": lambda: csa.sink_attention_decode_torch(q, keys[:, :win], sel[:, :win], keys[:, win:],
                                                                          sel[:, win:], sinks, hd ** -0.5),
        "sink_attn_decode triton": lambda: sink_attention_triton(q, keys[:, :win], sel[:, :win], sinks, hd ** -0.5,
                                                                 keys[:, win:], sel[:, win:]),
        "compress entries torch": lambda: comp.entries(rows, ends, cos, sin, dt),
        "compress entries triton": lambda: compress_entries_triton(kvp, gp, ps, ends, m, 2, hd, wk, 1e-6,
                                                                   cos, sin, dt),
        # HCA's window: 128 tokens, one series (kv and gate of the first hd columns each)
        "hca entries torch": lambda: hca.entries(rows1, ends, cos, sin, dt),
        "hca entries triton": lambda: compress_entries_triton(kvp1, gp1, ps, ends, 128, 1, hd, wk, 1e-6, cos, sin, dt),
        "hca entries triton 1 program": lambda: compress_entries_triton(kvp1, gp1, ps, ends, 128, 1, hd, wk, 1e-6,
                                                                        cos, sin, dt, split=0),
        "hca entries triton split 64": lambda: compress_entries_triton(kvp1, gp1, ps, ends, 128, 1, hd, wk, 1e-6,
                                                                       cos, sin, dt, split=64),
    }
    outs = {}
    for name, f in cases.items():
        print(f"{name:26s} B={b}: {graph_us(f, reps):8.1f} us/call")
        outs[name] = f()
    for name, ref in outs.items():  # each kernel against its torch op, on these inputs
        if name.endswith(" torch") and isinstance(ref, torch.Tensor):
            for other in (k for k in outs if k.startswith(name[:-6] + " triton")):
                got = outs[other].float()
                err = float((got - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))
                print(f"{other:26s} B={b}: relative error {err:.2e} against torch")


if __name__ == "__main__":
    import sys
    _bench(*(int(a) for a in sys.argv[1:2]))
