"""OpenMP's idle threads spin briefly, not for milliseconds, in this process, unless the user
set `GOMP_SPINCOUNT` (GNU OpenMP, torch's pip builds), `KMP_BLOCKTIME` (Intel's) or
`OMP_WAIT_POLICY` (from which both runtimes derive their spin when the others are unset).

Why: after every parallel torch op, GNU OpenMP's worker threads spin for the next one, 300,000
iterations by default (milliseconds), on the cores where our own C++ pools (the expert executor,
the CPU's dense rows, attention and DeltaNet kernels) run the next part of a decode step. On the
2-core dev machine a pure-CPU decode step of a 12-layer Qwen3.6 slice took 131 ms with the
default and 89 ms at 1,000 spins: the C++ parts ran 1.4-1.8x slower (the DeltaNet step 9x)
while an OpenMP thread held the other core. Fully passive threads (OMP_WAIT_POLICY=passive)
cost the demo's prefill 40% (consecutive GEMMs wake their threads each time); a short spin kept
it (benchmarks/README.md, twenty-fourth session).

OpenMP reads the variables when torch loads it, so they are set at import (freetoken/__init__.py),
before torch is imported by anything of ours; a program that imported torch first keeps its
setting. They are dropped again from the environment of the programs we start (child_env), so a
llama.cpp baseline runs with OpenMP as its user has it.
"""
from __future__ import annotations

import os
import sys

DEFAULTS = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}  # ~0.1-0.3 ms of spinning; 1 ms
set_here: dict[str, str] = {}  # what apply() set (not the user)


def apply() -> dict[str, str]:
    """Set the defaults the user has not, if torch is not loaded yet -> what was set here."""
    if "torch" in sys.modules:  # too late: its OpenMP has read the environment
        return {}
    if "OMP_WAIT_POLICY" in os.environ:  # the user chose OpenMP's waiting: its spin follows from that
        return {}
    for k, v in DEFAULTS.items():
        if k not in os.environ:
            os.environ[k] = v
            set_here[k] = v
    return dict(set_here)


def strip(env: dict[str, str]) -> dict[str, str]:
    """env without the values apply() set (the user's own settings stay)."""
    for k, v in set_here.items():
        if env.get(k) == v:
            env.pop(k)
    return env
