"""Python's cyclic garbage collector as a source of latency in the serving loop.

A full (generation 2) collection walks every container object the process holds: with torch,
transformers and the engine imported that is ~350k objects and ~115 ms on the 2-core dev
machine, whichever thread triggers it, the engine thread included (it holds the GIL). Such a
pause lands between two tokens of every stream decoding, and between two layers of a prompt
forward where decode steps interleave (runtime/interleave.py). The objects made at start-up
(modules, the model's parameters, graphs, the tokenizer) live as long as the server, so after
start-up they are moved out of the collector's reach (gc.freeze, as vLLM and SGLang do); later
collections walk only what serving made since. unfreeze() gives them back when the serving
engine ends (a process that starts several, such as a test run, can then reclaim them).

GcWatch times every collection (gc.callbacks) for /metrics and the benchmarks."""
from __future__ import annotations

import gc
import threading
import time
from collections import deque


def freeze_startup_objects() -> int:
    """Collect what start-up left as garbage, then freeze every live object (the next
    collections skip them); -> how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Give the frozen objects back to the collector (the oldest generation)."""
    gc.unfreeze()


class GcWatch:
    """Pauses of the cyclic collector, by generation: collections, total and longest seconds,
    and the latest pauses themselves (start, generation, seconds), process-wide (shared())."""

    _shared: GcWatch | None = None

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self.recent: deque[tuple[float, int, float]] = deque(maxlen=4096)  # (perf_counter at start, gen, s)
        self._t0: float | None = None
        self._lock = threading.Lock()  # stats() from another thread reads a consistent copy
        gc.callbacks.append(self._callback)

    @classmethod
    def shared(cls) -> GcWatch:
        """The process's one watch (one callback however many serving engines a process makes)."""
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def _callback(self, phase: str, info: dict) -> None:
        # the collector runs with the GIL held and never nests: one start, then its stop
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:
            return
        t0, g = self._t0, min(int(info.get("generation", 2)), 2)
        dt, self._t0 = time.perf_counter() - t0, None
        with self._lock:
            self.recent.append((t0, g, dt))
            self.collections[g] += 1
            self.seconds[g] += dt
            self.longest[g] = max(self.longest[g], dt)

    def stats(self) -> dict:
        """gc_collections_gen{0,1,2}, gc_seconds_gen{...}, gc_longest_ms_gen{...}, gc_frozen."""
        with self._lock:
            out = {}
            for g in range(3):
                out[f"gc_collections_gen{g}"] = self.collections[g]
                out[f"gc_seconds_gen{g}"] = round(self.seconds[g], 6)
                out[f"gc_longest_ms_gen{g}"] = round(self.longest[g] * 1e3, 3)
        out["gc_frozen"] = gc.get_freeze_count()
        return out

    def pauses(self, since: float = 0.0) -> list[tuple[float, int, float]]:
        """The recorded pauses that started at or after `since` (perf_counter seconds)."""
        with self._lock:
            return [p for p in self.recent if p[0] >= since]

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if GcWatch._shared is self:
            GcWatch._shared = None
