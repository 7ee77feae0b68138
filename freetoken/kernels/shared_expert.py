"""The shared expert's two elementwise steps at decode, one kernel each (on CUDA):

  silu_mul:    act = silu(g) * u                     (torch: two kernels)
  gated_add:   out = routed + sigmoid(sg) * y        (torch: three kernels)

with g, u, sg column slices of the MoE layer's joined input projection (model/moe.py) and y
the shared expert's down projection. A decode step of the full-size Qwen3.6 shape spends about
2 us of GPU time on each of these tiny launches, 40 layers over: the two kernels take three
launches a layer out. Each rounds where the torch ops round (to the activation dtype after
every op; no FMA contraction, exact divides), so the results are the torch path's within an
ulp (exp may differ in its last bit).
References: silu_mul_torch, gated_add_torch (the CPU path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import tl_dtype
from .rounding import NO_FMA, emu, round_to


def silu_mul_torch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def gated_add_torch(routed: torch.Tensor, sg: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return routed + torch.sigmoid(sg) * y


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
                     EMU: tl.constexpr):
    """Program (row, block of columns): out = round(round(silu(g)) * u)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(g_ptr + r * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + c, mask=m, other=0.0).to(tl.float32)
    s = round_to(tl.div_rn(g, 1.0 + tl.exp(-g)), DTYPE, EMU)  # an exact divide, as torch's silu
    tl.store(out_ptr + r * N + c, round_to(s * u, DTYPE, EMU).to(DTYPE), mask=m)


@triton.jit
def _gated_add_kernel(routed_ptr, sg_ptr, y_ptr, out_ptr, N, stride_r, stride_sg, stride_y,
                      BLOCK: tl.constexpr, DTYPE: tl.constexpr, EMU: tl.constexpr):
    """Program (row, block of columns): out = round(routed + round(round(sigmoid(sg)) * y))."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    sg = tl.load(sg_ptr + r * stride_sg).to(tl.float32)
    gate = round_to(tl.div_rn(1.0, 1.0 + tl.exp(-sg)), DTYPE, EMU)
    y = tl.load(y_ptr + r * stride_y + c, mask=m, other=0.0).to(tl.float32)
    o = tl.load(routed_ptr + r * stride_r + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * N + c, round_to(o + round_to(gate * y, DTYPE, EMU), DTYPE, EMU).to(DTYPE), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[T, N] with unit column stride (a column slice of a wider tensor is fine)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def silu_mul_triton(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g, u [T, N] (column slices allowed) -> [T, N] contiguous, g's dtype."""
    g, u = _rows(g), _rows(u)
    t, n = g.shape
    out = torch.empty(t, n, dtype=g.dtype, device=g.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](g, u, out, n, g.stride(0), u.stride(0), BLOCK=block,
                                                  DTYPE=tl_dtype(g.dtype), EMU=emu(g.dtype), num_warps=4, **NO_FMA)
    return out


def gated_add_triton(routed: torch.Tensor, sg: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """routed, y [T, H]; sg [T, 1] (a column slice allowed) -> [T, H] contiguous, routed's dtype."""
    routed, y = _rows(routed), _rows(y)
    t, n = routed.shape
    out = torch.empty(t, n, dtype=routed.dtype, device=routed.device)
    block = min(1024, triton.next_power_of_2(n))
    _gated_add_kernel[(t, triton.cdiv(n, block))](routed, sg, y, out, n, routed.stride(0), sg.stride(0),
                                                   y.stride(0), BLOCK=block, DTYPE=tl_dtype(routed.dtype),
                                                   EMU=emu(routed.dtype), num_warps=4, **NO_FMA)
    return out
