"""Grouped routed-expert GEMM for prefill chunks: experts read in place, no weight gather.

A prefill chunk of a few hundred tokens already touches nearly every expert of a layer, so
gathering each used expert's weights into a batch (the torch path: `gate_up[experts]`) copies
the whole layer's experts every chunk. Here the (token, expert) pairs are sorted by expert and
padded to tiles of BLOCK_M pairs that share one expert; each program multiplies one tile of
pairs by one expert's weights where they lie:

  gate_up_act:  grid (tile, block of intermediate cols): h = act(x Wg^T + bg, x Wu^T + bu)
  down:         grid (tile, block of hidden cols):       y = (h Wd^T + bd) * gate weight
writing each pair's row at its place in [T, k, H], then each token sums its k rows (no atomics). The tiling is computed on the device with no
host sync (a static upper bound on tiles; tiles past the real count exit at once). The
activation and the optional biases as in moe_decode.py (ACT, BIAS constexprs).
Reference: experts.executor.reference_experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, tl_dtype
from .moe_decode import _activate, _round, act_args, sum_pairs_triton


# (BLOCK_N, BLOCK_K, warps, stages) tried for tiles of up to 64 pairs, and for tiles of 128 (a long
# pass's sub-chunk: ~1,000 pairs an expert), whose configs carry their pipeline depth
_SMALL = [(64, 64, 4, None), (128, 64, 4, None), (64, 128, 8, None)]
_LARGE = [(64, 64, 8, 3), (128, 64, 8, 3), (64, 64, 8, 4)]


def _configs():
    shapes = _SMALL[:1] if INTERPRET else _SMALL + _LARGE
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, **({} if st is None else {"num_stages": st}))
            for n, k, w, st in shapes]


def _prune(configs, named_args, **kw):
    """The configs of this tile height: BLOCK_M 128 takes the deeper-pipelined 8-warp ones."""
    large = kw.get("BLOCK_M", 64) >= 128
    keep = [c for c in configs
            if ((c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) in _LARGE) == large]
    return keep or configs[:1]  # the interpreter's one config


@triton.autotune(configs=_configs(), key=["H", "I", "BLOCK_M"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _grouped_gate_up_kernel(x_ptr, tok_ptr, tile_expert_ptr, gu_ptr, h_ptr, b_ptr, H, I, alpha, limit,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            DTYPE: tl.constexpr, IEEE: tl.constexpr, ACT: tl.constexpr, BIAS: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e >= 0:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # padded pair slots of this tile
        tok = tl.load(tok_ptr + rows)
        valid = tok >= 0
        tok = tl.where(valid, tok, 0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate columns
        cm = cols < I
        base = gu_ptr + e * (2 * I) * H
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            km = ks < H
            a = tl.load(x_ptr + tok[:, None] * H + ks[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            wm = km[:, None] & cm[None, :]
            wg = tl.load(base + cols[None, :] * H + ks[:, None], mask=wm, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(base + (cols[None, :] + I) * H + ks[:, None], mask=wm, other=0.0)
            if IEEE:  # float32 activations (and bfloat16 under the CPU interpreter, whose dot mishandles it)
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
                acc_g += tl.dot(a, wg, input_precision="ieee")
                acc_u += tl.dot(a, wu, input_precision="ieee")
            else:
                acc_g += tl.dot(a, wg)
                acc_u += tl.dot(a, wu)
        g = _round(acc_g, DTYPE)  # the reference rounds each GEMM to the activation dtype
        u = _round(acc_u, DTYPE)
        if BIAS:
            bias = b_ptr + e * (2 * I)
            g = _round(g + tl.load(bias + cols, mask=cm, other=0.0).to(tl.float32)[None, :], DTYPE)
            u = _round(u + tl.load(bias + I + cols, mask=cm, other=0.0).to(tl.float32)[None, :], DTYPE)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :],
                 _activate(g, u, alpha, limit, ACT, DTYPE).to(DTYPE), mask=valid[:, None] & cm[None, :])


@triton.autotune(configs=_configs(), key=["H", "I", "BLOCK_M"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _grouped_down_kernel(h_ptr, tok_ptr, dest_ptr, w_ptr, tile_expert_ptr, dn_ptr, b_ptr, y_ptr, H, I,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DTYPE: tl.constexpr, IEEE: tl.constexpr, BIAS: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e >= 0:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        valid = tl.load(tok_ptr + rows) >= 0
        rows64 = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns
        cm = cols < H
        base = dn_ptr + e * H * I
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            km = ks < I
            a = tl.load(h_ptr + rows64[:, None] * I + ks[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            w = tl.load(base + cols[None, :] * I + ks[:, None], mask=km[:, None] & cm[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        gate = tl.load(w_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        acc = _round(acc, DTYPE)
        if BIAS:
            acc = _round(acc + tl.load(b_ptr + e * H + cols, mask=cm, other=0.0).to(tl.float32)[None, :], DTYPE)
        y = (acc * gate[:, None]).to(DTYPE)
        dest = tl.load(dest_ptr + rows, mask=valid, other=0).to(tl.int64)  # the pair's row in [T*k, H]
        tl.store(y_ptr + dest[:, None] * H + cols[None, :], y, mask=valid[:, None] & cm[None, :])


def sort_pairs(ids: torch.Tensor, n_experts: int):
    """ids [T, k] -> (key [P]: each pair's expert, NO_EXPERT pairs (-1, rows that are not running)
    as n_experts, a last bucket that runs nowhere; order [P]: the pairs grouped by expert, stable;
    counts [N + 1]: pairs per expert, by scatter_add, not bincount, which reads the max id back to
    the host)."""
    flat = torch.where(ids.reshape(-1) < 0, n_experts, ids.reshape(-1))
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    return flat, order, counts


def tile_pairs(ids: torch.Tensor, weights: torch.Tensor, n_experts: int, block_m: int, max_experts: int):
    """Sort the (token, expert) pairs by expert into tiles of block_m that share one expert.

    ids, weights: [T, k] -> (tok [S] token of each padded slot or -1, dest [S] its pair index
    t*k + j, gate [S] its weight, tile_expert [S / block_m] expert of each tile or -1). S is a static bound: every expert
    present adds at most one partly filled tile, and at most max_experts are present."""
    t, k = ids.shape
    pairs = t * k
    flat, order, counts = sort_pairs(ids, n_experts)
    tiles = (counts + block_m - 1) // block_m  # [N]
    tile_end = torch.cumsum(tiles, 0)  # [N]
    pair_start = torch.cumsum(counts, 0) - counts  # [N]
    e_sorted = flat[order]
    slot = (tile_end - tiles)[e_sorted] * block_m + torch.arange(pairs, device=ids.device) - pair_start[e_sorted]
    n_tiles = -(-pairs // block_m) + min(pairs, max_experts + 1)
    tok = torch.full((n_tiles * block_m,), -1, dtype=torch.int32, device=ids.device)
    tok[slot] = (order // k).to(torch.int32)
    dest = torch.zeros(n_tiles * block_m, dtype=torch.int32, device=ids.device)
    dest[slot] = order.to(torch.int32)
    gate = torch.zeros(n_tiles * block_m, dtype=weights.dtype, device=ids.device)
    gate[slot] = weights.reshape(-1)[order]
    idx = torch.arange(n_tiles, device=ids.device)
    owner = torch.searchsorted(tile_end, idx, right=True)  # [n_tiles] expert whose tiles cover idx
    tile_expert = torch.where(owner < n_experts, owner, -1).to(torch.int32)
    return tok, dest, gate, tile_expert


def moe_grouped_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor, max_experts: int | None = None, activation=None,
                       gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                       block_m: int | None = None) -> torch.Tensor:
    """x: [T, H]; ids, weights: [T, k]; gate_up: [N, 2I, H]; down: [N, H, I] -> [T, H].
    max_experts: how many distinct experts one call can route to (a layer's count), a bound
    that keeps the tile grid small; default all N. activation, gate_up_bias [N, 2I], down_bias
    [N, H]: the expert function, as moe_decode_triton takes it. block_m: pairs a tile (16, 64 or
    128; default by the pairs an expert gets on average: 16 up to 16, else 64)."""
    t, k = ids.shape
    n, n_h, n_i = down.shape
    if block_m is None:
        block_m = 16 if t * k <= 16 * min(n, max_experts or n) else 64  # ~pairs per expert
    if block_m not in (16, 64, 128):
        raise ValueError(f"block_m must be 16, 64 or 128, got {block_m}")
    tok, dest, gate, tile_expert = tile_pairs(ids, weights.to(x.dtype), n, block_m, min(n, max_experts or n))
    slots = tok.numel()
    x = x.contiguous()
    h = torch.empty(slots, n_i, dtype=x.dtype, device=x.device)
    # each live pair's row is written once; the others (ids < 0) stay unwritten and the sum skips them
    y = torch.empty(t * k, n_h, dtype=x.dtype, device=x.device)
    dt, ieee = tl_dtype(x.dtype), x.dtype == torch.float32 or INTERPRET
    n_tiles = tile_expert.numel()
    act, alpha, limit = act_args(activation)
    gub = gate_up_bias.contiguous() if gate_up_bias is not None else tok  # unread without BIAS
    db = down_bias.contiguous() if down_bias is not None else tok
    _grouped_gate_up_kernel[lambda m: (n_tiles, triton.cdiv(n_i, m["BLOCK_N"]))](
        x, tok, tile_expert, gate_up, h, gub, n_h, n_i, alpha, limit, BLOCK_M=block_m, DTYPE=dt, IEEE=ieee,
        ACT=act, BIAS=gate_up_bias is not None)
    _grouped_down_kernel[lambda m: (n_tiles, triton.cdiv(n_h, m["BLOCK_N"]))](
        h, tok, dest, gate, tile_expert, down, db, y, n_h, n_i, BLOCK_M=block_m, DTYPE=dt, IEEE=ieee,
        BIAS=down_bias is not None)
    return sum_pairs_triton(y, t, k, ids)


def grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: rows of 16-byte multiples (H and I
    times the element size) everywhere; on CUDA bf16 on sm90 and later (its CUTLASS kernels);
    on the CPU any float dtype (a loop there)."""
    if not hasattr(torch, "_grouped_mm") or not isinstance(gate_up, torch.Tensor):
        return False
    n, n_h, n_i = down.shape
    el = x.element_size()
    if (n_h * el) % 16 or (n_i * el) % 16 or not x.dtype == gate_up.dtype == down.dtype:
        return False
    if x.device.type != "cuda":
        return True
    return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9


def moe_grouped_mm(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, max_experts: int | None = None, activation=None,
                   gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """moe_grouped_triton's sums through torch's grouped GEMM (`torch._grouped_mm`: CUTLASS on
    sm90, a loop elsewhere): the comparison bench/grouped_gemm.py runs, not the engine (on an
    H100, torch 2.11, it took 1.26 / 2.83 / 9.77 ms at 2k / 8k / 32k tokens of the full-size
    expert shape against the Triton kernel's 1.01 / 1.95 / 6.15: results/grouped_gemm-h100-gpu.json).
    The pairs' rows gathered in expert order, one grouped GEMM per
    projection over every expert of the bank (a group of no rows costs nothing), the activation
    in torch (experts.executor.Activation, op by op, as the reference), each pair's row times its
    gate weight, then each token's k rows summed in pair order (no atomics), as the Triton path
    does. x: [T, H]; ids, weights: [T, k] (NO_EXPERT pairs add nothing); gate_up [N, 2I, H],
    down [N, H, I] -> [T, H]. max_experts is unused (moe_grouped_triton's signature). At its
    peak it holds [T k, H] more than the Triton path: the gathered rows beside the down
    projection's output (which then goes back into the gathered rows' memory)."""
    from ..experts.executor import SILU
    t, k = ids.shape
    n, n_h, n_i = down.shape
    key, order, counts = sort_pairs(ids, n)  # [P], [P] pairs in expert order, [N + 1]
    offs = torch.cumsum(counts[:n], 0).to(torch.int32)  # [N] each expert's end among the sorted pairs
    xs = x[order // k]  # [P, H]
    gu = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)  # [P, 2I]
    e_sorted = key[order].clamp(max=n - 1)
    if gate_up_bias is not None:
        gu = gu + gate_up_bias[e_sorted].to(x.dtype)
    h = (activation or SILU)(gu)  # [P, I]
    del gu
    y = torch._grouped_mm(h, down.transpose(-2, -1), offs=offs)  # [P, H]
    del h
    if down_bias is not None:
        y += down_bias[e_sorted].to(x.dtype)
    y.mul_(weights.reshape(-1)[order, None].to(x.dtype))
    y.masked_fill_((key[order] >= n)[:, None], 0)  # rows past the last group: not written by the GEMM
    xs.index_copy_(0, order, y)  # back in pair order, into the gathered rows' memory (dead by now)
    return xs.view(t, k, n_h).sum(1)
