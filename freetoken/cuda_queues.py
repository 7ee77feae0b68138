"""CUDA's launch queues at four times their default depth, for this process, unless the user set
`CUDA_SCALE_LAUNCH_QUEUES` or the GPU is a Jetson's.

Why: decode steps replayed between a long prompt's layers queue a 40-layer graph behind the
layers already queued, and with the default depth the host's next launches waited for room: in
a 16k-token prefill on the H200, 414 `cudaGraphLaunch` calls over 1 ms (up to 6.5 ms) with the
default queues against 104 (up to 3.5 ms) at 4x (benchmarks/README.md, plans 37 and 40).

The driver reads the variable when CUDA starts, so it is set at import (freetoken/__init__.py),
before anything of ours touches CUDA; a host program that started CUDA before importing us keeps
its queues. Not on Jetson (Tegra) boards: llama.cpp set the same 4x by default and took it back
after MoE decode hung at any scale above 1x on a Jetson Orin (its issue 19219, PR 19227); we have
not measured one. The variable is dropped again from the environment of the programs we start
(child_env), so a llama.cpp baseline or an agent client runs with the queues its user chose.
"""
from __future__ import annotations

import os
import platform

VAR = "CUDA_SCALE_LAUNCH_QUEUES"
SCALE = "4x"
set_here = False  # whether apply() set it (not the user)


def tegra() -> bool:
    """A Jetson / Tegra board (L4T writes this file), where scaled queues hung llama.cpp."""
    return platform.machine() == "aarch64" and os.path.exists("/etc/nv_tegra_release")


def apply() -> bool:
    """Set the variable for this process where the user has not -> whether it was set here."""
    global set_here
    if VAR in os.environ or tegra():
        return False
    os.environ[VAR] = SCALE
    set_here = True
    return True


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) for a program we start, without the variable
    where apply() set it, nor omp_env's (the user's own settings are passed on)."""
    from .omp_env import strip  # and OpenMP's spin as its user has it (omp_env.py)
    out = dict(os.environ if env is None else env)
    if set_here and out.get(VAR) == SCALE:
        out.pop(VAR)
    return strip(out)
