"""Semantic anchors and the recurrent-state checkpoint store.

Agent frameworks edit context exactly at turn, thinking, tool-call and tool-output
boundaries. Checkpoints of the state the page pool cannot share (linear-attention state, the
rings of sliding-window layers: cache/prefix.py) taken at those token boundaries (just
before and just after each such special token) survive the edits; checkpoints at fixed
intervals mostly do not. The anchor tokens come from the tokenizer, not from a per-model list.
Plain Python: checkpoint slots index a state pool the engine owns.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

# names of the special tokens that open/close turns, thinking, tool calls and tool outputs:
# ChatML (Qwen); Harmony (GPT-OSS: a message is <|start|>role<|channel|>c<|message|>... and ends
# in <|end|>, <|call|> for a tool call or <|return|> for the final answer); DeepSeek (V4: turns
# after <｜User｜> and <｜Assistant｜>, an answer ends in <｜end▁of▁sentence｜>)
ANCHOR_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>",
                 "<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|return|>",
                 "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")


TURN_OPEN = ("<|im_start|>", "<|start|>", "<｜User｜>")


def _ids(token_id, names) -> set[int]:
    return {i for i in (token_id(t) for t in names) if i is not None}


def anchor_ids(token_id) -> set[int]:
    """Ids of the anchor tokens this tokenizer has (token_id: str -> int | None)."""
    return _ids(token_id, ANCHOR_TOKENS)


def turn_open_ids(token_id) -> set[int]:
    """Ids of the tokens that open a turn (a checkpoint just before one is always kept)."""
    return _ids(token_id, TURN_OPEN)


class CheckpointPolicy:
    """Where to checkpoint: 'anchors', 'interval:N' or 'none'.

    anchors: the boundary just before and just after each anchor token, thinned so that a
    boundary within `min_gap` tokens after another is skipped, except the one just before a
    turn opener (always kept). Anchors come in clusters (`</tool_call><|im_end|>\n<|im_start|>`);
    each checkpoint costs a state copy and a slot of the checkpoint budget (not a prefill
    split: the DeltaNet layers emit it in the same pass), and a skipped one costs at most
    min_gap re-prefilled tokens after an edit."""

    def __init__(self, spec: str, anchors: set[int], turn_open: set[int] | None = None, min_gap: int = 64):
        self.spec = spec
        self.anchors = anchors
        self.turn_open = turn_open or set()
        self.min_gap = min_gap
        self.interval = 0
        if spec.startswith("interval:"):
            try:
                self.interval = int(spec.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"bad checkpoint policy {spec!r}: interval:N needs an integer N") from None
            if self.interval < 1:
                raise ValueError(f"bad checkpoint policy {spec!r}: N must be >= 1")
        elif spec not in ("anchors", "none"):
            raise ValueError(f"bad checkpoint policy {spec!r}: use anchors, interval:N or none")

    def positions(self, tokens: list[int], start: int, end: int) -> list[int]:
        """Token boundaries p in (start, end] (state after tokens[:p]) to checkpoint."""
        if self.spec == "none":
            return []
        if self.interval:
            first = (start // self.interval + 1) * self.interval
            return list(range(first, end + 1, self.interval))
        out = set()
        # tokens[end] may be known (the next chunk, or a token sampled but not yet fed): an
        # anchor there asks for the boundary just before it, p = end
        for i in range(max(start - 1, 0), min(end + 1, len(tokens))):
            if tokens[i] in self.anchors:
                for p in (i, i + 1):  # just before and just after the special token
                    if start < p <= end and self._keep(tokens, p):
                        out.add(p)
        return sorted(out)

    def _keep(self, tokens: list[int], p: int) -> bool:
        """Keep p unless an anchor token lies in the min_gap tokens before it (a turn opener
        at p is always kept)."""
        if p < len(tokens) and tokens[p] in self.turn_open:
            return True
        return not any(tokens[j] in self.anchors for j in range(max(0, p - self.min_gap), p))


class CheckpointStore:
    """LRU of recurrent-state checkpoints, keyed by the exact token prefix they follow.

    Keys are tuples of token ids (the prefix is what makes a checkpoint valid); slots are
    indices into the engine's checkpoint pool, recycled least recently used first, with a
    budget of its own, apart from the KV pages."""

    def __init__(self, slots: int):
        self.capacity = slots
        self.free = list(range(slots))
        self.entries: OrderedDict[tuple[int, ...], int] = OrderedDict()  # prefix -> slot, LRU order
        self.hits = self.evictions = 0
        self._ids = itertools.count()

    def lookup(self, tokens: list[int], max_len: int) -> tuple[int, int | None]:
        """Deepest checkpoint at a prefix of tokens[:max_len]: (position, slot) or (0, None)."""
        best = (0, None)
        for key, slot in self.entries.items():
            n = len(key)
            if best[0] < n <= max_len and tuple(tokens[:n]) == key:
                best = (n, slot)
        if best[1] is not None:
            self.entries.move_to_end(tuple(tokens[:best[0]]))
            self.hits += 1
        return best

    def reserve(self, prefix: list[int], evict: bool = True) -> int | None:
        """A slot to save the state after `prefix` into (evicting the LRU one if full, unless
        evict is False: then None)."""
        key = tuple(prefix)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        if self.capacity == 0 or (not self.free and not evict):
            return None
        if not self.free:
            _, slot = self.entries.popitem(last=False)
            self.evictions += 1
            self.free.append(slot)
        slot = self.free.pop()
        self.entries[key] = slot
        return slot

    def discard(self, prefix: list[int]) -> None:
        """Forget a checkpoint whose state was never written (its prefill failed)."""
        slot = self.entries.pop(tuple(prefix), None)
        if slot is not None:
            self.free.append(slot)

    def __len__(self) -> int:
        return len(self.entries)
