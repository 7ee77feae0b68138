"""Flush-to-zero on the CPU while torch work that makes fp32 denormals runs (denormals.h says
why): the gated DeltaNet chunk rule of a prompt chunk, ~10x slower on x86 without it when a
layer's gates decay fast. Set on the calling thread and torch's OpenMP team for the duration,
then cleared (unless the caller had set it). FREETOKEN_CPU_FLUSH_DENORMALS=0 leaves the CPU's
IEEE behaviour alone (A/B runs). Without the C++ extension nothing is set."""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

FLUSH = os.environ.get("FREETOKEN_CPU_FLUSH_DENORMALS", "1") != "0"


@contextmanager
def flushed(device: torch.device):
    """Within: flush-to-zero and denormals-are-zero on this thread and its OpenMP team, where
    `device` is the CPU."""
    ext = None
    if FLUSH and device.type == "cpu":
        from . import extension
        ext = extension()
    if ext is None:
        yield
        return
    state = ext.flush_denormals(True)
    try:
        yield
    finally:
        if not state & 4:  # the caller had them clear
            ext.flush_denormals(False)
