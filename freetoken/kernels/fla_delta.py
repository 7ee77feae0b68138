"""The gated delta rule's chunked prefill on CUDA through flash-linear-attention (fla-core).

Our chunk rule (model/deltanet.py `chunk_gated_delta_rule`) is the reference and the CPU path:
fp32, a batched UT transform with one small product per 64-token chunk, and a dozen more ops
around it. On the H200 that form is bound by launches and fp32 GEMMs (benchmarks/README.md,
"Prefill on the full-size model": 30 DeltaNet layers took most of the host time of a
2,048-token forward). fla's kernels are the field's reference implementation of the same rule
(transformers' Qwen3-Next / Qwen3.5 use them when installed): bf16 tensor-core work, the
q/k l2 norm and grouped value heads inside the kernels, a handful of launches per layer.

Used for CUDA tensors when `fla` imports and FREETOKEN_FLA is not 0; `bench.deltanet_prefill`
times both and `tests/test_deltanet_chunks.py` compares them (on a GPU: fla's kernels do not
run under the Triton interpreter).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("freetoken.kernels")


def _switch() -> bool:
    """FREETOKEN_FLA: 1 (default) or 0; anything else is an error (checked at engine load)."""
    raw = os.environ.get("FREETOKEN_FLA", "1")
    if raw not in ("0", "1"):
        from ..errors import FreeTokenError
        raise FreeTokenError(f"FREETOKEN_FLA must be 0 or 1, got {raw!r}")
    return raw == "1"


@functools.lru_cache(maxsize=1)
def _kernel():
    """fla's chunk_gated_delta_rule, or None (not installed, or it fails to import: then the
    torch path runs, and the log says why once)."""
    import importlib.util
    if importlib.util.find_spec("fla") is None:
        log.info("flash-linear-attention is not installed: the DeltaNet prefill runs the torch chunk rule "
                 "(pip install -e '.[cuda]' for it)")
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 (installed, yet it fails: a Triton or torch it does not support)
        log.warning("flash-linear-attention is installed but fails to import (%s: %s): the DeltaNet prefill "
                    "runs the slower torch chunk rule", type(e).__name__, e)
        return None
    return chunk_gated_delta_rule


# head widths (dk, dv) fla is used at: verified at 128 (Qwen3.5 / 3.6 / Next) against our rule,
# chained calls and checkpoint cuts included (tests/test_deltanet_chunks.py: every call the engine
# makes at 128 agrees with our rule within 0.8%, bench.fla_engine_diag). An engine whose DeltaNet
# heads were 16 wide prefilled logits 40% off with fla (H200, 49047e7): very likely the tiny random
# model's bf16 noise (at 128 wide, transformers' own bf16 run is 35% off its fp32 one), but
# unverified, so other widths stay on our rule until a run shows it. (fla 0.6 may dispatch
# 128-wide heads on Hopper to its FlashQLA backend when the flash-qla package is installed: not
# installed where it was verified.)
HEAD_DIMS = {(128, 128)}


def supports(dk: int, dv: int) -> bool:
    """Whether fla is used for DeltaNet heads dk (q/k) and dv (v) wide."""
    return (dk, dv) in HEAD_DIMS


_state = {"proven": False, "broken": None}  # a first call ran / why the first call failed


def available(t: torch.Tensor) -> bool:
    """Whether the DeltaNet prefill of activations t goes to fla: CUDA, 16-bit activations
    (an fp32 run is a precision run: its products stay fp32, on our rule)."""
    return (t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and _switch() and _state["broken"] is None
            and _kernel() is not None)


def _give_up(e: Exception, when: str) -> None:
    _state["broken"] = f"{type(e).__name__}: {e}"
    log.warning("flash-linear-attention failed %s (%s); the DeltaNet prefill uses the torch chunk rule "
                "(FREETOKEN_FLA=0 silences this)", when, _state["broken"])


def try_chunk_delta_fla(*args, **kw):
    """chunk_delta_fla, or None if fla has not been proven on this process (warm_up at engine
    load proves it) and this call fails: then the log says so once and the torch rule runs
    from then on. Once proven, a failure is an error like any other (an OOM) and propagates."""
    if _state["proven"]:
        return chunk_delta_fla(*args, **kw)
    try:
        out = chunk_delta_fla(*args, **kw)
    except Exception as e:  # noqa: BLE001
        _give_up(e, "on its first call")
        return None
    _state["proven"] = True
    return out


def chunk_delta_fla(q, k, v, g, beta, state, scale: float, cuts=()):
    """q, k: [T, Hk, dk] before the l2 norm (the kernel applies it, then `scale` to q);
    v: [T, Hv, dv], Hv a multiple of Hk (value head j reads q/k head j // (Hv / Hk));
    g: [T, Hv] log-decay (<= 0) and beta: [T, Hv], both fp32; state: [Hv, dk, dv] fp32.

    Returns (out [T, Hv, dv] in v's dtype, new state fp32, [state after c tokens for c in
    cuts]), as model/deltanet.py chunk_gated_delta_rule does. A cut ends one call and the
    next starts from its state (checkpoints are few: one call per anchor in the chunk)."""
    fn = _kernel()
    t = q.shape[0]
    bounds = sorted({c for c in cuts if 0 < c < t}) + [t]
    outs, at, s = [], {}, 0
    for b in bounds:
        o, state = fn(q[None, s:b], k[None, s:b], v[None, s:b], g[None, s:b], beta[None, s:b],  # [1, n, ...]
                      scale=scale, initial_state=state[None], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
        state = state[0]  # [Hv, dk, dv] fp32
        outs.append(o[0])  # [n, Hv, dv]
        at[b], s = state, b
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out, state, [at[c] for c in cuts if c in at]


def warm_up(cfg, device: torch.device, dtype: torch.dtype) -> None:
    """One small call at the model's DeltaNet head shape, at load: fla autotunes and compiles
    its kernels on first use (seconds to a minute), which would otherwise land in the first
    request's time to first token; a platform fla cannot run on is found here too."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if not supports(dk, dv) or not available(torch.empty(1, device=device, dtype=dtype)):
        return
    import time
    t0 = time.perf_counter()
    # Triton compiles a kernel again for each new kind of length (1, a multiple of 16, other):
    # one of each here (on the H200 a prompt forward of a new kind stalled 0.75 s)
    # all three or none: a variant that fails to compile turns fla off here, not in a request
    try:
        for n in (1, 64, 100):
            q, k = (torch.randn(n, hk, dk, device=device, dtype=dtype) for _ in range(2))  # [n, Hk, dk]
            v = torch.randn(n, hv, dv, device=device, dtype=dtype)  # [n, Hv, dv]
            g = -torch.rand(n, hv, device=device)  # [n, Hv] log-decay
            beta = torch.rand(n, hv, device=device)
            chunk_delta_fla(q, k, v, g, beta, torch.zeros(hv, dk, dv, device=device), dk ** -0.5)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001
        _give_up(e, "at its warm-up")
        return
    _state["proven"] = True
    log.info("DeltaNet prefill on flash-linear-attention's kernels (warmed up in %.1f s)", time.perf_counter() - t0)
