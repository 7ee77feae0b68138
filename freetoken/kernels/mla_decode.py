"""Fused decode kernels for multi-head latent attention with the DSA indexer (GLM-5, model/mla.py):
a decode layer's ~80 small torch ops (four RoPEs of seven ops each, two norms and a LayerNorm,
concatenations, the page arithmetic and two scatters into the pages, the indexer's gather, fp32
copies, two matmuls, relu and mask, then the latent rows' gather, mask, two matmuls and a softmax,
the per-head up-projection) become six kernels between the layer's three GEMMs:

  mla_prep_triton       q latent RMSNorm; KV latent RMSNorm and the key's RoPE, written straight
                        into the K pages; the indexer key's LayerNorm and RoPE into the V pages;
                        the row lengths (idle rows: scratch page, length 0)
  mla_q_triton          the absorbed query (q_nope through each head's slice of kv_b_proj's key
                        half) beside its rotated part; the indexer query's RoPE
  index_scores_triton   the indexer's scores read from the V pages through the block table, fp32,
                        -inf past each row's length; blocks past the length read nothing (the
                        torch path, static under a CUDA graph, gathers the whole table)
  mla_attention_triton  split-K flash decoding over the latent rows (the top-k positions, or every
                        position of the table), read once from the K pages, then a combine that
                        applies each head's value half of kv_b_proj (o: [N, nh * vd])

References (and the CPU path): model.mla latent_prep, latent_q, paged_index_scores,
paged_latent_attention: the same functions as the layer's torch decode.

Rounding: fp32 throughout except where the reference rounds to the activation dtype (normed
values, the rotated halves' products and sums, the absorbed query, the weighted latent, the
output), which the kernels round at the same points. The attention keeps its scores in fp32
(the reference rounds q.k to the activation dtype first: bf16 differs by that rounding). fp32
dots use input_precision="ieee" (no TF32). Decode shapes only (a few rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, graph_us, tl_dtype

UPCAST = INTERPRET  # the CPU interpreter's bf16 tl.dot returns garbage (Triton 3.9): fp32 operands there


def _p2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # only fp32 operands care


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32; UPCAST: through fp32 operands (the same math: products of bf16
    values are exact in fp32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


# ----------------------------------------------------------------------------- prep


@triton.jit
def _rope_store(src, dst, i, im, c, s, HALF_RD, DTYPE: tl.constexpr):
    """Rotate the adjacent pairs (src[2i], src[2i + 1]) by (c, s); store [firsts | seconds] at dst,
    each product and the sum rounded to DTYPE as the reference's ops are."""
    a = tl.load(src + 2 * i, mask=im, other=0.0).to(DTYPE).to(tl.float32)
    b = tl.load(src + 2 * i + 1, mask=im, other=0.0).to(DTYPE).to(tl.float32)
    _rope_pair_store(a, b, dst, i, im, c, s, HALF_RD, DTYPE)


@triton.jit
def _rope_pair_store(a, b, dst, i, im, c, s, HALF_RD, DTYPE: tl.constexpr):
    ac = (a * c).to(DTYPE).to(tl.float32)
    bs = (b * s).to(DTYPE).to(tl.float32)
    bc = (b * c).to(DTYPE).to(tl.float32)
    as_ = (a * s).to(DTYPE).to(tl.float32)
    tl.store(dst + i, (ac - bs).to(DTYPE), mask=im)
    tl.store(dst + HALF_RD + i, (bc + as_).to(DTYPE), mask=im)


