"""Routed experts on quantized banks (fp8_block, mxfp4, nvfp4): the published bytes read in place
and dequantized in registers, never a dequantized copy of an expert in memory.

Two kernel pairs with the structure of the bf16 ones:
  decode   (moe_decode.py's GEMV, grid (pair, block of output rows)): few tokens x top-k pairs
  grouped  (moe_grouped.py's tiles of pairs sharing one expert, tl.dot): prefill chunks
each a gate_up + activation kernel, then a down kernel, with the same activation constexpr,
optional biases and NO_EXPERT (-1) skip. Bank layouts as experts/banks.py documents them; the
kernels read values, scales (and NVFP4's scale_2) by flat expert id and decode them with integer
ops, so nothing is built per call (no lookup table, no host copy, no host sync in decode: it is
captured in the decode CUDA graph):
  e4m3  (fp8 values, nvfp4 scales)  its 7 low bits put in an fp16's exponent and mantissa give
        the value times 2^-8 (exponent biases 15 and 7), subnormals included
  e2m1  (fp4 values)                 likewise in an fp16, times 2^-14 (biases 15 and 1)
  e8m0  (mxfp4 scales)               the byte as an fp32 exponent; 0 -> 2^-127, 255 -> NaN
all exact: a weight here is bit for bit quant.py's fp32 dequantization.

The decode GEMV applies each scale once per block of its partial row dot (tiles [rows, blocks,
block]); the grouped kernel dequantizes each weight tile before the dot (and rounds it to the
activation dtype, as the reference's dequantized copy is). fp4 bytes hold columns 2j (low nibble)
and 2j+1 (high): the kernels multiply the two nibble planes by the even and odd activations.

References (the pure-torch code each kernel is tested against, reusing the engine's torch paths
on QuantBank.dequant): moe_quant_decode_torch (TorchExpertExecutor._static), moe_quant_grouped_torch
(reference_experts).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..weights.quant import FP8_BLOCK, MX_BLOCK, NV_BLOCK
from . import INTERPRET, tl_dtype
from .moe_decode import _activate, _round, act_args, sum_pairs_triton
from .moe_grouped import tile_pairs

FMT = {"fp8_block": 0, "mxfp4": 1, "nvfp4": 2}  # the kernels' FMT constexpr
# storage columns (bytes) of one scale along a row: fp8 one byte a value, fp4 two values a byte
SCALE_COLS = {0: FP8_BLOCK, 1: MX_BLOCK // 2, 2: NV_BLOCK // 2}


@triton.jit
def _e4m3(b):
    """e4m3 bytes (int32 0..255) -> fp32, exactly (the NaN codes are not decoded: none published)."""
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _e2m1(c):
    """e2m1 codes (int32 0..15) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    bits = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _scale(s, FMT: tl.constexpr):
    """A scale as loaded -> fp32: fp8_block's in its published float dtype, mxfp4's e8m0 byte
    (as quant.e8m0_to_float: 0 is 2^-127, an fp32 subnormal; 255 NaN), nvfp4's e4m3 byte."""
    if FMT == 0:
        out = s.to(tl.float32)
    elif FMT == 1:
        b = s.to(tl.int32)
        bits = tl.where(b == 0, 0x400000, b << 23)
        out = tl.where(b == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)
    else:
        out = _e4m3(s.to(tl.int32))
    return out


