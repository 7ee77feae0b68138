"""Fused MoE routing for small batches: softmax, top-k, optional renormalisation, flat ids.

One program per token; top-k by k rounds of arg-max in registers. Reference: model.moe.MoE.route
(torch.softmax in fp32, torch.topk, renormalise, offset by the layer's first flat id).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tl_dtype


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, E, stride_l, base,
                  K: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    m = e < E
    lg = tl.load(logits_ptr + row * stride_l + e, mask=m, other=float("-inf")).to(tl.float32)
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(m, p, -1.0)
    ks = tl.arange(0, K)
    vals = tl.zeros([K], dtype=tl.float32)
    idxs = tl.zeros([K], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        at = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)  # lowest index among equals
        at = tl.minimum(at, E - 1)  # a row of NaN logits matches nothing: an id in range, not past the layer
        vals = tl.where(ks == j, best, vals)
        idxs = tl.where(ks == j, at.to(tl.int64), idxs)
        p = tl.where(e == at, -1.0, p)
    if NORM:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(ids_ptr + row * K + ks, idxs + base)
    tl.store(w_ptr + row * K + ks, vals.to(DTYPE))


def route_triton(logits: torch.Tensor, k: int, norm: bool, base: int, dtype: torch.dtype):
    """logits: [T, E] -> (flat ids [T, k] int64, weights [T, k] in dtype)."""
    t, e = logits.shape
    assert k & (k - 1) == 0, "top-k must be a power of two for the fused router"
    ids = torch.empty(t, k, dtype=torch.long, device=logits.device)
    w = torch.empty(t, k, dtype=dtype, device=logits.device)
    block = triton.next_power_of_2(e)
    # one warp up to 512 experts: the 2 + 2k reductions over the row then stay in warp shuffles,
    # no shared-memory round trips (the H200 profile had 3.3 us a layer with the default four)
    _route_kernel[(t,)](logits, ids, w, e, logits.stride(0), base, K=k, BLOCK_E=block,
                        NORM=norm, DTYPE=tl_dtype(dtype), num_warps=1 if block <= 512 else 4)
    return ids, w
