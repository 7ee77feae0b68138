"""Python's cyclic garbage collector as a source of latency in the serving loop.

A full (generation 2) collection walks every container object the process holds: with torch,
transformers and the engine imported that is ~350k objects and ~115 ms on the 2-core dev
machine, whichever thread triggers it, the engine thread included (it holds the GIL). Such a
pause lands between two tokens of every stream decoding, and between two layers of a prompt
forward where decode steps interleave (runtime/interleave.py). The objects made at start-up
(modules, the model's parameters, graphs, the tokenizer, the web app) live as long as the
server, so after start-up they are moved out of the collector's reach (gc.freeze, as vLLM and
SGLang do); later collections walk only what serving made since. The freeze is given back
(gc.unfreeze) when the last holder of it ends, so a process that starts several serving
engines, such as a test run, can reclaim them.

GcWatch times every collection (gc.callbacks) for /metrics and the benchmarks. Its callback
takes no lock: a collection runs its callbacks in the thread that triggered it, which may be a
reader of these numbers in the middle of an allocation, and a lock held there would deadlock that
thread. The callback's updates are plain attribute and list writes under the GIL (collections
never nest), and readers copy each list in one C-level call before they use it (the deque of
pauses with the collector off for the copy)."""
from __future__ import annotations

import gc
import threading
import time
from collections import deque

_holders = 0  # serving engines holding the freeze (the last one to let go unfreezes)
_holders_lock = threading.Lock()  # never taken inside a GC callback


def freeze_startup_objects() -> int:
    """Collect what start-up left as garbage, then freeze every live object (the next
    collections skip them), as one more holder of the freeze; -> how many are frozen."""
    global _holders
    with _holders_lock:
        _holders += 1
        gc.collect()
        gc.freeze()
        return gc.get_freeze_count()


def refreeze() -> int:
    """Freeze what was made since (a holder's later start-up work: the web app, the listening
    server), without taking another hold; -> how many are frozen."""
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Let go of one hold; the last one gives the frozen objects back to the collector."""
    global _holders
    with _holders_lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
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
        gc.callbacks.append(self._callback)

    @classmethod
    def shared(cls) -> GcWatch:
        """The process's one watch (one callback however many serving engines a process makes)."""
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def _callback(self, phase: str, info: dict) -> None:
        # no lock here (see the module's docstring); one start, then its stop, in one thread
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:
            return
        t0, g = self._t0, min(int(info.get("generation", 2)), 2)
        dt, self._t0 = time.perf_counter() - t0, None
        self.collections[g] += 1
        self.seconds[g] += dt
        if dt > self.longest[g]:
            self.longest[g] = dt
        self.recent.append((t0, g, dt))

    def stats(self) -> dict:
        """gc_collections_gen{0,1,2}, gc_seconds_gen{...}, gc_longest_ms_gen{...}, gc_frozen."""
        n, s, m = list(self.collections), list(self.seconds), list(self.longest)  # copies first
        out = {}
        for g in range(3):
            out[f"gc_collections_gen{g}"] = n[g]
            out[f"gc_seconds_gen{g}"] = round(s[g], 6)
            out[f"gc_longest_ms_gen{g}"] = round(m[g] * 1e3, 3)
        out["gc_frozen"] = gc.get_freeze_count()
        return out

    def pauses(self, since: float = 0.0, until: float = float("inf")) -> list[tuple[float, int, float]]:
        """The recorded pauses that started in [since, until] (perf_counter seconds)."""
        # the copy allocates, and a collection it triggers would append to the deque mid-copy
        # (an error; retrying would only trigger the next one): no collection during the copy
        was = gc.isenabled()
        gc.disable()
        try:
            snap = tuple(self.recent)
        finally:
            if was:
                gc.enable()
        return [p for p in snap if since <= p[0] <= until]

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if GcWatch._shared is self:
            GcWatch._shared = None
