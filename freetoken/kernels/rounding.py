"""Rounding as torch rounds, for kernels that must match the torch ops they replace: to the
activation dtype after each op, to nearest even, under the CPU interpreter too, and no FMA
contraction in compiled launches. Shared by csa_decode.py, moe_decode.py, shared_expert.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET

# the compiled (not interpreted) launches keep a * b - c * d as two rounded products and a
# rounded difference, as torch computes them; the interpreter is numpy, which never contracts
NO_FMA = {} if INTERPRET else {"enable_fp_fusion": False}


def emu(dtype: torch.dtype) -> bool:
    """Round to bf16 by hand (the interpreter's cast truncates)."""
    return INTERPRET and dtype == torch.bfloat16


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMU: tl.constexpr):
    """fp32 x rounded to DTYPE (to nearest even), as fp32. EMU: the CPU interpreter, whose
    fp32 -> bf16 cast truncates; rounded by hand on the bits (finite values), so the tests see
    the GPU's rounding."""
    if EMU:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)
