"""The serving loop's batched decode step, replayed from one CUDA graph per batch size.

An eager decode step of a full-size model costs tens of ms of host time on the H200 (about a
thousand kernel launches) against ~4 ms as one CUDA graph (benchmarks/README.md). A step
covers batch rows 0..B-1 (rows are the state's slots; rows that are not decoding are masked by
`active`: they write to the scratch page, attend to nothing and route to no expert) and reads
its inputs from static device buffers. Lengths and block tables are device data, so one graph
per batch size B (1, 2, 4, 8, ... up to the slot count) serves every context length; a step
of n rows replays the smallest captured B >= n.

Graphs are captured at start-up: each size is warmed up eagerly on a side stream first (which
also compiles and autotunes the Triton kernels outside the capture), then captured. Warm-up
and capture run with every row inactive, so they never change the state. Without graphs
(the CPU, or an executor that cannot be captured) the same static step runs eagerly.
"""
from __future__ import annotations

import logging

import torch

from ..errors import FreeTokenError
from ..experts.executor import GRAPH_CAPTURE
from ..model.state import DecodeState
from .capture_stream import own_capture_stream

log = logging.getLogger("freetoken.decode")


def batch_sizes(rows: int) -> list[int]:
    """Powers of two below `rows`, and `rows` itself."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return out + [rows]


class DecodeRunner:
    def __init__(self, model, state: DecodeState, graphs: bool, variant=None, on_abort=None):
        """variant: the executor's graph_variant; on_abort: what the executor drops when a capture
        fails midway (the expert cache's lookahead copies pending from a step that never ended)."""
        self.model, self.state = model, state
        self._on_abort = on_abort or (lambda: None)
        rows = state.slots
        dev = model.device
        self.sizes = batch_sizes(rows)
        self.graphs = graphs and dev.type == "cuda"
        # static inputs, one upload per step: token, position and running flag of each row
        self.inputs = torch.zeros(3, rows, dtype=torch.long, device=dev)  # [3, rows]
        self._host = torch.zeros(3, rows, dtype=torch.long, pin_memory=dev.type == "cuda")
        # a CUDA event after the last copy of _host (rewritten only once it ran)
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        # graphs by (variant, batch size): an executor whose step can take two shapes (the expert
        # cache with or without its CPU branch) says which one it needs now (graph_variant());
        # a variant is captured the first time it is needed, then kept
        self._captured: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._variant = variant or (lambda: None)
        self._pool = None
        # the stream the graphs are captured on, their own (runtime/capture_stream.py: a captured
        # GEMM keeps its capture stream's cuBLAS workspace; where a decode graph replays while a
        # prompt's graph runs, --decode-overlap, a shared one would be written at the same time)
        self._capture_stream = None
        self._dropped: list = []  # graphs of a variant whose capture failed, kept (capture_stream.py)
        self._failed: set = set()  # variants whose capture failed while serving: eager

    @property
    def path(self) -> str:
        return "cuda-graphs" if self._captured else "eager"

    def capture(self) -> None:
        """Warm up and capture every batch size (largest first: smaller graphs reuse its
        memory pool) for the executor's current variant. Raises FreeTokenError if a capture
        fails."""
        if not self.graphs:
            return
        with GRAPH_CAPTURE:  # no other thread syncs the device meanwhile (/metrics)
            self._capture(self._variant())

    def _capture(self, variant) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        pool = self._pool
        self.inputs.zero_()  # every row idle: warm-up and capture change no state
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in self.sizes:
                for _ in range(2):
                    self._eager(b)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self._capture_stream is None:
            self._capture_stream = own_capture_stream(self.inputs.device, "decode")
        for b in reversed(self.sizes):
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, pool=pool, stream=self._capture_stream):
                    out = self._eager(b)
            except Exception as e:  # noqa: BLE001 - something in the step cannot be captured
                self._on_abort()
                self._dropped += [g] + [v for k, v in self._captured.items() if k[0] == variant]
                self._captured = {k: v for k, v in self._captured.items() if k[0] != variant}
                raise FreeTokenError(f"CUDA graph capture of the decode step failed at batch size {b} "
                                     f"({type(e).__name__}: {e}); pass --allow-eager to decode without "
                                     "graphs (several times slower)") from None
            self._captured[(variant, b)] = (g, out)
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s%s", self.sizes, f" ({variant})" if variant else "")

    def _eager(self, b: int) -> torch.Tensor:
        x = self.inputs[:, :b]
        return self.model.decode(x[0], self.state, x[1], x[2] != 0)

    def replays(self, n: int) -> bool:
        """Whether a step of n rows would replay a graph already captured (no capture, no eager
        step: no model code runs on the host)."""
        b = next(s for s in self.sizes if s >= n)
        return (self._variant(), b) in self._captured

    def __call__(self, tokens: list[int], pos: list[int], active: list[bool]) -> torch.Tensor:
        """tokens, pos, active: rows 0..n-1 (rows not decoding: active False) -> logits
        [>= n, V] on the device (rows past n are not meaningful). The result may be
        overwritten by the next call; the caller reads it (a sync) before the next one."""
        n = len(tokens)
        b = next(s for s in self.sizes if s >= n)
        key = (self._variant(), b)
        if self.graphs and self._captured and key not in self._captured and key[0] not in self._failed:
            try:  # a new variant (the expert cache's split turned on or off): captured once
                self.capture()
            except FreeTokenError as e:  # keep serving: that variant decodes eagerly
                self._failed.add(key[0])
                log.warning("%s; the %s variant decodes eagerly", e, key[0])
        if self._copied is not None:  # the last step's copy has read _host (normally long since;
            self._copied.synchronize()  # an event never recorded returns at once)
        self._host.zero_()
        self._host[:, :n] = torch.tensor([tokens, pos, active], dtype=torch.long)
        # the whole buffer: a [:, :b] slice of it is not contiguous where b < rows, and copy_ then
        # stages it through a pageable temporary, a copy the driver may hold the host for until the
        # stream reaches it (behind every prompt layer queued before a decode step between layers)
        self.inputs.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.inputs.device))  # the copy's stream
        hit = self._captured.get(key)
        if hit is not None:
            hit[0].replay()
            return hit[1]
        return self._eager(b)
