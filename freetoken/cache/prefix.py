"""PrefixCache: the tensors behind the radix tree and the checkpoint store.

Design (copy-in): each running request decodes in its own contiguous slot of the decode
state, as before; cached prefixes live in a shared pool of KV pages
([pages, kv_heads, page_size, head_dim] per attention layer) and a pool of DeltaNet state
checkpoints. A new request restores the deepest position where both survive: the KV pages are
copied into its slot (a device copy, far cheaper than recomputing them) and the recurrent
state is copied from the checkpoint taken at exactly that token boundary; only the rest is
prefilled. A finished request's KV goes into the pool page by page. Sliding-window layers can
join by keeping only their last window of pages.
"""
from __future__ import annotations

import torch

from ..model.state import DecodeState
from .anchors import CheckpointPolicy, CheckpointStore
from .radix import RadixCache


class PrefixCache:
    def __init__(self, cfg, st: DecodeState, page_size: int, kv_pages: int, checkpoint_slots: int,
                 policy: CheckpointPolicy):
        self.cfg, self.page = cfg, page_size
        self.radix = RadixCache(page_size)
        self.free_pages = list(range(kv_pages))
        self.policy = policy
        self.hybrid = bool(cfg.linear_layers)
        shape = (kv_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
        self.k = {l: torch.zeros(shape, dtype=t.dtype, device=t.device) for l, t in st.k.items()}
        self.v = {l: torch.zeros(shape, dtype=t.dtype, device=t.device) for l, t in st.v.items()}
        slots = checkpoint_slots if self.hybrid else 0
        self.ckpt = CheckpointStore(slots)
        self.conv = {l: torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, device=t.device) for l, t in st.conv.items()}
        self.rec = {l: torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, device=t.device) for l, t in st.rec.items()}
        self.kv_evicted_pages = 0

    # ---- bytes, for the log and the budget flags ----------------------------------------
    @staticmethod
    def checkpoint_bytes(st: DecodeState) -> int:
        """Bytes of one recurrent-state checkpoint (every linear-attention layer)."""
        return sum(t[0].numel() * t.element_size() for t in [*st.conv.values(), *st.rec.values()])

    # ---- restore ------------------------------------------------------------------------
    def restore(self, req, st: DecodeState) -> int:
        """Before a request's first prefill: copy in the deepest reusable prefix of its prompt.
        Returns the number of prompt tokens that need no prefill."""
        toks = req.prompt_ids
        limit = len(toks) - 1  # at least one token is prefilled: its logits start decoding
        n, pages, node = self.radix.match(toks[:limit], partial=True)
        self.radix.lock(node)
        req.cache_node = node
        if self.hybrid:
            p, slot = self.ckpt.lookup(toks, n)
        else:
            p, slot = n, None
        if p == 0:
            return 0
        used = -(-p // self.page)
        for l in self.k:
            idx = torch.tensor(pages[:used], device=self.k[l].device)
            for pool, dst in ((self.k[l], st.k[l]), (self.v[l], st.v[l])):
                blk = pool[idx].permute(1, 0, 2, 3).reshape(pool.shape[1], used * self.page, pool.shape[3])
                dst[req.slot, :, :used * self.page] = blk  # positions >= p are overwritten by prefill
        if slot is not None:
            for l in self.conv:
                st.conv[l][req.slot].copy_(self.conv[l][slot])
                st.rec[l][req.slot].copy_(self.rec[l][slot])
        return p

    # ---- checkpoints --------------------------------------------------------------------
    def positions(self, seq: list[int], start: int, end: int) -> list[int]:
        return self.policy.positions(seq, start, end) if self.hybrid and self.ckpt.capacity else []

    def capture(self, prompt: list[int], cuts: list[int]) -> "StateCapture | None":
        """Checkpoints at token boundaries `cuts` of `prompt`, to be filled by the DeltaNet
        layers during the prefill that crosses them (one pass, no split of the chunk)."""
        where: dict[int, int] = {}
        for c in cuts:
            s = self.ckpt.reserve(prompt[:c])
            if s is not None:
                where[s] = c  # a later reservation that evicted an earlier one of these takes its slot
        return StateCapture(self, prompt, {c: s for s, c in where.items()}) if where else None

    def save(self, prefix: list[int], st: DecodeState, slot: int) -> None:
        """Checkpoint the recurrent state of `slot`, which has consumed exactly `prefix`."""
        s = self.ckpt.reserve(prefix)
        if s is None:
            return
        for l in self.conv:
            self.conv[l][s].copy_(st.conv[l][slot])
            self.rec[l][s].copy_(st.rec[l][slot])

    # ---- finish -------------------------------------------------------------------------
    def release(self, req, st: DecodeState | None, in_state: list[int] | None) -> None:
        """A request ends: cache the KV of `in_state` (tokens whose K/V its slot holds), then
        drop its hold on the prefix it reused. st None: the state is not trustworthy."""
        node = getattr(req, "cache_node", None)
        try:
            if st is not None and in_state and self.k:
                self._insert(req.slot, st, in_state)
        finally:
            if node is not None:
                self.radix.unlock(node)
                req.cache_node = None

    def _insert(self, slot: int, st: DecodeState, toks: list[int]) -> None:
        p = self.page
        matched, pages, node = self.radix.match(toks)  # whole pages already cached
        need = -(-(len(toks) - matched) // p)  # the last page may be partly filled
        if need == 0:
            return
        self.radix.lock(node)  # keep the matched path while evicting for room
        try:
            if len(self.free_pages) < need:
                freed = self.radix.evict(need - len(self.free_pages))
                self.kv_evicted_pages += len(freed)
                self.free_pages += freed
            take = min(need, len(self.free_pages))
            new = [self.free_pages.pop() for _ in range(take)]
        finally:
            self.radix.unlock(node)
        if not new:
            return
        end = min(len(toks), matched + take * p)
        idx = torch.tensor(new, device=next(iter(self.k.values())).device)
        for l in self.k:
            for pool, src in ((self.k[l], st.k[l]), (self.v[l], st.v[l])):
                blk = src[slot, :, matched:matched + take * p]  # [kvh, <= take*P, hd]
                if blk.shape[1] < take * p:  # at the very end of the context
                    blk = torch.nn.functional.pad(blk, (0, 0, 0, take * p - blk.shape[1]))
                pool[idx] = blk.reshape(blk.shape[0], take, p, blk.shape[2]).permute(1, 0, 2, 3)
        _, dup = self.radix.insert(toks[:end], pages + new)
        self.free_pages += [d for d in dup if d in new]  # a tail that was already cached

    def stats(self) -> dict:
        return {"kv_pages_cached": self.radix.cached_pages, "kv_pages_free": len(self.free_pages),
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

    def abort(self) -> None:
        for p in self.positions:
            self.cache.ckpt.discard(self.prompt[:p])
