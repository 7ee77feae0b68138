"""A prefill chunk's keys (or values) gathered from the page pool into buffers kept between calls.

The eager prefill attention (paged_attention.paged_prefill_attention_torch) reads a chunk's
whole visible context as one contiguous [kvh, S, hd] tensor for SDPA. Gathered with plain
indexing, that is two fresh allocations per tensor per layer (the page gather, then the copy
that puts the KV heads first), 4 x 32 MB for K and V at a 32k context on the full-size shape,
each a little larger than the last chunk's because the context grew. The CUDA caching allocator
then needs a new segment at the first attention layer of nearly every chunk, and where VRAM is
held by weights, KV pool and graph pools, a failed cudaMalloc frees its cache (a device-wide
sync) and retries. Here each KV head's pages go straight into a buffer that only grows (by
GROW, so a growing context reallocates O(log S) times): one copy, no allocation per layer.
The buffers stay: at most the block table's width in pages each (the memory plan counts K and
V's, runtime/budget.py); the engine empties them after its start-up warm-up, which runs on
another thread than serving.

A gathered tensor is a view of the buffer: valid until the next gather with the same tag on
the same thread and CUDA stream (the caller hands it to the attention kernel at once; work on
one stream runs in order, so the next layer's gather cannot overwrite it before it is read).
"""
from __future__ import annotations

import threading

import torch

GROW = 1.25  # growth factor of a buffer too small for the request
ALIGN = 64  # pages: buffers are sized in multiples of this (a 16-token page: 1,024 tokens)


def gather_pages(pages: torch.Tensor, ids: torch.Tensor, length: int) -> torch.Tensor:
    """pages [num_pages, kvh, P, hd], ids [..., n] -> [..., kvh, n*P, hd][..., :length, :]: a fresh
    tensor (the decode reference's gather, and what the workspace is tested against)."""
    x = pages[ids.long()]  # [..., n, kvh, P, hd]
    x = x.movedim(-3, -4)  # [..., kvh, n, P, hd]
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])[..., :length, :]


def gather_fresh(pages: torch.Tensor, ids: torch.Tensor, length: int) -> torch.Tensor:
    """gather_pages for one row of ids [n], into a fresh tensor by one index_select per KV head
    straight into place. Plain indexing (gather_pages) copies twice, the second time through a
    permuted view, and on the CPU its index kernel moves a page's 2 KB row element by element:
    the gather of a 32k context was most of a long prompt's attention layer there
    (bench.cpu_prefill_attention's gather rows)."""
    _, kvh, p, hd = pages.shape
    n = ids.numel()
    out = torch.empty((kvh, n, p, hd), dtype=pages.dtype, device=pages.device)
    _select_into(pages, ids, out)
    return out.view(kvh, n * p, hd)[:, :length]


def _select_into(pages: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """pages [num_pages, kvh, P, hd], ids [n] -> out [kvh, >= n, P, hd][:, :n]: one copy per KV
    head straight into place ([n, P, hd] each; the form run on the H200, plan 30)."""
    ids = ids.long()
    for h in range(out.shape[0]):
        torch.index_select(pages[:, h], 0, ids, out=out[h, :ids.numel()])


class GatherWorkspace(threading.local):
    """Per thread: tag -> buffer [kvh, capacity pages, P, hd]. Keyed by tag ("k", "v"), device,
    CUDA stream, dtype and page shape, so two tensors read together never share one."""

    def __init__(self):
        self.bufs: dict[tuple, torch.Tensor] = {}
        self.grows = 0  # buffers (re)allocated: O(log S) over a growing context, not one per layer

    def gather(self, pages: torch.Tensor, ids: torch.Tensor, length: int, tag: str,
               limit: int = 0) -> torch.Tensor:
        """gather_pages(pages, ids, length), into this thread's buffer for `tag`. limit: the
        most pages a gather can ask for (the block table's width; 0: none), so growth never
        overshoots the longest possible context."""
        _, kvh, p, hd = pages.shape
        n = ids.numel()
        stream = torch.cuda.current_stream(pages.device).cuda_stream if pages.is_cuda else 0
        key = (tag, pages.device, stream, pages.dtype, kvh, p, hd)
        buf = self.bufs.get(key)
        if buf is None or buf.shape[1] < n:
            cap = max(n, int(buf.shape[1] * GROW) if buf is not None else 0)
            cap = -(-cap // ALIGN) * ALIGN
            if limit:
                cap = max(n, min(cap, limit))
            self.bufs.pop(key, None)
            del buf  # the old buffer back to the allocator before the larger one is asked for
            # a normal tensor, not an inference one, even when the first gather runs under
            # inference_mode (every model entry point does): a later gather outside it writes
            # into the buffer in place, which an inference tensor refuses
            with torch.inference_mode(False):
                buf = torch.empty((kvh, cap, p, hd), dtype=pages.dtype, device=pages.device)
            self.bufs[key] = buf
            self.grows += 1
        _select_into(pages, ids, buf)
        return buf[:, :n].reshape(kvh, n * p, hd)[:, :length]  # a view: n and P merge

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values())

    def clear(self) -> None:
        self.bufs.clear()


WORKSPACE = GatherWorkspace()
# on CUDA by default (the allocator stalls above); off: a fresh tensor per call, as on the CPU,
# where allocating is cheap and a buffer the size of the longest context would stay in host RAM
ENABLED = True


def gather_for_prefill(pages: torch.Tensor, ids: torch.Tensor, length: int, tag: str,
                       limit: int = 0) -> torch.Tensor:
    """The prefill attention's gather: into the workspace on CUDA (when ENABLED), fresh elsewhere."""
    if ENABLED and pages.is_cuda:
        return WORKSPACE.gather(pages, ids, length, tag, limit)
    return gather_fresh(pages, ids, length)


def workspace_bytes(kvh: int, head_dim: int, max_len: int, dtype) -> int:
    """What the K and V buffers of one thread can grow to over a context of max_len tokens (the
    memory plan counts it): the block table's width in pages, at most."""
    el = torch.empty((), dtype=dtype).element_size()
    return 2 * kvh * head_dim * el * max_len
