"""Compile time of the expert cache's control kernel per call size: what the cache's start-up
warm-up (control.warm_up_control) costs, with the fill list sized by fill_cap (K up to the
layer's experts) and, for comparison, sized by the call's pairs as before (K = pairs).

Each (pairs, K) row is a fresh Triton compile (a fresh cache directory for the run): the first
call's seconds are the compile, the second call's the run. The JSON is rewritten after every row,
so a run stopped by its time limit keeps the rows it finished.
    python -m bench.control_compile --experts 256 --layers 40 --slots 2048 --old-max 1024
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="ft-control-compile-"))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from freetoken.experts.control import MAX_PAIRS, Residency, control_triton, fill_cap  # noqa: E402


def first_and_second(n_flat: int, experts: int, slots: int, pairs: int, k: int, policy: str, dev) -> dict:
    res = Residency.empty(n_flat, slots, dev)
    share = torch.ones(1, dtype=torch.float32, device=dev)
    g = torch.Generator().manual_seed(pairs)
    ids = torch.randint(0, experts, (pairs, 1), generator=g).to(dev)  # [P, 1] one layer's experts
    w = torch.rand(pairs, 1, generator=g).to(dev, torch.bfloat16)  # [P, 1]
    times = []
    for _ in range(2):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        control_triton(ids, w, res, share, k, policy)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return {"pairs": pairs, "max_fill": k, "compile_s": round(times[0] - times[1], 2),
            "run_ms": round(times[1] * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=256, help="experts per MoE layer")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--slots", type=int, default=2048)
    ap.add_argument("--policy", default="recent")
    ap.add_argument("--old-max", type=int, default=1024, help="largest pairs measured with K = pairs too")
    ap.add_argument("--name", default="control-compile")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.control_compile measures Triton's CUDA compile: it needs a GPU")
    dev = torch.device("cuda")
    n_flat = a.experts * a.layers
    rows, total = [], {"fill_cap": 0.0, "pairs": 0.0}
    p = 2
    while p <= MAX_PAIRS:
        sizings = [("fill_cap", fill_cap(p, a.experts, a.slots))]
        if p <= a.old_max and fill_cap(p, a.experts, a.slots) != p:
            sizings.append(("pairs", p))
        for sizing, k in sizings:
            row = {"sizing": sizing, **first_and_second(n_flat, a.experts, a.slots, p, k, a.policy, dev)}
            total[sizing] += row["compile_s"]
            rows.append(row)
            print(row, flush=True)
            write_result(a.name, {"experts": a.experts, "layers": a.layers, "slots": a.slots, "policy": a.policy,
                                  "rows": rows, "compile_s_total": {s: round(v, 2) for s, v in total.items()}})
        p *= 2


if __name__ == "__main__":
    main()
