"""What a new chunk shape costs the eager prefill attention (issue 9's stalled first attention
layer): paged_prefill_attention_torch at the full-size shape (kvh 2, nh 16, hd 256, bf16, pages
of 16), each chunk size timed on its first call and again, wall clock around a synchronize (host
and GPU time together, as the serving loop's layer timing sees them).

Two cases per size: a prompt's first chunk (start 0: T == S, where SDPA's causal bias goes
through the general dispatcher with is_causal) and a later chunk (start 30,000: T < S, straight
to the flash kernel); each with SDPA's backends as shipped and with cuDNN attention turned off.
Also the CUDA kernels of one first call of a new size (which backend ran). Since ef4a1dc's run
model.attention.prefill_attention leaves cuDNN out itself, so both settings should read alike.
    python -m bench.attention_shapes [--sizes 870,444,705,1133,1199,748] [--start 30000]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import write_result
from freetoken.kernels.paged_attention import paged_prefill_attention_torch

KVH, NH, HD, P = 2, 16, 256, 16


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) * 1e3, 3)


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key[:90] for e in prof.key_averages() if e.device_type.name == "CUDA"})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="870,444,705,1133,1199,748")
    ap.add_argument("--start", type=int, default=30000)
    ap.add_argument("--name", default="attention_shapes")
    a = ap.parse_args()
    dev = torch.device("cuda")
    sizes = [int(s) for s in a.sizes.split(",")]
    ctx = a.start + max(sizes) + 2 * P
    pages = ctx // P + 1
    g = torch.Generator(device=dev).manual_seed(0)
    kp = torch.randn(pages, KVH, P, HD, device=dev, generator=g).bfloat16()
    vp = torch.randn(pages, KVH, P, HD, device=dev, generator=g).bfloat16()
    table = torch.randperm(pages, device=dev, generator=g).int()
    rows = []
    with torch.inference_mode():
        for cudnn in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            for start in (0, a.start):
                for i, t in enumerate(sizes):
                    t = t + (0 if cudnn else 1) + (0 if start else 2)  # a size no earlier row used
                    q = torch.randn(t, NH, HD, device=dev, generator=g).bfloat16()
                    call = lambda: paged_prefill_attention_torch(q, kp, vp, table, start, HD ** -0.5)  # noqa: E731
                    first = timed(call)
                    again = timed(call)
                    row = {"cudnn_sdp": cudnn, "start": start, "tokens": t, "first_ms": first, "again_ms": again}
                    if i == 1:  # a new size's kernels, under the profiler
                        q = torch.randn(t + 3, NH, HD, device=dev, generator=g).bfloat16()
                        row["kernels_new_size"] = kernel_names(
                            lambda: paged_prefill_attention_torch(q, kp, vp, table, start, HD ** -0.5))
                    rows.append(row)
                    print(row, flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    write_result(a.name, {"shape": {"kvh": KVH, "nh": NH, "hd": HD, "page": P, "dtype": "bf16"}, "rows": rows})


if __name__ == "__main__":
    main()
