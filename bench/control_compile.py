"""Compile time of the expert cache's control kernel per call size: what the cache's start-up
warm-up (control.warm_up_control) costs, with the fill list as the cache sizes it (fill_cap, padded
by fill_pad: up to the layer's experts) and, for comparison, sized by the call's pairs as before
(K = pairs); --warps adds rows at other warp counts (their own totals).

Each (pairs, K) row is a fresh Triton compile (a fresh cache directory for the run): the first
call's seconds are the compile, the second call's the run. The JSON is rewritten after every row,
so a run stopped by its time limit keeps the rows it finished.
    python -m bench.control_compile --experts 256 --layers 40 --slots 2048 --old-max 1024
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="ft-control-compile-"))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from freetoken.experts.control import (MAX_PAIRS, Residency, control_reference, control_triton,  # noqa: E402
                                       control_warps, fill_cap, fill_pad, next_pow2, pair_bucket)


def first_and_second(n_flat: int, experts: int, slots: int, pairs: int, k: int, policy: str, dev,
                     num_warps: int | None = None, k_pad: int | None = None) -> dict:
    """Two calls of `pairs` one-layer routes on a fresh pool (the first compiles), each checked
    against the torch reference call for call (outputs and residency)."""
    res, ref = Residency.empty(n_flat, slots, dev), Residency.empty(n_flat, slots, "cpu")
    share = torch.ones(1, dtype=torch.float32)
    g = torch.Generator().manual_seed(pairs)
    times, same = [], True
    for _ in range(2):
        ids = torch.randint(0, experts, (pairs, 1), generator=g)  # [P, 1] one layer's experts
        w = torch.rand(pairs, 1, generator=g).to(torch.bfloat16)  # [P, 1]
        ids_d, w_d, share_d = ids.to(dev), w.to(dev), share.to(dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = control_triton(ids_d, w_d, res, share_d, k, policy, num_warps=num_warps, k_pad=k_pad)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        want = control_reference(ids, w, ref, share, k, policy)
        same = same and _equal(want, _cpu(out)) and _equal(ref, _cpu(res))
    return {"pairs": pairs, "max_fill": k, "k_pad": k_pad or next_pow2(k), "num_warps": num_warps or control_warps(pair_bucket(pairs)),
            "compile_s": round(times[0] - times[1], 2), "run_ms": round(times[1] * 1e3, 3), "equals_reference": same}


def buckets() -> list[int]:
    """The pair buckets the cache's warm-up compiles, up to MAX_PAIRS."""
    out = [pair_bucket(1)]
    while out[-1] < MAX_PAIRS:
        out.append(pair_bucket(out[-1] + 1))
    return out


def _tensors(x) -> dict:
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if isinstance(getattr(x, f.name), torch.Tensor)}


def _cpu(x):
    """A ControlOut or Residency with every tensor field on the CPU."""
    return dataclasses.replace(x, **{n: t.cpu() for n, t in _tensors(x).items()})


def _equal(a, b) -> bool:
    """Every tensor field equal (a ControlOut or a Residency)."""
    tb = _tensors(b)
    return all(torch.equal(t, tb[n]) for n, t in _tensors(a).items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=256, help="experts per MoE layer")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--slots", type=int, default=2048)
    ap.add_argument("--policy", default="recent")
    ap.add_argument("--old-max", type=int, default=1024, help="largest pairs measured with K = pairs too")
    ap.add_argument("--pairs", default="", help="comma-separated pair counts (default: each pair_bucket, as warmed)")
    ap.add_argument("--warps", default="", help="comma-separated num_warps to measure beside the default rule")
    ap.add_argument("--name", default="control-compile")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.control_compile measures Triton's CUDA compile: it needs a GPU")
    dev = torch.device("cuda")
    n_flat = a.experts * a.layers
    rows, total = [], {"fill_cap": 0.0, "pairs": 0.0}
    sizes = [int(x) for x in a.pairs.split(",")] if a.pairs else buckets()
    for p in sizes:
        cap, pad = fill_cap(p, a.experts, a.slots), fill_pad(p, a.experts, a.slots)
        sizings = [("fill_cap", cap, None, pad)]  # as the cache calls it
        sizings += [(f"warps{w}", cap, int(w), pad) for w in a.warps.split(",") if w]
        if p <= a.old_max and cap != p:
            sizings.append(("pairs", p, None, None))  # K = pairs, as before 028d37b
        for sizing, k, warps, k_pad in sizings:
            row = {"sizing": sizing, **first_and_second(n_flat, a.experts, a.slots, p, k, a.policy, dev, warps, k_pad)}
            total[sizing] = total.get(sizing, 0.0) + row["compile_s"]
            rows.append(row)
            print(row, flush=True)
            write_result(a.name, {"experts": a.experts, "layers": a.layers, "slots": a.slots, "policy": a.policy,
                                  "rows": rows, "compile_s_total": {s: round(v, 2) for s, v in total.items()}})


if __name__ == "__main__":
    main()
