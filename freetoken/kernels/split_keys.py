"""A prefill chunk's attention over a long context in pieces of keys, with a hook between them.

On the CPU a prompt chunk's attention layer at a long context is the costliest stretch of its
forward, whatever the chunk's size: on the 2-core dev machine a 32-token chunk's SDPA over 32k
keys of the demo shape is most of a ~20-30 ms layer, a decode step of the streams ~18-20 ms
(benchmarks/results/interference-32k-cpu-keys*-cpu.json). The serving loop
runs decode steps between a prompt forward's layers (runtime/interleave.py), so a stream's gap
is at least a decode step plus the costliest stretch between two hooks: with a whole attention
layer in it, over 2x the stream's unloaded gap. Here the chunk's queries attend to the context
in pieces of KEY_PIECE keys, each giving its output and its log-sum-exp; the pieces are merged
by their log-sum-exp (the flash-decoding merge), and between two pieces the hook in effect
(key_points, set by the model's layer loop for the interleaving loop) may run a decode step.

The pieces also run without a hook in fp32 (the CPU's default dtype), where they are faster
than the whole-context kernel (`wanted`); in bf16 only with a hook, since a piece's output is
rounded to bf16 before the merge, one more rounding than the whole-context kernel.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from .page_gather import gather_fresh

KEY_PIECE = 8192  # keys per piece (a multiple of any page size in use): ~4 ms of a 32-token chunk there
# the interleaver's point before the n-th key piece (n >= 1) of layer i's attention in a forward:
# i + min(n, MAX_POINTS) * POINT_STEP, below i + 0.5 (the MID_LAYER point) whatever the context
# (400 pieces: 3.3M keys); n counts on across the segments of a batch, so labels never repeat
# within a layer but for the last, shared past MAX_POINTS
POINT_STEP = 0.001
MAX_POINTS = 400


def point(i: int, n: int) -> float:
    """The interleaver's label of the point before layer i's n-th key piece (see POINT_STEP)."""
    return round(i + min(n, MAX_POINTS) * POINT_STEP, 3)


def is_key_point(j: float) -> bool:
    """Whether label j is a key piece's point (not a layer's, nor the MID_LAYER i + 0.5)."""
    return 0 < j - int(j) < 0.5


class PointHook(threading.local):
    """The hook a forward's layer loop sets for the pieces of work inside a layer (here the key
    pieces of an attention, experts/split_experts.py the expert pieces of a MoE block), per
    thread: fn(n) is called before piece n >= 1."""
    fn = None

    @contextmanager
    def use(self, fn):
        """fn in effect within it; None: no hook (also what a hook's own work sees: a forward
        nested in it does not split)."""
        prev, self.fn = self.fn, fn
        try:
            yield
        finally:
            self.fn = prev


HOOK = PointHook()


def key_points(fn):
    """Within it, a split attention on this thread calls fn(k) before its key piece k (k >= 1)."""
    return HOOK.use(fn)


def splits(start: int, page: int) -> list[tuple[int, int]]:
    """The pieces [a, b) of keys 0..start-1 (those every query of a chunk at `start` sees), each
    starting at a page boundary."""
    step = max(page, KEY_PIECE // page * page)
    return [(a, min(a + step, start)) for a in range(0, start, step)]


def wanted(q: torch.Tensor, start: int, window, sinks) -> bool:
    """Whether a chunk's attention runs in pieces here: on the CPU (the kernel below), a
    full-attention layer without sinks, a chunk of at least one token (torch's CPU flash kernel
    dies of a division by zero, not an exception, on empty inputs) after some context; then
    with a hook set, where there are at least two pieces, and without one in fp32 (the CPU's
    default dtype), where the pieces add no rounding and were faster in every case measured:
    1.11-1.74x on the 2-core dev machine for chunks of 64-2,048 tokens at 2k-32k of context,
    on the demo's and the Qwen3.6 shape's heads (bench.cpu_prefill_attention). The whole-context
    path materializes a [T, S] mask for the bottom-right causal bias, and reads a long context's
    K/V once per query block from memory, where a piece's stays in cache."""
    if (q.device.type != "cpu" or window or sinks is not None or q.shape[0] == 0 or start <= 0
            or _flash_lse is None):
        return False
    if HOOK.fn is not None:
        return start > KEY_PIECE or q.dtype == torch.float32
    return q.dtype == torch.float32


