"""`ft bench bw`: measure B_H, B_P (alone and together) and the CPU executor's fixed cost per
call on a model's expert shape, without loading the model.

Only the FTW header is read (shape and format of the expert banks). The measuring runs on a
scratch bank of that shape: enough experts that their bytes are at least 4x the last-level
cache (and the GPU's L2), so every call reads from DRAM as serving does, bounded by a quarter
of the available memory. On CUDA the bank is pinned host memory, as the engine's banks are
(the transfer kernel reads it in place).
  B_H   the engine's CPU executor (CpuExpertExecutor, the engine's default thread rule) in
        decode calls: batch 1, top-k distinct experts per call, each call on experts not read
        recently; GB/s of expert bytes read
  B_P   fills as the cache makes them: one launch of the fused zero-copy kernel per layer call,
        top-k experts from the pinned bank into VRAM slots (CUDA only)
  both  the CPU loop in a thread (the C++ call releases the GIL) while the kernel streams;
        each side's own rate over its own window
  fixed the time of a call on top-k tiny experts (128 x 128), against a full-size call
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time

import torch

from ..config import ModelConfig
from ..errors import FreeTokenError
from ..weights.ftw import DTYPES, read_header
from . import bandwidth

TINY = 128  # hidden and intermediate size of the fixed-cost experts: a multiple of every block


def llc_bytes() -> int:
    """The last-level cache, summed over its instances (one per socket, or per CCD on AMD), from
    sysfs; 32 MiB when sysfs does not say."""
    seen, level, total = set(), 0, 0
    root = "/sys/devices/system/cpu"
    try:
        cpus = [d for d in os.listdir(root) if d.startswith("cpu") and d[3:].isdigit()]
        for c in cpus:
            base = os.path.join(root, c, "cache")
            for idx in os.listdir(base):
                d = os.path.join(base, idx)
                with open(os.path.join(d, "level")) as f:
                    lv = int(f.read())
                with open(os.path.join(d, "size")) as f:
                    s = f.read().strip()
                with open(os.path.join(d, "shared_cpu_list")) as f:
                    who = f.read().strip()
                size = int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[s[-1]] if s[-1].isalpha() else int(s)
                if lv > level:
                    seen, level, total = set(), lv, 0
                if lv == level and who not in seen:
                    seen.add(who)
                    total += size
    except (OSError, ValueError, KeyError, IndexError):
        return 32 << 20
    return total or 32 << 20


def available_memory() -> int:
    """Host memory available now (the memory plan's reading), 4 GiB when it cannot be read."""
    from .budget import host_available
    return host_available() or 4 << 30


def engine_threads(threads: int, cuda: bool) -> int:
    """The engine's rule (Engine._cpu_threads): --cpu-threads if given; else every physical
    core on a CPU-only machine (0 lets the executor take them), all but two on CUDA."""
    if threads or not cuda:
        return threads
    from ..experts.cpu import physical_cores
    return max(1, len(physical_cores()) - 2)


def bank_layout(meta: dict, entries: dict, n: int, hidden: int | None = None, inter: int | None = None):
    """(format, [(dtype, shape, part, component)]) of the model's expert banks with n experts,
    optionally of another hidden / intermediate size (the tiny fixed-cost experts)."""
    from ..weights.convert import bank_entries
    b = meta.get("banks") or {}
    if not b.get("gate_up") or b["gate_up"] not in entries:
        raise FreeTokenError("the model has no routed experts: nothing to measure")
    fmt = b.get("format", "dense")
    gu = entries[b["gate_up"]]
    h, i = gu.shape[2], entries[b["down"]].shape[2]
    if fmt in ("mxfp4", "nvfp4"):
        h, i = 2 * h, 2 * i  # two fp4 codes per byte
    values = gu.dtype if gu.dtype in ("bfloat16", "float32") else "bfloat16"  # f16: same bytes as bf16
    scale = entries[b["gate_up_scale"]].dtype if b.get("gate_up_scale") else "float32"
    rows = bank_entries(fmt, n, inter or i, hidden or h, {"values": values, "scale": scale})
    return fmt, [(dt, shape, part, comp) for _, dt, shape, part, comp in rows]


# bytes that decode to 1.0 (or small values): constant data, written once so every page is
# really backed (an untouched calloc'd page reads as the shared zero page, all cache hits)
ONE = {("fp8_block", "values"): 0x38, ("mxfp4", "values"): 0x22,
       ("nvfp4", "values"): 0x22, ("mxfp4", "scale"): 127, ("nvfp4", "scale"): 0x38}


def scratch_banks(fmt: str, layout, pin: bool):
    """ExpertBanks of the layout, filled with harmless constants (no NaN, no denormals)."""
    from ..experts.banks import ExpertBanks, QuantBank
    parts: dict[str, dict[str, torch.Tensor]] = {"gate_up": {}, "down": {}}
    for dt, shape, part, comp in layout:
        t = torch.empty(shape, dtype=DTYPES[dt], pin_memory=pin)
        byte = ONE.get((fmt, comp))
        if t.dtype.is_floating_point and t.element_size() > 1:
            t.fill_(0.01 if comp == "values" else 1.0)
        else:
            t.view(torch.uint8).fill_(byte if byte is not None else 0x38)
        parts[part][comp] = t
    if fmt == "dense":
        return ExpertBanks(fmt, parts["gate_up"]["values"], parts["down"]["values"])

    def bank(part, halves):
        p = parts[part]
        return QuantBank(fmt, p["values"], p["scale"], p.get("scale_2"), halves)
    return ExpertBanks(fmt, bank("gate_up", 2), bank("down", 1))


class Progress:
    """One line per phase on stderr: what is measured, then its result on the same line."""

    def __init__(self, phases: int):
        self.n, self.i = phases, 0

    def start(self, what: str) -> None:
        self.i += 1
        print(f"ft bench bw: [{self.i}/{self.n}] {what} ...", end="", file=sys.stderr, flush=True)

    def done(self, result: str) -> None:
        print(f" {result}", file=sys.stderr, flush=True)


def id_lists(n: int, k: int, calls: int, seed: int = 0) -> list[torch.Tensor]:
    """[1, k] distinct expert ids per call, walking random permutations of the bank, so a call
    reads experts last read about n/k calls ago (evicted: the bank is 4x the caches)."""
    g = torch.Generator().manual_seed(seed)
    out, perm = [], torch.randperm(n, generator=g)
    pos = 0
    for _ in range(calls):
        if pos + k > n:
            perm, pos = torch.randperm(n, generator=g), 0
        out.append(perm[pos:pos + k][None].clone())
        pos += k
    return out


def cpu_loop(cpu, hidden: int, ids: list[torch.Tensor], seconds: float, ready=None) -> tuple[int, float]:
    """(calls, seconds) of decode calls on the C++ path (what the decode graph's host node
    runs), for `seconds`; `ready` a barrier to start together with the transfer loop."""
    k = ids[0].shape[1]
    x = torch.randn(1, hidden) * 0.1
    w = torch.full((1, k), 1.0 / k)
    call = cpu.kernel if cpu.handle is not None else (lambda x, i, w: cpu.run(x, i, w, "decode"))
    call(x, ids[-1], w)  # warm: the thread pool up, the code paged in
    if ready is not None:
        ready.wait()
    calls, t0 = 0, time.perf_counter()
    while True:
        call(x, ids[calls % len(ids)], w)
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return calls, dt


def call_seconds(cpu, hidden: int, ids: torch.Tensor, seconds: float) -> float:
    """Median seconds of one call on the same experts (cached after the first)."""
    x = torch.randn(1, hidden) * 0.1
    w = torch.full((1, ids.shape[1]), 1.0 / ids.shape[1])
    call = cpu.kernel if cpu.handle is not None else (lambda x, i, w: cpu.run(x, i, w, "decode"))
    call(x, ids, w)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        call(x, ids, w)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


class Transfer:
    """Fills as the cache makes them: the fused kernel, top-k experts per launch, from the
    pinned bank (read in place) into VRAM slots. Quantized banks: every tensor a slot holds
    (values, scales, NVFP4's scale_2), copied as bytes, as the cache's fills move them."""

    def __init__(self, banks, k: int, n: int, dev):
        from ..kernels.expert_transfer import zero_copy_ok
        host = banks.tensors()  # dense gate_up and down, or each bank's values, scale (, scale_2)
        if not all(zero_copy_ok(h) for h in host):
            raise FreeTokenError("the pinned scratch bank is not readable in place by the GPU (no unified "
                                 "addressing?): the cache would copy with a sync per layer; B_P not measured")
        self.host = host
        self.slots = [torch.empty(k, *h.shape[1:], dtype=h.dtype, device=dev) for h in host]
        self.src = [i.to(torch.int32).reshape(-1).to(dev) for i in id_lists(n, k, max(1, n // k), seed=1)]
        self.dst = torch.arange(k, dtype=torch.int32, device=dev)
        self.launch_bytes = k * sum(h[0].numel() * h.element_size() for h in host)

    def loop(self, seconds: float, ready=None) -> tuple[int, float]:
        """(launches, seconds) streaming for `seconds`: launches enqueued 8 at a time, then a
        sync (so the queue never runs dry nor grows without bound)."""
        from ..kernels.expert_transfer import transfer_triton
        transfer_triton(self.host, self.slots, self.src[0], self.dst)  # compiles the kernel once
        torch.cuda.synchronize()
        if ready is not None:
            ready.wait()
        n, t0 = 0, time.perf_counter()
        while True:
            for _ in range(8):
                transfer_triton(self.host, self.slots, self.src[n % len(self.src)], self.dst)
                n += 1
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if dt >= seconds:
                return n, dt


def both(cpu, tr: Transfer, hidden: int, ids, seconds: float) -> tuple[tuple[int, float], tuple[int, float]]:
    """((launches, seconds), (calls, seconds)): the transfer loop here, the CPU loop in a thread
    (the C++ call releases the GIL), started together on a barrier."""
    ready, res = threading.Barrier(2), {}

    def cpu_side():  # a failure breaks the barrier, so this thread does not wait forever
        try:
            res["cpu"] = cpu_loop(cpu, hidden, ids, seconds, ready)
        except BaseException as e:
            res["error"] = e
            ready.abort()
    th = threading.Thread(target=cpu_side, daemon=True)
    th.start()
    try:
        gpu = tr.loop(seconds, ready)
    except threading.BrokenBarrierError:
        th.join()
        raise res["error"] from None
    th.join()
    if "error" in res:
        raise res["error"]
    return gpu, res["cpu"]


def measure(path: str, threads: int = 0, seconds: float = 2.0, cpu_act: str = "exact") -> tuple[dict, ModelConfig]:
    """(the profile of the model at `path` on this machine (see the module doc), its config).
    cpu_act: the executor's activations as `ft serve --cpu-act` sets them (int8: MXFP4 / NVFP4
    banks on the C++ executor; elsewhere the profile says exact, as the engine would run)."""
    from ..experts.cpu import CpuExpertExecutor, physical_cores
    meta, entries = read_header(path)
    cfg = ModelConfig.from_hf(meta["config"], path)
    k = cfg.top_k
    fmt, one = bank_layout(meta, entries, 1)
    expert_bytes = sum(math.prod(s) * torch.empty((), dtype=DTYPES[dt]).element_size() for dt, s, _, _ in one)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else None
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) if cuda else 0
    llc = llc_bytes()
    caches = max(llc, l2)  # the GPU's L2 may cache host reads of the transfer kernel
    room = available_memory() // 4
    n = max(64, 2 * k, math.ceil(4 * caches / expert_bytes))
    notes = []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * len(physical_cores()):  # the executor's pinned workers share their cores
        notes.append(f"the machine was busy (load average {load:.1f}): the CPU numbers may be low")
    if n * expert_bytes > room:
        n = room // expert_bytes
        if n < 2 * k:
            raise FreeTokenError(f"not enough free memory for a scratch bank of {2 * k} experts of "
                                 f"{expert_bytes / 1e6:.1f} MB; free some memory")
        notes.append(f"scratch bank limited to {n} experts by free memory: less than 4x the caches, "
                     "B_H may read partly from cache")
    _, layout = bank_layout(meta, entries, n)
    banks = scratch_banks(fmt, layout, pin=cuda)
    # the engine's expert_format (banks.label) of the file's banks, f16 included (the scratch is bf16)
    label = fmt if fmt != "dense" else {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(
        entries[meta["banks"]["gate_up"]].dtype, banks.label)
    cpu = CpuExpertExecutor(banks, threads=engine_threads(threads, cuda))
    if cpu.backend != "cpp":
        notes.append("the C++ executor could not be built: B_H is the torch fallback's")
    _, tiny_layout = bank_layout(meta, entries, k, hidden=TINY, inter=TINY)
    tiny = CpuExpertExecutor(scratch_banks(fmt, tiny_layout, pin=False), threads=cpu.threads)
    if cpu_act == "int8":
        if cpu.set_act(True) != "exact":  # where int8 applies, the fixed-cost calls take it too
            tiny.set_act(True)
        else:
            notes.append(f"--cpu-act int8 applies to MXFP4 / NVFP4 banks on the C++ executor; these ({label}) "
                         "were measured exact, as the engine runs them")
    ids = id_lists(n, k, 4 * max(1, n // k))
    prog = Progress(4 if cuda else 2)

    prog.start(f"B_H: CPU executor, {cpu.threads} thread{'s' * (cpu.threads != 1)}, {k} experts per call, "
               f"{seconds:g} s")
    calls, dt = cpu_loop(cpu, cfg.hidden_size, ids, seconds)
    b_h = calls * k * expert_bytes / dt / 1e9
    call_us = dt / calls * 1e6
    prog.done(f"{b_h:.2f} GB/s ({call_us:.0f} us per call)")

    prog.start("CPU call fixed cost (tiny experts)")
    fixed_us = call_seconds(tiny, TINY, torch.arange(k)[None], min(0.5, max(0.1, seconds / 4))) * 1e6
    prog.done(f"{fixed_us:.1f} us per call")

    b_p = b_p_c = b_h_c = None
    if cuda:
        try:
            tr = Transfer(banks, k, n, dev)
        except FreeTokenError as e:
            notes.append(str(e))
            tr = None
        if tr is not None:
            prog.start(f"B_P: fused zero-copy kernel, {k} experts per launch, {seconds:g} s")
            launches, dt = tr.loop(seconds)
            b_p = launches * tr.launch_bytes / dt / 1e9
            prog.done(f"{b_p:.2f} GB/s")
            if banks.quantized:
                notes.append("B_P measured on the value banks (the scales are a few percent of the bytes)")
            prog.start(f"both at once, {seconds:g} s")
            (launches, dt), (c_calls, c_dt) = both(cpu, tr, cfg.hidden_size, ids, seconds)
            b_p_c = launches * tr.launch_bytes / dt / 1e9
            b_h_c = c_calls * k * expert_bytes / c_dt / 1e9
            prog.done(f"B_P {b_p_c:.2f} GB/s, B_H {b_h_c:.2f} GB/s")

    r2 = lambda v: None if v is None else round(v, 3)  # noqa: E731
    prof = {
        "version": bandwidth.VERSION, "date": bandwidth.now_iso(), "units": "GB/s (1e9 bytes/s), us",
        "machine": {"cpu": bandwidth.cpu_model(), "cores": len(physical_cores()), "logical_cpus": os.cpu_count(),
                    "llc_bytes": llc, "load_average": round(load, 2), "gpu": bandwidth.gpu_name(),
                    "torch": torch.__version__},
        "model": {"path": os.path.abspath(path), "arch": cfg.arch, "format": label, "hidden": cfg.hidden_size,
                  "inter": cfg.moe_intermediate_size, "experts_per_layer": cfg.num_experts,
                  "moe_layers": len(cfg.moe_layers), "top_k": k, "expert_bytes": expert_bytes},
        "threads": cpu.threads, "isa": cpu.isa, "backend": cpu.backend, "cpu_act": cpu.act or "exact",
        "bank": {"experts": n, "bytes": n * expert_bytes, "pinned": cuda},
        "seconds": seconds,
        "B_H": r2(b_h), "B_P": r2(b_p), "B_H_concurrent": r2(b_h_c), "B_P_concurrent": r2(b_p_c),
        "cpu_call_us": round(call_us, 2), "cpu_fixed_us": round(fixed_us, 2),
        "notes": notes,
    }
    return prof, cfg


def table(p: dict) -> str:
    """The short human summary `ft bench bw` prints."""
    m, mc = p["model"], p["machine"]
    gb = lambda v: "   -" if v is None else f"{v:7.2f} GB/s"  # noqa: E731
    rows = [
        f"{m['format']} experts {2 * m['inter']}x{m['hidden']} + {m['hidden']}x{m['inter']} "
        f"({m['expert_bytes'] / 1e6:.2f} MB), top-{m['top_k']}, {m['moe_layers']} MoE layers",
        f"{mc['cpu']}, {mc['cores']} cores, {mc['gpu'] or 'no GPU'}; CPU executor {p['threads']} threads ({p['isa']}, "
        f"{p.get('cpu_act', 'exact')} activations)",
        f"  B_H  CPU executor, decode calls      {gb(p['B_H'])}",
        f"  B_P  pinned host -> VRAM slots       {gb(p['B_P'])}" + ("" if p["B_P"] is not None else "  (no CUDA)"),
        f"  B_H  while the kernel streams        {gb(p['B_H_concurrent'])}",
        f"  B_P  while the CPU computes          {gb(p['B_P_concurrent'])}",
        f"  CPU call fixed cost                  {p['cpu_fixed_us']:7.1f} us  (a full call {p['cpu_call_us']:.1f} us)",
        f"  predicted fill share r               {bandwidth.predicted_share(p):7.2f}",
    ]
    return "\n".join(rows + [f"note: {n}" for n in p["notes"]])
