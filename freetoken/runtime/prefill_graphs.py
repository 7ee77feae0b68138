"""Prompt chunks' MoE blocks replayed from CUDA graphs: one per (MoE layer, token bucket).

A prompt forward of a short chunk is bound by host time, not by the GPU: on the H200 a
2,048-token forward of the full-size Qwen3.6 shape took 194 ms of wall time against 73.7 ms of
kernels (4,785 launches, about 120 a layer; benchmarks/README.md, prefill-profile-ec9d29b).
Each layer therefore costs a few ms whatever the chunk's size, which is what keeps the serving
loop's interleaved prompt chunks (decode steps between a prompt forward's layers, issue 9)
either slow to prefill or long between decode steps. The MoE block (router, the grouped
experts' tiling and GEMMs, the shared expert) is about a third of those launches, and it is a
pure function of its input rows, with no per-sequence state: it can be recorded once per row
count and replayed as one launch.

A chunk of T <= the largest bucket tokens takes the smallest bucket B >= T: its rows are
copied into a static input [B, H] and the rows past T are masked as not running (`active`:
they route to no expert, MoE's own decode-row mask; the shared expert computes them and they
are dropped). The rows [:T] of the graph's output are the block's result. The result is the
eager block's up to the rounding of GEMMs with a different row count (cuBLAS may pick another
kernel for B rows than for T): the same latitude as a decode graph against an eager step.

The layers' graphs share one static input, one static output and one memory pool: they
replay one after another on one stream, and each output is read (by the residual add that
follows the block, in stream order) before the next replay. Larger chunks run eagerly: there the launches are a small share.

Only where it can be captured: CUDA, the experts in VRAM behind an executor whose prefill is a
static-shape kernel chain (the Triton grouped kernels of the GPU-resident executor: no host
sync, no device-to-host read). The GPU expert cache, the CPU executor and the torch paths keep
the eager block.
"""
from __future__ import annotations

import logging
import time

import torch

from ..experts.executor import GRAPH_CAPTURE, TorchExpertExecutor
from ..kernels import use_triton

log = logging.getLogger("freetoken.prefill_graphs")

# token buckets: ~1.4x apart, so a chunk pads by at most 41% (the MoE block's GPU time grows
# with it; the host time saved is per layer, whatever T)
BUCKETS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket_for(t: int, buckets) -> int | None:
    """The smallest bucket >= t, or None past the largest."""
    return next((b for b in buckets if b >= t), None)


def graphable(executor, device: torch.device) -> str | None:
    """Why the MoE block cannot be captured for prompt chunks here, or None if it can."""
    if device.type != "cuda":
        return "not on CUDA"
    if not isinstance(executor, TorchExpertExecutor) or executor.device.type != "cuda":
        return "the experts are not in VRAM behind the GPU-resident executor"
    if not executor.capturable or not use_triton(torch.empty(0, device=device)):
        return "the GPU-resident executor's prefill is not the Triton kernel chain"
    return None


class MoEPrefillGraphs:
    """The MoE blocks' graphs of one model. moes: the model's MoE blocks (model.moe.MoE), each
    given this object as its `prefill_graphs`; hidden, dtype: their input rows' width and dtype."""

    def __init__(self, moes: list, hidden: int, device: torch.device, dtype: torch.dtype,
                 buckets=BUCKETS):
        self.moes = list(moes)
        self.buckets = tuple(sorted(buckets))
        top = self.buckets[-1]
        self.device = device
        self.x = torch.zeros(top, hidden, dtype=dtype, device=device)  # [Bmax, H] the static input rows
        self.out = torch.zeros(top, hidden, dtype=dtype, device=device)  # [Bmax, H] every graph's output
        self.n = torch.zeros((), dtype=torch.long, device=device)  # real rows of the call
        self.rows = torch.arange(top, device=device)  # [Bmax]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.enabled = True  # off: every block eager (a bench's comparison row)
        self.replays = 0
        for m in self.moes:
            m.prefill_graphs = self

    def padded(self, moe, b: int) -> torch.Tensor:
        """The block on the static input's first b rows, rows >= n masked: [b, H]. What each
        graph records; run eagerly, the same arithmetic (the CPU tests check it there)."""
        active = self.rows[:b] < self.n  # [b] the real rows
        return moe.forward(self.x[:b], "prefill", active)

    def stage(self, x: torch.Tensor, b: int) -> None:
        """Copy a chunk's rows x [T, H] into the static input and mark T rows real."""
        t = x.shape[0]
        self.x[:t].copy_(x)
        self.n.fill_(t)

    def capture(self) -> float:
        """Warm up (Triton autotunes, cuBLAS picks its kernels) on a side stream, then capture
        every (block, bucket), largest bucket first. Returns the seconds it took. On a failure
        the graphs captured so far are dropped and the error raised (the caller keeps eager)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with GRAPH_CAPTURE, torch.inference_mode():
            self.x.normal_()  # finite rows everywhere: padded rows are read (the shared expert)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for b in self.buckets:
                    self.n.fill_(b)
                    for m in self.moes:
                        self.padded(m, b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            try:
                for b in reversed(self.buckets):
                    for m in self.moes:
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, pool=pool):  # the block's own output freed: the pool reuses it
                            self.out[:b].copy_(self.padded(m, b))
                        self.graphs[(id(m), b)] = g
            except Exception:
                self.graphs.clear()
                raise
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def run(self, moe, x: torch.Tensor) -> torch.Tensor | None:
        """A chunk's block through its graph: x [T, H] -> [T, H], or None where there is none
        (T past the largest bucket, not captured, or turned off): the caller runs it eagerly.
        The result is a view of the shared output, valid until the next replay of any block."""
        if not self.enabled:
            return None
        t = x.shape[0]
        b = bucket_for(t, self.buckets)
        graph = self.graphs.get((id(moe), b)) if b is not None else None
        if graph is None:
            return None
        with torch.inference_mode():  # the buffers may be inference tensors (made in a forward)
            self.stage(x, b)
        graph.replay()
        self.replays += 1
        return self.out[:t]


def attach(model, executor, device: torch.device, dtype: torch.dtype) -> MoEPrefillGraphs | None:
    """Capture the prompt chunks' MoE graphs of `model` where they can be (graphable), else
    None with the reason logged. A capture that fails leaves every block eager."""
    from ..model.moe import MoE
    why = graphable(executor, device)
    moes = [layer[1] for layer in getattr(model, "layers", []) if isinstance(layer, tuple) and isinstance(layer[1], MoE)]
    if why is None and not moes:
        why = "the model has no MoE blocks of the Qwen / GPT-OSS kind"
    if why is not None:
        log.info("prompt chunks' MoE blocks run eagerly: %s", why)
        return None
    graphs = MoEPrefillGraphs(moes, model.cfg.hidden_size, device, dtype)
    try:
        s = graphs.capture()
    except Exception as e:  # noqa: BLE001 - eager is correct, only slower
        for m in moes:
            m.prefill_graphs = None
        log.warning("capturing the prompt chunks' MoE graphs failed (%s: %s); they run eagerly",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    log.info("captured the prompt chunks' MoE graphs: %d blocks x buckets %s in %.1f s",
             len(moes), list(graphs.buckets), s)
    return graphs
