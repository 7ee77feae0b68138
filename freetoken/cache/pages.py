"""Which KV pages are free: the allocator of the one paged KV pool (plain Python, no torch).

Every full-attention K/V byte the engine keeps lives in one pool of fixed-size pages. A page
belongs to exactly one owner at a time: the free list, a running request (its private pages),
or the radix tree (cached prefixes, shared in place by every request that reuses them). Page 0
is never handed out: decode rows that are not running write their K/V there, and block-table
entries past a sequence's end point at it.
"""
from __future__ import annotations

SCRATCH = 0  # the page idle rows write into; never allocated


class PagesExhausted(Exception):
    """No free page is left (after evicting whatever the prefix cache could give back)."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("a KV pool needs at least 2 pages (one is the scratch page)")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, SCRATCH, -1))  # pop() hands out low ids first
        self.high_water = 0  # most pages ever in use at once

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n pages, or PagesExhausted (nothing is taken then)."""
        if n > len(self._free):
            raise PagesExhausted(f"{n} KV pages wanted, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self.high_water = max(self.high_water, self.used)
        return out

    def release(self, pages) -> None:
        for p in pages:
            if p == SCRATCH:
                raise ValueError("the scratch page is not allocatable")
            self._free.append(p)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)
