"""CPU expert executor: the C++ thread pool (moe_cpu.cpp) behind the ExpertExecutor interface.

The extension is JIT-built once per machine with torch.utils.cpp_extension (a C++ compiler
is all it needs) into FreeToken's cache; if it cannot be built, the pure-torch reference runs
instead and a warning says why. Large batches (prefill chunks) of float banks go to the torch
grouped path, which uses the BLAS GEMM kernels; decode-sized batches go to the bandwidth-bound
C++ kernels.

Banks: bf16 / f32 tensors, or quantized (experts.banks: an ExpertBanks, or its QuantBank pair,
in fp8_block, mxfp4 or nvfp4) read by the C++ kernels as published, dequantized in registers
(no copy, no dequantized buffer), prefill chunks included (up to 4096 tokens; above, the torch
reference dequantizes the selected experts, banks.take).

The expert function is data, as for the torch executors: SiLU-gated experts without biases
(Qwen, DeepSeek), or GPT-OSS's clamped SwiGLU with its gate_up / down bias banks, computed by the
same C++ kernels (the activation and biases are applied per row between the projections).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
import weakref

import torch

from ..banks import ExpertBanks, QuantBank
from .. import split_experts
from ..executor import NO_EXPERT, SILU, Activation, ExpertExecutor, Pending, reference_experts
from ... import limits
from ...errors import notice
from ...paths import cache_dir, file_lock

log = logging.getLogger("freetoken.experts")
_ext = None
_ext_error: str | None = None
ISA_NAMES = ["scalar", "avx2", "avx512", "avx512-bf16"]
# the int8-activation kernels in order (moe_cpu.cpp Q8Kernel): each later one needs more of the ISA
INT8_KERNELS = ("scalar", "avx2", "vnni", "vbmi")  # moe_cpu.cpp Q8Kernel, slowest first


EXT_NAME = "freetoken_moe_cpu"
HEADERS = ("attention.h", "dense.h", "deltanet.h", "denormals.h", "row_runs.h")  # included by moe_cpu.cpp
BUILD_SECONDS = "20-60 s"  # for the first-run message


def extension():
    """Build (first time) and import the C++ extension; None if unavailable.

    Processes starting together build it once: an flock on the build folder's `freetoken.lock`
    serialises them (the first builds, the others wait, then import the finished library).
    torch's own build lock (a `lock` file it creates and deletes, polled by waiters) would also
    keep concurrent builds apart, but a build killed midway leaves that file behind and every
    later start waits on it forever; under our flock no other FreeToken process can be building,
    so a leftover one is stale and is removed.
    """
    global _ext, _ext_error
    if _ext is not None or _ext_error is not None:
        return _ext
    try:
        from torch.utils.cpp_extension import load
        here = os.path.dirname(__file__)
        src = os.path.join(here, "moe_cpu.cpp")
        parts = [src] + [os.path.join(here, h) for h in HEADERS]  # one translation unit: moe_cpu.cpp includes them
        build = os.path.join(cache_dir(), "build", f"moe_cpu-torch{torch.__version__.replace('+', '_')}")
        os.makedirs(build, exist_ok=True)

        def waiting():
            notice("another process is building the C++ expert executor; waiting for it ...")

        with file_lock(os.path.join(build, "freetoken.lock"), on_wait=waiting):
            baton = os.path.join(build, "lock")
            if os.path.exists(baton):
                log.warning("removing %s, left by a build that did not finish", baton)
                os.remove(baton)
            lib = os.path.join(build, EXT_NAME + ".so")
            fresh = os.path.exists(lib) and os.path.getmtime(lib) >= max(map(os.path.getmtime, parts))
            if not fresh:
                notice(f"building the C++ expert executor into {build} (takes {BUILD_SECONDS}, once) ...")
            else:
                log.info("C++ expert executor: using the build in %s", build)
            t0 = time.perf_counter()
            # torch rebuilds when a source or a flag changes, not an included header: the headers'
            # hash goes in as a flag
            digest = hashlib.sha256()
            for h in parts[1:]:
                with open(h, "rb") as f:
                    digest.update(f.read())
            header = digest.hexdigest()[:16]
            _ext = load(name=EXT_NAME, sources=[src], build_directory=build,
                        # no -std: torch's own (C++20 since 2.10), which a -std=c++17 here overrode
                        extra_cflags=["-O3", "-fno-math-errno", "-fno-trapping-math",
                                      f"-DFT_ATTENTION_H={header}"], verbose=False)
            if not fresh:
                log.info("C++ expert executor built in %.0f s", time.perf_counter() - t0)
    except Exception as e:  # no compiler, no ninja, ...: degrade to torch, loudly
        _ext_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("C++ expert executor unavailable (%s); using the torch fallback", _ext_error)
    return _ext


# The CPU decode step's C++ kernels beside the experts' (dense.h through model/linear.py's
# host_gemv, deltanet.h through GatedDeltaNet._decode_host); FREETOKEN_CPU_KERNELS=0 leaves those
# parts to torch (A/B runs). Read at import.
DECODE_KERNELS = os.environ.get("FREETOKEN_CPU_KERNELS", "1") != "0"

PREFETCH_HINTS = ("t0", "t1", "t2", "nta", "off")


def check_prefetch_env() -> None:
    """FREETOKEN_CPU_PREFETCH_HINT / _BYTES (the quantized kernels' look-ahead), _ROW_SCALES,
    _DECODE_ONCE, _ROW_SEQ and _ROW_RUNS, read by moe_cpu.cpp, which would quietly take a default or 0 for a bad value:
    one clear error instead."""
    from ...errors import FreeTokenError
    hint = os.environ.get("FREETOKEN_CPU_PREFETCH_HINT", "")
    if hint and hint not in PREFETCH_HINTS:
        raise FreeTokenError(f"FREETOKEN_CPU_PREFETCH_HINT must be one of {', '.join(PREFETCH_HINTS)}, got {hint!r}")
    raw = os.environ.get("FREETOKEN_CPU_PREFETCH_BYTES", "")
    if raw and not (raw.isdigit() and int(raw) <= 1 << 20):
        raise FreeTokenError(f"FREETOKEN_CPU_PREFETCH_BYTES must be a byte count from 0 to 1048576, got {raw!r}")
    # the kernels' A/B switches, read by moe_cpu.cpp as integers (a typo there would read as 0)
    raw = os.environ.get("FREETOKEN_CPU_ROW_SCALES", "")
    if raw and raw not in ("0", "1", "2", "3"):
        raise FreeTokenError("FREETOKEN_CPU_ROW_SCALES must be a mask from 0 to 3 (1: the AVX2 kernels, "
                             f"2: the AVX-512 ones), got {raw!r}")
    raw = os.environ.get("FREETOKEN_CPU_DECODE_ONCE", "")
    if raw and not raw.isdigit():
        raise FreeTokenError(f"FREETOKEN_CPU_DECODE_ONCE must be a token count (0: off), got {raw!r}")
    raw = os.environ.get("FREETOKEN_CPU_ROW_SEQ", "")
    if raw and raw not in ("0", "1"):
        raise FreeTokenError("FREETOKEN_CPU_ROW_SEQ must be 0 (a 4-row block's rows side by side, the default) "
                             f"or 1 (one after another), got {raw!r}")
    raw = os.environ.get("FREETOKEN_CPU_ROW_RUNS", "")
    if raw and raw not in ("0", "1"):
        raise FreeTokenError("FREETOKEN_CPU_ROW_RUNS must be 1 (the fp4 kernels' decode calls take a run of rows at a "
                             f"time, the default) or 0 (a 4-row block at a time), got {raw!r}")


def has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU has AMX tiles for bf16 (Sapphire Rapids and later Xeons), whose GEMMs
    torch's oneDNN path uses; False where that cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    return False


# Tokens above which a call with float banks takes the torch path (per-expert BLAS GEMMs)
# instead of the C++ kernel. Without AMX the C++ kernel wins on prefill chunks well past 32
# tokens: on the 2-core dev machine (Zen 4, AVX512-BF16, no AMX, 2 threads) at the Qwen3.6 expert
# shape (256 experts of 2048 x 512, top-8), bf16 activations, it took 44.1 / 91.1 / 131.0 / 210.0
# ms for 32 / 128 / 256 / 512 tokens against torch's 76.5 / 119.0 / 128.3 / 138.5
# (results/cpu_experts-bf16-prefill-threshold-devmachine-cpu.json). With AMX (the GPU host's Xeon,
# 6 threads, 256 experts, bf16 activations) the C++ kernel still wins up to 256 tokens: 17.6 /
# 41.1 / 62.4 / 49.2 / 85.1 ms for 16 / 32 / 64 / 128 / 256 tokens against torch's 39.8 / 52.4 /
# 76.1 / 77.7 / 114.4, and loses at 512 (148.7 against 94.1;
# results/cpu_experts-bf16-prefill-threshold-t6-gpu.json): the 32 it had was a guess.
FLOAT_TORCH_THRESHOLD = {True: 256, False: 128}  # AMX: tokens
# The same for float banks of another dtype than the call's activations (bf16 banks under a float32
# engine, the CPU's default): the torch path then widens every selected expert before its GEMM, as
# it dequantizes a quantized one, once per expert the call touches, so what decides is the routed
# pairs per expert: on the 2-core dev machine at the Qwen3.6 expert shape (256 experts, top-8), 2
# threads, float32 activations, the C++ kernel (which widens as it reads) took 120 / 206 / 355 /
# 606 / 1,307 ms for 128 / 256 / 512 / 1,024 / 2,048 tokens (4-64 pairs an expert) against the
# torch path's 717 / 818 / 1,070 / 919 / 1,308 (results/cpu_experts-bf16-f32act-threshold-
# devmachine-cpu.json, `torch_f32act_ms`): a float32 engine's prompt chunks of 129-1,024 tokens
# had taken the slower path, 1.5-6x. The demo's 2,048-token chunks (256 pairs on each of its 32
# small experts, cheap to widen) stay on the torch path, which a scratch A/B favoured there.
WIDENING_PAIRS_PER_EXPERT = 64  # below this many pairs per distinct expert, the C++ kernel


def physical_cores() -> list[int]:
    """One logical CPU per physical core among those this process may run on, no more than a
    container's CPU quota allows (freetoken/limits.py: a pool wider than the quota is throttled
    every period, and a call waits for its slowest worker)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    seen, cpus = set(), []
    for c in allowed:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id") as f:
                core = f.read().strip() + ":" + core
        except OSError:
            core = str(c)
        if core not in seen:
            seen.add(core)
            cpus.append(c)
    quota = limits.process_cpu_limit()
    return cpus[:quota] if quota else cpus


