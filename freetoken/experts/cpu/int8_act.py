"""int8 activations for the CPU executor's MXFP4 / NVFP4 banks (opt-in: `--cpu-act int8`).

The C++ kernel (moe_cpu.cpp, qdot4_fp4_q8) quantizes each activation row in blocks of 32
columns, d = max|x| / 127, q = round-half-even(x * (127 / max|x|)), and computes each weight
row's dot as sum over blocks of d * sum(w * q) with the e2m1 values as small integers (VNNI
integer dot products), so dequantizing costs a table lookup per 64 weights instead of per 16.
llama.cpp's quantized CPU kernels work this way (its Q8 activations). Not bit-exact with the
reference: one rounding of each activation to 8 bits. This module is that arithmetic in pure
torch (float64 sums, the quantization in f32 as the kernel does it), the kernel's reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..executor import SILU, Activation

BLOCK = 32


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, C] -> (q [n, C] integers in [-127, 127] as f32, d [n, ceil(C / 32)] f32 scales),
    the f32 operations of the kernel's quantize_q8 (x * inv, inv = 127 / amax, both in f32)."""
    n, c = x.shape
    xp = F.pad(x.float(), (0, (-c) % BLOCK)).view(n, -1, BLOCK)  # [n, nb, 32]
    amax = xp.abs().amax(-1)  # [n, nb]
    big = 127.0 / torch.finfo(torch.float32).max  # below: 127 / amax overflows, the block is zero
    inv = torch.where(amax > big, 127.0 / amax.clamp(min=big), torch.zeros_like(amax))
    q = torch.round((xp * inv[..., None]).clamp(-127, 127))  # half to even, as nearbyint
    return q.view(n, -1)[:, :c], amax / 127.0


def dot_int8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, C] activations, w [R, C] dequantized weights (exact in f32) -> [n, R] f64: the
    kernel's blockwise sum(d_b * sum_{c in b} w_c q_c)."""
    q, d = quantize_int8(x)
    n, c = q.shape
    pad = (-c) % BLOCK
    qb = F.pad(q.double(), (0, pad)).view(n, -1, BLOCK)  # [n, nb, 32]
    wb = F.pad(w.double(), (0, pad)).view(w.shape[0], -1, BLOCK)  # [R, nb, 32]
    per_block = torch.einsum("rbc,nbc->nrb", wb, qb)  # [n, R, nb]
    return (per_block * d.double()[:, None, :]).sum(-1)


def reference_experts_int8(x, ids, weights, gate_up, down, activation: Activation = SILU, gate_up_bias=None,
                           down_bias=None) -> torch.Tensor:
    """experts.executor.reference_experts with the int8-activation dots: x [T, H], ids and
    weights [T, K], gate_up / down QuantBanks -> [T, H] f32."""
    x = x.float()
    out = torch.zeros(x.shape, dtype=torch.float64)
    k = ids.shape[1]
    for pair, e in enumerate(ids.reshape(-1).tolist()):
        if e < 0:
            continue
        tok = pair // k
        gu = dot_int8(x[tok:tok + 1], gate_up.dequant(e, torch.float32)).float()  # [1, 2I]
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].float()
        h = activation(gu)  # [1, I]
        y = dot_int8(h, down.dequant(e, torch.float32))  # [1, H]
        if down_bias is not None:
            y = y + down_bias[e].double()
        out[tok] += weights.reshape(-1)[pair].double() * y[0]
    return out.float()
