"""Prompt chunks' MoE blocks and DeltaNet mixers replayed from CUDA graphs, one per (block,
token bucket).

A prompt forward of a short chunk is bound by host time, not by the GPU: on the H200 a
2,048-token forward of the full-size Qwen3.6 shape took 194 ms of wall time against 73.7 ms of
kernels (4,785 launches, about 120 a layer; benchmarks/README.md, prefill-profile-ec9d29b).
Each layer therefore costs a few ms whatever the chunk's size, which is what keeps the serving
loop's interleaved prompt chunks (decode steps between a prompt forward's layers, issue 9)
either slow to prefill or long between decode steps. Two parts of a layer have static shapes
for a given row count and can be recorded once per row count and replayed as one launch:

- the MoE block (router, the grouped experts' tiling and GEMMs, the shared expert): a pure
  function of its rows. The rows past the chunk are masked as not running (`active`, MoE's own
  decode-row mask: they route to no expert; the shared expert computes them, they are dropped).
  Measured alone (f56b5de, prefill-graphs-gpu.json): chunks of 32-512 tokens 1.58-1.84x faster;
  with the mixers too (2f06f17, prefill-graphs-mixers-gpu.json): 5.68x at 32 tokens, 2.72x at 512.
- the gated DeltaNet mixer (model/deltanet.py prefill_padded): it carries the sequence's conv
  and recurrent state, which the graph reads from and writes to static buffers (copied from and
  back to the slot's state around the replay: a graph records addresses, and a slot or a state
  object may differ from call to call). The rows past the chunk get decay 0 and beta 0, so they
  neither decay nor write the state, and the conv state is taken at the chunk's real end.

A chunk of T <= the largest bucket tokens takes the smallest bucket B >= T: its rows are copied
into a static input [B, H] and the real row count into a device scalar; the rows [:T] of the
static output are the block's result. The result is the eager block's up to the rounding of
GEMMs with a different row count (cuBLAS may pick another kernel for B rows than for T): the
same latitude as a decode graph against an eager step.

Every graph shares the static input, the static output and one memory pool: they replay one
after another on the device's default stream, under a lock, and each result is copied out of
the shared output before the lock is let go (a forward of several prompts calls a mixer once per
prompt before it joins the results: a view would have been overwritten). Rows past the chunk
are zeroed when it is staged: stale rows of an earlier chunk never reach a computation. A call
on another stream (a side stream's forward) runs eagerly. Larger chunks run eagerly, as do
chunks with prefix-cache checkpoints inside them (their states are taken mid-chunk).

Only where it can be captured: CUDA, the experts in VRAM behind an executor whose prefill is a
static-shape kernel chain (the Triton grouped kernels of the GPU-resident executor: no host
sync, no device-to-host read). The GPU expert cache, the CPU executor and the torch paths keep
the eager blocks. A kind whose capture fails (fla's kernels, say) stays eager; the other keeps
its graphs.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from ..experts.executor import GRAPH_CAPTURE, TorchExpertExecutor
from ..kernels import use_triton
from .capture_stream import own_capture_stream

log = logging.getLogger("freetoken.prefill_graphs")

# token buckets: ~1.4x apart, so a chunk pads by at most 50% (the blocks' GPU time grows with
# it; the host time saved is per layer, whatever T). The engine captures those up to
# --prefill-graph-tokens (default MAX_TOKENS: measured there, see the module docstring)
ALL_BUCKETS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
MAX_TOKENS = 512
BUCKETS = tuple(b for b in ALL_BUCKETS if b <= MAX_TOKENS)


def buckets_upto(tokens: int) -> tuple:
    """The buckets of chunks up to `tokens` (the smallest bucket holding it included)."""
    top = bucket_for(tokens, ALL_BUCKETS) or ALL_BUCKETS[-1]
    return tuple(b for b in ALL_BUCKETS if b <= top)


def bucket_for(t: int, buckets) -> int | None:
    """The smallest bucket >= t, or None past the largest."""
    return next((b for b in buckets if b >= t), None)


def graphable(executor, device: torch.device) -> str | None:
    """Why the prompt chunks' blocks cannot be captured here, or None if they can."""
    if device.type != "cuda":
        return "not on CUDA"
    if not isinstance(executor, TorchExpertExecutor) or executor.device.type != "cuda":
        return "the experts are not in VRAM behind the GPU-resident executor"
    if not executor.capturable or not use_triton(torch.empty(0, device=device)):
        return "the GPU-resident executor's prefill is not the Triton kernel chain"
    return None


