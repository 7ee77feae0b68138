"""KVSpace: requests' block tables in the one paged KV pool, grown as tokens arrive.

A running request owns the pages past its shared prefix; the prefix cache (if on) owns the
rest and gives pages back (LRU) when the pool runs short. What no one can give back raises
PagesExhausted, and the serving loop preempts a request to make room.
"""
from __future__ import annotations

from ..errors import FreeTokenError

from ..model.state import DecodeState
from .pages import PagesExhausted
from .prefix import PrefixCache


class KVSpace:
    def __init__(self, st: DecodeState, cache: PrefixCache | None):
        self.st, self.cache = st, cache

    def alloc(self, n: int) -> list[int]:
        short = n - self.st.pages.free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.st.pages.alloc(n)  # PagesExhausted if still short

    def restore(self, req) -> int:
        """A request's first prefill: fresh recurrent state, then whatever the prefix cache
        can restore. Returns the tokens that need no prefill."""
        self.st.reset(req.slot)
        req.pages, req.shared_pages = [], 0
        if self.cache is None:
            return 0
        return self.cache.restore(req, self.alloc)

    def grow(self, req, tokens: int) -> None:
        """Pages for positions [0, tokens) of `req`; PagesExhausted leaves it unchanged."""
        if tokens > self.st.width * self.st.page_size:  # the block table's row: the context
            raise FreeTokenError(f"the request reaches {tokens} tokens and the context holds {self.st.max_len}; "
                                 "send a shorter prompt or fewer max_tokens, or serve with a longer context")
        need = self.st.pages.pages_for(tokens) - len(req.pages)
        if need > 0:
            start = len(req.pages)
            req.pages = req.pages + self.alloc(need)
            self.st.set_pages(req.slot, req.pages, start)

    def release(self, req, in_state: list[int] | None) -> None:
        """The request ends (or is preempted): cache `in_state` (tokens whose K/V it holds,
        None: nothing trustworthy), free its other pages."""
        if self.cache is not None:
            self.cache.release(req, in_state)
        else:
            self.st.pages.release(req.pages[req.shared_pages:])
            req.pages, req.shared_pages = [], 0

    def stats(self) -> dict:
        p = self.st.pages
        return {"kv_pages_total": p.num_pages - 1, "kv_pages_used": p.used, "kv_pages_high_water": p.high_water}


__all__ = ["KVSpace", "PagesExhausted"]
