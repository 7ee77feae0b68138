"""linear(x, w, b): what the model calls where it would call F.linear on a dense weight that may
be kept quantized (weights/dense_fp8.py Fp8BlockWeight).

  plain tensor    F.linear, unchanged (bit for bit what the engine did before)
  Fp8BlockWeight  CUDA: the Triton kernel reading the FP8 bytes in place (kernels/fp8_linear.py)
                  CPU:  dequantized per call to fp32 (bit for bit quant.py's), then F.linear
                        in fp32, rounded once to x's dtype

Why the CPU path dequantizes per call rather than caching the dequantized weight: a cache is
the copy keeping FP8 exists to avoid (the dense weights at fp32 would take 4x their published
bytes), and the per-call copy lives for one GEMM, one weight at a time. The engine's default on
the CPU is to dequantize at load anyway (--dense-fp8 auto: host memory is not the scarce kind
there, and a GEMM then pays no dequantization); keeping FP8 there is for hosts short of memory.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import use_triton
from ..weights.dense_fp8 import Fp8BlockWeight


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], w [N, K] (a tensor or an Fp8BlockWeight), b [N] or None -> [..., N] in x's dtype."""
    if not isinstance(w, Fp8BlockWeight):
        return F.linear(x, w, b)
    if use_triton(x):
        from ..kernels.fp8_linear import fp8_linear_triton
        return fp8_linear_triton(x, w.values, w.scale_inv, b)
    out = F.linear(x.float(), w.dequantize(torch.float32), None if b is None else b.float())  # [..., N]
    return out.to(x.dtype)
