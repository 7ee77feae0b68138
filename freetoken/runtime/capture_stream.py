"""A stream of its own to capture one family of CUDA graphs on.

torch keys the cuBLAS (and cuBLASLt) workspace by (handle, stream), and a captured GEMM keeps the
workspace of its capture stream; graphs captured without `stream=` all use torch's one default
capture stream, so they share a workspace. Replayed one after the other that is harmless;
replayed at once on two streams (decode graphs on --decode-overlap's high-priority stream while
a prompt's prefill graphs replay on the default one) both write it: wrong results, or a split-K
kernel spinning on a counter the other reset (benchmarks/README.md, nineteenth session; the
race alone: bench/graph_race.py). Each family (the decode runner's, the prefill graphs') captures
on a stream of its own, and a family's dropped graphs (a failed capture) are kept alive.

torch hands streams out round-robin from a small pool, so a new Stream() can be one already in
use: the default capture stream or another family's. Those are avoided here (the default
capture stream made first, so that it cannot later land on one of ours). Other code's pool
streams may still land on one later; they run no graphs of their own beside these.

Left open: in torch releases where destroying a graph clears its capture stream's workspace
(pytorch#175276; the 2.13 headers declare clearCublasWorkspacesForStream, whether a graph's
reset calls it in 2.11-2.13 is not checked), graphs of a family that
outlive another of its graphs (a second serving engine's decode graphs, in the tests and the
benchmarks) would keep a freed workspace (pytorch#193402), as every graph on the shared default
capture stream did before. One serving engine a process (ft serve) never destroys its graphs."""
from __future__ import annotations

import torch

_FAMILIES: dict[tuple[str, int], torch.cuda.Stream] = {}  # (family, device index) -> its stream


def own_capture_stream(device: torch.device, family: str) -> torch.cuda.Stream:
    """The capture stream of a family of graphs ("decode", "prefill") on `device`: one per family
    and device, made at the first call, neither torch's default capture stream nor another
    family's. Graphs of one family share it (they do not replay at once: a family's graphs
    replay on one stream, one after the other)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (family, index)
    if key not in _FAMILIES:
        if torch.cuda.graph.default_capture_stream is None:  # made as torch.cuda.graph would make it
            torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
        avoid = {s.cuda_stream for s in _FAMILIES.values()} | {torch.cuda.graph.default_capture_stream.cuda_stream}
        for _ in range(256):  # the pool is 32 streams a priority: a few turns at most
            s = torch.cuda.Stream(torch.device("cuda", index))
            if s.cuda_stream not in avoid:
                _FAMILIES[key] = s
                break
        else:
            raise RuntimeError(f"no CUDA stream of its own left for the {family} graphs")
    return _FAMILIES[key]
