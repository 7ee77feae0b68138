"""Fused routed-expert GEMV for small batches: experts read in place by flat id, no gather.

  gate_up_act:  grid (pair, block of intermediate rows): h = act(x Wg^T + bg, x Wu^T + bu)
  down:         grid (pair, block of hidden rows):        y = (h Wd^T + bd) * gate weight
then the k pairs of each token are summed (in slot order, deterministic; sum_pairs_triton, one
small kernel: torch's reduction over that middle dim of 8 took 4.9 us a layer on the H200, 197
us of a 4.2 ms full-size Qwen3.6 step). Pairs routed to
NO_EXPERT (-1, rows that are not running) read no weights and add zero. The activation is a
constexpr (experts.executor.Activation: 0 silu(g) * u, 1 GPT-OSS's clamped SwiGLU) and the
biases are optional (BIAS constexpr; gate_up_bias [N, 2I], down_bias [N, H]). Reference:
experts.executor.TorchExpertExecutor._static, with the same roundings to the activation dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, tl_dtype
from .rounding import emu, round_to


def _configs(block_rows: str, block_k: str, rows, ks, warps):
    """A few tile shapes to autotune over on the GPU; one under the CPU interpreter."""
    shapes = [(r, k, w) for r in rows for k in ks for w in warps]
    if INTERPRET:
        shapes = shapes[:1]
    return [triton.Config({block_rows: r, block_k: k}, num_warps=w) for r, k, w in shapes]


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    """v rounded to the activation dtype, kept in fp32 (what each torch op of the reference does)."""
    return v.to(DTYPE).to(tl.float32)


@triton.jit
def _activate(g, u, alpha, limit, ACT: tl.constexpr, DTYPE: tl.constexpr):
    """The expert activation of gate and up values (fp32 holding DTYPE values), rounded op by op
    as experts.executor.Activation computes it in torch; returns fp32 (the caller rounds)."""
    if ACT == 0:  # silu(g) * u
        h = _round(g / (1.0 + tl.exp(-g)), DTYPE) * u
    elif ACT == 2:  # silu(min(g, limit)) * clamp(u, -limit, limit) (DeepSeek-V4)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = _round(g / (1.0 + tl.exp(-g)), DTYPE) * u
    else:  # (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sig = _round(1.0 / (1.0 + tl.exp(-_round(g * alpha, DTYPE))), DTYPE)
        h = _round(u + 1.0, DTYPE) * _round(g * sig, DTYPE)
    return h


# GEMV at batch 1 needs many programs in flight to saturate HBM: few rows per program
@triton.autotune(configs=_configs("BLOCK_I", "BLOCK_H", [4, 8, 16], [256, 512], [4]), key=["H", "I"])
@triton.jit
def _gate_up_act_kernel(x_ptr, ids_ptr, gu_ptr, h_ptr, b_ptr, H, I, K, alpha, limit,
                        BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, DTYPE: tl.constexpr,
                        ACT: tl.constexpr, BIAS: tl.constexpr):
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    rm = rows < I
    e = tl.load(ids_ptr + p).to(tl.int64)
    live = e >= 0  # NO_EXPERT (-1): a batch row that is not running reads no weights
    tok = p // K
    base = gu_ptr + tl.maximum(e, 0) * (2 * I) * H
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in range(0, tl.where(live, H, 0), BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cm = cols < H
        x = tl.load(x_ptr + tok * H + cols, mask=cm, other=0.0).to(tl.float32)
        m2 = rm[:, None] & cm[None, :]
        wg = tl.load(base + rows[:, None] * H + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        wu = tl.load(base + (rows[:, None] + I) * H + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * x[None, :], axis=1)
        acc_u += tl.sum(wu * x[None, :], axis=1)
    g = _round(acc_g, DTYPE)
    u = _round(acc_u, DTYPE)
    if BIAS:  # a NO_EXPERT pair reads expert 0's bias: finite, and its down row is zeroed
        bias = b_ptr + tl.maximum(e, 0) * (2 * I)
        g = _round(g + tl.load(bias + rows, mask=rm, other=0.0).to(tl.float32), DTYPE)
        u = _round(u + tl.load(bias + I + rows, mask=rm, other=0.0).to(tl.float32), DTYPE)
    tl.store(h_ptr + p * I + rows, _activate(g, u, alpha, limit, ACT, DTYPE).to(DTYPE), mask=rm)


@triton.autotune(configs=_configs("BLOCK_N", "BLOCK_I", [8, 16, 32], [128, 256], [4]), key=["H", "I"])
@triton.jit
def _down_kernel(h_ptr, ids_ptr, w_ptr, dn_ptr, b_ptr, y_ptr, H, I,
                 BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, DTYPE: tl.constexpr, BIAS: tl.constexpr):
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < H
    e = tl.load(ids_ptr + p).to(tl.int64)
    live = e >= 0  # NO_EXPERT: no weights read, the pair's row is zero
    base = dn_ptr + tl.maximum(e, 0) * H * I
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i0 in range(0, tl.where(live, I, 0), BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        cm = cols < I
        hv = tl.load(h_ptr + p * I + cols, mask=cm, other=0.0).to(tl.float32)
        wd = tl.load(base + rows[:, None] * I + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
        acc += tl.sum(wd.to(tl.float32) * hv[None, :], axis=1)
    gate = tl.where(live, tl.load(w_ptr + p).to(tl.float32), 0.0)
    acc = _round(acc, DTYPE)
    if BIAS:
        acc = _round(acc + tl.load(b_ptr + tl.maximum(e, 0) * H + rows, mask=rm, other=0.0).to(tl.float32), DTYPE)
    y = (acc * gate).to(DTYPE)
    tl.store(y_ptr + p * H + rows, y, mask=rm)


@triton.jit
def _sum_pairs_kernel(y_ptr, ids_ptr, out_ptr, K, H, BLOCK: tl.constexpr, DTYPE: tl.constexpr, EMU: tl.constexpr,
                      SKIP: tl.constexpr):
    """out[t] = sum over j < K of y[t, j] (fp32, in order), rounded once to DTYPE, as torch's
    sum over dim 1 computes it; grid (token, block of H). SKIP: pairs whose id is < 0 (rows
    routed to no expert) add nothing and their rows of y are never read (never written)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(0, K):
        m = cm
        if SKIP:
            m = m & ((c * 0 + tl.load(ids_ptr + t * K + j)) >= 0)  # the pair's id, broadcast over the block
        acc += tl.load(y_ptr + (t * K + j) * H + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + c, round_to(acc, DTYPE, EMU).to(DTYPE), mask=cm)


