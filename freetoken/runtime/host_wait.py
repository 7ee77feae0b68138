"""How the host thread that drives decode waits for a step on the GPU.

CUDA's default wait (cudaDeviceScheduleAuto with one context on a many-core host) spins: the
thread that launched a step's graph and then reads its tokens (`.tolist()`, an event's
synchronize) keeps a core busy for the whole step. Where the step has a CPU branch (the C++
expert executor's pinned workers, behind the doorbell or a host-function node), that core is one
the workers need: with every core given to the executor (16 threads on the 16-core GPU host), one
worker shared its core with the spinning thread, and since a layer's call waits for its slowest
worker, the 40-layer Qwen3.6 MXFP4 step went from 11 ms at 6 threads to 109 ms at 16 (device plan
70, benchmarks/README.md). A blocking event (cudaEventBlockingSync) puts the thread to sleep until
the step's work is done instead; its wake-up costs tens of microseconds, nothing against a step
that waits for the CPU. Steps with no CPU branch (all experts in VRAM) keep the spin's lower
latency.

FREETOKEN_HOST_WAIT: `auto` (default: block where the step has a CPU branch), `block`, `spin`.
"""
from __future__ import annotations

import os

import torch

MODES = ("auto", "block", "spin")


def mode() -> str:
    """FREETOKEN_HOST_WAIT, checked: auto, block or spin."""
    m = os.environ.get("FREETOKEN_HOST_WAIT", "auto").strip().lower() or "auto"
    if m not in MODES:
        from ..errors import FreeTokenError
        raise FreeTokenError(f"FREETOKEN_HOST_WAIT must be one of {', '.join(MODES)}, got {m!r}")
    return m


def blocks(cpu_branch: bool) -> bool:
    """Whether a decode step with (or without) a CPU branch is waited for with a blocking event."""
    m = mode()
    return m == "block" or (m == "auto" and cpu_branch)


def has_cpu_branch(ex) -> bool:
    """Whether an expert executor's decode step now runs experts on the host: the C++ executor
    itself, the streamed CPU branch (`branch`), or the expert cache while its split sends misses
    there (`runs_cpu_branch`: not fill-only, whose graph has no host node); wrappers (`inner`, as
    PiecedExecutor and benchmarks' adapters have) are looked through. Asked at every step: the
    cache's split changes while serving."""
    for _ in range(8):
        if ex is None:
            return False
        if hasattr(ex, "runs_cpu_branch"):
            return bool(ex.runs_cpu_branch)
        if getattr(ex, "name", None) == "cpu" or getattr(ex, "branch", None) is not None:
            return True
        ex = getattr(ex, "inner", None)
    return False


def wait(device: torch.device, cpu_branch: bool) -> None:
    """Wait for the work queued so far on device's current stream, the way blocks() says
    (a spinning wait is left to the caller's own sync: nothing to do here)."""
    if device.type != "cuda" or not blocks(cpu_branch):
        return
    ev = torch.cuda.Event(blocking=True)
    ev.record(torch.cuda.current_stream(device))
    ev.synchronize()
