"""PrefixCache: the radix tree over the one paged KV pool, and the checkpoint store.

Design (shared in place): cached prefixes are pages of the same KV pool running requests use;
the radix tree owns them. A new request restores the deepest position where both the KV
prefix and (for hybrid models) a recurrent-state checkpoint survive: its block table starts
with the tree's pages, used where they lie (no copy, no second pool), and a partly used last
page is copied before the request writes into it (copy on write). Only the rest is prefilled.
When a request ends, its pages are handed to the tree (those holding tokens the tree already
has are freed). Checkpoints of the DeltaNet state live in their own pool, with their own
budget and LRU. Sliding-window layers kept in rings (model/state.py: only the window's pages,
per slot) are state the tree cannot share in place either: a checkpoint holds their last
window's keys and values beside the DeltaNet state, taken at the same anchors, and a restore
writes them back into the new slot's ring. A model with either kind of layer restores at
checkpoints only (hybrid); one with neither at any page of the tree (partial pages copied).
"""
from __future__ import annotations

import torch

from ..model.state import DecodeState
from .anchors import CheckpointPolicy, CheckpointStore
from .radix import RadixCache


class PrefixCache:
    def __init__(self, cfg, st: DecodeState, checkpoint_slots: int, policy: CheckpointPolicy):
        self.cfg, self.st, self.page = cfg, st, st.page_size
        self.radix = RadixCache(self.page)
        self.policy = policy
        self.hybrid = bool(cfg.linear_layers or st.ring)
        slots = checkpoint_slots if self.hybrid else 0
        self.ckpt = CheckpointStore(slots)

        def pool(t, shape):
            return torch.zeros((slots, *shape), dtype=t.dtype, device=t.device)
        self.conv = {l: pool(t, t.shape[1:]) for l, t in st.conv.items()}
        self.rec = {l: pool(t, t.shape[1:]) for l, t in st.rec.items()}
        # per ring layer, one pool per part a continuation reads (state.window_parts): [slots, n, heads, width]
        dt = {l: st.ring_tensors(l)[0].dtype for l in st.ring}
        self.win = {l: [torch.zeros((slots, n, h, w), dtype=dt[l], device=st.block_table.device)
                        for _, _, n, h, w in st.window_parts[l]] for l in st.ring}
        self.kv_evicted_pages = 0

    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint: the recurrent state of every linear-attention layer and the
        ring rows of every ring layer."""
        wins = [t for ts in self.win.values() for t in ts]
        return sum(t[0].numel() * t.element_size() for t in [*self.conv.values(), *self.rec.values(), *wins])

    # ---- pages --------------------------------------------------------------------------
    def evict(self, n_pages: int) -> int:
        """Give back up to n_pages cached pages no running request uses (LRU); returns how many."""
        freed = self.radix.evict(n_pages)
        self.kv_evicted_pages += len(freed)
        self.st.pages.release(freed)
        return len(freed)

    # ---- restore ------------------------------------------------------------------------
    def restore(self, req, alloc) -> int:
        """Before a request's first prefill: point its block table at the deepest reusable
        prefix of its tokens and restore the recurrent state there. Returns the number of
        tokens that need no prefill. alloc(n) -> n fresh pages (for the copy-on-write page)."""
        toks = req.tokens(0, req.prefill_end)
        limit = len(toks) - 1  # at least one token is prefilled: its logits start decoding
        n, pages, _ = self.radix.match(toks[:limit], partial=True)
        p, slot = self.ckpt.lookup(toks, n) if self.hybrid else (n, None)
        full = p // self.page
        # hold the whole pages the request reads in place (only those: the rest stays evictable)
        req.cache_node = self.radix.match(toks[:full * self.page])[2]
        self.radix.lock(req.cache_node)
        if p == 0:
            return 0
        req.pages, req.shared_pages = pages[:full], full
        if p % self.page:  # the request writes into this page from position p on: copy it first
            own = alloc(1)
            self.st.copy_page(pages[full], own[0])
            req.pages = req.pages + own
        self.st.set_pages(req.slot, req.pages)
        if slot is not None:
            for l in self.conv:
                self.st.conv[l][req.slot].copy_(self.conv[l][slot])
                self.st.rec[l][req.slot].copy_(self.rec[l][slot])
            for l, ts in self.win.items():
                self.st.write_window(l, req.slot, p, [t[slot] for t in ts])
        return p

    # ---- checkpoints --------------------------------------------------------------------
    def positions(self, seq, start: int, end: int) -> list[int]:
        return self.policy.positions(seq, start, end) if self.hybrid and self.ckpt.capacity else []

    def capture(self, prompt: list[int], cuts: list[int], evict: bool = True) -> "StateCapture | None":
        """Checkpoints at token boundaries `cuts` of `prompt`, to be filled by the DeltaNet
        layers during the prefill that crosses them (one pass, no split of the chunk). evict
        False: only into free checkpoint slots (inside another prompt forward, whose own
        capture may be writing the others)."""
        where: dict[int, int] = {}
        for c in cuts:
            s = self.ckpt.reserve(prompt[:c], evict)
            if s is not None:
                where[s] = c  # a later reservation that evicted an earlier one of these takes its slot
        return StateCapture(self, prompt, {c: s for s, c in where.items()}) if where else None

    def save(self, prefix: list[int], slot: int, evict: bool = True) -> None:
        """Checkpoint the recurrent state of `slot`, which has consumed exactly `prefix`.
        evict False: only into a free checkpoint slot (a prompt forward in flight may be
        writing the others: runtime/overlap.py)."""
        s = self.ckpt.reserve(prefix, evict)
        if s is None:
            return
        for l in self.conv:
            self.conv[l][s].copy_(self.st.conv[l][slot])
            self.rec[l][s].copy_(self.st.rec[l][slot])
        for l, ts in self.win.items():
            for t, rows in zip(ts, self.st.read_window(l, slot, len(prefix))):
                t[s].copy_(rows)

    # ---- finish -------------------------------------------------------------------------
    def release(self, req, in_state: list[int] | None) -> None:
        """A request ends: hand the pages holding `in_state` (tokens whose K/V it computed)
        to the tree, free the rest of its own pages, drop its hold on the prefix it reused.
        in_state None: its state is not trustworthy, cache nothing."""
        own = set(req.pages[req.shared_pages:])
        try:
            if in_state:
                used = req.pages[:-(-len(in_state) // self.page)]
                _, dup = self.radix.insert(in_state, used)
                own -= set(used) - set(dup)  # now the tree's
            self.st.pages.release(own)
        finally:
            req.pages, req.shared_pages = [], 0
            if req.cache_node is not None:
                self.radix.unlock(req.cache_node)
                req.cache_node = None

    def stats(self) -> dict:
        return {"kv_pages_cached": self.radix.cached_pages, "kv_pages_free": self.st.pages.free,
                "kv_pages_evicted": self.kv_evicted_pages, "checkpoints": len(self.ckpt),
                "checkpoint_hits": self.ckpt.hits, "checkpoint_evictions": self.ckpt.evictions}


class StateCapture:
    """Pool slots that a prefill fills with the recurrent state at chosen token boundaries.

    The DeltaNet layers call offsets() for the boundaries inside their chunk and store() with
    the state there. If the prefill fails, abort() drops the half-written checkpoints."""

    def __init__(self, cache: PrefixCache, prompt: list[int], slots: dict[int, int]):
        self.cache, self.prompt, self.slots = cache, prompt, slots
        self.positions = sorted(slots)

    def offsets(self, start: int, t: int) -> list[int]:
        """Boundaries inside the chunk at positions start..start+t, as offsets in 1..t."""
        return [p - start for p in self.positions if start < p <= start + t]

    def store(self, layer: int, pos: int, conv: torch.Tensor, rec: torch.Tensor) -> None:
        s = self.slots[pos]
        self.cache.conv[layer][s].copy_(conv)
        self.cache.rec[layer][s].copy_(rec)

    def store_window(self, layer: int, pos: int, rows: list[torch.Tensor]) -> None:
        """A ring layer's rows at boundary pos (DecodeState.read_window)."""
        s = self.slots[pos]
        for t, x in zip(self.cache.win[layer], rows):
            t[s].copy_(x)

    def abort(self) -> None:
        for p in self.positions:
            self.cache.ckpt.discard(self.prompt[:p])
