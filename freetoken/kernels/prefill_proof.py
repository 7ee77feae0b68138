"""The prefill kernels (FREETOKEN_PREFILL_KERNELS, on by default) proven on this GPU at load.

Their CUDA tests have run on an H100 (sm_90) only. A consumer card has less shared memory a block
and may run another Triton: a kernel that fails to compile there, or computes something else,
would fail or corrupt requests. So at load each one runs once at the model's own shapes against
its torch reference (the same comparisons as tests/test_kernels.py); on any failure the torch
paths run for the rest of the process (kernels.prefill_kernels() turns false) and the log says
which kernel and why, once. A passing proof also compiles the kernels before the first request.
"""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

log = logging.getLogger("freetoken.engine")
ROWS = 100  # tokens of each trial: neither a power of two nor a tile multiple, so the masks are exercised


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _conv(cfg, dev, dtype, g) -> str | None:
    from .causal_conv import causal_conv_silu_torch, causal_conv_silu_triton
    c, k = cfg.conv_dim, cfg.linear_conv_kernel_dim
    x = torch.randn(ROWS, c + 8, generator=g).to(dev, dtype)[:, :c]  # a column slice, as the fused projection gives it
    state = torch.randn(c, k - 1, generator=g).to(dev, dtype)  # [C, K-1]
    w = (torch.randn(c, k, generator=g) * 0.5).to(dev, dtype)  # [C, K]
    err = _rel(causal_conv_silu_triton(x, state, w, None), causal_conv_silu_torch(x, state, w, None))
    return None if err < 2e-2 else f"its output is {err:.3g} off the torch reference"


def _gated_norm(cfg, dev, dtype, g) -> str | None:
    from ..model.layers import gated_rms_norm_torch
    from .rmsnorm import gated_rms_norm_triton
    h, d = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    x = (torch.randn(ROWS, h, d, generator=g) * 3).to(dev, dtype)  # [N, Hv, dv]
    z = (torch.randn(ROWS, h, d, generator=g) * 2).to(dev, dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dev, dtype)
    eps = cfg.rms_norm_eps
    err = _rel(gated_rms_norm_triton(x, z, w, eps), gated_rms_norm_torch(x, z, w, eps))
    return None if err < 2e-2 else f"its output is {err:.3g} off the torch reference"


def _router(cfg, dev, dtype, g) -> str | None:
    from ..model.moe import MoE
    from .router import route_triton
    e, k = cfg.num_experts, cfg.top_k
    logits = (torch.randn(ROWS, e, generator=g) * 2).to(dev, dtype)  # [T, E]
    ids, w = route_triton(logits, k, True, 0, dtype)  # [T, k] each
    ref_ids, ref_w = MoE.route_torch(SimpleNamespace(top_k=k, norm_topk=True, base=0), logits, dtype)
    kth = torch.topk(logits.float(), k).values[:, -1:]  # [T, 1]: ties may come in any order
    if ids.shape != ref_ids.shape or not bool((logits.float().gather(1, ids) >= kth).all()):
        return "it picked experts outside the top-k"
    err = _rel(w.float().sort(-1).values, ref_w.float().sort(-1).values)
    return None if err < 2e-2 else f"its weights are {err:.3g} off the torch reference"


def prove(cfg, device, dtype) -> str | None:
    """Run the kernels this model's prefill takes once each against their references -> None, or
    why not (the kernels are then off for the process: kernels.prefill_off)."""
    from . import prefill_kernels, prefill_off
    if not prefill_kernels():
        return None
    trials = []
    if getattr(cfg, "linear_layers", None):  # gated DeltaNet: the conv and the output norm
        trials += [("the DeltaNet conv kernel", _conv), ("the gated norm kernel", _gated_norm)]
    if cfg.num_experts and cfg.top_k and cfg.top_k & (cfg.top_k - 1) == 0:  # the fused router's cases (moe.py route)
        trials.append(("the router kernel", _router))
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    for name, trial in trials:
        try:
            why = trial(cfg, torch.device(device), dtype, g)
        except Exception as e:  # noqa: BLE001 (a compile or launch failure: the reason is in the message)
            why = f"it failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if why is not None:
            reason = f"{name} on this GPU: {why}"
            prefill_off(reason)
            log.warning("prefill kernels off, the torch paths run instead (%s); FREETOKEN_PREFILL_KERNELS=0 "
                        "skips this check", reason)
            return reason
    if trials:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        log.info("prefill kernels proven against their references in %.1f s", time.perf_counter() - t0)
    return None
