"""Where an interleaved prompt forward's time goes, layer by layer: device time (CUDA events on
the forward's stream) beside host time, for each stretch of prompt work between two hook points.

The serving loop learns each layer's cost from the wall time of the cycles between decode steps,
shared among the queued layers (runtime/interleave.py). That cannot tell a layer's device work
from host work done around it (a forward's set-up lands in its first cycle). Here each stretch is
timed on its own: from the hook after point i (the decode step that may run there excluded) to
the hook before the next point, on the device and on the host. Used by bench.interference
(--layer-events); on the CPU only the host times are kept."""
from __future__ import annotations

import statistics
import time

import torch


class LayerTimeline:
    def __init__(self, device: torch.device, keep: int = 512, lines=None):
        """lines: a bench.line_trace.LineTrace that stamps each stretch's Python lines (or None)."""
        self.cuda = torch.device(device).type == "cuda"
        self.lines = lines
        self._stretch: str | None = None  # the stretch the line tracer is in
        self.keep = keep  # forwards kept (the oldest dropped): a 32k prompt runs tens of them
        self.forwards: list[dict] = []
        self.open: dict | None = None

    def _mark(self, what):
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.open["marks"].append((what, time.perf_counter(), ev))

    def begin(self, tokens: int) -> None:
        """A prompt forward (not one nested between another's layers) starts."""
        self.open = {"tokens": tokens, "marks": []}
        self._mark("begin")
        self._trace("setup")

    def enter(self, i: float) -> None:
        """The hook before point i starts (a decode step may run inside it)."""
        if self.open is not None:
            self._trace(None)
            self._mark(("in", i))

    def leave(self, i: float, stepped: bool = False) -> None:
        """The hook before point i returns: point i's prompt work follows. stepped: a decode
        step started inside the hook. A step that waits for its tokens drains the device's
        queue (the point's work then starts on an idle device, as fast as the host launches
        it); a deferred one (runtime/deferred_step.py) does not, so after_step compares
        different things with deferral on and off."""
        if self.open is not None:
            self._mark(("out", i, stepped))
            self._trace(f"{i:g}")

    def end(self) -> None:
        if self.open is None:
            return
        if self._stretch not in (None, "setup"):
            self._stretch = "tail"  # the last point's work is the tail, as stretches() names it
        self._trace(None)
        self._mark("end")
        self.forwards.append(self.open)
        self.forwards = self.forwards[-self.keep:]
        self.open = None

    def abort(self) -> None:
        """The forward failed: it is not kept, and the line tracer stops."""
        self._stretch = None if self._stretch is None else "failed"
        self._trace(None)
        self.open = None

    def _trace(self, stretch: str | None) -> None:
        """The line tracer leaves the stretch it is in, and enters `stretch` (None: none)."""
        if self.lines is None:
            return
        if self._stretch is not None:
            self.lines.stop(self._stretch)
        self._stretch = stretch
        if stretch is not None:
            self.lines.start()

    def stretches(self, fwd: dict) -> list[tuple[str, float, float | None, bool]]:
        """(name, host ms, device ms or None, after a decode step) of one forward: "setup" (its
        start to the first hook: the loop's host work, the embedding), each point's work ("3",
        "3.5": from the hook before it to the next hook) and "tail" (the last point's hook to
        the forward's end: the last layer, the head, the sync)."""
        out, marks = [], fwd["marks"]
        for (a, ta, ea), (b, tb, eb) in zip(marks, marks[1:]):
            stepped = False
            if a == "begin":
                name = "setup"
            elif a[0] == "out":
                name, stepped = ("tail" if b == "end" else f"{a[1]:g}"), a[2]
            else:
                continue  # in -> out: the hook itself (a decode step), not prompt work
            dev = ea.elapsed_time(eb) if ea is not None else None
            out.append((name, (tb - ta) * 1e3, dev, stepped))
        return out

    def summary(self, cap: int | None = None, top: int = 8) -> dict | None:
        """Per stretch name, the median host and device ms over the forwards, split into graphed
        (tokens <= cap) and eager forwards; the costliest `top` of each by device time (host time
        off CUDA), and each stretch's median where it is one of them. after_step: per stretch
        name, [forwards where a decode step ran just before it, their median device (host off
        CUDA) ms, the others' median]: what a drained queue costs the work that follows it."""
        if not self.forwards:
            return None
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for kind, pick in (("graphed", lambda n: cap is not None and n <= cap),
                           ("eager", lambda n: cap is None or n > cap)):
            fwds = [f for f in self.forwards if pick(f["tokens"])]
            if not fwds:
                continue
            host: dict[str, list[float]] = {}
            dev: dict[str, list[float]] = {}
            split: dict[str, tuple[list, list]] = {}
            for f in fwds:
                for name, h, d, stepped in self.stretches(f):
                    host.setdefault(name, []).append(h)
                    if d is not None:
                        dev.setdefault(name, []).append(d)
                    split.setdefault(name, ([], []))[0 if stepped else 1].append(d if d is not None else h)
            med = {n: (statistics.median(host[n]), statistics.median(dev[n]) if n in dev else None) for n in host}
            rank = sorted(med, key=lambda n: -(med[n][1] if med[n][1] is not None else med[n][0]))
            out[kind] = {"forwards": len(fwds), "tokens_p50": statistics.median(f["tokens"] for f in fwds),
                         "costliest_host_dev_ms": {n: [round(med[n][0], 3), None if med[n][1] is None
                                                       else round(med[n][1], 3)] for n in rank[:top]},
                         "all_host_dev_ms": {n: [round(h, 3), None if d is None else round(d, 3)]
                                             for n, (h, d) in med.items()},
                         "after_step": {n: [len(a), round(statistics.median(a), 3) if a else None,
                                            round(statistics.median(b), 3) if b else None]
                                        for n, (a, b) in split.items() if n not in ("setup", "tail")}}
        return out