def sum_pairs_triton(y: torch.Tensor, t: int, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """y [t * k, H] (each token's k expert outputs, contiguous) -> [t, H] in y's dtype: the
    decode kernels' last step (reference: y.view(t, k, H).sum(1)). ids [t, k]: where given, the
    pairs with ids < 0 count as zero rows without being read (the grouped kernels leave them
    unwritten, so y needs no zero fill)."""
    assert y.is_contiguous() and y.shape[0] == t * k, (tuple(y.shape), t, k)
    n_h = y.shape[1]
    out = torch.empty(t, n_h, dtype=y.dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(n_h))
    flat = ids.reshape(-1).contiguous() if ids is not None else y  # unread without SKIP
    _sum_pairs_kernel[(t, triton.cdiv(n_h, block))](y, flat, out, k, n_h, BLOCK=block, DTYPE=tl_dtype(y.dtype),
                                                      EMU=emu(y.dtype), SKIP=ids is not None, num_warps=4)
    return out


def moe_decode_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, activation=None,
                      gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]; ids, weights: [T, k]; gate_up: [N, 2I, H]; down: [N, H, I]; activation: an
    experts.executor.Activation (None: SiLU); gate_up_bias [N, 2I], down_bias [N, H] or None
    -> [T, H]."""
    t, k = ids.shape
    n_h = x.shape[1]
    n_i = down.shape[2]
    pairs = t * k
    x = x.contiguous()
    flat = ids.reshape(-1).contiguous()
    w = weights.reshape(-1).to(x.dtype).contiguous()
    h = torch.empty(pairs, n_i, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, n_h, dtype=x.dtype, device=x.device)
    dt = tl_dtype(x.dtype)
    act, alpha, limit = act_args(activation)
    gub = gate_up_bias.contiguous() if gate_up_bias is not None else flat  # unread without BIAS
    db = down_bias.contiguous() if down_bias is not None else flat
    _gate_up_act_kernel[lambda m: (pairs, triton.cdiv(n_i, m["BLOCK_I"]))](
        x, flat, gate_up, h, gub, n_h, n_i, k, alpha, limit, DTYPE=dt, ACT=act, BIAS=gate_up_bias is not None)
    _down_kernel[lambda m: (pairs, triton.cdiv(n_h, m["BLOCK_N"]))](
        h, flat, w, down, db, y, n_h, n_i, DTYPE=dt, BIAS=down_bias is not None)
    return sum_pairs_triton(y, t, k)


def act_args(activation) -> tuple[int, float, float]:
    """(ACT constexpr, alpha, limit) of an experts.executor.Activation (None: SiLU)."""
    if activation is None:
        return 0, 1.0, 0.0
    return activation.code, float(activation.alpha), float(activation.limit)
