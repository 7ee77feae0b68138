"""Dense GEMMs on FP8 weights as published: y = x W^T with W e4m3 [N, K] and one scale per
128 x 128 block, scale_inv [ceil(N/128), ceil(K/128)] (the Qwen / DeepSeek FP8 layout,
weights/quant.py: W[n, k] = float(W8[n, k]) * scale_inv[n // 128, k // 128]). The bytes are read
in place and dequantized in registers, so the weight takes its published VRAM, not twice it.

Two kernels, chosen by the rows of x (M):
  gemv   M <= GEMV_ROWS (decode): grid (blocks of output rows, blocks of x rows); each step of
         128 columns loads a [BLOCK_N, 128] tile of bytes, one scale per row, and reduces it
         against a few x rows in fp32 (no tensor cores: the step is bound by the weight bytes)
  tiles  prefill chunks and larger batches: [BLOCK_M, BLOCK_N] tiles with tl.dot; each
         [BLOCK_K, BLOCK_N] weight tile is dequantized, then rounded to the activation dtype for
         the tensor cores, as the dequantized-at-load copy is (fp32 activations, and any under
         the CPU interpreter, whose bf16 rounding truncates: an fp32 IEEE dot instead)
Both accumulate in fp32, add the bias in fp32 and round once to x's dtype. The e4m3 bytes are
decoded with integer ops (moe_quant._e4m3, exact, subnormals included), so no FP8 hardware
is needed (Ampere GPUs run it too). A step of BLOCK_K <= 128 columns never
crosses a scale block (k0 is a multiple of BLOCK_K, which divides 128): one scale per row a step.
Static shapes, no host sync: captured in the decode CUDA graph.

Reference (the pure-torch code the kernels are tested against): fp8_linear_reference,
quant.py's dequant_fp8_block then F.linear in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..weights.dense_fp8 import block_scale_f32
from ..weights.quant import FP8_BLOCK, dequant_fp8_block
from . import INTERPRET, tl_dtype
from .moe_quant import _e4m3, _mma

GEMV_ROWS = 4  # x rows up to which the GEMV kernel runs (decode at small batch)


def fp8_linear_reference(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K]; values e4m3 [N, K]; scale [ceil(N/128), ceil(K/128)] (fp32 / bf16 / f16, or
    ue8m0 bytes); bias [N] or None -> [..., N] in x's dtype, computed in fp32."""
    w = dequant_fp8_block(values, block_scale_f32(scale))  # [N, K] fp32
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


