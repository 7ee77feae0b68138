"""Triton kernels for the decode hot path, each beside the pure-torch code it replaces.

The torch versions (model/layers.py, model/deltanet.py) are the references and the CPU path;
a kernel is used for CUDA tensors when Triton is importable. Tests run the kernels on the CPU
under TRITON_INTERPRET=1 and compare them with the references on fresh random inputs.
"""
from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:  # CPU-only installs may lack it: the torch path runs
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether a tensor's op should go to a Triton kernel (CUDA), else to the torch path."""
    return HAS_TRITON and t.is_cuda


def tl_dtype(dtype: torch.dtype):
    import triton.language as tl
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
