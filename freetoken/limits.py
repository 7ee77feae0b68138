"""The CPU and memory limits a container (cgroup v1 or v2) puts on this process.

Why: `docker run --cpus 4` or a Kubernetes CPU limit leaves every core in the affinity mask
(os.sched_getaffinity sees the whole host) but lets the process run only 4 cores' worth of time
a period. A pool of one pinned worker per physical core then gets throttled every period, and a
decode step waits for its slowest worker: tens of times slower, with nothing in the log to say
why (the peer engine's users reported such runs). Likewise `--memory 32g` leaves /proc/meminfo's
MemAvailable at the host's figure, so a memory plan sized from it is killed by the kernel's OOM
killer instead of refused with a line that names the flag. Both limits are read here, and the
thread defaults (experts/cpu physical_cores) and the host budget (runtime/budget host_available)
keep within them.

Every limit is the tightest one on the path from this process's cgroup up to the root of the
controller's mount (a limit on a parent cgroup binds its children too). `root` prefixes every
path read, so tests can lay a fake /proc and /sys tree out in a temporary folder.
"""
from __future__ import annotations

import functools
import math
import os

UNLIMITED_V1 = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _mounts(root: str) -> dict[str, tuple[str, str]]:
    """controller -> (the mount's root inside the hierarchy, its mount point) from mountinfo;
    the unified (v2) hierarchy under the key ''."""
    text = _read(os.path.join(root, "proc/self/mountinfo")) or ""
    out: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        f, g = pre.split(), post.split()
        if not sep or len(f) < 5 or len(g) < 3:
            continue
        if g[0] == "cgroup2":
            out.setdefault("", (f[3], f[4]))
        elif g[0] == "cgroup":
            for opt in g[2].split(","):
                if opt in ("cpu", "memory"):
                    out.setdefault(opt, (f[3], f[4]))
    return out


def _dirs(controller: str, root: str) -> list[str]:
    """The directories holding this process's cgroup files for `controller` ('' for v2), its own
    cgroup first, then each parent up to the mount point."""
    mounts = _mounts(root)
    for line in (_read(os.path.join(root, "proc/self/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, path = parts
        key = "" if hid == "0" and ctrls == "" else next((c for c in ctrls.split(",") if c == controller), None)
        if key is None or key != controller or key not in mounts:
            continue
        mroot, mpoint = mounts[key]
        # inside a container the mount's root is the container's own cgroup, and so is the path
        under = path == mroot or path.startswith(mroot.rstrip("/") + "/")
        rel = os.path.relpath(path, mroot) if under else path.lstrip("/")
        rel = "" if rel in (".", "") else rel
        base = os.path.join(root, mpoint.lstrip("/"))
        out, d = [], os.path.normpath(os.path.join(base, rel))
        while True:
            out.append(d)
            if d == os.path.normpath(base) or not d.startswith(os.path.normpath(base)):
                return out
            d = os.path.dirname(d)
    return []


def cpu_quota(root: str = "/") -> float | None:
    """CPUs' worth of time a period this process may use (4.0 for `docker run --cpus 4`), or None
    where no quota is set."""
    best = math.inf
    for d in _dirs("", root):
        parts = (_read(os.path.join(d, "cpu.max")) or "").split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                best = min(best, int(parts[0]) / int(parts[1]))
            except (ValueError, ZeroDivisionError):
                pass
    for d in _dirs("cpu", root):
        q, p = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
        try:
            if q is not None and p is not None and int(q) > 0:
                best = min(best, int(q) / int(p))
        except (ValueError, ZeroDivisionError):
            pass
    return None if best == math.inf else best


def cpu_limit(root: str = "/") -> int | None:
    """The quota rounded up to whole CPUs (a pool of that many workers uses it all), or None."""
    q = cpu_quota(root)
    return None if q is None else max(1, math.ceil(q - 1e-9))


def _stat(d: str, key: str) -> int:
    for line in (_read(os.path.join(d, "memory.stat")) or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            try:
                return int(v)
            except ValueError:
                return 0
    return 0


def memory_left(root: str = "/") -> int | None:
    """Bytes this process's cgroup may still take before its memory limit, or None where no limit
    is set. File pages in the page cache (a checkpoint just read, active or not) count as free:
    the kernel reclaims them before it kills anything in the cgroup."""
    best = math.inf
    for d in _dirs("", root):
        lim, cur = _read(os.path.join(d, "memory.max")), _read(os.path.join(d, "memory.current"))
        if lim and lim != "max" and cur is not None:
            try:
                cache = _stat(d, "file") or _stat(d, "active_file") + _stat(d, "inactive_file")
                best = min(best, int(lim) - max(int(cur) - cache, 0))
            except ValueError:
                pass
    for d in _dirs("memory", root):
        lim, cur = _read(os.path.join(d, "memory.limit_in_bytes")), _read(os.path.join(d, "memory.usage_in_bytes"))
        try:
            if lim is not None and cur is not None and int(lim) < UNLIMITED_V1:
                cache = _stat(d, "total_active_file") + _stat(d, "total_inactive_file")
                best = min(best, int(lim) - max(int(cur) - cache, 0))
        except ValueError:
            pass
    return None if best == math.inf else max(int(best), 0)


@functools.lru_cache(maxsize=1)
def process_cpu_limit() -> int | None:
    """cpu_limit() of this process, read once (a quota does not change under a running server;
    FREETOKEN_IGNORE_CPU_QUOTA=1 ignores it, for a quota the user knows to be generous)."""
    if os.environ.get("FREETOKEN_IGNORE_CPU_QUOTA", "") == "1":
        return None
    return cpu_limit()


def quota_binds() -> bool:
    """Whether this process's CPU quota is smaller than the CPUs its affinity mask allows (the
    case where one worker per core would be throttled)."""
    quota = process_cpu_limit()
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return quota is not None and quota < allowed