class PrefillGraphs:
    """The graphs of one model's blocks. Blocks are model.moe.MoE (kind "moe") and
    model.deltanet.GatedDeltaNet (kind "deltanet"); each added block gets this object as its
    `prefill_graphs`. hidden, dtype: the blocks' input rows' width and dtype."""

    def __init__(self, hidden: int, device: torch.device, dtype: torch.dtype, buckets=BUCKETS):
        self.buckets = tuple(sorted(buckets))
        top = self.buckets[-1]
        self.device = device
        self.x = torch.zeros(top, hidden, dtype=dtype, device=device)  # [Bmax, H] the static input rows
        self.out = torch.zeros(top, hidden, dtype=dtype, device=device)  # [Bmax, H] every graph's output
        self.n = torch.zeros((), dtype=torch.long, device=device)  # real rows of the call
        self.rows = torch.arange(top, device=device)  # [Bmax]
        self.conv = self.rec = None  # a DeltaNet mixer's state, static: [C, K-1], [Hv, dk, dv] fp32
        self.blocks: dict[str, list] = {}
        self.graphs: dict[tuple[int, int], object] = {}  # (id(block), bucket) -> CUDAGraph
        self.enabled = True  # off: every block eager (a bench's comparison row)
        self.replays = 0
        self.bytes = 0  # device memory the graphs hold (their pool and the static buffers), set by attach
        self._lock = threading.Lock()  # stage + replay + copy-out as one step, whatever the thread
        self._pool = None  # the graphs' shared memory pool (CUDA), made at the first capture
        self._capture_stream = None  # their own capture stream (runtime/capture_stream.py), at the first capture
        self._dropped: list = []  # graphs dropped (a failed capture), kept alive (capture_stream.py)

    def add(self, kind: str, blocks: list) -> None:
        if not blocks:
            return
        if kind == "deltanet" and self.conv is None:
            m = blocks[0]
            self.conv = torch.zeros(m.conv_w.shape[0], m.kernel - 1, dtype=self.x.dtype, device=self.device)
            self.rec = torch.zeros(m.hv, m.dk, m.dv, dtype=torch.float32, device=self.device)
        self.blocks[kind] = list(blocks)
        for m in blocks:
            m.prefill_graphs = self

    def drop(self, kind: str) -> None:
        """Back to eager for every block of `kind`."""
        for m in self.blocks.pop(kind, []):
            m.prefill_graphs = None
            for b in self.buckets:
                g = self.graphs.pop((id(m), b), None)
                if g is not None:  # kept: destroying it may free the workspace the others use
                    self._dropped.append(g)

    def padded(self, block, b: int) -> torch.Tensor:
        """The block on the static input's first b rows, rows >= n masked: [b, H]. What each
        graph records; run eagerly, the same arithmetic (the CPU tests check it there)."""
        if block in self.blocks.get("deltanet", ()):
            return block.prefill_padded(self.x[:b], self.n, self.rows[:b], self.conv, self.rec)
        return block.forward(self.x[:b], "prefill", self.rows[:b] < self.n)

    def stage(self, x: torch.Tensor, b: int) -> None:
        """Copy a chunk's rows x [T, H] into the static input's first b rows (zeros past T) and
        mark T rows real."""
        t = x.shape[0]
        self.x[:t].copy_(x)
        if b > t:
            self.x[t:b].zero_()
        self.n.fill_(t)

    def capture(self, kind: str) -> float:
        """Warm up (Triton autotunes, cuBLAS picks its kernels) on a side stream, then capture
        every (block of `kind`, bucket), largest bucket first. Returns the seconds it took. On a
        failure that kind's graphs are dropped and the error raised (the caller keeps eager)."""
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._capture_stream is None:
            self._capture_stream = own_capture_stream(self.device, "prefill")
        blocks = self.blocks.get(kind, [])
        with GRAPH_CAPTURE, torch.inference_mode():
            self.x.normal_()  # finite rows everywhere: padded rows are read
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for b in self.buckets:
                    self.n.fill_(max(1, b - 1))  # a padded row too
                    for m in blocks:
                        self._reset_state()
                        self.padded(m, b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            g = None
            try:
                for b in reversed(self.buckets):
                    for m in blocks:
                        g = torch.cuda.CUDAGraph()
                        # the block's own output freed: the pool reuses it; on a stream of the
                        # prefill graphs' own (runtime/capture_stream.py)
                        with torch.cuda.graph(g, pool=self._pool, stream=self._capture_stream):
                            self.out[:b].copy_(self.padded(m, b))
                        self.graphs[(id(m), b)] = g
            except Exception:
                self._dropped.append(g)  # the one whose capture failed, kept as drop() keeps the others
                self.drop(kind)
                raise
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _reset_state(self) -> None:
        if self.conv is not None:  # warm-up calls chain through the static state: keep it small
            self.conv.zero_()
            self.rec.zero_()

    def _graph(self, block, t: int):
        """(graph, bucket) for a chunk of t rows of `block`, or None: turned off, t past the
        largest bucket, not captured, or called on a stream other than the device's default
        one (the graphs' static buffers are ordered by that stream)."""
        if not self.enabled:
            return None
        b = bucket_for(t, self.buckets)
        graph = self.graphs.get((id(block), b)) if b is not None else None
        if graph is None or (self.device.type == "cuda" and
                             torch.cuda.current_stream(self.device) != torch.cuda.default_stream(self.device)):
            return None
        return graph, b

    def run(self, block, x: torch.Tensor) -> torch.Tensor | None:
        """A chunk's MoE block through its graph: x [T, H] -> [T, H], or None where there is
        none (see _graph): the caller runs it eagerly."""
        hit = self._graph(block, x.shape[0])
        if hit is None:
            return None
        t = x.shape[0]
        with self._lock, torch.inference_mode():  # the buffers may be inference tensors (made in a forward)
            self.stage(x, hit[1])
            hit[0].replay()
            self.replays += 1
            return self.out[:t].clone()

    def run_mixer(self, block, x: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> torch.Tensor | None:
        """A chunk through a DeltaNet mixer's graph, continuing from (and updating) one
        sequence's conv state [C, K-1] and recurrent state [Hv, dk, dv]: as run()."""
        hit = self._graph(block, x.shape[0])
        if hit is None:
            return None
        t = x.shape[0]
        with self._lock, torch.inference_mode():
            self.stage(x, hit[1])
            self.conv.copy_(conv)
            self.rec.copy_(rec)
            hit[0].replay()
            conv.copy_(self.conv)
            rec.copy_(self.rec)
            self.replays += 1
            return self.out[:t].clone()


def attach(model, executor, device: torch.device, dtype: torch.dtype,
           max_tokens: int = MAX_TOKENS) -> PrefillGraphs | None:
    """Capture the prompt chunks' graphs of `model` for chunks up to max_tokens where they can
    be (graphable), else None with the reason logged. A kind whose capture fails stays eager
    (logged); None if none is left."""
    from ..model.deltanet import GatedDeltaNet
    from ..model.moe import MoE
    why = graphable(executor, device)
    layers = [layer for layer in getattr(model, "layers", []) if isinstance(layer, tuple)]
    kinds = {"moe": [layer[1] for layer in layers if isinstance(layer[1], MoE)],
             "deltanet": [layer[0] for layer in layers if isinstance(layer[0], GatedDeltaNet)]}
    if why is None and not kinds["moe"]:
        why = "the model has no MoE blocks of the Qwen / GPT-OSS kind"
    if why is not None:
        log.info("prompt chunks' blocks run eagerly: %s", why)
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    graphs = PrefillGraphs(model.cfg.hidden_size, device, dtype, buckets_upto(max_tokens))
    done = []
    for kind, blocks in kinds.items():
        if not blocks:
            continue
        graphs.add(kind, blocks)
        try:
            s = graphs.capture(kind)
        except Exception as e:  # noqa: BLE001 - eager is correct, only slower
            graphs.drop(kind)
            log.warning("capturing the prompt chunks' %s graphs failed (%s: %s); those blocks run eagerly",
                        kind, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            continue
        done.append(f"{len(blocks)} {kind} blocks in {s:.1f} s")
    if not done:
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the eager warm-up's freed blocks: what stays reserved is the graphs'
    graphs.bytes = max(0, torch.cuda.memory_reserved(device) - before)
    log.info("captured the prompt chunks' graphs (buckets %s, %.0f MiB): %s", list(graphs.buckets),
             graphs.bytes / (1 << 20), ", ".join(done))
    return graphs
