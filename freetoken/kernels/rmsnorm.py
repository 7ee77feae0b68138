"""Fused RMSNorm: one kernel per call instead of the reference's chain of small ops.

Reference: model.layers.rms_norm (both the one-centered Qwen3.5 form and the Qwen3 form,
including where each rounds to the activation dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tl_dtype
from .rounding import NO_FMA, emu, round_to


@triton.jit
def _normalize(x, w_ptr, cols, m, D, eps, ONE_CENTERED: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 row x -> normed and scaled, rounded where the reference rounds."""
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    if ONE_CENTERED:
        y = normed * (1.0 + w)  # fp32 scale, then round once
    else:
        y = w * normed.to(DTYPE).to(tl.float32)  # round, then scale in the activation dtype
    return y.to(DTYPE)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, stride_x, stride_o,
                     BLOCK: tl.constexpr, ONE_CENTERED: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _normalize(x, w_ptr, cols, m, D, eps, ONE_CENTERED, DTYPE), mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, one_centered: bool) -> torch.Tensor:
    """x: [..., D] -> same shape and dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    d = shape[-1]
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, d, eps, x2.stride(0), out.stride(0),
                                     BLOCK=block, ONE_CENTERED=one_centered, DTYPE=tl_dtype(x.dtype),
                                     num_warps=min(8, max(1, block // 256)))
    return out.view(shape)


@triton.jit
def _add_rms_norm_kernel(res_ptr, h_ptr, w_ptr, sum_ptr, out_ptr, D, eps,
                         BLOCK: tl.constexpr, ONE_CENTERED: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    r = tl.load(res_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    s = (r + h).to(DTYPE)  # the residual stream is kept in the activation dtype
    tl.store(sum_ptr + row * D + cols, s, mask=m)
    y = _normalize(s.to(tl.float32), w_ptr, cols, m, D, eps, ONE_CENTERED, DTYPE)
    tl.store(out_ptr + row * D + cols, y, mask=m)


def add_rms_norm_triton(res: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                        one_centered: bool):
    """(res + h, rms_norm(res + h)) in one pass. res, h: [N, D] contiguous."""
    res, h = res.contiguous(), h.contiguous()
    n, d = res.shape
    s = torch.empty_like(res)
    out = torch.empty_like(res)
    block = triton.next_power_of_2(d)
    _add_rms_norm_kernel[(n,)](res, h, weight, s, out, d, eps, BLOCK=block, ONE_CENTERED=one_centered,
                               DTYPE=tl_dtype(res.dtype), num_warps=min(8, max(1, block // 256)))
    return s, out


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, R, NH, D, eps, sx_t, sx_h, sg_t, sg_h,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr, EMU: tl.constexpr):
    """Program: ROWS rows of D; row r is head r % NH of token r // NH (each input's own token and
    head strides: the gate is a column slice of the fused in-projection, read in place).
    out = round(round(w * round(norm(x))) * silu(g)), silu in fp32."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    tok, head = rows // NH, rows % NH
    cols = tl.arange(0, BLOCK)
    cm = cols < D
    m = (rows < R)[:, None] & cm[None, :]
    x = tl.load(x_ptr + (tok * sx_t + head * sx_h)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    o = round_to(w[None, :] * round_to(normed, DTYPE, EMU), DTYPE, EMU)
    g = tl.load(g_ptr + (tok * sg_t + head * sg_h)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.div_rn(g, 1.0 + tl.exp(-g))  # silu(gate.float()): fp32, an exact divide as torch's
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], round_to(o * s, DTYPE, EMU).to(DTYPE), mask=m)


def _token_head(t: torch.Tensor):
    """t [N, NH, D] or [N, D] with unit stride along D -> (t, token stride, head stride), copied
    only where D is not contiguous."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return (t, t.stride(0), t.stride(1)) if t.dim() == 3 else (t, t.stride(0), 0)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model.layers.gated_rms_norm_torch (DeltaNet's output norm) in one pass: the torch form is about ten
    launches over fp32 copies of a [T, Hv, dv] tensor (plan 120's 32k-token profile: the largest
    share of its elementwise kernels). x, gate: [N, NH, D] or [N, D] of one dtype (any token and
    head strides, D contiguous), weight [D] of it too -> x's shape, contiguous."""
    assert x.shape == gate.shape and x.dim() in (2, 3), (tuple(x.shape), tuple(gate.shape))
    d = x.shape[-1]
    nh = x.shape[1] if x.dim() == 3 else 1
    (x3, sx_t, sx_h), (g3, sg_t, sg_h) = _token_head(x), _token_head(gate)
    r = x.shape[0] * nh
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    rows = max(1, min(16, 4096 // block))  # about 4k elements a program: whole rows, a full block
    _gated_rms_norm_kernel[(triton.cdiv(r, rows),)](
        x3, g3, weight, out, r, nh, d, eps, sx_t, sx_h, sg_t, sg_h, ROWS=rows, BLOCK=block,
        DTYPE=tl_dtype(x.dtype), EMU=emu(x.dtype), num_warps=4, **NO_FMA)
    return out