def _gemv_configs():
    # many programs in flight saturate HBM at batch 1: few rows each; under the interpreter (cost
    # per program) one wide block
    shapes = [(32, 4)] if INTERPRET else [(4, 4), (8, 4), (16, 4), (32, 8)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": FP8_BLOCK}, num_warps=w) for n, w in shapes]


@triton.autotune(configs=_gemv_configs(), key=["N", "K", "BLOCK_M"])
@triton.jit
def _fp8_gemv_kernel(x_ptr, v_ptr, s_ptr, b_ptr, y_ptr, M, N, K, sxm, svn, ssn, ssk, sym,
                     QB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr):
    tl.static_assert(QB % BLOCK_K == 0)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows (weight rows)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # x rows
    nm = rn < N
    mm = rm < M
    v_row = v_ptr + rn.to(tl.int64) * svn  # [BLOCK_N] each weight row's first byte
    s_row = s_ptr + (rn // QB) * ssn  # [BLOCK_N] its block row of scales
    x_row = x_ptr + rm.to(tl.int64) * sxm  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < K
        q = tl.load(v_row[:, None] + ks[None, :], mask=nm[:, None] & km[None, :], other=0).to(tl.int32)
        s = tl.load(s_row + (k0 // QB) * ssk, mask=nm, other=0).to(tl.float32)  # [BLOCK_N]
        w = _e4m3(q) * s[:, None]  # [BLOCK_N, BLOCK_K]: quant.py's fp32 weights, bit for bit
        xv = tl.load(x_row[:, None] + ks[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * sym + rn[None, :], acc.to(DTYPE), mask=mm[:, None] & nm[None, :])


def _tile_configs():
    shapes = [(64, 128, 4, 1)] if INTERPRET else [(64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4),
                                                 (128, 64, 4, 3), (32, 128, 4, 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st) for n, k, w, st in shapes]


@triton.autotune(configs=_tile_configs(), key=["N", "K", "BLOCK_M"])
@triton.jit
def _fp8_gemm_kernel(x_ptr, v_ptr, s_ptr, b_ptr, y_ptr, M, N, K, sxm, svn, ssn, ssk, sym,
                     QB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr, IEEE: tl.constexpr):
    tl.static_assert(QB % BLOCK_K == 0)
    # x-row blocks vary fastest: programs running together share one weight column block (L2)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = rn < N
    mm = rm < M
    v_col = v_ptr + rn.to(tl.int64) * svn  # [BLOCK_N]
    s_col = s_ptr + (rn // QB) * ssn  # [BLOCK_N]
    x_row = x_ptr + rm.to(tl.int64) * sxm  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < K
        a = tl.load(x_row[:, None] + ks[None, :], mask=mm[:, None] & km[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        q = tl.load(v_col[None, :] + ks[:, None], mask=km[:, None] & nm[None, :], other=0).to(tl.int32)
        s = tl.load(s_col + (k0 // QB) * ssk, mask=nm, other=0).to(tl.float32)  # [BLOCK_N]
        acc = _mma(acc, a, _e4m3(q) * s[None, :], DTYPE, IEEE)  # w tile [BLOCK_K, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * sym + rn[None, :], acc.to(DTYPE), mask=mm[:, None] & nm[None, :])


def _block_m(m: int) -> int:
    """x rows a tile holds: the power of two >= m, 16 (tl.dot's least) to 128."""
    return min(128, max(16, triton.next_power_of_2(m)))


def fp8_linear_triton(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / f16 / fp32); values e4m3 [N, K] (rows contiguous); scale float
    [ceil(N/128), ceil(K/128)] (ue8m0 bytes converted first: block_scale_f32); bias [N] or None
    -> [..., N] in x's dtype."""
    n, k = values.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8 linear: x has {x.shape[-1]} features, the weight [{n}, {k}] takes {k}")
    want = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if tuple(scale.shape) != want or not scale.is_floating_point():
        raise ValueError(f"fp8 linear: scale_inv {tuple(scale.shape)} {scale.dtype} does not fit the weight "
                         f"[{n}, {k}]: expected float {want}")
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    v = values.view(torch.uint8)  # the kernels decode the e4m3 bytes themselves
    if v.stride(1) != 1:
        v = v.contiguous()
    b = bias.contiguous() if bias is not None else y  # unread without HAS_BIAS
    args = (x2, v, scale, b, y, m, n, k, x2.stride(0), v.stride(0), scale.stride(0), scale.stride(1), y.stride(0))
    dt = tl_dtype(x.dtype)
    if m <= GEMV_ROWS:
        bm = triton.next_power_of_2(m)
        _fp8_gemv_kernel[lambda c: (triton.cdiv(n, c["BLOCK_N"]), triton.cdiv(m, bm))](
            *args, QB=FP8_BLOCK, BLOCK_M=bm, HAS_BIAS=bias is not None, DTYPE=dt)
    else:
        bm = _block_m(m)
        ieee = x.dtype == torch.float32 or INTERPRET
        _fp8_gemm_kernel[lambda c: (triton.cdiv(m, bm), triton.cdiv(n, c["BLOCK_N"]))](
            *args, QB=FP8_BLOCK, BLOCK_M=bm, HAS_BIAS=bias is not None, DTYPE=dt, IEEE=ieee)
    return y.view(*x.shape[:-1], n)
