"""A host-memory hog for benchmarks: another process streaming memory while a configuration is
measured, as a busy host would (the expert cache's split must hold up under it, and so must
llama.cpp's rows of a side-by-side run, which run under the same hog).

The hog copies between two buffers much larger than the last-level cache with `threads` torch
threads, pinned to the given CPUs, until it is told to stop; it then reports the GB/s it moved
(bytes read + written), so a result can say how hard the host was being hit.
    with MemoryHog(threads=4, cpus=[12, 13, 14, 15]) as hog:
        ...  # measure
    hog.gbs
    python -m bench.hog --threads 4 --seconds 5     # alone: what it moves on an idle host
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time


class MemoryHog:
    def __init__(self, threads: int, cpus: list[int] | None = None, mb: int = 1024):
        self.threads, self.cpus, self.mb = threads, cpus, mb
        self.gbs: float | None = None
        self.proc = None

    def __enter__(self) -> "MemoryHog":
        self.out = tempfile.NamedTemporaryFile("r", suffix=".hog", delete=False)
        cmd = [sys.executable, "-m", "bench.hog", "--threads", str(self.threads), "--mb", str(self.mb),
               "--out", self.out.name]
        if self.cpus:
            cmd += ["--cpus", ",".join(map(str, self.cpus))]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # "ready" once its buffers are touched and it streams
        if not line.startswith("ready"):
            self.proc.kill()
            raise RuntimeError(f"the memory hog did not start: {line!r}")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        try:
            with open(self.out.name) as f:
                self.gbs = float(f.read().strip() or "nan")
        finally:
            os.unlink(self.out.name)


def run(threads: int, mb: int, cpus: list[int] | None, out: str | None, seconds: float | None) -> float:
    import torch
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    n = mb << 20
    a = torch.ones(n, dtype=torch.uint8)
    b = torch.empty(n, dtype=torch.uint8)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    # The touching copy is timed and counted too: a short measurement may stop the hog before the
    # loop finishes one copy, and a rate of 0 would say nothing streamed while something did.
    t0 = time.perf_counter()
    b.copy_(a)
    moved = 2 * n  # read + write
    print("ready", flush=True)
    while not stop and (seconds is None or time.perf_counter() - t0 < seconds):
        b.copy_(a)
        a, b = b, a
        moved += 2 * n  # read + write
    gbs = moved / (time.perf_counter() - t0) / 1e9
    if out:
        with open(out, "w") as f:
            f.write(f"{gbs:.6g}\n")  # not rounded to 0.0 when a short run moved little
    return gbs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mb", type=int, default=1024, help="MiB per buffer (two of them)")
    ap.add_argument("--cpus", default="", help="comma-separated CPUs to run on (default: any)")
    ap.add_argument("--out", default=None, help="file to write the GB/s moved into, on SIGTERM")
    ap.add_argument("--seconds", type=float, default=None, help="stop by itself after this long")
    a = ap.parse_args()
    cpus = [int(c) for c in a.cpus.split(",") if c] or None
    gbs = run(a.threads, a.mb, cpus, a.out, a.seconds)
    if a.out is None:
        print(f"{gbs:.1f} GB/s")


if __name__ == "__main__":
    main()
