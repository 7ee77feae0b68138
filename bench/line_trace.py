"""Which Python line the host is blocked in, during a stretch of prompt work (bench.interference
--layer-lines). The profiler's host view of the H200 runs named the operators that held the host
(aten::mm, cudaMemcpyAsync up to 6-7 ms) but not where they were called from (torch 2.11's
profiler recorded no Python frames there). Here sys.settrace stamps every line, call and return
event of the loop's thread while a stretch runs; the time from one event to the next belongs to
the earlier event's line (a C call inside a line emits nothing until the line ends). Lines that
took `min_ms` or more are kept, by stretch and site.

The tracer costs ~1-2 us a line: a traced layer's host time grows, so read the sites, not the
row's ratios (the flag is for diagnosis only)."""
from __future__ import annotations

import linecache
import os
import statistics
import sys
import time

import freetoken


# the repository's root (the folder holding the freetoken package): its files are named from it
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(freetoken.__file__))) + os.sep


def _site(code, line: int) -> str:
    """'freetoken/model/attention.py:64': a path from the repository's root, or from
    site-packages for a library's file."""
    path = code.co_filename
    k = path.rfind("site-packages" + os.sep)
    if k >= 0:
        path = path[k + len("site-packages" + os.sep):]
    elif path.startswith(_ROOT):
        path = path[len(_ROOT):]
    return f"{path}:{line}"


class LineTrace:
    def __init__(self, min_ms: float = 1.0, keep: int = 20):
        self.min_ns = int(min_ms * 1e6)
        self.keep = keep
        self.sites: dict[tuple[str, str, str], list[float]] = {}  # (stretch, site, event) -> ms each time
        self.code: dict[str, str] = {}  # site -> its source line
        self._events: list | None = None
        self._prev = None  # the thread's tracer before start() (a debugger's, coverage's), put back at stop()
        self._frames: list = []  # (frame, its f_trace before start())

    def _trace(self, frame, event, arg):
        ev = self._events
        if ev is not None:
            if event == "return" and frame.f_back is not None:  # what follows runs in the caller's line
                ev.append((time.perf_counter_ns(), time.thread_time_ns(), frame.f_back.f_code,
                           frame.f_back.f_lineno, event))
            elif event in ("call", "line", "return"):
                ev.append((time.perf_counter_ns(), time.thread_time_ns(), frame.f_code, frame.f_lineno, event))
            return self._trace
        return None  # stopped: a frame that kept this tracer (a generator's) traces no further

    def start(self) -> None:
        """From here on this thread's lines are stamped (and the frames already running: the
        forward's layer loop that calls the hooks is one of them)."""
        self._events = []
        self._prev = sys.gettrace()
        self._frames = []
        f = sys._getframe(1)
        while f is not None:  # settrace reaches new frames only; these get their line events too
            self._frames.append((f, f.f_trace))
            f.f_trace = self._trace
            f = f.f_back
        sys.settrace(self._trace)
        self._events.append((time.perf_counter_ns(), time.thread_time_ns(), None, 0, "start"))

    def stop(self, stretch: str) -> None:
        """The stretch ends: its slow lines are kept under `stretch`; the thread's tracer and
        the frames' are what they were before start()."""
        if self._events is None:
            return
        sys.settrace(self._prev)
        for f, old in self._frames:
            f.f_trace = old
        self._frames, self._prev = [], None
        ev, self._events = self._events, None
        ev.append((time.perf_counter_ns(), time.thread_time_ns(), None, 0, "stop"))
        for (t0, c0, code, line, kind), (t1, c1, *_) in zip(ev, ev[1:]):
            if t1 - t0 < self.min_ns or code is None:
                continue
            site = _site(code, line)
            self.code.setdefault(site, linecache.getline(code.co_filename, line).strip()[:120])
            self.sites.setdefault((stretch, site, kind), []).append(((t1 - t0) / 1e6, (c1 - c0) / 1e6))

    def summary(self) -> list[dict]:
        """The sites by how often they held the host `min_ms` or more: stretch, site, its source,
        the event the time followed (line: the line itself; call: entering a function; return: the
        rest of the caller's line after a call returned, named by the caller's site), count, p50
        and max ms, and the p50 of the thread's CPU time meanwhile (near the wall time: the thread
        ran, spinning in a driver's wait say; near 0: it slept, on a lock such as the GIL, or was
        off the CPU)."""
        rows = [{"stretch": s, "site": site, "code": self.code.get(site, ""), "after": kind, "count": len(ms),
                 "p50_ms": round(statistics.median(w for w, _ in ms), 2), "max_ms": round(max(w for w, _ in ms), 2),
                 "cpu_p50_ms": round(statistics.median(c for _, c in ms), 2)}
                for (s, site, kind), ms in self.sites.items()]
        rows.sort(key=lambda r: (-r["count"], -r["max_ms"]))
        return rows[:self.keep]
