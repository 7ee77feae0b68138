"""CPU expert executor bandwidth: GB/s of expert weights streamed, against memory bandwidth.

Full-size Qwen3.6-35B-A3B expert shape (hidden 2048, moe_intermediate 512, BF16 = 6.3 MB per
expert), top-8 routing over a bank much larger than the last-level cache, so every call
reads its experts from DRAM. Reports, per batch size: the C++ executor, the torch reference
(per-expert loop), and the host's read bandwidth measured on the same bank (torch sum).
`--format` picks the banks: bf16 (the default), or random quantized banks as experts/banks.py
keeps them (fp8_block: e4m3 + an fp32 scale per 128x128 block, 3.2 MB per expert; mxfp4: e2m1 +
e8m0 per 32, 1.67 MB; nvfp4: e2m1 + e4m3 per 16 + scale_2, 1.77 MB), read in place by the C++
kernels; GB/s then counts the quantized bytes (values and scales) of the distinct experts read.
`--activation swiglu_clamp` computes GPT-OSS's experts instead of SiLU ones (the clamped SwiGLU,
alpha 1.702, limit 7, with random bf16 gate_up and down bias banks), to measure what the
per-row epilogue and the bias reads cost; results then go to ...-swiglu_clamp. MXFP4 / NVFP4
rows also time the int8-activation path (`--cpu-act int8`: cpp_int8_gbs, its relative error
against the exact reference on the first call, int8_vs_read_bw).
Results go to cpu_experts (bf16) or cpu_experts-FORMAT.
    python -m bench.cpu_experts [--format bf16|fp8_block|mxfp4|nvfp4] [--experts 512]
                                [--threads 0] [--batches 1,2,4,8,32] [--activation silu|swiglu_clamp]
                                [--fixed-cost]
--fixed-cost adds batch-1 calls on experts already in cache (`fixed_cost`: one expert, and the
same top-k every call): what a call costs besides streaming its bytes (issue 12).
--row-runs 1,0 times them again with the fp4 kernels' decode calls a run of rows at a time and a
4-row block at a time (moe_cpu's FREETOKEN_CPU_ROW_RUNS), alternating in one process.
--row-scales 3,0 times the fp4 rows again with each mask of the kernels that decode their block
scales once per call (moe_cpu's FREETOKEN_CPU_ROW_SCALES: 1 AVX2, 2 AVX-512, 3 both, 0 none),
alternating in one process (`*_ms_by_row_scales`, and the cached top-k's `us_by_row_scales`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import timeit, write_result
from freetoken.experts.banks import ExpertBanks, QuantBank
from freetoken.experts.cpu import CpuExpertExecutor, extension, physical_cores
from freetoken.experts.executor import ACTIVATIONS, Activation, reference_experts
from freetoken.weights.hostmem import host_tensor, huge_bytes, thp_mode

FORMATS = ("bf16", "fp8_block", "mxfp4", "nvfp4")


def read_bandwidth(t: torch.Tensor, threads: int) -> float:
    """GB/s of a plain reduction over the bank (what streaming weights could reach)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flat = t.view(-1).view(torch.float32)  # same bytes; fp32 sum vectorises everywhere
        s = timeit(lambda: flat.sum(), warmup=1, iters=5)
    finally:
        torch.set_num_threads(old)
    return t.numel() * t.element_size() / s / 1e9


