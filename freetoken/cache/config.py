"""Prefix-cache options (the `ft serve` flags) and their validation."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import FreeTokenError

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30}


@dataclass
class CacheConfig:
    enabled: bool = True
    page_size: int = 16  # tokens per KV page (match granularity)
    checkpoint_budget: str = "32"  # checkpoint slots ("32") or bytes ("2GiB")
    checkpoint_policy: str = "anchors"  # anchors | interval:N | none
    min_gap: int = 64  # anchors closer than this to an earlier one are not checkpointed

    def __post_init__(self):
        if self.page_size < 1:
            raise FreeTokenError("--page-size must be >= 1")
        from .anchors import CheckpointPolicy
        try:
            CheckpointPolicy(self.checkpoint_policy, set())
        except ValueError as e:
            raise FreeTokenError(f"--checkpoint-policy: {e}") from None
        self._budget = parse_budget(self.checkpoint_budget)

    def checkpoint_slots(self, bytes_per_checkpoint: int) -> int:
        kind, n = self._budget
        if kind == "slots":
            return n
        return int(n // max(bytes_per_checkpoint, 1))

    def build(self, engine, st, checkpoint_slots: int):
        """The prefix cache over `st`'s page pool, with checkpoint slots the memory plan sized."""
        from .anchors import CheckpointPolicy, anchor_ids, turn_open_ids
        from .prefix import PrefixCache
        tid = engine.tokenizer.token_id
        policy = CheckpointPolicy(self.checkpoint_policy, anchor_ids(tid), turn_open_ids(tid), self.min_gap)
        return PrefixCache(engine.cfg, st, checkpoint_slots, policy)


def parse_budget(text: str) -> tuple[str, int]:
    """'32' -> ('slots', 32); '2GiB' / '512MB' / '1e9B' -> ('bytes', n)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m:
        raise FreeTokenError(f"--checkpoint-budget: {text!r} is neither a slot count nor a size like 2GiB")
    num, unit = m.group(1), m.group(2).lower()
    if unit == "":
        if not num.isdigit():
            raise FreeTokenError(f"--checkpoint-budget: a slot count must be an integer, got {text!r}")
        return "slots", int(num)
    if unit not in _UNITS:
        raise FreeTokenError(f"--checkpoint-budget: unknown unit {m.group(2)!r} (use B, KB, MB, GB, KiB, MiB, GiB)")
    return "bytes", int(float(num) * _UNITS[unit])