def attention_lse_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: q [nh, T, hd], k/v [kvh, S, hd] (causal: the T queries are the last T of
    the S keys' positions) -> (o [nh, T, hd] in q's dtype, lse [nh, T] fp32), in fp32."""
    g = q.shape[0] // k.shape[0]
    s = q.float() @ k.float().repeat_interleave(g, 0).transpose(1, 2) * scale  # [nh, T, S]
    if causal:
        t, n = q.shape[1], k.shape[1]
        seen = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t)  # [T, S]
        s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [nh, T]
    o = torch.softmax(s, -1) @ v.float().repeat_interleave(g, 0)
    return o.to(q.dtype), lse


_flash_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_lse_torch on torch's CPU flash kernel, which returns the log-sum-exp. Without a
    mask a KV head's query heads go in as one head of g x T rows (each row sees every key: no
    K/V copy per query head); causal pieces (the chunk's own keys: S == T) go head by head."""
    nh, t, hd = q.shape
    kvh = k.shape[0]
    g = nh // kvh
    if causal:
        if k.shape[1] != t:
            raise ValueError(f"a causal piece is the chunk's own keys: {k.shape[1]} keys for {t} queries")
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)  # [nh, T, hd]: T keys, small
        o, lse = _flash_lse(q[None], k[None], v[None], 0.0, True, scale=scale)[:2]
        return o[0].reshape(nh, t, hd), lse[0].reshape(nh, t)
    qg = q.reshape(kvh, g * t, hd)  # [kvh, g*T, hd]: q [nh, T, hd] with head h = kv*g + j
    o, lse = _flash_lse(qg[None], k[None], v[None], 0.0, False, scale=scale)[:2]
    return o[0].reshape(nh, t, hd), lse[0].reshape(nh, t)


class Merge:
    """Partial outputs over disjoint key sets, folded in as they come (o [nh, T, hd], lse [nh, T])
    -> the output over their union, each part weighted by its share of the whole softmax mass,
    in fp32. One running output: memory does not grow with the number of pieces."""

    def __init__(self):
        self.o: torch.Tensor | None = None  # [nh, T, hd] fp32
        self.lse: torch.Tensor | None = None  # [nh, T] fp32

    def add(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        if self.o is None:
            self.o, self.lse = o.float(), lse.float()
            return
        total = torch.logaddexp(self.lse, lse)  # [nh, T]
        self.o = self.o * torch.exp(self.lse - total)[..., None] + o.float() * torch.exp(lse - total)[..., None]
        self.lse = total

    def result(self, dtype) -> torch.Tensor:
        return self.o.to(dtype)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype) -> torch.Tensor:
    """Merge of every part at once [(o, lse)] -> [nh, T, hd] in dtype."""
    m = Merge()
    for o, lse in parts:
        m.add(o, lse)
    return m.result(dtype)


def split_prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                            table: torch.Tensor, start: int, scale: float, lse_fn=attention_lse) -> torch.Tensor:
    """q [T, nh, hd] at positions start..start+T-1 (their K/V already in the pages);
    table [W] -> [T, nh, hd]: the pieces of splits(start) one by one, the hook in effect called
    before each but the first (hook(n), n = 1, 2, ...), then the chunk's own keys (causal),
    merged as they come."""
    t = q.shape[0]
    p = k_pages.shape[2]
    qh = q.transpose(0, 1).contiguous()  # [nh, T, hd]
    hook, out = HOOK.fn, Merge()
    for n, (a, b) in enumerate(splits(start, p)):
        if n and hook is not None:
            with key_points(None):  # a forward inside the hook (a short prompt's) does not split
                hook(n)
        ids = table[a // p:-(-b // p)]  # [pages of the piece]
        out.add(*lse_fn(qh, gather_fresh(k_pages, ids, b - a), gather_fresh(v_pages, ids, b - a), scale, False))
    first = start // p  # the chunk's own keys: from the page holding `start`
    ids = table[first:-(-(start + t) // p)]
    off = start - first * p
    k = gather_fresh(k_pages, ids, start + t - first * p)[:, off:]  # [kvh, T, hd]
    v = gather_fresh(v_pages, ids, start + t - first * p)[:, off:]
    out.add(*lse_fn(qh, k, v, scale, True))
    return out.result(q.dtype).transpose(0, 1).contiguous()  # [T, nh, hd]
