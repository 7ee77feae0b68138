"""Flush-to-zero on the CPU while torch work that makes fp32 denormals runs (denormals.h says
why): the gated DeltaNet chunk rule of a prompt chunk, ~10x slower on x86 without it when a
layer's gates decay fast. Set on the calling thread and torch's OpenMP team for the duration;
after it the caller is as it was (torch.set_flush_denormal may have set it) and the rest of the
team is cleared (torch cannot set those threads). Nested uses leave it to the outermost.
FREETOKEN_CPU_FLUSH_DENORMALS=0 leaves the CPU's IEEE behaviour alone (A/B runs). Without the
C++ extension nothing is set."""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch

FLUSH = os.environ.get("FREETOKEN_CPU_FLUSH_DENORMALS", "1") != "0"
_inside = threading.local()  # a thread's own team: each thread that runs torch ops has its own


@contextmanager
def flushed(device: torch.device):
    """Within: flush-to-zero and denormals-are-zero on this thread and its OpenMP team, where
    `device` is the CPU."""
    ext = None
    if FLUSH and device.type == "cpu" and not getattr(_inside, "on", False):
        from . import extension
        ext = extension()
    if ext is None:
        yield
        return
    state = ext.flush_denormals(True, True)
    _inside.on = True
    try:
        yield
    finally:
        _inside.on = False
        ext.flush_denormals(bool(state & 4), False)
