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


_PREFILL_OFF: list[str] = []  # why the load-time proof turned the prefill kernels off (prefill_proof.py)


def prefill_off(reason: str | None) -> None:
    """The prefill kernels off for the process (reason), or on again (None: tests)."""
    _PREFILL_OFF[:] = [reason] if reason else []


def prefill_kernels() -> bool:
    """Whether CUDA prefill takes the DeltaNet conv kernel (causal_conv.py), its output norm as one
    kernel (rmsnorm.py gated_rms_norm_triton; decode steps on CUDA take it too, their layer ending
    in the same GatedDeltaNet._finish), the fused router on prompt chunks (router.py; decode
    batches always take it) and fused projections padded to 16-byte rows (model/layers.py
    FusedLinear). On by default since their CUDA tests passed on an H100 (plan 134, 2026-12-07) and
    they took the 12-layer 32k compute pass from 0.401 to 0.319 s (plan 127);
    FREETOKEN_PREFILL_KERNELS=0 gives the torch paths back, for A/B runs. Anything but 0 or 1 is an
    error (checked at engine load). Off too once the load-time proof failed on this GPU
    (prefill_proof.py: a kernel that does not compile or computes something else here)."""
    raw = os.environ.get("FREETOKEN_PREFILL_KERNELS", "1")
    if raw not in ("0", "1"):
        from ..errors import FreeTokenError
        raise FreeTokenError(f"FREETOKEN_PREFILL_KERNELS must be 0 or 1, got {raw!r}")
    return raw == "1" and not _PREFILL_OFF


def fused_decode(t: torch.Tensor) -> bool:
    """use_triton for the fused DeepSeek-V4 / GLM-5 decode kernels (hyper.py, csa_decode.py,
    mla_decode.py): on by default since their tests passed on the H200 (2026-12-02, with the
    models' GPU paths equal to transformers) and their graph timings beat the torch ops they
    replace (hc_pre 16 us against 204, MLA decode 273 against 355); FREETOKEN_FUSED_DECODE=0
    turns them off (the old path, for comparison or a regression)."""
    raw = os.environ.get("FREETOKEN_FUSED_DECODE", "1")
    if raw not in ("0", "1"):
        from ..errors import FreeTokenError
        raise FreeTokenError(f"FREETOKEN_FUSED_DECODE must be 0 or 1, got {raw!r}")
    return raw == "1" and use_triton(t)


def graph_us(f, reps: int = 200, inner: int = 10) -> float:
    """Microseconds per call of f() replayed from a CUDA graph of `inner` calls (warmed up, so
    compiled, on a side stream first): the kernel benchmarks' old-against-new timing."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            f()
    graph.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / (reps * inner)


def tl_dtype(dtype: torch.dtype):
    import triton.language as tl
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