@triton.jit
def _qdot_rows(v_row, s_row, x_ptr, CS, NSC, live, rm, FMT: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr, SB: tl.constexpr):
    """sum_c W[r, c] * x[c] (fp32) for a block of rows of one expert's matrix. v_row [BLOCK_R]:
    each row's first value byte; s_row [BLOCK_R]: its first scale; CS value bytes a row, NSC
    scales a row (SB bytes each); BLOCK_C bytes a step. A dead pair (NO_EXPERT) reads nothing."""
    NB: tl.constexpr = BLOCK_C // SB
    nb = tl.arange(0, NB)
    cols = nb[:, None] * SB + tl.arange(0, SB)[None, :]  # [NB, SB] byte offsets of a step
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, tl.where(live, CS, 0), BLOCK_C):
        c = c0 + cols
        cm = c < CS
        q = tl.load(v_row[:, None, None] + c[None, :, :], mask=rm[:, None, None] & cm[None, :, :],
                    other=0).to(tl.int32)  # [BLOCK_R, NB, SB]
        if FMT == 0:
            xv = tl.load(x_ptr + c, mask=cm, other=0.0).to(tl.float32)  # [NB, SB]
            part = tl.sum(_e4m3(q) * xv[None, :, :], axis=2)  # [BLOCK_R, NB]
        else:  # byte j: column 2j in the low nibble, 2j+1 in the high one
            xe = tl.load(x_ptr + 2 * c, mask=cm, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + 2 * c + 1, mask=cm, other=0.0).to(tl.float32)
            part = tl.sum(_e2m1(q & 0xF) * xe[None, :, :] + _e2m1(q >> 4) * xo[None, :, :], axis=2)
        blk = c0 // SB + nb  # [NB] scale column of each block
        s = tl.load(s_row[:, None] + blk[None, :], mask=rm[:, None] & (blk < NSC)[None, :], other=0)
        acc += tl.sum(part * _scale(s, FMT), axis=1)
    return acc


def _configs(rows: str, cols: str, shapes, interpreted):
    """A few tile shapes to autotune over on the GPU; under the CPU interpreter one with many rows
    (its cost is per program) and two scale blocks of fp8 a step."""
    shapes = [interpreted] if INTERPRET else shapes
    return [triton.Config({rows: r, cols: c}, num_warps=w) for r, c, w in shapes]


# GEMV at batch 1 needs many programs in flight to saturate HBM: few rows per program; steps of
# 256+ bytes a row keep loads wide (a 4-bit row of 2048 weights is only 1 KiB)
@triton.autotune(configs=_configs("BLOCK_I", "BLOCK_C", [(4, 256, 4), (8, 256, 4), (4, 512, 4), (8, 512, 4),
                                                         (16, 256, 4), (16, 512, 8)], (32, 256, 4)),
                 key=["H", "I", "FMT"])
