"""Where a pure-CPU decode step's time goes, by part: each C++ kernel of the step (the dense rows
kernel, the expert executor, the DeltaNet and attention kernels) and the rest (Python, small
torch ops), for a slice of a full-size shape with random weights, no GPU.

The step is timed plainly first; then cProfile's own time of each `freetoken_moe_cpu` call
(the kernels release the GIL and return when their pool is done, so a call's time is the
kernel's wall time) gives the parts, "other" the profiled step less those. The profiler adds to
"other" only. Each row runs with torch and the kernels on the row's thread count.

    python -m bench.cpu_step_parts --arch qwen3_5_moe --layers 12 --expert-format mxfp4 --threads 2

With --prefill N the row is a fresh N-token prompt's prefill instead (one chunk), and "ops_ms" also
names the costliest other built-ins (torch's matmuls, the DeltaNet chunk rule's ops) by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from bench import large_models as L
from bench.common import write_result

KERNEL_MODULE = "freetoken_moe_cpu"


def kernel_parts(prof: cProfile.Profile, steps: int) -> dict[str, float]:
    """ms a step of each freetoken_moe_cpu function, from the profile's own times."""
    out: dict[str, float] = {}
    for (_, _, name), (_, _, own, _, _) in pstats.Stats(prof).stats.items():
        if KERNEL_MODULE in name:  # "<built-in method freetoken_moe_cpu.dense_gemv>"
            key = name.split(KERNEL_MODULE + ".")[-1].rstrip(">}")
            out[key] = out.get(key, 0.0) + own * 1e3 / steps
    return out


def top_builtins(prof: cProfile.Profile, reps: int, n: int = 10) -> dict[str, float]:
    """ms a rep of the n costliest built-ins outside freetoken_moe_cpu (torch ops), by own time."""
    rows = []
    for (_, _, name), (_, _, own, _, _) in pstats.Stats(prof).stats.items():
        if name.startswith("<") and KERNEL_MODULE not in name:
            rows.append((own * 1e3 / reps, name.strip("<>").replace("built-in method ", "")))
    return {k: round(v, 2) for v, k in sorted(rows, reverse=True)[:n]}


def timed(run, warm: int, reps: int) -> tuple[float, float, cProfile.Profile]:
    """(ms a rep plainly, ms a rep under cProfile, the profile) of run(n), after run(warm)."""
    with torch.no_grad():
        run(warm)
        t0 = time.perf_counter()
        run(reps)
        plain = (time.perf_counter() - t0) * 1e3 / reps
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        run(reps)
        prof.disable()
        return plain, (time.perf_counter() - t0) * 1e3 / reps, prof


def prefill_row(mc, w, banks, threads: int, reps: int, prompt: int) -> dict:
    from freetoken.model.registry import model_class
    from freetoken.model.state import DecodeState
    dev = torch.device("cpu")
    with L.host_threads(dev, threads):
        ex = L.make_executor("cpu-only", banks, mc, dev, threads, 1, 1.0, "lru")
        model = model_class(mc.arch)(mc, w, ex, dev, torch.bfloat16, prompt + 16)
        ids = torch.randint(0, mc.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1))

        def run(n: int) -> None:
            for _ in range(n):
                st = DecodeState(mc, 1, prompt + 16, dev, torch.bfloat16)
                st.reserve(0, prompt + 16)
                model.prefill(ids, st, 0, 0)
        plain, profiled, prof = timed(run, 1, reps)
        parts = kernel_parts(prof, reps)
        ex = model = None
        return {"threads": threads, "torch_threads": torch.get_num_threads(), "prefill_tokens": prompt,
                "ms_per_prefill": round(plain, 1), "tok_s": round(prompt * 1e3 / plain, 1),
                "profiled_ms": round(profiled, 1),
                "parts_ms": {k: round(v, 2) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
                "other_ms": round(profiled - sum(parts.values()), 2), "ops_ms": top_builtins(prof, reps)}


def row(mc, w, banks, threads: int, steps: int, prompt: int) -> dict:
    from freetoken.model.registry import model_class
    from freetoken.model.state import DecodeState
    dev = torch.device("cpu")
    with L.host_threads(dev, threads):
        ex = L.make_executor("cpu-only", banks, mc, dev, threads, 1, 1.0, "lru")
        model = model_class(mc.arch)(mc, w, ex, dev, torch.bfloat16, prompt + 3 * steps + 16)
        st = DecodeState(mc, 1, prompt + 3 * steps + 16, dev, torch.bfloat16)
        st.reserve(0, prompt + 3 * steps + 16)
        ids = torch.randint(0, mc.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1))
        tok = model.prefill(ids, st, 0, 0)[-1].argmax().view(1)
        pos = torch.full((1,), prompt)

        def run(n: int) -> None:
            nonlocal tok
            for _ in range(n):
                tok = model.decode(tok, st, pos).argmax(-1)
                pos.add_(1)
        plain, profiled, prof = timed(run, 4, steps)
        parts = kernel_parts(prof, steps)
        ex = model = None  # the executor's threads end before the next row's start
        return {"threads": threads, "torch_threads": torch.get_num_threads(), "ms_per_step": round(plain, 2),
                "tok_s": round(1e3 / plain, 2), "profiled_ms_per_step": round(profiled, 2),
                "parts_ms": {k: round(v, 2) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
                "other_ms": round(profiled - sum(parts.values()), 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3_5_moe", choices=sorted(L.SHAPES))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--expert-format", default="mxfp4", choices=["bf16", "fp8_block", "mxfp4", "nvfp4"])
    ap.add_argument("--threads", default="2", help="comma-separated thread counts, one row each")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=0, help="time a prefill of this many tokens instead of decode "
                    "steps (--steps of them, one chunk each)")
    ap.add_argument("--name", default="cpu_step_parts")
    a = ap.parse_args(argv)
    try:
        threads = [int(x) for x in a.threads.split(",") if x]
    except ValueError:
        ap.error(f"--threads takes comma-separated whole numbers, got {a.threads!r}")
    if not threads or min(threads) < 1:
        ap.error(f"--threads takes thread counts of 1 or more, got {a.threads!r}")
    from freetoken.config import ModelConfig
    cfg = L.slice_config(L.SHAPES[a.arch], a.layers)
    mc = ModelConfig.from_hf(cfg)
    dev = torch.device("cpu")
    w = L.random_dense(L.weight_plan(cfg), mc, dev)
    banks, _ = L.make_banks(a.expert_format, mc, dev)
    rows = []
    for t in threads:
        if a.prefill:
            rows.append(prefill_row(mc, w, banks, t, a.steps, a.prefill))
        else:
            rows.append(row(mc, w, banks, t, a.steps, a.prompt))
        print(rows[-1], flush=True)
    write_result(a.name, {"arch": a.arch, "layers": a.layers, "expert_format": a.expert_format,
                          "steps": a.steps, "prompt": a.prompt, "prefill": a.prefill, "rows": rows})


if __name__ == "__main__":
    main()
