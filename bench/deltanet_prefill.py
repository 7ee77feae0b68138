"""The gated delta rule's chunked prefill at the full-size Qwen3.6 shape (16 q/k heads, 32 value
heads, 128-wide, one sequence): our torch chunk rule (model/deltanet.py, fp32, the reference and
the CPU path) against flash-linear-attention's kernels (kernels/fla_delta.py, bf16), per layer,
for prompts of 512 to 32k tokens, with the largest difference between the two outputs.

Wall time per call (CUDA events around `iters` calls after a warm-up: the host's launches
count, as they do in a prefill forward), so the torch rule's per-chunk launches show.
    python -m bench.deltanet_prefill [--lengths 512,2048,8192,32768] [--iters 5]
"""
from __future__ import annotations

import argparse

import torch

from bench.common import write_result
from freetoken.kernels import fla_delta
from freetoken.model.deltanet import chunk_gated_delta_rule, l2norm

HK, HV, D = 16, 32, 128


def wall_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--name", default="deltanet_prefill")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.deltanet_prefill times CUDA kernels: run it on the GPU machine")
    fla_ok = fla_delta.available(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    rows = []
    for t in (int(x) for x in a.lengths.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(t)
        r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
        q, k, v = r(t, HK, D).bfloat16(), r(t, HK, D).bfloat16(), r(t, HV, D).bfloat16()  # [T, H, D]
        g = -torch.nn.functional.softplus(r(t, HV))  # [T, Hv]
        beta = torch.sigmoid(r(t, HV))
        state = r(HV, D, D) * 0.1  # [Hv, dk, dv] fp32

        def torch_rule():
            # what the layer does on the torch path: fp32 heads, l2 norm, repeated to the value heads
            rq = l2norm(q.float().repeat_interleave(HV // HK, 1)) * D ** -0.5
            rk = l2norm(k.float().repeat_interleave(HV // HK, 1))
            return chunk_gated_delta_rule(rq, rk, v.float(), g, beta, state)

        row = {"tokens": t, "torch_ms": round(wall_ms(torch_rule, a.iters), 3)}
        if fla_ok:
            fla = lambda: fla_delta.chunk_delta_fla(q, k, v, g, beta, state, D ** -0.5)  # noqa: E731
            row["fla_ms"] = round(wall_ms(fla, a.iters), 3)
            row["torch_over_fla"] = round(row["torch_ms"] / row["fla_ms"], 2)
            ref, got = torch_rule()[0], fla()[0].float()
            row["max_rel_diff"] = round(float((got - ref).abs().max() / ref.abs().max()), 5)
        rows.append(row)
        print(row, flush=True)
    write_result(a.name, {"shape": {"hk": HK, "hv": HV, "d": D}, "fla": fla_ok,
                          "fla_version": _fla_version(), "rows": rows})


def _fla_version():
    try:
        from importlib.metadata import version
        return version("fla-core")
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()
