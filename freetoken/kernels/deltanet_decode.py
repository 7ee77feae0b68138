"""Fused gated-DeltaNet decode step: two or three kernels per layer instead of ~40 small ops.

  conv_update:   causal conv1d over the stored window plus the new input, SiLU, window shift
  delta_step:    per (token, value head, block of value columns): l2-norm q/k, decay and beta
                 gates, the delta-rule update of the [dk, block] fp32 state slice in place, the
                 readout, and (one block per head: larger batches) the gated RMSNorm; at small
                 batches the columns split over programs and a third kernel does the norm
References: model.deltanet.GatedDeltaNet.decode's torch path (recurrent_gated_delta_step,
_gates_and_heads, _finish), with the same points of rounding to the activation dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tl_dtype


@triton.jit
def _conv_update_kernel(x_ptr, state_ptr, w_ptr, out_ptr, active_ptr, C, stride_xb, stride_ob, stride_sb, stride_sc,
                        K: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < C
    live = tl.load(active_ptr + b).to(tl.int32)  # inactive rows compute but keep their state
    x = tl.load(x_ptr + b * stride_xb + cols, mask=m, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + cols * K + (K - 1), mask=m, other=0.0).to(tl.float32)
    sp = state_ptr + b * stride_sb + cols * stride_sc
    for j in tl.static_range(K - 1):
        s = tl.load(sp + j, mask=m, other=0.0).to(tl.float32)
        acc += s * tl.load(w_ptr + cols * K + j, mask=m, other=0.0).to(tl.float32)
    ms = m & ((cols * 0 + live) != 0)
    for j in tl.static_range(K - 2):  # shift the window left by one
        tl.store(sp + j, tl.load(sp + j + 1, mask=m, other=0.0), mask=ms)
    tl.store(sp + (K - 2), x.to(DTYPE), mask=ms)
    y = acc.to(DTYPE).to(tl.float32)
    tl.store(out_ptr + b * stride_ob + cols, (y / (1.0 + tl.exp(-y))).to(DTYPE), mask=m)


def _active_rows(active, b: int, device) -> torch.Tensor:
    if active is None:
        return torch.ones(b, dtype=torch.int8, device=device)
    return active.to(torch.int8)


def conv_update_triton(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, active=None) -> torch.Tensor:
    """x: [B, C], state: [B, C, K-1] (updated in place where active), weight: [C, K]
    -> silu(conv) [B, C]."""
    b, c = x.shape
    k = weight.shape[1]
    assert state.stride(2) == 1 and k >= 2 and x.stride(1) == 1
    out = torch.empty(b, c, dtype=x.dtype, device=x.device)  # x may be a strided view of a fused GEMM
    block = 256
    _conv_update_kernel[(b, triton.cdiv(c, block))](x, state, weight, out, _active_rows(active, b, x.device), c,
                                                   x.stride(0), out.stride(0), state.stride(0), state.stride(1),
                                                   K=k, BLOCK=block,
                                                   DTYPE=tl_dtype(x.dtype))
    return out


@triton.jit
def _delta_step_kernel(mixed_ptr, z_ptr, b_ptr, a_ptr, neg_a_ptr, dt_bias_ptr, state_ptr, norm_w_ptr, out_ptr,
                       o_ptr, active_ptr, stride_m, stride_z, stride_ba, stride_o, eps,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BV: tl.constexpr, DTYPE: tl.constexpr):
    """Program (token, value head, block of BV value columns): the state's columns are
    independent in the delta rule, so a block updates its [DK, BV] slice alone. BV == DV: the
    gated RMSNorm (over all DV) follows here; else the rounded readout goes to o_ptr [B, HV*DV]
    and _gated_norm_kernel finishes (more programs at small batches: one per head left most
    of the GPU idle, 6.7 us a layer on the H200 for a 2 MB state)."""
    bi = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    row = mixed_ptr + bi * stride_m
    q = tl.load(row + kh * DK + dk).to(tl.float32)
    k = tl.load(row + HK * DK + kh * DK + dk).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + h * DV + dv).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * (DK ** -0.5)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    bb = tl.load(b_ptr + bi * stride_ba + h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-bb))).to(DTYPE).to(tl.float32)  # sigmoid in the activation dtype
    xa = tl.load(a_ptr + bi * stride_ba + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(tl.minimum(xa, 20.0))))
    g = tl.load(neg_a_ptr + h) * softplus
    sp = state_ptr + ((bi * HV + h) * DK + dk[:, None]) * DV + dv[None, :]
    s = tl.load(sp) * tl.exp(g)  # [DK, BV]
    kv_mem = tl.sum(s * k[:, None], axis=0)  # [BV]
    delta = (v - kv_mem) * beta
    s = s + k[:, None] * delta[None, :]
    live = tl.load(active_ptr + bi).to(tl.int32)
    tl.store(sp, s, mask=(dk[:, None] * 0 + dv[None, :] * 0 + live) != 0)
    o = tl.sum(s * q[:, None], axis=0).to(DTYPE).to(tl.float32)  # [BV]
    if BV < DV:
        tl.store(o_ptr + (bi * HV + h) * DV + dv, o.to(DTYPE))
    else:
        _gated_norm(o, z_ptr + bi * stride_z + h * DV, norm_w_ptr, out_ptr + bi * stride_o + h * DV, dv, eps,
                    DV, DTYPE)


@triton.jit
def _gated_norm(o, z_ptr, norm_w_ptr, out_ptr, dv, eps, DV: tl.constexpr, DTYPE: tl.constexpr):
    """One head's gated RMSNorm of its readout o [DV] (fp32 holding DTYPE values): w * norm(o)
    rounded to dtype, times silu(z), stored in DTYPE."""
    normed = (o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)).to(DTYPE).to(tl.float32)
    w = tl.load(norm_w_ptr + dv).to(tl.float32)
    y = (w * normed).to(DTYPE).to(tl.float32)
    z = tl.load(z_ptr + dv).to(tl.float32)
    tl.store(out_ptr + dv, (y * (z / (1.0 + tl.exp(-z)))).to(DTYPE))


@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, norm_w_ptr, out_ptr, stride_z, stride_o, eps,
                       HV: tl.constexpr, DV: tl.constexpr, DTYPE: tl.constexpr):
    """Program (token, value head): the gated RMSNorm of the readout the split step wrote."""
    bi = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.arange(0, DV)
    o = tl.load(o_ptr + (bi * HV + h) * DV + dv).to(tl.float32)
    _gated_norm(o, z_ptr + bi * stride_z + h * DV, norm_w_ptr, out_ptr + bi * stride_o + h * DV, dv, eps, DV, DTYPE)


DELTA_PROGRAMS = 128  # split the value columns until about this many programs run (132 SMs on an H200)


def delta_value_block(bsz: int, hv: int, dv: int, programs: int = DELTA_PROGRAMS) -> int:
    """Value columns per program: all of them (one kernel, the norm fused) once the tokens and
    heads fill the GPU, else a power-of-two share of at least 16 (dv is a power of two)."""
    splits = 1
    while bsz * hv * splits < programs and dv // (splits * 2) >= 16:
        splits *= 2
    return dv // splits


def delta_step_triton(mixed, z, b, a, neg_a, dt_bias, state, norm_w, eps, hk, hv, dk, dv, active=None,
                      bv: int | None = None):
    """mixed: [B, C] conv output; z: [B, Hv*dv]; b, a: [B, Hv]; state: [B, Hv, dk, dv] fp32,
    updated in place where active -> gated-normed readout [B, Hv*dv] in mixed's dtype. bv:
    value columns per program (default delta_value_block)."""
    bsz = mixed.shape[0]
    assert state.is_contiguous() and b.stride(0) == a.stride(0) and b.stride(1) == 1 == a.stride(1)
    bv = delta_value_block(bsz, hv, dv) if bv is None else bv
    assert dv % bv == 0 and bv & (bv - 1) == 0, (dv, bv)
    out = torch.empty(bsz, hv * dv, dtype=mixed.dtype, device=mixed.device)
    o = torch.empty(bsz, hv * dv, dtype=mixed.dtype, device=mixed.device) if bv < dv else out  # unread at bv == dv
    dt = tl_dtype(mixed.dtype)
    _delta_step_kernel[(bsz, hv, dv // bv)](mixed, z, b, a, neg_a, dt_bias, state, norm_w, out, o,
                                            _active_rows(active, bsz, mixed.device), mixed.stride(0), z.stride(0),
                                            b.stride(0), out.stride(0), eps, HK=hk, HV=hv, DK=dk, DV=dv, BV=bv,
                                            DTYPE=dt, num_warps=8 if dk * bv >= 8192 else 4)
    if bv < dv:
        _gated_norm_kernel[(bsz, hv)](o, z, norm_w, out, z.stride(0), out.stride(0), eps, HV=hv, DV=dv, DTYPE=dt,
                                      num_warps=1 if dv <= 256 else 4)
    return out
