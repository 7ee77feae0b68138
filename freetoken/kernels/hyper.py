"""Fused manifold-constrained hyper-connections (DeepSeek-V4): hc_pre, hc_post and hc_head in
one to three kernels each instead of the reference's chain of tiny ops (Sinkhorn-Knopp alone is
~4 kernels per iteration, 20 iterations, twice per layer).

Reference: model.hyper (hc_pre, hc_post, hc_head), which follows transformers'
DeepseekV4HyperConnection / DeepseekV4HyperHead.

hc_pre / hc_head: the projection `mix = F.linear(flat * r, fn)` with r the per-row rsqrt of the
mean square is computed as `r * F.linear(flat, fn)` (r is one scalar per row), so the norm and
the projection need only one pass over h. For small N (decode) a split-K kernel computes the
partial projections and partial sums of squares of each token together, and the per-token
kernel adds them up; for large N (prefill) cuBLAS does the projection, as a per-token kernel
would re-read fn once per token, and the per-token kernel computes the sum of squares itself.
Either way one per-token kernel then does the sigmoids, the softmax, Sinkhorn-Knopp (same order
as the reference: columns, then iters - 1 times rows then columns) and the collapse.

Rounding: everything but the collapsed output is fp32, as in the reference. Differences are
fp32 summation order (the projection's dot products, r applied after instead of before the
projection, the 2..4-term sums over streams), FMA contraction and Triton's exp / sigmoid being
the fast PTX approximations (a couple of ulp): ~1e-7 relative, amplified little by the softmax
and Sinkhorn steps (whose divisions are rounded to nearest, as torch's). hc_post rounds at the
reference's points; only the order of its <= hc-term fp32 sums may differ (bf16: an ulp, rarely).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import graph_us, tl_dtype

# hc_pre/hc_head fuse the projection into a split-K kernel up to this many tokens (each token
# re-reads fn, [(2 + hc) * hc, hc * H] fp32, 1.5 MB for V4-Flash, from L2); cuBLAS beyond
FUSED_MIX_MAX_N = 16
_MIX_BLOCK_K = 128
_MAX_SPLIT = 64


@triton.jit
def _hc_mix_kernel(h_ptr, fn_ptr, part_ptr, sq_ptr, K, CHUNK, SPLIT,
                   MIX: tl.constexpr, MIXP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (token n, split s): partial fn @ h[n] and partial sum of h[n]^2 over one CHUNK
    of the K = hc * H columns -> part [N, SPLIT, MIXP], sq [N, SPLIT] (fp32)."""
    n = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    rows = tl.arange(0, MIXP)
    rm = rows < MIX
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([MIXP, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    start = s * CHUNK
    for k0 in range(start, start + CHUNK, BLOCK_K):
        kk = k0 + ks
        km = kk < K
        x = tl.load(h_ptr + n * K + kk, mask=km, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = tl.load(fn_ptr + rows[:, None] * K + kk[None, :], mask=rm[:, None] & km[None, :],
                    other=0.0)  # [MIXP, BLOCK_K]
        acc += w * x[None, :]
        sq += x * x
    tl.store(part_ptr + (n * SPLIT + s) * MIXP + rows, tl.sum(acc, axis=1))  # padded rows: 0
    tl.store(sq_ptr + n * SPLIT + s, tl.sum(sq, axis=0))


@triton.jit
def _hc_pre_kernel(h_ptr, mix_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
                   H, SPLIT, stride_mn, stride_ms, iters, eps, norm_eps,
                   HC: tl.constexpr, HCP: tl.constexpr, SPLITP: tl.constexpr, BLOCK_H: tl.constexpr,
                   HAS_SQ: tl.constexpr, HEAD: tl.constexpr, DTYPE: tl.constexpr):
    """One program per token n. mix: the un-normalised projection, summed here over SPLIT
    partials (SPLIT = 1: a plain [N, MIX] GEMM output); sq: the partial sums of squares, or
    computed here from h when not HAS_SQ. HEAD: only `pre` and the collapse (hc_head)."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HCP)
    jm = j < HC
    hs = tl.arange(0, BLOCK_H)
    sp = tl.arange(0, SPLITP)
    spm = sp < SPLIT
    row = h_ptr + n * HC * H  # h [N, HC, H] contiguous
    mrow = mix_ptr + n * stride_mn + sp * stride_ms  # [SPLITP] pointers to each partial
    if HAS_SQ:
        sq = tl.sum(tl.load(sq_ptr + n * SPLIT + sp, mask=spm, other=0.0), axis=0)
    else:
        acc = tl.zeros([HCP, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + hs
            x = tl.load(row + j[:, None] * H + cols[None, :], mask=jm[:, None] & (cols < H)[None, :],
                        other=0.0).to(tl.float32)  # [HCP, BLOCK_H]
            acc += x * x
        sq = tl.sum(tl.sum(acc, axis=1), axis=0)
    # the reference's unweighted RMSNorm of the row; the *_rn forms round like torch (Triton's
    # `/` and rsqrt are the approximate PTX instructions, ~2 ulp)
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sq, (HC * H).to(tl.float32)) + norm_eps))

    pre_w = tl.sum(tl.load(mrow[:, None] + j[None, :], mask=spm[:, None] & jm[None, :], other=0.0),
                   axis=0) * r  # [HCP]
    pre = tl.sigmoid(pre_w * tl.load(scale_ptr) + tl.load(base_ptr + j, mask=jm, other=0.0)) + eps
    pre = tl.where(jm, pre, 0.0)

    if not HEAD:
        post_w = tl.sum(tl.load(mrow[:, None] + HC + j[None, :], mask=spm[:, None] & jm[None, :],
                                other=0.0), axis=0) * r  # [HCP]
        post = 2 * tl.sigmoid(post_w * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + j, mask=jm, other=0.0))
        tl.store(post_ptr + n * HC + j, post, mask=jm)

        ci = j[:, None]  # comb[j, k]: old stream j into new stream k
        ck = j[None, :]
        cm = jm[:, None] & jm[None, :]
        cidx = 2 * HC + ci * HC + ck  # [HCP, HCP]
        comb_w = tl.sum(tl.load(mrow[:, None, None] + cidx[None, :, :],
                                mask=spm[:, None, None] & cm[None, :, :], other=0.0), axis=0) * r
        # padded rows stay finite (0 logits), padded columns drop out of the softmax
        lg = comb_w * tl.load(scale_ptr + 2) + tl.load(base_ptr + cidx, mask=cm, other=0.0)
        lg = tl.where(ck < HC, lg, float("-inf"))
        e = tl.exp(lg - tl.max(lg, axis=1)[:, None])
        comb = tl.where(cm, tl.div_rn(e, tl.sum(e, axis=1)[:, None]) + eps, 0.0)
        # Sinkhorn-Knopp: columns first, then (rows, columns) iters - 1 more times; padded
        # entries stay 0 (0 / (0 + eps)); divisions rounded to nearest as they compound
        comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + eps)
        for _ in range(iters - 1):
            comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None] + eps)
            comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + eps)
        tl.store(comb_ptr + n * HC * HC + ci * HC + ck, comb, mask=cm)

    # collapse: sum_j pre[j] * h[n, j, :] in fp32, rounded once to h's dtype
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + hs
        cmask = cols < H
        x = tl.load(row + j[:, None] * H + cols[None, :], mask=jm[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)  # [HCP, BLOCK_H]
        tl.store(out_ptr + n * H + cols, tl.sum(pre[:, None] * x, axis=0).to(DTYPE), mask=cmask)


@triton.jit
def _hc_post_kernel(h_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, H, stride_o,
                    HC: tl.constexpr, HCP: tl.constexpr, BLOCK_H: tl.constexpr, DTYPE: tl.constexpr):
    """Program (token n, H-block): new[n, k] = post[n, k] * out[n] + sum_j comb[n, j, k] * h[n, j],
    rounded where the reference rounds (post and comb cast to DTYPE first; the spread term, the
    stream mix and their sum each rounded to DTYPE)."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    j = tl.arange(0, HCP)
    jm = j < HC
    tile = jm[:, None] & m[None, :]
    hidx = n * HC * H + j[:, None] * H + cols[None, :]  # [HCP, BLOCK_H]
    post = tl.load(post_ptr + n * HC + j, mask=jm, other=0.0).to(DTYPE).to(tl.float32)  # [HCP]
    o = tl.load(out_ptr + n * stride_o + cols, mask=m, other=0.0).to(tl.float32)  # [BLOCK_H]
    spread = (post[:, None] * o[None, :]).to(DTYPE).to(tl.float32)  # [HCP, BLOCK_H]
    comb = tl.load(comb_ptr + n * HC * HC + j[:, None] * HC + j[None, :], mask=jm[:, None] & jm[None, :],
                   other=0.0).to(DTYPE).to(tl.float32)  # [HCP (j), HCP (k)]
    x = tl.load(h_ptr + hidx, mask=tile, other=0.0).to(tl.float32)  # [HCP (j), BLOCK_H]
    # the reference's matmul accumulates in fp32 and rounds once; only the order of the <= HC
    # terms may differ
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [HCP (k), BLOCK_H]
    new = spread + mixed.to(DTYPE).to(tl.float32)
    tl.store(new_ptr + hidx, new.to(DTYPE), mask=tile)


def _block_h(h: int) -> int:
    return min(1024 if h >= 1024 else 256, triton.next_power_of_2(h))


def _mix_and_sq(h: torch.Tensor, fn: torch.Tensor, fuse: bool | None):
    """h [N, hc, H] contiguous; fn [MIX, hc * H] fp32 contiguous -> (mix, sq or None, split,
    stride_mn, stride_ms): the un-normalised projection, either split-K partials with the sums
    of squares (small N) or one cuBLAS GEMM (large N)."""
    n, k = h.shape[0], h.shape[1] * h.shape[2]
    mixn = fn.shape[0]
    if fuse is None:
        fuse = n <= FUSED_MIX_MAX_N
    if not fuse:
        mix = F.linear(h.reshape(n, k).float(), fn)  # [N, MIX]
        return mix, None, 1, mix.stride(0), 0
    nblk = triton.cdiv(k, _MIX_BLOCK_K)
    split = min(_MAX_SPLIT, triton.cdiv(nblk, 2))  # >= 2 K-blocks per program
    per = triton.cdiv(nblk, split)
    split = triton.cdiv(nblk, per)
    mixp = triton.next_power_of_2(mixn)
    part = torch.empty(n, split, mixp, dtype=torch.float32, device=h.device)  # [N, SPLIT, MIXP]
    sq = torch.empty(n, split, dtype=torch.float32, device=h.device)  # [N, SPLIT]
    _hc_mix_kernel[(n, split)](h, fn, part, sq, k, per * _MIX_BLOCK_K, split,
                               MIX=mixn, MIXP=mixp, BLOCK_K=_MIX_BLOCK_K, num_warps=4)
    return part, sq, split, split * mixp, mixp


def hc_pre_triton(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                  eps: float, norm_eps: float, fuse_mix: bool | None = None):
    """As model.hyper.hc_pre: h [N, hc, H] -> post [N, hc] fp32, comb [N, hc, hc] fp32,
    collapsed [N, H] in h's dtype. fuse_mix: split-K projection (default: N small) or cuBLAS."""
    h = h.contiguous()
    n, hc, hd = h.shape
    fn = fn.float().contiguous()
    mix, sq, split, smn, sms = _mix_and_sq(h, fn, fuse_mix)
    post = torch.empty(n, hc, dtype=torch.float32, device=h.device)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=h.device)
    out = torch.empty(n, hd, dtype=h.dtype, device=h.device)
    _hc_pre_kernel[(n,)](h, mix, sq if sq is not None else mix, base.float().contiguous(), scale.float(),
                         post, comb, out, hd, split, smn, sms, iters, eps, norm_eps,
                         HC=hc, HCP=triton.next_power_of_2(hc), SPLITP=triton.next_power_of_2(split),
                         BLOCK_H=_block_h(hd), HAS_SQ=sq is not None, HEAD=False, DTYPE=tl_dtype(h.dtype),
                         num_warps=4)
    return post, comb, out


def hc_head_triton(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                   norm_eps: float, fuse_mix: bool | None = None) -> torch.Tensor:
    """As model.hyper.hc_head: h [N, hc, H]; fn [hc, hc * H] -> [N, H] in h's dtype."""
    h = h.contiguous()
    n, hc, hd = h.shape
    fn = fn.float().contiguous()
    mix, sq, split, smn, sms = _mix_and_sq(h, fn, fuse_mix)
    out = torch.empty(n, hd, dtype=h.dtype, device=h.device)
    _hc_pre_kernel[(n,)](h, mix, sq if sq is not None else mix, base.float().contiguous(), scale.float(),
                         out, out, out, hd, split, smn, sms, 0, eps, norm_eps,
                         HC=hc, HCP=triton.next_power_of_2(hc), SPLITP=triton.next_power_of_2(split),
                         BLOCK_H=_block_h(hd), HAS_SQ=sq is not None, HEAD=True, DTYPE=tl_dtype(h.dtype),
                         num_warps=4)
    return out


def hc_post_triton(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """As model.hyper.hc_post: h [N, hc, H], out [N, H] (h's dtype), post [N, hc], comb [N, hc, hc]
    -> new streams [N, hc, H] in h's dtype."""
    h = h.contiguous()
    n, hc, hd = h.shape
    if out.stride(-1) != 1:
        out = out.contiguous()
    new = torch.empty_like(h)
    block = min(256, triton.next_power_of_2(hd))
    _hc_post_kernel[(n, triton.cdiv(hd, block))](h, out, post.float().contiguous(), comb.float().contiguous(), new,
                                                 hd, out.stride(0), HC=hc, HCP=triton.next_power_of_2(hc),
                                                 BLOCK_H=block, DTYPE=tl_dtype(h.dtype), num_warps=4)
    return new


def _bench(n: int = 1, hd: int = 4096, hc: int = 4, iters: int = 20, reps: int = 200):
    """Old (torch) vs new (Triton) per call on CUDA, each timed from a CUDA graph:
    python -m freetoken.kernels.hyper [N] [H]"""
    from ..model import hyper
    dev, dt = "cuda", torch.bfloat16
    mixn = (2 + hc) * hc
    h = torch.randn(n, hc, hd, device=dev).to(dt)
    out = torch.randn(n, hd, device=dev).to(dt)
    fn = torch.randn(mixn, hc * hd, device=dev) * 1e-2
    base, scale = torch.randn(mixn, device=dev) * 0.1, torch.rand(3, device=dev) + 0.5
    post, comb, _ = hyper.hc_pre_torch(h, fn, base, scale, iters, 1e-6, 1e-6)
    cases = {
        "hc_pre torch": lambda: hyper.hc_pre_torch(h, fn, base, scale, iters, 1e-6, 1e-6),
        "hc_pre triton": lambda: hc_pre_triton(h, fn, base, scale, iters, 1e-6, 1e-6),
        "hc_post torch": lambda: hyper.hc_post_torch(h, out, post, comb),
        "hc_post triton": lambda: hc_post_triton(h, out, post, comb),
    }
    for name, f in cases.items():
        print(f"{name:16s} N={n} H={hd}: {graph_us(f, reps):8.1f} us/call")


if __name__ == "__main__":
    import sys
    _bench(*(int(a) for a in sys.argv[1:3]))
