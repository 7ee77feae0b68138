"""A decode step between a prompt forward's layers whose tokens are read one hook later.

A decode step that runs between a prompt's layers (runtime/interleave.py) used to wait for its
tokens at once: the host synchronised with the stream, so the device drained the prompt layers
queued before the step, ran the step, then idled while the host emitted the tokens and
launched the next layer kernel by kernel. On the H200 (benchmarks/README.md, sixteenth
session: bench.interference --layer-events) a stretch of prompt work right after such a step
took 0.4-1.3 ms more device time than the same layer after none (layer 11: 3.42 against 2.12
ms), the device waiting on the host's launches; the first attention layer of every forward,
always right after one, was the costliest layer of most forwards for that reason alone
(bench.layer_profile: alone it costs what every other attention layer does).

Here the step's picks (greedy rows, reduced on the device: sampler.greedy_packed) and the
logits of any other rows are copied into pinned host memory without waiting, an event marks
their end, and the hook returns: the host queues the next layer behind the step while the
device runs it. The next hook (or the prompt forward's end, or its failure) waits on that
event, which the step alone holds, and emits the tokens. A token is then emitted when the
device finishes the step plus at most the host's launch of one layer, and the device never
runs dry.

Only for what needs no host round trip inside the step: no grammar rows (their masks come from
the grammar worker), no recorded logits, not inside a streamed pass (its own synchronisation
with the copy stream) or on the overlap worker. On the CPU the work is done when the call
returns, so holding the tokens back a layer would only delay them: the loop defers on CUDA.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampler import greedy_packed, parse_greedy


class HostMark:
    """A point in time on a device that runs each op as it is called (the CPU): what a CUDA
    timing event is on the GPU (elapsed_time in ms, as torch.cuda.Event's)."""

    def __init__(self):
        self.t = time.perf_counter()

    def elapsed_time(self, later: HostMark) -> float:
        return (later.t - self.t) * 1e3

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True  # the work before it ran as it was called


def mark(device: torch.device, blocking: bool = False):
    """A timing mark on `device`'s current stream: a recorded CUDA event, or a HostMark.
    blocking: its synchronize() sleeps instead of spinning (runtime/host_wait.py)."""
    if device.type != "cuda":
        return HostMark()
    ev = torch.cuda.Event(enable_timing=True, blocking=blocking)
    ev.record(torch.cuda.current_stream(device))
    return ev


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A copy of x in host memory that is in flight until the stream reaches it (pinned on
    CUDA, so the copy does not make the host wait; a plain copy elsewhere)."""
    if not x.is_cuda:
        return x.to("cpu", copy=True)
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # the caching host allocator's
    out.copy_(x, non_blocking=True)
    return out


@dataclass
class DeferredStep:
    """One decode step's results on their way to the host."""
    reqs: list  # the step's requests, in row order
    greedy: list  # those whose pick was made on the device
    packed: torch.Tensor | None  # [rows lo..hi, 2 (+ 2n)] host copy of the device picks (in flight)
    logits: torch.Tensor | None  # [B, V] host copy of the logits, for the other rows (in flight)
    event: torch.cuda.Event | HostMark  # recorded after both copies (a HostMark off CUDA)
    t0: float  # when the step's forward started (perf_counter)
    lo: int = 0  # the first row of `packed` (the greedy requests' lowest slot)
    start: torch.cuda.Event | HostMark | None = None  # recorded before the step's forward
    queued: list = field(default_factory=list)  # the interleaver's points this step's cycle ran

    @classmethod
    def launch(cls, reqs: list, logits: torch.Tensor, t0: float, start=None, blocking: bool = False) -> DeferredStep:
        """logits [B, V] of a decode step (row r.slot for each request) -> the step, its copies
        queued on the current stream. start: a mark() taken before the step's forward.
        blocking: wait() sleeps until the copies are done (a step with a CPU branch,
        runtime/host_wait.py) instead of spinning."""
        greedy = [r for r in reqs if r.picked_on_device()]
        packed, lo = None, 0
        if greedy:
            top = max(r.sampling.top_logprobs for r in greedy)
            # every row from the lowest greedy slot to the highest (a slice: a list of scattered
            # slots would go up as an index tensor from pageable memory, a sync); rows between
            # them that are not the step's (idle or mid-prefill slots) are reduced and ignored
            lo, hi = min(r.slot for r in greedy), max(r.slot for r in greedy)
            packed = to_host(greedy_packed(logits, list(range(lo, hi + 1)), top))
        host = to_host(logits) if len(greedy) < len(reqs) else None
        return cls(reqs, greedy, packed, host, mark(logits.device, blocking), t0, lo, start)

    def wait(self) -> tuple[dict, torch.Tensor | None]:
        """Wait for the step's copies (not for anything queued after them) -> (picks by
        request id, as the loop's _device_picks gives them; the host logits or None)."""
        self.event.synchronize()
        if self.packed is None:
            return {}, self.logits
        rows = self.packed.tolist()
        picks = parse_greedy([rows[r.slot - self.lo] for r in self.greedy])
        return ({r.id: (tok, lp, tops[:r.sampling.top_logprobs])
                 for r, (tok, lp, tops) in zip(self.greedy, picks)}, self.logits)

    @staticmethod
    def eligible(reqs: list, record_logits: bool) -> bool:
        """Whether a step of these requests can be deferred: nothing in it needs the host
        before its tokens are picked."""
        return not record_logits and all(r.grammar is None and r.sampling.grammar is None for r in reqs)
