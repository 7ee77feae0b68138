"""Radix tree over token ids mapping cached prefixes to KV pages (as in SGLang), with LRU
eviction of pages no running request holds.

Granularity is a page of `page_size` tokens. Each edge holds a run of pages and splits at a
page boundary when two sequences diverge inside it; a leaf may end in a partly filled page
(the tail of a finished request), so a later turn can reuse its prefix to the last token.
Plain Python: page ids index a KV pool the engine owns.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    key: tuple[int, ...] = ()  # tokens on the edge from the parent (a multiple of page_size)
    pages: list[int] = field(default_factory=list)  # one KV page per page_size tokens of key
    parent: "Node | None" = None
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)  # first page of key -> child
    refs: int = 0  # running requests holding this node (and so all its ancestors)
    last_use: int = 0

    def touch(self) -> None:
        self.last_use = next(_clock)


class RadixCache:
    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.root = Node()
        self.root.refs = 1  # never evicted
        self.cached_pages = 0

    def _first(self, tokens) -> tuple[int, ...]:
        return tuple(tokens[:self.page_size])

    def match(self, tokens: list[int], partial: bool = False) -> tuple[int, list[int], Node]:
        """Longest cached page-aligned prefix of `tokens`: (length, its pages, deepest node).

        partial: also use the first tokens of one more page when they match (its page is
        returned too; a reader copies it and overwrites the rest). The node stays the last
        one matched in full."""
        node, pos, pages = self.root, 0, []
        p = self.page_size
        while pos + p <= len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + p]))
            if child is None:
                break
            n = self._common(child.key, tokens, pos)
            if n < len(child.key):
                if n == 0:
                    break
                child = self._split(child, n)
            pages += child.pages
            pos += len(child.key)
            node = child
            node.touch()
        if partial:
            best, page = self._partial(node, tokens, pos)
            if page is not None:
                return pos + best, pages + [page], node
        return pos, pages, node

    def _partial(self, node: Node, tokens, pos: int):
        """The child whose first page shares the most leading tokens with tokens[pos:]."""
        best, page = 0, None
        for child in node.children.values():
            r, lim = 0, min(self.page_size, len(tokens) - pos, len(child.key))
            while r < lim and child.key[r] == tokens[pos + r]:
                r += 1
            if r > best:
                best, page = r, child.pages[0]
        return best, page

    def _common(self, key, tokens, pos) -> int:
        """Tokens of `key` matching tokens[pos:], rounded down to whole pages."""
        p, n = self.page_size, 0
        while n + p <= len(key) and pos + n + p <= len(tokens) and \
                tuple(key[n:n + p]) == tuple(tokens[pos + n:pos + n + p]):
            n += p
        return n

    def _split(self, node: Node, n: int) -> Node:
        """Cut node's edge after n tokens; returns the new upper node."""
        upper = Node(node.key[:n], node.pages[:n // self.page_size], node.parent, refs=node.refs,
                     last_use=node.last_use)
        node.parent.children[self._first(upper.key)] = upper
        node.key, node.pages = node.key[n:], node.pages[n // self.page_size:]
        node.parent = upper
        upper.children[self._first(node.key)] = node
        return upper

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[Node, list[int]]:
        """Cache `tokens` (pages[i] holds tokens [i*P, (i+1)*P); a last, partly filled page
        is allowed). Tokens beyond the pages given are dropped.

        Returns (deepest node, pages of `pages` that were already cached under the same
        prefix: the caller frees those, the tree keeps its own copies)."""
        p = self.page_size
        tokens = list(tokens[:len(pages) * p])
        matched, _, node = self.match(tokens)
        dup = pages[:matched // p]
        tail = len(tokens) - matched
        if 0 < tail < p and self._partial(node, tokens, matched)[0] == tail:
            dup = pages[:matched // p + 1]  # the tail is already inside a cached page
        elif tail > 0:
            leaf = Node(tuple(tokens[matched:]), list(pages[matched // p:]), node)
            leaf.touch()
            node.children[self._first(leaf.key)] = leaf
            self.cached_pages += len(leaf.pages)
            node = leaf
        return node, dup

    def lock(self, node: Node) -> None:
        """A running request uses the prefix ending at node: none of it may be evicted."""
        while node is not None:
            node.refs += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.refs -= 1
            node.touch()
            node = node.parent

    def evict(self, n_pages: int) -> list[int]:
        """Free at least n_pages (fewer if not enough are unreferenced): least recently used
        leaves first. Returns the freed page ids."""
        freed: list[int] = []
        while len(freed) < n_pages:
            leaves = [nd for nd in self._nodes() if not nd.children and nd.refs == 0 and nd is not self.root]
            if not leaves:
                break
            victim = min(leaves, key=lambda nd: nd.last_use)
            freed += victim.pages
            self.cached_pages -= len(victim.pages)
            del victim.parent.children[self._first(victim.key)]
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            nd = stack.pop()
            yield nd
            stack.extend(nd.children.values())