def quantized_banks(fmt: str, n: int, h: int, i: int, g: torch.Generator) -> ExpertBanks:
    """Random banks in the layout experts/banks.py documents: every byte pattern of an e2m1 pair
    is a valid weight pair; e4m3 values without the NaN code; scales of the size a real
    checkpoint has (weights around 0.02). Made on the generator's device (a CUDA generator: the
    banks on the GPU)."""
    dev = g.device

    def bank(rows: int, cols: int, halves: int) -> QuantBank:
        if fmt == "fp8_block":
            v = torch.randint(0, 256, (n, rows, cols), generator=g, dtype=torch.uint8, device=dev)
            v[(v & 0x7F) == 0x7F] = 0x7E  # no NaN
            per = -(-(rows // halves) // 128)
            s = torch.rand(n, halves * per, -(-cols // 128), generator=g, device=dev) * 1e-4 + 5e-5
            return QuantBank(fmt, v.view(torch.float8_e4m3fn), s, None, halves)
        v = torch.randint(0, 256, (n, rows, cols // 2), generator=g, dtype=torch.uint8, device=dev)
        if fmt == "mxfp4":
            s = torch.randint(118, 122, (n, rows, cols // 32), generator=g, dtype=torch.uint8, device=dev)
            return QuantBank(fmt, v, s, None, halves)
        s = torch.randint(0x30, 0x60, (n, rows, cols // 16), generator=g, dtype=torch.uint8,
                          device=dev).view(torch.float8_e4m3fn)
        return QuantBank(fmt, v, s, torch.rand(n, halves, generator=g, device=dev) * 1e-3 + 1e-3, halves)
    return ExpertBanks(fmt, bank(2 * i, h, 2), bank(h, i, 1))


def engine_memory(t: torch.Tensor, plain: bool) -> torch.Tensor:
    """t copied into the kind of host buffer the engine's weight banks live in (weights/hostmem.py:
    page-aligned, advised onto transparent huge pages unless FREETOKEN_HUGEPAGES=0), so the
    kernels stream what they stream when serving: on the 2-core dev machine, 2 threads, MXFP4
    without prefetch, plain tensors read 9.2 GB/s where huge pages read 11.2 (int8 path: 12.4
    against 14.6; results/cpu_experts-mxfp4-{plain-,}hintoff-devmachine-cpu.json). plain: t as
    it is (the bench before it used the engine's buffers)."""
    if plain:
        return t
    out = host_tensor(t.shape, t.dtype)
    out.copy_(t)
    return out


# the parts of a quantized call the C++ executor times (moe_cpu.cpp, Executor::last_us)
PARTS = ("wrapper", "grouping", "quantize_x", "phase1", "quantize_h", "phase2")


def fixed_cost_rows(ex, a, h: int, k: int, per_expert: int, g: torch.Generator) -> list[dict]:
    """Batch-1 calls whose experts sit in the caches (the same ones every call): `one` routes one
    expert (the others -1), `topk` the same k experts. Their time is what a call costs besides
    reading its bytes from DRAM: the pool's wake-up and barrier, the activation's quantization,
    the instructions. GB/s counts the bytes as if read (a compute-bound rate, against which the
    DRAM rows above say how much is memory). Exact kernels, and int8 where the format has it."""
    x = torch.randn(1, h, generator=g)
    w = torch.softmax(torch.randn(1, k, generator=g), -1)
    # none: every id -1 (no expert runs): the call itself, its phases' hand-offs and the activation's
    # quantization, with no bank byte read
    cases = {"none": (torch.full((1, k), -1), 0), "one": (torch.tensor([[5] + [-1] * (k - 1)]), 1),
             "topk": (torch.arange(k)[None] + 5, k)}
    acts = ["exact"] + (["int8"] if a.format in ("mxfp4", "nvfp4") and ex.handle is not None else [])
    rows = []
    for act in acts:
        if act == "int8":
            ex.set_act(True)
        for name, (ids, experts) in cases.items():
            t = timeit(lambda: ex.kernel(x, ids, w), warmup=5, iters=max(a.iters, 50))
            row = {"case": name, "act": act, "experts": experts, "us": round(t * 1e6, 1),
                   "cached_gbs": round(experts * per_expert / t / 1e9, 1)}
            if ex.quantized:  # where the call's time goes (the C++ side's clock, the median of 30 calls)
                parts = []
                for _ in range(30):
                    ex.kernel(x, ids, w)
                    parts.append(extension().timing(ex.handle))
                med = [statistics.median(p[j] for p in parts) for j in range(6)]
                row["parts_us"] = {k: round(v, 1) for k, v in zip(PARTS, med)}
                row["outside_cpp_us"] = round(t * 1e6 - sum(med), 1)  # Python, pybind, the GIL
            if name == "topk" and a.format in ("mxfp4", "nvfp4") and ex.handle is not None:
                # the cached (compute-bound) call with each setting of the A/B switches asked for
                for key, setter, values in (("row_scales", extension().set_row_scales, settings(a.row_scales)),
                                            ("row_seq", extension().set_row_seq, settings(a.row_seq)),
                                            ("row_runs", extension().set_row_runs, settings(a.row_runs))):
                    if values:
                        row[f"us_by_{key}"] = alternate(setter, values, lambda: round(
                            timeit(lambda: ex.kernel(x, ids, w), warmup=5, iters=max(a.iters, 50)) * 1e6, 1))
            rows.append(row)
        ex.set_act(False)
    return rows


def settings(csv: str) -> list[int]:
    """an A/B option's comma-separated integer settings ("1,0"); a bad one exits with one line"""
    try:
        return [int(v) for v in csv.split(",") if v]
    except ValueError:
        raise SystemExit(f"cpu_experts: an A/B option wants comma-separated integers such as 1,0, got {csv!r}")


def alternate(setter, values: list[int], timed) -> dict[str, list]:
    """timed() under each of a switch's values (setter: moe_cpu's set_*, returning the value it
    replaces), alternating, twice each, in one process; the switch's value before is restored."""
    before, ab = setter(values[0]), {}
    try:
        for _ in range(2):
            for v in values:
                setter(v)
                ab.setdefault(str(v), []).append(timed())
    finally:
        setter(before)
    return ab


def kernel_ab(ex, run, setter, values: list, key: str) -> dict:
    """ms of the quantized kernels with each value of one moe_cpu switch, alternating, twice each: float,
    bf16 and int8 activations ({act}_ms_by_{key}; int8 for MXFP4 / NVFP4 only)."""
    out = {}
    try:
        for act, cast, int8 in (("f32act", lambda x: x, False), ("bf16act", lambda x: x.bfloat16(), False),
                                ("int8", lambda x: x, True)):
            if int8 and ex.set_act(True) != "int8":
                continue
            out[f"{act}_ms_by_{key}"] = alternate(setter, values, lambda: round(
                run(lambda x, ids, w: ex.kernel(cast(x), ids, w)) * 1e3, 3))
            ex.set_act(False)
    finally:
        ex.set_act(False)
    return out


PREFETCH_HINTS = {"t0": 0, "t1": 1, "t2": 2, "nta": 3, "off": -1}


def set_prefetch(spec: str) -> str:
    """moe_cpu.set_prefetch from "HINT:BYTES" (as FREETOKEN_CPU_PREFETCH_HINT / _BYTES name them);
    returns the setting it replaces in the same form"""
    hint, _, nbytes = spec.partition(":")
    before = extension().set_prefetch(PREFETCH_HINTS[hint], int(nbytes or 8192))
    names = {v: k for k, v in PREFETCH_HINTS.items()}
    return f"{names[before >> 32]}:{before & 0xFFFFFFFF}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="bf16", choices=FORMATS,
                    help="expert banks: bf16, or quantized as published (read in place by the C++ kernels)")
    ap.add_argument("--experts", type=int, default=512, help="experts in the bank (6.3 MB each)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batches", default="1,2,4,8,32")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--activation", default="silu", choices=ACTIVATIONS,
                    help="the expert function: silu (no biases), or GPT-OSS's swiglu_clamp with bias banks")
    ap.add_argument("--name", default=None, help="result name (default cpu_experts[-FORMAT][-ACTIVATION])")
    ap.add_argument("--fixed-cost", action="store_true",
                    help="also time batch-1 calls on experts already in cache: one expert, and the same "
                         "top-k every call (what a call costs besides streaming its bytes)")
    ap.add_argument("--decode-once", default="",
                    help="N,M,...: the float-, bf16- and int8-activation rows again with each decode-once threshold "
                         "(moe_cpu set_decode_once; 0: the rows decoded once per two tokens, int8 once per token), "
                         "alternating, twice each")
    ap.add_argument("--row-scales", default="",
                    help="3,0: the fp4 formats' float-, bf16- and int8-activation rows (and --fixed-cost's cached "
                         "top-k) again with each moe_cpu set_row_scales mask (which kernels decode the block scales "
                         "once per call: 1 the AVX2 ones, the default; 2 the AVX-512 ones; 3 both; 0 none), "
                         "alternating, twice each")
    ap.add_argument("--row-seq", default="",
                    help="0,1: the fp4 formats' rows again with each moe_cpu set_row_seq setting (1: a 4-row block's "
                         "rows one after another in the int8 and bf16-activation kernels; 0, the default: side by side), "
                         "alternating, twice each")
    ap.add_argument("--row-runs", default="",
                    help="1,0: the fp4 formats' rows (and --fixed-cost's cached top-k) again with each moe_cpu "
                         "set_row_runs setting (1, the default: the kernels' one-token calls take a run of an "
                         "expert's rows at a time; 0: a 4-row block at a time), alternating, twice each")
    ap.add_argument("--prefetch", default="",
                    help="t2:8192,off:0,...: the fp4 formats' rows again with each software look-ahead "
                         "(moe_cpu set_prefetch: hint t0|t1|t2|nta|off, distance in bytes), alternating, twice each")
    ap.add_argument("--isa-cap", type=int, default=3,
                    help="the executor's highest ISA (0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 BF16): an AVX-512 "
                         "machine timing the kernels a CPU without it runs (the AVX2 int8 kernel included)")
    ap.add_argument("--warmup-s", type=float, default=1.0,
                    help="seconds of untimed batch-1 calls before the first timed row (0: none)")
    ap.add_argument("--plain-banks", action="store_true",
                    help="banks in plain torch tensors instead of the engine's (huge-page) host buffers")
    a = ap.parse_args()
    for ab in (a.decode_once, a.row_scales, a.row_seq, a.row_runs):  # before minutes of bank set-up
        settings(ab)
    for spec in filter(None, a.prefetch.split(",")):
        hint, _, nbytes = spec.partition(":")
        if hint not in PREFETCH_HINTS or not nbytes.isdigit():
            ap.error(f"--prefetch wants HINT:BYTES with HINT one of {', '.join(PREFETCH_HINTS)}, got {spec!r}")
    n, h, i, k = a.experts, a.hidden, a.inter, a.top_k
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    if a.format == "bf16":
        gu = engine_memory((torch.randn(n, 2 * i, h, generator=g) * 0.02).bfloat16(), a.plain_banks)
        dn = engine_memory((torch.randn(n, h, i, generator=g) * 0.02).bfloat16(), a.plain_banks)
        per_expert = 3 * h * i * gu.element_size()
        probe = gu  # the read-bandwidth probe's bytes
    else:
        banks = quantized_banks(a.format, n, h, i, g)
        gu, dn = (QuantBank(b.format, engine_memory(b.values, a.plain_banks), engine_memory(b.scale, a.plain_banks),
                            b.scale_2, b.halves) for b in (banks.gate_up, banks.down))
        per_expert = banks.expert_bytes  # values and scales: what one expert's call reads
        probe = gu.values
    fn = {}
    if a.activation != "silu":  # GPT-OSS: its constants, and bias banks as it publishes them (bf16)
        fn = dict(activation=Activation(a.activation, 1.702, 7.0),
                  gate_up_bias=(torch.randn(n, 2 * i, generator=g) * 0.1).bfloat16(),
                  down_bias=(torch.randn(n, h, generator=g) * 0.1).bfloat16())
    gen_s = time.perf_counter() - t0
    ex = CpuExpertExecutor(gu, dn, threads=a.threads, isa_cap=a.isa_cap, **fn)
    threads = ex.threads
    res = {"format": a.format, "activation": a.activation, "isa": ex.isa, "threads": threads, "physical_cores": len(physical_cores()),
           "shape": [h, i], "top_k": k,
           "bank_gb": round(n * per_expert / 1e9, 2), "expert_mb": round(per_expert / 1e6, 2),
           "gen_s": round(gen_s, 1), "thp": thp_mode(), "plain_banks": a.plain_banks,
           "bank_huge_gb": round(sum(huge_bytes(b if isinstance(b, torch.Tensor) else b.values) or 0
                                     for b in (gu, dn)) / 1e9, 2), "batches": []}
    # a warm-up before any timed row: on a Xeon at 16 threads the first ~100 calls of a fresh process
    # ran 5-6x slower than the rest (plan 152: 1.2-1.4 ms at batch 1 against 0.21-0.27 for the same
    # calls later), which the first timed rows then reported as the executor's rate
    warm_end, wg = time.perf_counter() + a.warmup_s, torch.Generator().manual_seed(1)
    while time.perf_counter() < warm_end:
        x = torch.randn(1, h, generator=wg)
        ids = torch.randperm(n, generator=wg)[:k][None]
        for act in ("exact", "int8") if a.format in ("mxfp4", "nvfp4") and ex.handle is not None else ("exact",):
            ex.set_act(act == "int8")
            ex.kernel(x, ids, torch.full((1, k), 1.0 / k))
        ex.set_act(False)
    res["warmup_s"] = a.warmup_s
    for b in [int(x) for x in a.batches.split(",")]:
        def routed():
            """a.iters + 3 calls, fresh routing every call, like decode across layers"""
            out = []
            for c in range(a.iters + 3):
                x = torch.randn(b, h, generator=g)
                ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
                out.append((x, ids, torch.softmax(torch.randn(b, k, generator=g), -1)))
            return out
        calls = routed()
        distinct = sum(len(torch.unique(c[1])) for c in calls[3:]) / a.iters

        def run(fn):
            # each row routes afresh: rows of one batch that replayed the same calls found the
            # experts the row before had just read partly in the L3 cache, which favoured the
            # later row of an A/B (the VNNI-only int8 kernel ran after the VBMI one)
            it = iter(routed())
            return timeit(lambda: fn(*next(it)), warmup=3, iters=a.iters)

        t_cpp = run(ex.kernel)
        # a bf16 model hands over bf16 activations: the VDPBF16PS path where the CPU has it
        t_bf = run(lambda x, ids, w: ex.kernel(x.bfloat16(), ids, w))
        row = {"batch": b, "distinct_experts": round(distinct, 1),
               "cpp_ms": round(t_cpp * 1e3, 3), "cpp_gbs": round(distinct * per_expert / t_cpp / 1e9, 1),
               "cpp_bf16act_ms": round(t_bf * 1e3, 3),
               "cpp_bf16act_gbs": round(distinct * per_expert / t_bf / 1e9, 1)}
        if a.decode_once and ex.handle is not None:  # A/B of the decode-once threshold, alternating
            row.update(kernel_ab(ex, run, extension().set_decode_once, settings(a.decode_once), "decode_once"))
        if a.format in ("mxfp4", "nvfp4") and ex.handle is not None:  # A/B runs of the fp4 kernels' switches
            if a.row_scales:
                row.update(kernel_ab(ex, run, extension().set_row_scales, settings(a.row_scales), "row_scales"))
            if a.row_seq:
                row.update(kernel_ab(ex, run, extension().set_row_seq, settings(a.row_seq), "row_seq"))
            if a.prefetch:
                row.update(kernel_ab(ex, run, set_prefetch, a.prefetch.split(","), "prefetch"))
            if a.row_runs:
                row.update(kernel_ab(ex, run, extension().set_row_runs, settings(a.row_runs), "row_runs"))
        if a.format in ("mxfp4", "nvfp4") and ex.handle is not None:  # --cpu-act int8, same executor
            vnni = ex.set_act(True) == "int8"
            kernel = ex.int8_kernel
            x0, ids0, w0 = calls[0]
            exact = reference_experts(x0, ids0, w0, gu, dn, **fn)
            err = float((ex.kernel(x0, ids0, w0) - exact).norm() / exact.norm())
            t_i8 = run(ex.kernel)
            row.update(cpp_int8_ms=round(t_i8 * 1e3, 3), cpp_int8_gbs=round(distinct * per_expert / t_i8 / 1e9, 1),
                       int8_vnni=vnni, int8_kernel=kernel, int8_rel_err=float(f"{err:.2e}"))
            if kernel == "vbmi":  # the VNNI-only kernel beside it, in the same run (A/B)
                ex.set_act(True, max_kernel="vnni")
                t_vnni = run(ex.kernel)
                row.update(cpp_int8_vnni_ms=round(t_vnni * 1e3, 3),
                           cpp_int8_vnni_gbs=round(distinct * per_expert / t_vnni / 1e9, 1))
            ex.set_act(False)
        # the torch path's per-expert GEMMs against the C++ kernel decide the executor's
        # FLOAT_TORCH_THRESHOLD (prefill chunks); the quantized reference dequantizes each expert
        if b <= (2048 if a.format == "bf16" else 8):
            t_ref = run(lambda x, ids, w: reference_experts(x.bfloat16(), ids, w, gu, dn, **fn))
            row.update(torch_ms=round(t_ref * 1e3, 3), torch_gbs=round(distinct * per_expert / t_ref / 1e9, 1),
                       torch_over_cpp=round(t_ref / min(t_cpp, t_bf), 2))
            if a.format == "bf16":  # a float32 engine's call (the CPU's default dtype): each expert widened
                # first on the torch path, read as it is by the C++ kernel (experts/cpu WIDENING_PAIRS_PER_EXPERT)
                t_w = run(lambda x, ids, w: reference_experts(x, ids, w, gu, dn, **fn))
                row.update(torch_f32act_ms=round(t_w * 1e3, 3), torch_f32act_over_cpp=round(t_w / t_cpp, 2))
        res["batches"].append(row)
        print(row, flush=True)
    if a.fixed_cost:
        res["fixed_cost"] = fixed_cost_rows(ex, a, h, k, per_expert, g)
        print(res["fixed_cost"], flush=True)
    # measured last: torch's OpenMP threads keep spinning after a parallel region and would
    # compete with the executor's pinned threads
    res["host_read_gbs"] = round(read_bandwidth(probe, threads), 1)
    best1 = max(res["batches"][0]["cpp_gbs"], res["batches"][0]["cpp_bf16act_gbs"])
    res["cpp_vs_read_bw_batch1"] = round(best1 / res["host_read_gbs"], 2)
    for row in res["batches"]:  # each batch's best C++ path against the same probe
        row["cpp_vs_read_bw"] = round(max(row["cpp_gbs"], row["cpp_bf16act_gbs"]) / res["host_read_gbs"], 2)
        if "cpp_int8_gbs" in row:
            row["int8_vs_read_bw"] = round(row["cpp_int8_gbs"] / res["host_read_gbs"], 2)
    name = "cpu_experts" if a.format == "bf16" else f"cpu_experts-{a.format}"
    res["schedule"] = os.environ.get("FREETOKEN_CPU_SCHEDULE") or "static"
    # bf16 / fp32 banks: an expert's tokens four at a time (moe_cpu.cpp dot4x4_*) or one at a time
    res["token_block"] = os.environ.get("FREETOKEN_CPU_TOKEN_BLOCK", "1") != "0"
    # the quantized kernels' software look-ahead (moe_cpu.cpp g_pf_hint / g_pf)
    res["prefetch"] = (f"{os.environ.get('FREETOKEN_CPU_PREFETCH_HINT') or 't2'}:"
                       f"{os.environ.get('FREETOKEN_CPU_PREFETCH_BYTES') or '8192'}")
    write_result(a.name or (name if a.activation == "silu" else f"{name}-{a.activation}"), res)


if __name__ == "__main__":
    main()