@triton.jit
def _q_gate_up_act_kernel(x_ptr, ids_ptr, v_ptr, s_ptr, s2_ptr, h_ptr, b_ptr, H, I, K, CS, NSC,
                          v_se, v_sr, s_se, s_sr, s2_se, RPS, SU, alpha, limit,
                          FMT: tl.constexpr, SB: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_C: tl.constexpr,
                          DTYPE: tl.constexpr, ACT: tl.constexpr, BIAS: tl.constexpr):
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    rm = rows < I
    e = tl.load(ids_ptr + p).to(tl.int64)
    live = e >= 0  # NO_EXPERT (-1): a batch row that is not running reads no weights
    e0 = tl.maximum(e, 0)
    vb = v_ptr + e0 * v_se
    sb = s_ptr + e0 * s_se
    x_row = x_ptr + (p // K) * H
    # gate rows [0, I), up rows [I, 2I); each half has its own scale rows (fp8: its own block grid)
    g = _qdot_rows(vb + rows * v_sr, sb + (rows // RPS) * s_sr, x_row, CS, NSC, live, rm,
                   FMT, BLOCK_I, BLOCK_C, SB)
    u = _qdot_rows(vb + (rows + I) * v_sr, sb + (rows // RPS + SU) * s_sr, x_row, CS, NSC, live, rm,
                   FMT, BLOCK_I, BLOCK_C, SB)
    if FMT == 2:  # nvfp4: the gate's and the up's per-tensor scale
        g = g * tl.load(s2_ptr + e0 * s2_se)
        u = u * tl.load(s2_ptr + e0 * s2_se + 1)
    g = _round(g, DTYPE)
    u = _round(u, DTYPE)
    if BIAS:  # a NO_EXPERT pair reads expert 0's bias: finite, and its down row is zeroed
        bias = b_ptr + e0 * (2 * I)
        g = _round(g + tl.load(bias + rows, mask=rm, other=0.0).to(tl.float32), DTYPE)
        u = _round(u + tl.load(bias + I + rows, mask=rm, other=0.0).to(tl.float32), DTYPE)
    tl.store(h_ptr + p * I + rows, _activate(g, u, alpha, limit, ACT, DTYPE).to(DTYPE), mask=rm)


@triton.autotune(configs=_configs("BLOCK_N", "BLOCK_C", [(8, 256, 4), (16, 256, 4), (32, 256, 4), (8, 512, 4),
                                                         (16, 512, 4), (32, 128, 4)], (128, 256, 4)),
                 key=["H", "I", "FMT"])
@triton.jit
def _q_down_kernel(h_ptr, ids_ptr, w_ptr, v_ptr, s_ptr, s2_ptr, b_ptr, y_ptr, H, I, CS, NSC,
                   v_se, v_sr, s_se, s_sr, s2_se, RPS,
                   FMT: tl.constexpr, SB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                   DTYPE: tl.constexpr, BIAS: tl.constexpr):
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < H
    e = tl.load(ids_ptr + p).to(tl.int64)
    live = e >= 0  # NO_EXPERT: no weights read, the pair's row is zero
    e0 = tl.maximum(e, 0)
    acc = _qdot_rows(v_ptr + e0 * v_se + rows * v_sr, s_ptr + e0 * s_se + (rows // RPS) * s_sr, h_ptr + p * I,
                     CS, NSC, live, rm, FMT, BLOCK_N, BLOCK_C, SB)
    if FMT == 2:
        acc = acc * tl.load(s2_ptr + e0 * s2_se)
    gate = tl.where(live, tl.load(w_ptr + p).to(tl.float32), 0.0)
    acc = _round(acc, DTYPE)
    if BIAS:
        acc = _round(acc + tl.load(b_ptr + e0 * H + rows, mask=rm, other=0.0).to(tl.float32), DTYPE)
    tl.store(y_ptr + p * H + rows, (acc * gate).to(DTYPE), mask=rm)


class _Bank:
    """What the kernels take of a QuantBank: byte views (no copy) and the strides of one bank."""

    def __init__(self, bank):
        if bank.values.stride(2) != 1 or bank.scale.stride(2) != 1:
            raise ValueError("quantized expert banks must be contiguous along their rows")
        self.fmt = FMT[bank.format]
        # fp8 values and nvfp4 scales are e4m3 bytes the kernels decode themselves
        self.v = bank.values.view(torch.uint8) if self.fmt == 0 else bank.values
        self.s = bank.scale.view(torch.uint8) if self.fmt == 2 else bank.scale
        self.s2 = bank.scale_2 if self.fmt == 2 else self.s  # unread unless nvfp4
        self.cs, self.nsc = self.v.shape[2], self.s.shape[2]  # value bytes, scales per row
        self.strides = (self.v.stride(0), self.v.stride(1), self.s.stride(0), self.s.stride(1),
                        self.s2.stride(0) if self.fmt == 2 else 0)
        self.rps = FP8_BLOCK if self.fmt == 0 else 1  # rows sharing one scale row

    def up_scale_row(self, inter: int) -> int:
        """The first scale row of a gate_up bank's up half: the gate's block rows (fp8), or its
        rows (fp4)."""
        return self.s.shape[1] // 2 if self.fmt == 0 else inter


def _check(gate_up, down):
    if gate_up.format != down.format or gate_up.halves != 2:
        raise ValueError("gate_up and down banks must be one quantized format, gate_up in two halves")


def moe_quant_decode_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down,
                            activation=None, gate_up_bias: torch.Tensor | None = None,
                            down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]; ids, weights: [T, k]; gate_up, down: banks.QuantBank of shape [N, 2I, H] and
    [N, H, I] in one format; activation, biases as moe_decode_triton takes them -> [T, H].
    Static shapes, no host sync: CUDA-graph capturable."""
    _check(gate_up, down)
    t, k = ids.shape
    n_h, n_i = x.shape[1], down.shape[2]
    pairs = t * k
    gb, db = _Bank(gate_up), _Bank(down)
    x = x.contiguous()
    flat = ids.reshape(-1).contiguous()  # [P]
    w = weights.reshape(-1).to(x.dtype).contiguous()  # [P]
    h = torch.empty(pairs, n_i, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, n_h, dtype=x.dtype, device=x.device)
    dt = tl_dtype(x.dtype)
    act, alpha, limit = act_args(activation)
    gub = gate_up_bias.contiguous() if gate_up_bias is not None else flat  # unread without BIAS
    dnb = down_bias.contiguous() if down_bias is not None else flat
    fmt, sb = gb.fmt, SCALE_COLS[gb.fmt]
    _q_gate_up_act_kernel[lambda m: (pairs, triton.cdiv(n_i, m["BLOCK_I"]))](
        x, flat, gb.v, gb.s, gb.s2, h, gub, n_h, n_i, k, gb.cs, gb.nsc, *gb.strides, gb.rps,
        gb.up_scale_row(n_i), alpha, limit, FMT=fmt, SB=sb, DTYPE=dt, ACT=act, BIAS=gate_up_bias is not None)
    _q_down_kernel[lambda m: (pairs, triton.cdiv(n_h, m["BLOCK_N"]))](
        h, flat, w, db.v, db.s, db.s2, dnb, y, n_h, n_i, db.cs, db.nsc, *db.strides, db.rps,
        FMT=fmt, SB=sb, DTYPE=dt, BIAS=down_bias is not None)
    return sum_pairs_triton(y, t, k)


def moe_quant_decode_torch(x, ids, weights, gate_up, down, activation=None, gate_up_bias=None, down_bias=None):
    """The decode kernel's reference: the engine's static torch decode path, each pair's expert
    dequantized with quant.py (QuantBank.dequant) to x's dtype."""
    from ..experts.executor import SILU, TorchExpertExecutor
    ex = TorchExpertExecutor(gate_up, down, activation=activation or SILU, gate_up_bias=gate_up_bias,
                             down_bias=down_bias)
    return ex._static(x, ids, weights)


# ---- grouped prefill: tiles of pairs sharing one expert (moe_grouped.tile_pairs), tl.dot ----


def _grouped_configs():
    # BLOCK_K (value bytes a step) divides fp8's 128-column block: one scale per column a step
    shapes = [(128, 128, 4)] if INTERPRET else [(64, 64, 4), (128, 64, 4), (64, 128, 8)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in shapes]


@triton.jit
def _mma(acc, a, w, DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ w, the weights rounded to the activation dtype (to nearest, as the reference's
    dequantized copy is). IEEE: fp32 activations, and any under the CPU interpreter, whose bf16
    rounding truncates: there the weights stay fp32 rather than all biased toward zero."""
    if IEEE:
        acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
    else:
        acc += tl.dot(a.to(DTYPE), w.to(DTYPE))
    return acc


@triton.jit
def _q_tile_gemm(a_row, valid, v_col, s_col, s2, CS, cm, FMT: tl.constexpr, SB: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                 IEEE: tl.constexpr):
    """[BLOCK_M, BLOCK_N] = A W^T for a tile of pairs and a block of one expert's weight rows.
    a_row [BLOCK_M]: each pair's activation row (valid: a real pair); v_col [BLOCK_N]: each
    weight row's first value byte; s_col [BLOCK_N]: its scale row; s2: nvfp4's per-tensor scale
    (1.0 otherwise), applied as quant.py does, after the block scale."""
    tl.static_assert(FMT != 0 or SB % BLOCK_K == 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, CS, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # value bytes of this step
        km = ks < CS
        wm = km[:, None] & cm[None, :]
        am = valid[:, None] & km[None, :]
        q = tl.load(v_col[None, :] + ks[:, None], mask=wm, other=0).to(tl.int32)  # [BLOCK_K, BLOCK_N]
        if FMT == 0:
            s = tl.load(s_col + k0 // SB, mask=cm, other=0).to(tl.float32)  # [BLOCK_N]
            a = tl.load(a_row[:, None] + ks[None, :], mask=am, other=0.0)  # [BLOCK_M, BLOCK_K]
            acc = _mma(acc, a, _e4m3(q) * s[None, :] * s2, DTYPE, IEEE)
        else:  # the low nibbles hold the even columns, the high ones the odd
            s = _scale(tl.load(s_col[None, :] + (ks // SB)[:, None], mask=wm, other=0), FMT)  # [BLOCK_K, BLOCK_N]
            a_even = tl.load(a_row[:, None] + 2 * ks[None, :], mask=am, other=0.0)
            a_odd = tl.load(a_row[:, None] + 2 * ks[None, :] + 1, mask=am, other=0.0)
            acc = _mma(acc, a_even, _e2m1(q & 0xF) * s * s2, DTYPE, IEEE)
            acc = _mma(acc, a_odd, _e2m1(q >> 4) * s * s2, DTYPE, IEEE)
    return acc


@triton.autotune(configs=_grouped_configs(), key=["H", "I", "BLOCK_M", "FMT"])
@triton.jit
def _qg_gate_up_kernel(x_ptr, tok_ptr, tile_expert_ptr, v_ptr, s_ptr, s2_ptr, h_ptr, b_ptr, H, I, CS,
                       v_se, v_sr, s_se, s_sr, s2_se, RPS, SU, alpha, limit,
                       FMT: tl.constexpr, SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, IEEE: tl.constexpr, ACT: tl.constexpr,
                       BIAS: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e >= 0:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # padded pair slots of this tile
        tok = tl.load(tok_ptr + rows)
        valid = tok >= 0
        a_row = x_ptr + tl.where(valid, tok, 0).to(tl.int64) * H
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate columns
        cm = cols < I
        vb = v_ptr + e * v_se
        sb = s_ptr + e * s_se
        if FMT == 2:
            g2 = tl.load(s2_ptr + e * s2_se)
            u2 = tl.load(s2_ptr + e * s2_se + 1)
        else:
            g2 = 1.0
            u2 = 1.0
        g = _q_tile_gemm(a_row, valid, vb + cols * v_sr, sb + (cols // RPS) * s_sr, g2, CS, cm,
                         FMT, SB, BLOCK_M, BLOCK_N, BLOCK_K, DTYPE, IEEE)
        u = _q_tile_gemm(a_row, valid, vb + (cols + I) * v_sr, sb + (cols // RPS + SU) * s_sr, u2, CS, cm,
                         FMT, SB, BLOCK_M, BLOCK_N, BLOCK_K, DTYPE, IEEE)
        g = _round(g, DTYPE)  # the reference rounds each GEMM to the activation dtype
        u = _round(u, DTYPE)
        if BIAS:
            bias = b_ptr + e * (2 * I)
            g = _round(g + tl.load(bias + cols, mask=cm, other=0.0).to(tl.float32)[None, :], DTYPE)
            u = _round(u + tl.load(bias + I + cols, mask=cm, other=0.0).to(tl.float32)[None, :], DTYPE)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :],
                 _activate(g, u, alpha, limit, ACT, DTYPE).to(DTYPE), mask=valid[:, None] & cm[None, :])


@triton.autotune(configs=_grouped_configs(), key=["H", "I", "BLOCK_M", "FMT"])
@triton.jit
def _qg_down_kernel(h_ptr, tok_ptr, dest_ptr, w_ptr, tile_expert_ptr, v_ptr, s_ptr, s2_ptr, b_ptr, y_ptr,
                    H, I, CS, v_se, v_sr, s_se, s_sr, s2_se, RPS,
                    FMT: tl.constexpr, SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, IEEE: tl.constexpr, BIAS: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e >= 0:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        valid = tl.load(tok_ptr + rows) >= 0
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns
        cm = cols < H
        if FMT == 2:
            s2 = tl.load(s2_ptr + e * s2_se)
        else:
            s2 = 1.0
        acc = _q_tile_gemm(h_ptr + rows.to(tl.int64) * I, valid, v_ptr + e * v_se + cols * v_sr,
                           s_ptr + e * s_se + (cols // RPS) * s_sr, s2, CS, cm,
                           FMT, SB, BLOCK_M, BLOCK_N, BLOCK_K, DTYPE, IEEE)
        gate = tl.load(w_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        acc = _round(acc, DTYPE)
        if BIAS:
            acc = _round(acc + tl.load(b_ptr + e * H + cols, mask=cm, other=0.0).to(tl.float32)[None, :], DTYPE)
        y = (acc * gate[:, None]).to(DTYPE)
        dest = tl.load(dest_ptr + rows, mask=valid, other=0).to(tl.int64)  # the pair's row in [T*k, H]
        tl.store(y_ptr + dest[:, None] * H + cols[None, :], y, mask=valid[:, None] & cm[None, :])


def moe_quant_grouped_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down,
                             max_experts: int | None = None, activation=None,
                             gate_up_bias: torch.Tensor | None = None,
                             down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]; ids, weights: [T, k]; gate_up, down: QuantBanks [N, 2I, H], [N, H, I] -> [T, H].
    max_experts, activation, biases as moe_grouped_triton takes them; no host sync."""
    _check(gate_up, down)
    t, k = ids.shape
    n, n_h, n_i = down.shape
    bound = min(n, max_experts or n)
    block_m = 16 if t * k <= 16 * bound else 64  # ~pairs per expert
    tok, dest, gate, tile_expert = tile_pairs(ids, weights.to(x.dtype), n, block_m, bound)
    gb, db = _Bank(gate_up), _Bank(down)
    x = x.contiguous()
    h = torch.empty(tok.numel(), n_i, dtype=x.dtype, device=x.device)  # [S, I]
    # each live pair's row is written once; the others (ids < 0) stay unwritten and the sum skips them
    y = torch.empty(t * k, n_h, dtype=x.dtype, device=x.device)
    dt, ieee = tl_dtype(x.dtype), x.dtype == torch.float32 or INTERPRET
    n_tiles = tile_expert.numel()
    act, alpha, limit = act_args(activation)
    gub = gate_up_bias.contiguous() if gate_up_bias is not None else tok  # unread without BIAS
    dnb = down_bias.contiguous() if down_bias is not None else tok
    fmt, sb = gb.fmt, SCALE_COLS[gb.fmt]
    _qg_gate_up_kernel[lambda m: (n_tiles, triton.cdiv(n_i, m["BLOCK_N"]))](
        x, tok, tile_expert, gb.v, gb.s, gb.s2, h, gub, n_h, n_i, gb.cs, *gb.strides, gb.rps,
        gb.up_scale_row(n_i), alpha, limit, FMT=fmt, SB=sb, BLOCK_M=block_m, DTYPE=dt, IEEE=ieee, ACT=act,
        BIAS=gate_up_bias is not None)
    _qg_down_kernel[lambda m: (n_tiles, triton.cdiv(n_h, m["BLOCK_N"]))](
        h, tok, dest, gate, tile_expert, db.v, db.s, db.s2, dnb, y, n_h, n_i, db.cs, *db.strides, db.rps,
        FMT=fmt, SB=sb, BLOCK_M=block_m, DTYPE=dt, IEEE=ieee, BIAS=down_bias is not None)
    return sum_pairs_triton(y, t, k, ids)


def moe_quant_grouped_torch(x, ids, weights, gate_up, down, activation=None, gate_up_bias=None, down_bias=None):
    """The grouped kernel's reference: reference_experts, each distinct expert dequantized once."""
    from ..experts.executor import SILU, reference_experts
    return reference_experts(x, ids, weights, gate_up, down, activation or SILU, gate_up_bias, down_bias)
