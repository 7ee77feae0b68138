"""Manifold-constrained hyper-connections (DeepSeek-V4, transformers DeepseekV4HyperConnection and
DeepseekV4HyperHead): the residual stream is hc_mult parallel streams [N, hc, H]. Before each
sub-layer a small projection of all streams gives, per token, `pre` (how the streams collapse into
the sub-layer's input), `post` (how its output spreads back over them) and `comb` (how the old
streams mix into the new ones, pushed towards a doubly-stochastic matrix by Sinkhorn-Knopp);
after the last layer the head collapses them once more. All the weights are computed in fp32,
as the reference keeps these modules in fp32.

On CUDA (unless FREETOKEN_FUSED_DECODE=0: kernels.fused_decode) each of the three runs as one to three fused
Triton kernels (kernels/hyper.py); the
torch functions here (*_torch) are the references and the CPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import fused_decode


def _flat_norm(h: torch.Tensor, eps: float) -> torch.Tensor:
    """h [N, hc, H] -> [N, hc * H] fp32, RMS-normalised without a weight."""
    flat = h.reshape(h.shape[0], -1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           eps: float, norm_eps: float):
    """See hc_pre_torch; on CUDA the fused kernels."""
    if fused_decode(h):
        from ..kernels.hyper import hc_pre_triton
        return hc_pre_triton(h, fn, base, scale, iters, eps, norm_eps)
    return hc_pre_torch(h, fn, base, scale, iters, eps, norm_eps)


def hc_pre_torch(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                 eps: float, norm_eps: float):
    """h [N, hc, H]; fn [(2 + hc) * hc, hc * H]; base [(2 + hc) * hc]; scale [3] ->
    post [N, hc] fp32, comb [N, hc, hc] fp32 (comb[j, k]: old stream j into new stream k),
    collapsed [N, H] (the sub-layer's input before its norm)."""
    n, hc = h.shape[0], h.shape[1]
    mix = F.linear(_flat_norm(h, norm_eps), fn.float())  # [N, (2 + hc) * hc]
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + eps  # [N, hc]
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)  # [N, hc]
    comb = torch.softmax(comb_w.view(n, hc, hc) * s[2] + comb_b.view(hc, hc), dim=-1) + eps  # [N, hc, hc]
    # Sinkhorn-Knopp: columns first, then (rows, columns) iters - 1 more times, as the reference
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    collapsed = (pre[..., None] * h).sum(1).to(h.dtype)  # [N, H]
    return post, comb, collapsed


def hc_post(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """See hc_post_torch; on CUDA one fused kernel (out in h's dtype, as the model passes it)."""
    if fused_decode(h) and out.dtype == h.dtype:
        from ..kernels.hyper import hc_post_triton
        return hc_post_triton(h, out, post, comb)
    return hc_post_torch(h, out, post, comb)


def hc_post_torch(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [N, hc, H] = post * out (the sub-layer's output [N, H] spread) + comb^T @ h."""
    dt = h.dtype
    return post.to(dt)[..., None] * out[:, None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), h)


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """See hc_head_torch; on CUDA the fused kernels."""
    if fused_decode(h):
        from ..kernels.hyper import hc_head_triton
        return hc_head_triton(h, fn, base, scale, eps, norm_eps)
    return hc_head_torch(h, fn, base, scale, eps, norm_eps)


def hc_head_torch(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                  norm_eps: float) -> torch.Tensor:
    """The final collapse: h [N, hc, H]; fn [hc, hc * H]; base [hc]; scale [1] -> [N, H]."""
    mix = F.linear(_flat_norm(h, norm_eps), fn.float())  # [N, hc]
    pre = torch.sigmoid(mix * scale.float() + base.float()) + eps
    return (pre[..., None] * h).sum(1).to(h.dtype)