def pool_cpus(threads: int = 0) -> list[int]:
    """The logical CPUs a pool of `threads` pins to (0: one per physical core): one per physical
    core first, then the cores' other hardware threads (SMT siblings), and only past every CPU
    this process may use the same ones again. (The list was the physical cores repeated: asking
    for 16 threads on 8 cores with SMT pinned two workers to each core's first CPU and left its
    sibling idle; a call waits for its slowest worker.)"""
    first = physical_cores()
    if not threads:
        return first
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    order = first + [c for c in allowed if c not in set(first)]
    return (order * -(-threads // len(order)))[:threads]


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte tensor (float8_e4m3fn, uint8) as uint8, without a copy."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# The pool's spin where torch's own ops run on the same cores between its calls (a CPU engine):
# a worker spinning for the next call holds a core torch's next op wants, and a decode step
# alternates the two every layer. On the 2-core dev machine (demo, 2 threads) bench.demo_cpu
# decoded at 73.8-76.4 tok/s with no spin against 44.8-49.1 with the default's at 4k context, and
# 57.0 against 36.6 at 30k, prefill within the machine's noise (benchmarks/README.md, twentieth
# session). On CUDA torch leaves the host's cores alone, and the
# default spin keeps a decode step's calls from waking sleeping workers
SPIN_SHARED = 0


class CpuExpertExecutor(ExpertExecutor):
    """Runs routed experts from host banks. Returns results on x's device and dtype.

    `launch` runs the call (the result is ready at `finish`)."""

    name = "cpu"
    needs_pinned_staging = True

    FORMAT_CODES = {"fp8_block": 1, "mxfp4": 2, "nvfp4": 3}  # moe_cpu.cpp's Fmt

    def __init__(self, gate_up, down=None, threads: int = 0,
                 torch_batch_threshold: int | None = None, isa_cap: int = 3, activation: Activation = SILU,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 act_int8: bool = False, spin: int | None = None):
        """gate_up, down: float banks (bf16 / f32 tensors) or QuantBanks of one format; or
        gate_up an ExpertBanks (down None). activation, gate_up_bias [N, 2I], down_bias [N, H]:
        the expert function (executor.py), as TorchExpertExecutor takes it (GPT-OSS: the clamped
        SwiGLU with both biases). torch_batch_threshold: tokens above which a call takes the
        torch path (default for float banks: FLOAT_TORCH_THRESHOLD, 256 with AMX, 128 without,
        past which BLAS wins on prefill chunks;
        4096 for quantized ones, where the torch path dequantizes every selected expert first:
        on the 2-core dev machine the C++ kernel still takes 0.74 s against 1.19 s for a
        2048-token nvfp4 chunk over 128 experts of 2048 x 512). act_int8: MXFP4 / NVFP4 banks
        compute with int8 activations (int8_act.py; `--cpu-act int8`; not bit-exact); calls past
        torch_batch_threshold and FP8 / float banks stay exact. spin: pause loops the pool's
        workers spin for the next call before they sleep (None: FREETOKEN_CPU_SPIN, else 20000;
        SPIN_SHARED where torch computes on the same cores: Engine passes it on the CPU)."""
        if isinstance(gate_up, ExpertBanks):
            if down is not None:
                raise TypeError("CpuExpertExecutor: give an ExpertBanks or a (gate_up, down) pair, not both")
            gate_up, down = gate_up.gate_up, gate_up.down
        self.quantized = isinstance(gate_up, QuantBank)
        if self.quantized != isinstance(down, QuantBank) or (self.quantized and gate_up.format != down.format):
            raise TypeError("CpuExpertExecutor: gate_up and down must be banks of one format")
        if self.quantized:
            if gate_up.device.type != "cpu" or down.device.type != "cpu":
                raise ValueError("CpuExpertExecutor: quantized banks must be in host memory")
            self.format = gate_up.format
            self.gate_up, self.down = gate_up, down
            # the C++ kernel's arguments: every 1-byte tensor viewed as uint8 (same storage)
            self._qargs = [self.FORMAT_CODES[self.format]]
            for b in (gate_up, down):
                s = b.scale.contiguous()
                self._qargs += [_u8(b.values.contiguous()), _u8(s) if s.element_size() == 1 else s,
                                b.scale_2.float().contiguous() if b.scale_2 is not None else torch.empty(0)]
        else:
            if torch.float16 in (gate_up.dtype, down.dtype):
                # the C++ kernels read bf16 or f32 banks: f16 experts are widened to f32 once,
                # exactly, at twice their bytes in host memory (f16 MoE releases are rare)
                log.warning("f16 experts: widened to f32 for the CPU executor (%.1f GB more host memory)",
                            (gate_up.numel() + down.numel()) * 2 / 1e9)
                gate_up, down = gate_up.float(), down.float()
            self.format = {torch.bfloat16: "bf16", torch.float32: "f32"}.get(gate_up.dtype, str(gate_up.dtype))
            self.gate_up, self.down = gate_up.contiguous(), down.contiguous()
        self.activation = activation
        self._fn = self._fn_args(activation, gate_up_bias, down_bias)
        # the host copies serve the torch path too: the same values for bf16 / f16 / f32 biases
        # (kept as given, or widened to f32 exactly)
        self.gate_up_bias, self.down_bias = self._fn["gate_up_bias"], self._fn["down_bias"]
        self._threshold_given = torch_batch_threshold is not None
        if torch_batch_threshold is None:
            torch_batch_threshold = 4096 if self.quantized else FLOAT_TORCH_THRESHOLD[has_amx()]
        self.torch_batch_threshold = torch_batch_threshold  # tokens; above: the torch path
        schedule = os.environ.get("FREETOKEN_CPU_SCHEDULE", "static")
        if schedule not in ("static", "dynamic"):  # moe_cpu.cpp would silently take static
            from ...errors import FreeTokenError
            raise FreeTokenError(f"FREETOKEN_CPU_SCHEDULE must be static or dynamic, got {schedule!r}")
        check_prefetch_env()
        ext = extension()
        cpus = pool_cpus(threads)
        self.threads = len(cpus)
        if limits.quota_binds():
            # under a CPU quota the cores are shared time, not ours: workers pinned to the first
            # ones would pile onto the same cores as every other container pinned the same way
            cpus = [-1] * len(cpus)
        env_spin = os.environ.get("FREETOKEN_CPU_SPIN")
        if env_spin is not None:
            if not env_spin.strip().isdigit():  # moe_cpu.cpp would read a bad value as 0
                from ...errors import FreeTokenError
                raise FreeTokenError(f"FREETOKEN_CPU_SPIN must be a whole number of pause loops (0 or more), "
                                     f"got {env_spin!r}")
            spin = None  # the A/B override wins (moe_cpu.cpp reads it)
        self.spin = spin
        self.handle = ext.create(cpus, isa_cap, -1 if spin is None else int(spin)) if ext is not None else None
        self.isa = ISA_NAMES[ext.isa(self.handle)] if ext is not None else "torch"
        if ext is not None and hasattr(ext, "release"):  # its pinned threads end with this object
            weakref.finalize(self, ext.release, self.handle).atexit = False  # at exit the process ends them
        # "cpp": the C++ thread pool; "torch-fallback": it could not be built (slower, warned once)
        self.backend = "cpp" if ext is not None else "torch-fallback"
        self.calls = self.pairs = 0
        self.act = "exact"  # activations of the kernel's calls: exact, int8 or int8-scalar (set_act)
        self.int8_kernel: str | None = None  # with int8: vbmi, vnni, avx2 or scalar (set_act)
        if act_int8:
            self.set_act(True)

    def set_act(self, int8: bool, max_kernel: str = "vbmi") -> str:
        """int8 activations for this executor's MXFP4 / NVFP4 calls (--cpu-act int8), or the exact
        kernels again; -> self.act. Other banks, and the torch fallback, stay exact (said once).
        max_kernel caps the int8 kernel (vbmi, vnni, avx2, scalar: tests and A/B runs); the one
        chosen is self.int8_kernel."""
        if max_kernel not in INT8_KERNELS:
            raise ValueError(f"max_kernel {max_kernel!r}: one of {', '.join(INT8_KERNELS)}")
        ext = extension()
        if not (self.quantized and self.format in ("mxfp4", "nvfp4") and ext is not None):
            if int8:
                log.info("--cpu-act int8 applies to MXFP4 / NVFP4 banks on the C++ executor; %s experts stay exact",
                         self.format if ext is not None else "torch-fallback")
            return self.act
        kernel = ext.set_act_int8(self.handle, int8, INT8_KERNELS.index(max_kernel))
        self.int8_kernel = kernel if int8 else None
        self.act = "exact" if not int8 else "int8" if kernel != "scalar" else "int8-scalar"
        if int8 and kernel == "scalar" and max_kernel != "scalar":
            log.warning("--cpu-act int8: this CPU (or the ISA cap) has no AVX2; the int8 path runs its "
                        "scalar form, slower than the exact kernels")
        return self.act

    @staticmethod
    def _fn_args(activation: Activation, gate_up_bias, down_bias) -> dict:
        """The C++ kernels' expert-function arguments: the activation's code and constants, and
        the biases in host memory, both bf16 (GPT-OSS publishes them so) or else both f32 (the
        kernels read one bias dtype; rounding to the model's dtype happens there)."""
        biases = [b for b in (gate_up_bias, down_bias) if b is not None]
        dt = torch.bfloat16 if biases and all(b.dtype == torch.bfloat16 for b in biases) else torch.float32

        def host(b):
            return None if b is None else b.to("cpu", dt).contiguous()
        return dict(act=activation.code, alpha=float(activation.alpha), limit=float(activation.limit),
                    gate_up_bias=host(gate_up_bias), down_bias=host(down_bias))

    def qbanks_address(self) -> int:
        """The C++ side's view of the quantized banks for host-call descriptors (made once, freed
        with this executor, which keeps the bank tensors it points into alive)."""
        if getattr(self, "_qbanks", None) is None:
            ext = extension()
            self._qbanks = ext.qbanks_create(*self._qargs)
            # not at interpreter exit: a graph or the doorbell thread may still call in then
            weakref.finalize(self, ext.qbanks_free, self._qbanks).atexit = False
        return self._qbanks

    def host_fn_fields(self) -> dict:
        """The expert function as the host-call descriptor's fields (hostcall.py's _Desc); the
        bias tensors stay alive with this executor."""
        f = self._fn
        gb, db = f["gate_up_bias"], f["down_bias"]
        return dict(act=f["act"], alpha=f["alpha"], limit=f["limit"],
                    gate_up_bias=gb.data_ptr() if gb is not None else None,
                    down_bias=db.data_ptr() if db is not None else None,
                    bias_bf16=int(any(b is not None and b.dtype == torch.bfloat16 for b in (gb, db))))

    def launch(self, x, ids, weights, layer: int = 0, phase: str = "decode") -> Pending:
        # Synchronous for now: handing the call to a Python worker thread (the GIL-free C++
        # kernel would allow it) made the H200's CPU-only decode 2x and its prefill 12x slower
        # (benchmarks/results/decode-gpu.json of 671cdb0); the asynchronous CPU branch is the
        # expert-cache issue's, through doorbells inside the decode graph.
        self.calls += 1
        self.pairs += ids.numel()
        return Pending(out=self.run(x, ids, weights, phase))

    def run(self, x, ids, weights, phase):
        src_dev, src_dtype = x.device, x.dtype
        x, ids, weights = x.cpu(), ids.cpu(), weights.cpu()
        if self.torch_path(x, ids):
            out = reference_experts(x, ids, weights, self.gate_up, self.down, self.activation, self.gate_up_bias,
                                    self.down_bias)
        else:
            out = self.kernel(x, ids, weights).to(src_dtype)
        return out.to(src_dev)

    def torch_path(self, x, ids) -> bool:
        """Whether a call of x [T, H], ids [T, k] takes the torch path: without the C++ kernel, or
        past the batch threshold, except where float banks would be widened to x's dtype first
        with fewer than WIDENING_PAIRS_PER_EXPERT routed pairs per expert (unless the caller
        gave the threshold)."""
        if self.handle is None:
            return True
        if x.shape[0] <= self.torch_batch_threshold:
            return False
        if self._threshold_given or self.quantized or x.dtype == self.gate_up.dtype:
            return True
        live = ids[ids >= 0]  # [P] routed pairs (NO_EXPERT rows route nowhere)
        return live.numel() >= WIDENING_PAIRS_PER_EXPERT * max(1, int(live.unique().numel()))

    def splits(self, num_experts: int) -> bool:
        """Whether a layer of num_experts of these banks runs a prompt chunk in expert pieces
        (experts/split_experts.py: not a layer whose experts are few bytes)."""
        return split_experts.worth_it((self.gate_up.nbytes + self.down.nbytes) // self.gate_up.shape[0] * num_experts)

    def launch_pieces(self, x, ids, weights, base: int, num_experts: int, hook) -> Pending:
        """launch() of a prompt chunk in pieces of the layer's experts (base..base+num_experts-1),
        hook(n) before piece n >= 1 (experts/split_experts.py: the same sums); a layer whose
        experts are few bytes, whole."""
        if not self.splits(num_experts):
            return self.launch(x, ids, weights, phase="prefill")
        self.calls += 1
        self.pairs += ids.numel()
        src_dev, src_dtype = x.device, x.dtype
        x, ids, weights = x.cpu(), ids.cpu(), weights.cpu()
        if self.torch_path(x, ids):
            out = torch.zeros_like(x)  # [T, H]: every piece adds into it in expert order

            def part(lo, hi):
                reference_experts(x, ids, weights, self.gate_up, self.down, self.activation, self.gate_up_bias,
                                  self.down_bias, out=out, lo=lo, hi=hi)
        else:
            out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H] fp32: the kernel's partial sums

            def part(lo, hi):
                inside = (ids >= lo) & (ids < hi)  # [T, k]
                rows = inside.any(1).nonzero()[:, 0]  # [R] the tokens with a pair in the piece
                if rows.numel():
                    out.index_add_(0, rows, self.kernel(x[rows], ids[rows].masked_fill(~inside[rows], NO_EXPERT),
                                                        weights[rows]))
        split_experts.run(part, base, num_experts, hook)
        return Pending(out=out.to(src_dtype).to(src_dev))

    def kernel(self, x, ids, weights) -> torch.Tensor:
        """The C++ path whatever the batch size; fp32 result."""
        if self.quantized:
            return extension().forward_q(self.handle, x.float(), ids.long(), weights.float(), *self._qargs,
                                         x.dtype == torch.bfloat16, **self._fn)
        return extension().forward(self.handle, x.float(), ids.long(), weights.float(),
                                   self.gate_up, self.down, x.dtype == torch.bfloat16, **self._fn)

    def stats(self) -> dict:
        return {"calls": self.calls, "pairs": self.pairs}
