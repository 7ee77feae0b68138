"""Benchmark plumbing: machine facts, commit and command recorded with every result."""
from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch

from bench.commit import commit, commit_info  # noqa: F401  (commit: for callers)


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    m = {"host": platform.node(), "cpu": cpu, "logical_cpus": os.cpu_count(),
         "python": platform.python_version(), "torch": torch.__version__}
    try:
        with open("/proc/meminfo") as f:
            m["mem_gb"] = round(int(f.readline().split()[1]) / 1e6, 1)
    except OSError:
        pass
    try:
        import triton
        m["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, gpu_mem_gb=round(p.total_memory / 1e9, 1), cuda=torch.version.cuda)
    return m


def command() -> str:
    """The command line as typed: `python -m bench.x ...` when run as a module."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    argv = (["-m", spec.name] if spec is not None and spec.name else sys.argv[:1]) + sys.argv[1:]
    return " ".join([os.path.basename(sys.executable)] + argv)


def write_result(name: str, results: dict, out_dir: str | None = None, quiet: bool = False) -> str:
    """The results as JSON with machine, commit and command; quiet: the path only (a file
    rewritten after every row of a long run)."""
    info = commit_info()  # git here; .devcache/commit on the device machine (bench/commit.py)
    doc = {"benchmark": name, "machine": machine(), "commit": info["commit"], "commit_source": info["source"],
           "command": command(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
    if info.get("changed"):
        doc["changed_files"] = info["changed"]  # what "-dirty" means: these differ from the commit
    out_dir = out_dir or os.environ.get("OUT") or "benchmarks/results"
    os.makedirs(out_dir, exist_ok=True)
    tag = "gpu" if torch.cuda.is_available() else "cpu"
    path = os.path.join(out_dir, f"{name}-{tag}.json")
    tmp = path + ".tmp"  # whole or not at all: a run stopped by a time limit mid-write keeps the last file
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    if not quiet:
        print(json.dumps(doc["results"], indent=1))
    print("wrote", path)
    return path


def timeit(fn, warmup: int = 3, iters: int = 20, sync=None) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]