@triton.jit
def _rms_store(src, w_ptr, dst, D, eps, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    """dst[:D] = w * round(src * rsqrt(mean(src^2) + eps)), as layers.rms_norm_torch (not
    one-centered)."""
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(src + cols, mask=m, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + cols, (w * normed.to(DTYPE).to(tl.float32)).to(DTYPE), mask=m)


@triton.jit
def _prep_kernel(q_ptr, kv_ptr, ik_ptr, s_q, s_kv, s_ik,
                 pos_ptr, act_ptr, tab_ptr, s_tab, PS,
                 cos_ptr, sin_ptr, s_cs,
                 qw_ptr, kvw_ptr, ikw_ptr, ikb_ptr, eps, ieps,
                 qn_ptr, s_qn, k_ptr, s_kp, s_kr, v_ptr, s_vp, s_vr, lens_ptr,
                 QL, KVR, RD, ID, SCRATCH_PAGE,
                 BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr, HALF: tl.constexpr, BLOCK_ID: tl.constexpr,
                 FULL: tl.constexpr, HAS_ACTIVE: tl.constexpr, DTYPE: tl.constexpr):
    """One program per decode row n."""
    n = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + n).to(tl.int64)
    page = tl.load(tab_ptr + n * s_tab + p // PS).to(tl.int64)
    off = p % PS
    ln = p + 1
    if HAS_ACTIVE:
        a = tl.load(act_ptr + n) != 0
        page = tl.where(a, page, SCRATCH_PAGE)
        off = tl.where(a, off, 0)
        ln = tl.where(a, ln, 0)
    tl.store(lens_ptr + n, ln.to(tl.int32))

    # the query latent's RMSNorm (the input of q_b_proj and the indexer's wq_b)
    _rms_store(q_ptr + n * s_q, qw_ptr, qn_ptr + n * s_qn, QL, eps, BLOCK_Q, DTYPE)

    # the row the K pages keep: [RMSNorm(c) | RoPE(k_rope)]
    row = k_ptr + page * s_kp + off * s_kr
    _rms_store(kv_ptr + n * s_kv, kvw_ptr, row, KVR, eps, BLOCK_C, DTYPE)
    hr = RD // 2
    i = tl.arange(0, HALF)
    im = i < hr
    c = tl.load(cos_ptr + p * s_cs + i, mask=im, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + p * s_cs + i, mask=im, other=0.0).to(tl.float32)
    _rope_store(kv_ptr + n * s_kv + KVR, row + KVR, i, im, c, s, hr, DTYPE)

    if FULL:  # the indexer's key: LayerNorm, then RoPE on its first RD dims, into the V pages
        src = ik_ptr + n * s_ik
        vrow = v_ptr + page * s_vp + off * s_vr
        cols = tl.arange(0, BLOCK_ID)
        m = cols < ID
        x = tl.load(src + cols, mask=m, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / ID
        xc = tl.where(m, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / ID + ieps)
        w = tl.load(ikw_ptr + cols, mask=m, other=0.0).to(tl.float32)
        b = tl.load(ikb_ptr + cols, mask=m, other=0.0).to(tl.float32)
        y = (xc * rstd * w + b).to(DTYPE)
        tl.store(vrow + cols, y, mask=m & (cols >= RD))  # the pass-through part
        xe = tl.load(src + 2 * i, mask=im, other=0.0).to(tl.float32)  # the pairs, normed again
        xo = tl.load(src + 2 * i + 1, mask=im, other=0.0).to(tl.float32)
        ye = ((xe - mean) * rstd * tl.load(ikw_ptr + 2 * i, mask=im, other=0.0).to(tl.float32)
              + tl.load(ikb_ptr + 2 * i, mask=im, other=0.0).to(tl.float32)).to(DTYPE).to(tl.float32)
        yo = ((xo - mean) * rstd * tl.load(ikw_ptr + 2 * i + 1, mask=im, other=0.0).to(tl.float32)
              + tl.load(ikb_ptr + 2 * i + 1, mask=im, other=0.0).to(tl.float32)).to(DTYPE).to(tl.float32)
        _rope_pair_store(ye, yo, vrow, i, im, c, s, hr, DTYPE)


def mla_prep_triton(q_lat, kv, ik, pos, active, table, page_size, cos, sin, q_norm, kv_norm, ik_norm,
                    eps, ieps, kc, vc, scratch: int = 0):
    """As model.mla.latent_prep: q_lat [N, QL], kv [N, KVR + RD], ik [N, ID] or None (views with
    unit column stride); pos [N]; active [N] bool or None; table [>= N, W] int32; cos, sin
    [P, RD] (the first RD/2 columns used); kc [pages, 1, PS, KVR + RD], vc [pages, 1, PS, ID]
    (written at each row's page and offset) -> (normed q latent [N, QL], lens [N] int32)."""
    n, ql = q_lat.shape
    rd = cos.shape[1]
    kvr = kv.shape[1] - rd
    full = ik is not None
    idim = ik.shape[1] if full else 1
    qn = torch.empty(n, ql, dtype=q_lat.dtype, device=q_lat.device)
    lens = torch.empty(n, dtype=torch.int32, device=q_lat.device)
    vcache = vc if full else kc
    ikw, ikb = ik_norm if full else (q_norm, q_norm)
    _prep_kernel[(n,)](q_lat, kv, ik if full else kv, q_lat.stride(0), kv.stride(0), ik.stride(0) if full else 0,
                       pos, active if active is not None else pos, table, table.stride(0), page_size,
                       cos, sin, cos.stride(0), q_norm, kv_norm, ikw, ikb, eps, ieps,
                       qn, qn.stride(0), kc, kc.stride(0), kc.stride(2), vcache, vcache.stride(0), vcache.stride(2),
                       lens, ql, kvr, rd, idim, scratch,
                       BLOCK_Q=_p2(ql), BLOCK_C=_p2(kvr), HALF=_p2(rd // 2), BLOCK_ID=_p2(idim),
                       FULL=full, HAS_ACTIVE=active is not None, DTYPE=tl_dtype(q_lat.dtype),
                       num_warps=4)
    return qn, lens


# ----------------------------------------------------------------------------- queries


@triton.jit
def _q_kernel(q_ptr, s_q, iq_ptr, s_iq, wuk_ptr, s_wh, s_wd, pos_ptr, cos_ptr, sin_ptr, s_cs,
              out_ptr, iout_ptr, N, NH, NOPE, RD, KVR, IH, ID, NCB,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, HALF: tl.constexpr,
              BLOCK_P: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, DTYPE: tl.constexpr):
    """Program (row block, j): j < NH * NCB: head j // NCB's absorbed query, columns block j % NCB
    (block 0 also rotates the head's rope part); beyond: indexer head j - NH * NCB's RoPE."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < N
    rows64 = rows.to(tl.int64)
    j = tl.program_id(1)
    hr = RD // 2
    i = tl.arange(0, HALF)
    im = i < hr
    pos = tl.load(pos_ptr + rows64, mask=rm, other=0).to(tl.int64)
    tile = rm[:, None] & im[None, :]
    c = tl.load(cos_ptr + pos[:, None] * s_cs + i[None, :], mask=tile, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos[:, None] * s_cs + i[None, :], mask=tile, other=0.0).to(tl.float32)
    W = KVR + RD  # one head of the output
    if j < NH * NCB:
        h = j // NCB
        cb = j % NCB
        cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = cols < KVR
        src = q_ptr + rows64[:, None] * s_q + h * (NOPE + RD)
        acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for d0 in range(0, NOPE, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            dm = d < NOPE
            x = tl.load(src + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            w = tl.load(wuk_ptr + h * s_wh + d[:, None] * s_wd + cols[None, :], mask=dm[:, None] & cm[None, :],
                        other=0.0)  # [BLOCK_D, BLOCK_C]
            acc += _dot(x, w, PREC, UPCAST)
        dst = out_ptr + rows64[:, None] * (NH * W) + h * W
        tl.store(dst + cols[None, :], acc.to(DTYPE), mask=rm[:, None] & cm[None, :])
        if cb == 0:
            a = tl.load(src + NOPE + 2 * i[None, :], mask=tile, other=0.0).to(tl.float32)
            b = tl.load(src + NOPE + 2 * i[None, :] + 1, mask=tile, other=0.0).to(tl.float32)
            _rope_pair_store(a, b, dst + KVR, i[None, :], tile, c, s, hr, DTYPE)
    else:
        g = j - NH * NCB
        src = iq_ptr + rows64[:, None] * s_iq + g * ID
        dst = iout_ptr + rows64[:, None] * IH * ID + g * ID
        a = tl.load(src + 2 * i[None, :], mask=tile, other=0.0).to(tl.float32)
        b = tl.load(src + 2 * i[None, :] + 1, mask=tile, other=0.0).to(tl.float32)
        _rope_pair_store(a, b, dst, i[None, :], tile, c, s, hr, DTYPE)
        t = RD + tl.arange(0, BLOCK_P)
        pm = rm[:, None] & (t < ID)[None, :]
        tl.store(dst + t[None, :], tl.load(src + t[None, :], mask=pm, other=0.0), mask=pm)


def mla_q_triton(q, iq, w_uk, pos, cos, sin, nh: int, ih: int):
    """As model.mla.latent_q: q [N, nh * (nope + rd)] (q_b_proj's output), iq [N, ih * id] or None
    (views with unit column stride); w_uk [nh, nope, kvr] (unit last stride) -> (query
    [N, nh, kvr + rd], rotated indexer query [N, ih, id] or None)."""
    n = q.shape[0]
    rd = cos.shape[1]
    nope, kvr = w_uk.shape[1], w_uk.shape[2]
    assert w_uk.stride(2) == 1 and q.shape[1] == nh * (nope + rd)
    out = torch.empty(n, nh, kvr + rd, dtype=q.dtype, device=q.device)
    idim = iq.shape[1] // ih if iq is not None else rd
    iout = torch.empty(n, ih, idim, dtype=q.dtype, device=q.device) if iq is not None else None
    block_c = min(128, _p2(kvr, 16))
    ncb = triton.cdiv(kvr, block_c)
    block_n = min(64, _p2(n, 16))
    grid = (triton.cdiv(n, block_n), nh * ncb + (ih if iq is not None else 0))
    _q_kernel[grid](q, q.stride(0), iq if iq is not None else q, iq.stride(0) if iq is not None else 0,
                    w_uk, w_uk.stride(0), w_uk.stride(1), pos, cos, sin, cos.stride(0),
                    out, iout if iout is not None else out, n, nh, nope, rd, kvr, ih, idim, ncb,
                    BLOCK_N=block_n, BLOCK_D=min(64, _p2(nope, 16)), BLOCK_C=block_c, HALF=_p2(rd // 2),
                    BLOCK_P=_p2(max(idim - rd, 1)), PREC=_prec(q.dtype), UPCAST=UPCAST, DTYPE=tl_dtype(q.dtype),
                    num_warps=4)
    return out, iout


# ----------------------------------------------------------------------------- indexer


@triton.jit
def _index_kernel(iq_ptr, hw_ptr, hscale, v_ptr, s_vp, s_vr, tab_ptr, s_tab, lens_ptr, out_ptr,
                  L, PS, IH, ID, scale,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (row n, block of positions): score(j) = sum_h hw_h hscale relu(q_h . k_j scale),
    -inf from the row's length on."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    ln = tl.load(lens_ptr + n)
    valid = j < ln
    if tl.program_id(1) * BLOCK_S < ln:
        hh = tl.arange(0, BLOCK_H)
        hm = hh < IH
        d = tl.arange(0, BLOCK_D)
        dm = d < ID
        q = tl.load(iq_ptr + n * IH * ID + hh[:, None] * ID + d[None, :], mask=hm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
        page = tl.load(tab_ptr + n * s_tab + j // PS, mask=valid, other=0).to(tl.int64)
        k = tl.load(v_ptr + page[:, None] * s_vp + (j % PS)[:, None] * s_vr + d[None, :],
                    mask=valid[:, None] & dm[None, :], other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
        sc = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee") * scale, 0.0)  # [BLOCK_H, BLOCK_S]
        w = tl.load(hw_ptr + n * IH + hh, mask=hm, other=0.0) * hscale
        tot = tl.sum(w[:, None] * sc, axis=0)
        tl.store(out_ptr + n * L + j, tl.where(valid, tot, float("-inf")), mask=j < L)
    else:
        tl.store(out_ptr + n * L + j, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=j < L)


def index_scores_triton(iq, hw, hscale: float, vc, table, lens, length: int, page_size: int, scale: float):
    """As model.mla.paged_index_scores: iq [N, ih, id]; hw [N, ih] fp32; vc [pages, 1, PS, id];
    table [>= N, W]; lens [N] int32 -> scores [N, length] fp32 (-inf at j >= lens)."""
    n, ih, idim = iq.shape
    iq, hw = iq.contiguous(), hw.float().contiguous()
    out = torch.empty(n, length, dtype=torch.float32, device=iq.device)
    block_s = 64
    _index_kernel[(n, triton.cdiv(length, block_s))](iq, hw, hscale, vc, vc.stride(0), vc.stride(2), table,
                                                      table.stride(0), lens, out, length, page_size, ih, idim,
                                                      scale, BLOCK_H=_p2(ih, 16), BLOCK_D=_p2(idim, 16),
                                                      BLOCK_S=block_s, num_warps=4)
    return out


# ----------------------------------------------------------------------------- attention


@triton.jit
def _attn_kernel(q_ptr, k_ptr, s_kp, s_kr, tab_ptr, s_tab, lens_ptr, idx_ptr, s_idx,
                 acc_ptr, ml_ptr, K, CHUNK, NSPLIT, NH, KVR, RD, PS, scale,
                 BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                 HAS_IDX: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, DTYPE: tl.constexpr):
    """Program (row n, head block, split): online softmax over candidate slots
    [split * CHUNK, (split + 1) * CHUNK) of K (a slot: position idx[n, t], or t itself), valid where
    the position is below the row's length -> unnormalised acc [BLOCK_C] and (max, sum) per head."""
    n = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    hh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hh < NH
    c = tl.arange(0, BLOCK_C)
    cm = c < KVR
    r = tl.arange(0, BLOCK_R)
    rm = r < RD
    W = KVR + RD
    qrow = q_ptr + n * NH * W + hh[:, None] * W
    ql = tl.load(qrow + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)  # [BLOCK_H, BLOCK_C]
    qr = tl.load(qrow + KVR + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    ln = tl.load(lens_ptr + n)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    lo = sp * CHUNK
    hi = tl.minimum(lo + CHUNK, K)
    if not HAS_IDX:
        hi = tl.minimum(hi, ln)  # slots are positions: nothing past the length
    for t0 in range(lo, hi, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        tm = t < hi
        if HAS_IDX:
            j = tl.load(idx_ptr + n * s_idx + t, mask=tm, other=0).to(tl.int64)
        else:
            j = t.to(tl.int64)
        valid = tm & (j < ln) & (j >= 0)
        page = tl.load(tab_ptr + n * s_tab + j // PS, mask=valid, other=0).to(tl.int64)
        row = k_ptr + page * s_kp + (j % PS) * s_kr
        kl = tl.load(row[:, None] + c[None, :], mask=valid[:, None] & cm[None, :], other=0.0)  # [BLOCK_S, BLOCK_C]
        kr = tl.load(row[:, None] + KVR + r[None, :], mask=valid[:, None] & rm[None, :], other=0.0)
        # the reference's bmm rounds q.k to DTYPE before the fp32 scale
        s = (_dot(ql, tl.trans(kl), PREC, UPCAST) + _dot(qr, tl.trans(kr), PREC, UPCAST)).to(DTYPE).to(tl.float32)
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_S]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(DTYPE), kl, PREC, UPCAST)
        m_i = m_new
    base = (n * NH + hh) * NSPLIT + sp  # [BLOCK_H]
    tl.store(acc_ptr + base[:, None] * BLOCK_C + c[None, :], acc, mask=hm[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=hm)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=hm)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, wuv_ptr, s_wh, s_wv, out_ptr, NH, NSPLIT, KVR, VD, VPER,
                    SPLITP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, DTYPE: tl.constexpr):
    """Program (row n, head h, range of VPER value dims): the weighted latent from the splits,
    rounded to DTYPE, through the head's value half of kv_b_proj, BLOCK_V dims at a time ->
    out[n, h * VD + v]."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITP)
    spm = sp < NSPLIT
    c = tl.arange(0, BLOCK_C)
    cm = c < KVR
    base = (n * NH + h) * NSPLIT + sp
    m = tl.load(ml_ptr + base * 2, mask=spm, other=float("-inf"))
    lsum = tl.load(ml_ptr + base * 2 + 1, mask=spm, other=0.0)
    mx = tl.max(m, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wt = tl.exp(m - mx)  # 0 for empty splits
    tot = tl.sum(lsum * wt, axis=0)
    a = tl.load(acc_ptr + base[:, None] * BLOCK_C + c[None, :], mask=spm[:, None] & cm[None, :], other=0.0)
    lat = tl.sum(a * wt[:, None], axis=0) / tl.where(tot > 0, tot, 1.0)  # [BLOCK_C]; no key: 0
    lat = lat.to(DTYPE).to(tl.float32)
    v_lo = tl.program_id(2) * VPER
    v_hi = tl.minimum(v_lo + VPER, VD)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        vm = v < v_hi
        w = tl.load(wuv_ptr + h * s_wh + v[:, None] * s_wv + c[None, :], mask=vm[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_C]
        o = tl.sum(w * lat[None, :], axis=1)
        tl.store(out_ptr + n * NH * VD + h * VD + v, o.to(DTYPE), mask=vm)


def mla_attention_triton(q, kc, table, lens, idx, length: int, page_size: int, scale: float, w_uv,
                         splits: int | None = None):
    """As model.mla.paged_latent_attention: q [N, nh, kvr + rd]; kc [pages, 1, PS, kvr + rd];
    table [>= N, W]; lens [N] int32; idx [N, K] positions (the indexer's choice) or None (every
    position below `length`); w_uv [nh, vd, kvr] (unit last stride) -> [N, nh * vd] in q's dtype."""
    n, nh, width = q.shape
    vd, kvr = w_uv.shape[1], w_uv.shape[2]
    rd = width - kvr
    q = q.contiguous()
    k = idx.shape[1] if idx is not None else length
    block_s = 32
    block_h = 16  # heads a program takes (tl.dot's smallest M); the keys are read once per block
    if splits is None:  # enough programs for the GPU at batch 1 (each >= 4 blocks of keys), fewer
        # as rows add up: the partials ([N, nh, splits, kvr] fp32) are written and read once more
        splits = max(1, min(16, triton.cdiv(k, 4 * block_s), triton.cdiv(264, n * triton.cdiv(nh, block_h))))
    chunk = triton.cdiv(triton.cdiv(k, splits), block_s) * block_s
    splits = triton.cdiv(k, chunk)
    block_c = _p2(kvr, 16)
    acc = torch.empty(n, nh, splits, block_c, dtype=torch.float32, device=q.device)
    ml = torch.empty(n, nh, splits, 2, dtype=torch.float32, device=q.device)
    big = block_c >= 256
    _attn_kernel[(n, triton.cdiv(nh, block_h), splits)](
        q, kc, kc.stride(0), kc.stride(2), table, table.stride(0), lens,
        idx if idx is not None else lens, idx.stride(0) if idx is not None else 0,
        acc, ml, k, chunk, splits, nh, kvr, rd, page_size, scale,
        BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_R=_p2(rd, 16), BLOCK_S=block_s, HAS_IDX=idx is not None,
        PREC=_prec(q.dtype), UPCAST=UPCAST, DTYPE=tl_dtype(q.dtype), num_warps=8 if big else 4, num_stages=2)
    out = torch.empty(n, nh * vd, dtype=q.dtype, device=q.device)
    # each program combines one head's splits once, then runs its share of the value dims in
    # blocks small enough to stay in registers ([BLOCK_V, kvr] fp32)
    block_v = max(1, min(_p2(vd), 8192 // block_c))
    nvb = 2 if vd > block_v else 1
    vper = triton.cdiv(triton.cdiv(vd, nvb), block_v) * block_v
    _combine_kernel[(n, nh, triton.cdiv(vd, vper))](
        acc, ml, w_uv, w_uv.stride(0), w_uv.stride(1), out, nh, splits, kvr, vd, vper,
        SPLITP=_p2(splits), BLOCK_C=block_c, BLOCK_V=block_v, DTYPE=tl_dtype(q.dtype), num_warps=8 if big else 4)
    return out


# ----------------------------------------------------------------------------- timing


def _bench_layer(dev, dt, ctx: int, width: int):
    """One GLM-5-shaped attention layer (64 heads, latent 512 + 64, q_lora 2048, indexer 32 x 128,
    top-2048, hidden 6144) with random weights, a one-slot state of `width` positions whose
    pages hold random rows, the input of one decode step at position `ctx`."""
    from ..config import ModelConfig
    from ..model import mla
    from ..model.layers import Rope
    from ..model.state import DecodeState
    raw = dict(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=1024, hidden_size=6144,
               intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=1, num_attention_heads=64,
               num_key_value_heads=64, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
               topk_group=1, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256,
               qk_nope_head_dim=192, index_topk=2048, index_head_dim=128, index_n_heads=32, first_k_dense_replace=1,
               max_position_embeddings=width + 16, rope_theta=1e6, head_dim=64)
    cfg = ModelConfig.from_hf(raw)
    g = torch.Generator(device=dev).manual_seed(0)
    p = "model.layers.0.self_attn."
    H, nh, ql, kvr, rd, nope, vd = 6144, 64, 2048, 512, 64, 192, 256
    shapes = {"q_a_proj.weight": (ql, H), "kv_a_proj_with_mqa.weight": (kvr + rd, H), "q_a_layernorm.weight": (ql,),
              "kv_a_layernorm.weight": (kvr,), "q_b_proj.weight": (nh * (nope + rd), ql),
              "kv_b_proj.weight": (nh * (nope + vd), kvr), "o_proj.weight": (H, nh * vd),
              "indexer.wq_b.weight": (32 * 128, ql), "indexer.wk.weight": (128, H), "indexer.k_norm.weight": (128,),
              "indexer.k_norm.bias": (128,), "indexer.weights_proj.weight": (32, H)}
    w = {p + k: (torch.randn(s, device=dev, generator=g) * s[-1] ** -0.5).to(dt) for k, s in shapes.items()}
    layer = mla.LatentAttention(cfg, w, 0, Rope(rd, 1e6, width + 16, dev, dt), {})
    st = DecodeState(cfg, 1, width, torch.device(dev), dt, page_size=16)
    st.reserve(0, width)
    st.k[0].normal_()
    st.v[0].normal_()
    return layer, st, torch.randn(1, H, device=dev, dtype=dt), torch.tensor([ctx], device=dev)


def _bench(ctx: int = 300, width: int = 4096, reps: int = 100):
    """Old (the torch decode of one layer: its GEMMs and ~80 small ops) vs new (the same GEMMs and
    the fused kernels) per layer call on CUDA, each timed from a CUDA graph (static: the whole
    table of `width` positions, as the engine captures), GLM-5's attention shape, batch 1, context
    `ctx`: python -m freetoken.kernels.mla_decode [CTX] [WIDTH]"""
    from ..model import mla
    layer, st, x, pos = _bench_layer("cuda", torch.bfloat16, ctx, width)
    outs = {}
    for name, fused in (("torch", False), ("triton", True)):
        mla.FUSED = fused
        with torch.cuda.stream(torch.cuda.Stream()):  # the eager output, for the difference below
            outs[name] = layer.decode(x, st, pos)
        torch.cuda.synchronize()
        us = graph_us(lambda: layer.decode(x, st, pos), reps)
        print(f"mla decode layer {name:7s} ctx={ctx} table={width}: {us:8.1f} us/call")
    mla.FUSED = None
    a, b = outs["torch"].float(), outs["triton"].float()
    print(f"rel. difference of the outputs (bf16, eager): {float((a - b).abs().max() / a.abs().max()):.2e}")


if __name__ == "__main__":
    import sys
    _bench(*(int(a) for a in sys.argv[1:3]))
