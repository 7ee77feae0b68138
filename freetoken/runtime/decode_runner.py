"""The serving loop's batched decode step, optionally replayed from CUDA graphs.

An eager decode step of a full-size model costs ~38 ms of host time on the H200 (about a
thousand kernel launches) against ~4 ms as one CUDA graph (benchmarks/README.md). A graph
needs fixed shapes and fixed buffers, so in graph mode the step always covers every batch slot
(rows that are not decoding are masked by `active`, as in eager mode), reads its inputs from
static device buffers, and attends over a length rounded up to a bucket; one graph is
captured per bucket the first time it is needed, right after an eager step of the same shape
(which also compiles and autotunes the Triton kernels outside the capture). Capturing records
the work without running it, so the decode state is not advanced twice.

Without graphs (experts on the host, or graphs off) the step is the plain eager one over the
first n rows and the exact length. On a CPU, graph mode runs the same static-buffer, bucketed
step eagerly (no capture): that is how the tests check it.
"""
from __future__ import annotations

import logging

import torch

from ..model.state import DecodeState

log = logging.getLogger("freetoken.decode")


def length_bucket(n: int, cap: int) -> int:
    """Attend length rounded up: multiples of 512 up to 4096, then of an eighth of the power of
    two below (at most ~12% more keys read than needed), never beyond cap."""
    step = 512 if n <= 4096 else 1 << (n.bit_length() - 4)
    return min(-(-n // step) * step, cap)


class DecodeRunner:
    def __init__(self, model, state: DecodeState, graphs: bool):
        self.model, self.state = model, state
        rows = state.slots
        dev = model.device
        self.static = graphs  # full rows, static buffers, bucketed length
        self.graphs = graphs and dev.type == "cuda"  # ... and captured
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)  # [rows] static inputs
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """tokens, pos, active: [n] host tensors for slots 0..n-1 -> logits [>= n, V] on the
        device (rows past n are not meaningful). The result may be overwritten by the next call."""
        n = tokens.shape[0]
        attend = int(pos.max()) + 1  # rows that are not decoding have pos 0
        if not self.static:
            dev = self.tokens.device
            return self.model.decode(tokens.to(dev), self.state, pos.to(dev), attend, active.to(dev))
        self.tokens.zero_()
        self.pos.zero_()
        self.active.zero_()
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.pos[:n].copy_(pos, non_blocking=True)
        self.active[:n].copy_(active, non_blocking=True)
        length = length_bucket(attend, self.state.max_len)
        hit = self._captured.get(length)
        if hit is not None:
            hit[0].replay()
            return hit[1]
        out = self.model.decode(self.tokens, self.state, self.pos, length, self.active)  # this step, eager
        if self.graphs:
            self._capture(length)
        return out

    def _capture(self, length: int) -> None:
        try:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                out = self.model.decode(self.tokens, self.state, self.pos, length, self.active)
            self._captured[length] = (g, out)
            log.info("captured a decode graph for attend length %d (%d so far)", length, len(self._captured))
        except Exception as e:  # noqa: BLE001 - something in the step cannot be captured: stay eager
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly from now on", type(e).__name__, e)
            self.graphs = False
