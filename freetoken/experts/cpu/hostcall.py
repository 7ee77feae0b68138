"""The CPU expert branch in stream order, so a decode step that runs experts on the host can be
one CUDA graph.

The GPU writes the step's inputs into pinned buffers with its own stores (copy_flat), forks a
side stream on which the C++ executor's `host_call` runs on a fixed descriptor, and its fp32
result comes back to a device buffer (in the activations' dtype where a kernel copies it back,
rounded to nearest even as .to() rounds; fp32 on the copy engine's path); the main stream meanwhile runs whatever does not depend
on it (the fills, the GPU experts, the shared expert) and joins before the merge. No Python
and no host sync on the way, eager or replayed. Buffers and descriptor are fixed per (tokens,
k) shape, one set per executor: layers run one after the other, and each layer's reads of them
are ordered before the next layer's writes by the streams.

Two ways to signal the CPU:
- a doorbell, the default: a kernel rings a sequence number in mapped pinned memory, a
  resident C++ thread answers, a one-program kernel spins until the answer
  (kernels/doorbell.py). No driver thread in the loop;
- a host-function node (cuLaunchHostFunc, from the driver library; FREETOKEN_CPU_BRANCH=hostfn,
  and the fallback where the doorbell page cannot be mapped): ~20 us per call in a replayed graph.
Measured on the H200 (bench/split_overlap.py, bench/expert_cache.py; benchmarks/README.md):
copy-engine staging copies waited behind the zero-copy fill kernel, so branch and fills
serialized (fixed by the GPU's own loads and stores, copy_flat); then, in a real split step, the
host-function node still took ~700 us per layer around a 268 us C++ call. With the doorbell the
same batch-1 split step runs at 179.9 tok/s against 109.5 (12-layer slice, r=0.4;
expert_cache-doorbell-gpu.json against expert_cache-gpu.json).
Host functions must make no CUDA call; the C++ side makes none and reports errors in the
descriptor, raised here after the step.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from ...errors import FreeTokenError
from ...kernels.cuda_driver import driver_fn
from ...kernels.expert_transfer import copy_flat
from ..executor import ExpertExecutor, Pending

log = logging.getLogger("freetoken.experts")


class _Desc(ctypes.Structure):  # moe_cpu.cpp's HostCall, field for field
    _fields_ = [("executor", ctypes.c_int64), ("x", ctypes.c_void_p), ("ids", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("out", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("n", ctypes.c_int64), ("T", ctypes.c_int32), ("K", ctypes.c_int32),
                ("H", ctypes.c_int32), ("I", ctypes.c_int32), ("bank_bf16", ctypes.c_int32),
                ("bf16_act", ctypes.c_int32), ("error", ctypes.c_int32), ("calls", ctypes.c_int64),
                ("busy_ns", ctypes.c_int64),
                # the expert function (CpuExpertExecutor.host_fn_fields; zero: SiLU without biases)
                ("gate_up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p), ("act", ctypes.c_int32),
                ("bias_bf16", ctypes.c_int32), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                # quantized banks (CpuExpertExecutor.qbanks_address); null: gate_up / down above
                ("qbanks", ctypes.c_void_p),
                # how far the last call got: 1 entered, 2 holds the executor's lock, 3 returned
                ("stage", ctypes.c_int64)]


def zero_copy_staging() -> bool:
    """Whether the branch moves its inputs and result with the GPU's own loads and stores on
    pinned memory (kernels/expert_transfer.copy_flat) rather than copy-engine memcpys, which
    wait behind the fill kernel's PCIe reads (measured: the two serialized). Default on where
    Triton and zero-copy work; FREETOKEN_HOSTCALL_COPY=memcpy picks the copy engine."""
    import os

    from ...kernels import HAS_TRITON
    from ...kernels.expert_transfer import zero_copy_ok
    if os.environ.get("FREETOKEN_HOSTCALL_COPY", "").lower() == "memcpy" or not (HAS_TRITON and torch.cuda.is_available()):
        return False
    return zero_copy_ok(torch.empty(16, pin_memory=True))


def _launcher():
    """cuLaunchHostFunc from the driver library (present wherever CUDA runs), or None."""
    return driver_fn("cuLaunchHostFunc", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p])


def host_branch_ok(cpu) -> bool:
    """Whether `cpu` (a CpuExpertExecutor) can run in stream order: CUDA, the C++ extension with
    its host-call entry, bf16 / f32 banks or quantized ones (fp8_block, mxfp4, nvfp4)."""
    from . import extension
    ext = extension()
    banks_ok = getattr(cpu, "quantized", False) or getattr(cpu.gate_up, "dtype", None) in (torch.bfloat16, torch.float32)
    return (torch.cuda.is_available() and ext is not None and hasattr(ext, "host_call_address")
            and getattr(cpu, "handle", None) is not None and banks_ok and _launcher() is not None)


def call_buffers(cpu, executor: int, t: int, k: int, h: int, bf16_act: bool, pin: bool):
    """The host buffers of one call shape and the descriptor that points at them:
    (x [T, H] f32, ids [T, K] int64, w [T, K] f32, out [T, H] f32, _Desc). They must outlive
    every graph that holds their addresses (HostBranch keeps them per shape)."""
    x = torch.empty(t, h, dtype=torch.float32, pin_memory=pin)  # [T, H]
    ids = torch.full((t, k), -1, dtype=torch.int64, pin_memory=pin)  # [T, K]
    w = torch.zeros(t, k, dtype=torch.float32, pin_memory=pin)  # [T, K]
    out = torch.zeros(t, h, dtype=torch.float32, pin_memory=pin)  # [T, H]
    d = _Desc(executor=executor, x=x.data_ptr(), ids=ids.data_ptr(), w=w.data_ptr(), out=out.data_ptr(),
              T=t, K=k, H=h, bf16_act=int(bf16_act), error=0, calls=0, busy_ns=0,
              **bank_fields(cpu), **cpu.host_fn_fields())
    return x, ids, w, out, d


def bank_fields(cpu) -> dict:
    """The descriptor's bank fields for cpu's banks: float tensors by address, or quantized ones
    through the QPair the executor keeps (shapes: QuantBank.shape is the float bank's)."""
    gu, dn = cpu.gate_up, cpu.down
    if getattr(cpu, "quantized", False):
        return dict(gate_up=None, down=None, qbanks=cpu.qbanks_address(), n=gu.shape[0], I=dn.shape[2], bank_bf16=0)
    return dict(gate_up=gu.data_ptr(), down=dn.data_ptr(), qbanks=None, n=gu.shape[0], I=dn.shape[2],
                bank_bf16=int(gu.dtype == torch.bfloat16))


def branch_signal() -> tuple[str, bool]:
    """How the GPU hands the CPU its share -> (signal, asked): "doorbell" (kernels on mapped
    pinned memory and a resident C++ thread, no driver thread: the default) or "hostfn" (a
    host-function node), from FREETOKEN_CPU_BRANCH; asked says whether the variable chose it
    (a default doorbell that cannot be set up falls back to the host-function node, an asked
    one is an error)."""
    import os
    raw = os.environ.get("FREETOKEN_CPU_BRANCH", "")
    mode = (raw or "doorbell").lower()
    if mode not in ("hostfn", "doorbell"):
        raise FreeTokenError(f"FREETOKEN_CPU_BRANCH must be hostfn or doorbell, got {mode!r}")
    return mode, bool(raw)


class Doorbell:
    """moe_cpu.cpp's Bell seen from here: a page of host memory, mapped for the GPU, and the
    resident thread that answers each ring with host_call on the rung descriptor. The GPU side
    is kernels/doorbell.py. On the CPU (tests) the same protocol runs on plain host memory with
    the kernels under the Triton interpreter."""

    def __init__(self, device, start_delay_us: int = 0):
        from ...kernels import doorbell
        from ...kernels.expert_transfer import zero_copy_ok
        from . import extension
        self.ext, self.k = extension(), doorbell
        self.device = torch.device(device)
        self.addr = self.ext.bell_create(start_delay_us)  # the delay: tests (a thread scheduled late)
        self.words = torch.frombuffer((ctypes.c_int64 * 512).from_address(self.addr), dtype=torch.int64)  # [512]
        if self.device.type == "cuda":
            err = torch.cuda.cudart().cudaHostRegister(self.addr, 4096, 0)
            if int(err) != 0 or not zero_copy_ok(self.words):
                self.close()
                raise FreeTokenError(f"the CPU branch's doorbell page cannot be mapped for the GPU ({err}); "
                                     "set FREETOKEN_CPU_BRANCH=hostfn to use the host-function node")
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)  # calls rung (device)

    def ring(self, x, ids, w, xb, ib, wb, desc: int) -> None:
        """The inputs into the pinned buffers, then the call: stream order, no sync."""
        self.k.ring(x.contiguous(), ids.contiguous(), w.contiguous(), xb, ib, wb, self.counter, self.words, desc)

    def wait(self, ob, out) -> None:
        """Once the CPU answered the last ring: out <- ob."""
        self.k.wait(self.counter, self.words, ob, out)

    def gave_up(self) -> bool:
        return bool(self.words[self.k.GAVE_UP])

    def calls(self) -> int:
        return int(self.words[self.k.CALLS])

    def state(self) -> str:
        """The bell's words and the device's ring count, for a gave-up error: seq < rung says the
        thread never saw the last ring, entered = seq > done that it is stuck in a call, idle polls
        that grow between two reads that the thread is alive."""
        w = self.words
        return (f"rung {int(self.counter[0])}, seq {int(w[self.k.SEQ])}, entered {int(w[self.k.ENTERED])}, "
                f"done {int(w[self.k.DONE])}, answered {int(w[self.k.CALLS])}, stop {int(w[self.k.STOP])}, "
                f"idle polls {int(w[self.k.IDLE_POLLS])}")

    def recover(self, timeout: float = 1.0) -> bool:
        """After a wait gave up: whether the thread has answered every ring by now (polled up to
        `timeout` s); if so the flag is cleared and the bell serves the next rings."""
        import time
        rung, end = int(self.counter[0]), time.monotonic() + timeout
        while int(self.words[self.k.DONE]) < rung:
            if time.monotonic() > end or self.words[self.k.STOP]:
                return False
            time.sleep(0.001)
        self.words[self.k.GAVE_UP] = 0
        return True

    def close(self) -> None:
        """The thread returns; the page stays (the GPU may still hold its address)."""
        if self.addr:
            self.ext.bell_stop(self.addr)
            self.addr = 0

    def __del__(self):
        self.close()


# HostCall.stage, for the error of a call that never returned
STAGES = {0: "never called", 1: "waiting for the executor's lock", 2: "computing", 3: "returned"}


class HostBranch:
    """Runs a CpuExpertExecutor's decode calls in stream order (see the module doc)."""

    def __init__(self, cpu, device):
        from . import extension
        ext = extension()
        if ext.host_call_size() != ctypes.sizeof(_Desc):
            raise RuntimeError("moe_cpu.cpp's HostCall and hostcall.py's _Desc disagree")
        self.cpu, self.device = cpu, torch.device(device)
        self.fn = ext.host_call_address()
        self.executor = ext.executor_address(cpu.handle)
        self.side = torch.cuda.Stream(self.device)
        self.shapes: dict[tuple, tuple] = {}
        self.zero_copy = zero_copy_staging()
        self.signal, asked = branch_signal() if self.zero_copy else ("hostfn", False)
        self.bell = None
        if self.signal == "doorbell":
            try:
                self.bell = Doorbell(self.device)
            except FreeTokenError as e:
                if asked:
                    raise
                log.warning("%s: the CPU branch falls back to the host-function node", e)
                self.signal = "hostfn"

    def _buffers(self, t: int, k: int, h: int, dtype: torch.dtype):
        bf16_act = dtype == torch.bfloat16
        # the result lands in the caller's dtype where a kernel copies it out (the doorbell's wait,
        # the zero-copy copy: both round to nearest even, as .to() does), one copy kernel a layer
        # less; the copy engine's copy stays fp32 (a cast there would run on the host, unordered)
        out_dtype = dtype if self.bell is not None or self.zero_copy else torch.float32
        key = (t, k, dtype)
        if key not in self.shapes:
            x, ids, w, out, d = call_buffers(self.cpu, self.executor, t, k, h, bf16_act, pin=True)
            dev_out = torch.zeros(t, h, dtype=out_dtype, device=self.device)  # [T, H]
            # device staging the main stream writes and the side stream reads: persistent, so the
            # allocator cannot hand their memory to the main stream's next op while the side
            # stream's copy is still queued (a temporary would be freed at return)
            stage = (torch.empty(t, h, dtype=torch.float32, device=self.device),
                     torch.empty(t, k, dtype=torch.int64, device=self.device),
                     torch.empty(t, k, dtype=torch.float32, device=self.device))
            self.shapes[key] = (x, ids, w, out, dev_out, stage, d)
        return self.shapes[key]

    def check(self) -> None:
        """Raise if a call failed (the host node records it; the loop checks after each step)."""
        if self.bell is not None and self.bell.gave_up():
            stages = ", ".join(f"T={t}: {STAGES.get(d.stage, d.stage)}" for (t, *_), (*_, d) in self.shapes.items())
            state = self.bell.state()
            msg = (f"the CPU expert branch did not answer a decode step's doorbell in time ({state}; last call "
                   f"per batch shape: {stages})")
            # the step that waited in vain computed with a stale CPU share: it fails (raised
            # below). A thread that answers late (starved, not stuck) puts the branch back for
            # the steps after it, so one bad moment does not fail every later step of the server
            if self.bell.recover():
                log.warning("%s; the thread answered late, the next steps go on", msg)
                raise FreeTokenError(msg + "; that step failed, the next ones go on")
            raise FreeTokenError(msg + "; its thread stopped or is stuck: FREETOKEN_CPU_BRANCH=hostfn uses the "
                                 "host-function node")
        for *_, d in list(self.shapes.values()):
            if d.error:
                code, d.error = d.error, 0  # reported once: the descriptor serves the next steps
                raise FreeTokenError("the CPU expert branch failed inside a decode step "
                                     f"({'an expert id out of range' if code == 1 else 'an exception'})")

    def enqueue(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Fork: x [T, H], ids [T, K] (flat ids, -1 = not on the CPU), weights [T, K] -> the device
        buffer [T, H] the result will land in (x's dtype, rounded to nearest even from the
        executor's fp32 sums; fp32 on the copy-engine path); valid after `join`. The buffer is
        this shape's, reused by the next call: read it before enqueueing another."""
        self.check()
        t, k = ids.shape
        xb, ib, wb, ob, dev_out, (xs, is_, ws), d = self._buffers(t, k, x.shape[1], x.dtype)
        if self.bell is not None:  # inputs and the ring on the main stream, the wait on the side stream
            self.bell.ring(x, ids.long(), weights, xb, ib, wb, ctypes.addressof(d))
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                self.bell.wait(ob, dev_out)
            return dev_out
        if self.zero_copy:  # the GPU's own stores into the pinned buffers, on the main stream
            for src, dst in ((x, xb), (ids, ib), (weights, wb)):
                copy_flat(src.contiguous(), dst)
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                self._host_fn(d)
                copy_flat(ob, dev_out)
            return dev_out
        xs.copy_(x)  # on the main stream, into the persistent staging
        is_.copy_(ids)
        ws.copy_(weights)
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            xb.copy_(xs, non_blocking=True)
            ib.copy_(is_, non_blocking=True)
            wb.copy_(ws, non_blocking=True)
            self._host_fn(d)
            dev_out.copy_(ob, non_blocking=True)
        return dev_out

    def _host_fn(self, d) -> None:
        """The host-function node on the side stream (the current stream here)."""
        err = _launcher()(self.side.cuda_stream, self.fn, ctypes.addressof(d))
        if err:
            raise FreeTokenError(f"cuLaunchHostFunc failed with CUDA error {err}")

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.side)

    def stats(self) -> dict:
        descs = [v[-1] for v in list(self.shapes.values())]  # the loop thread may add a shape meanwhile
        calls = sum(d.calls for d in descs)
        busy = sum(d.busy_ns for d in descs)
        return {"cpu_branch_calls": calls, "cpu_busy_s": round(busy / 1e9, 3),
                "cpu_branch_copies": "zero-copy kernels" if self.zero_copy else "copy engine",
                "cpu_branch_signal": "doorbell" if self.bell is not None else "host-function node"}


@dataclass
class Forked(Pending):
    """A call forked onto the side stream: its device result buffer and the caller's dtype."""
    buffer: torch.Tensor | None = None
    dtype: torch.dtype | None = None


class StreamedCpuExecutor(ExpertExecutor):
    """The CPU-only MoE backend on a CUDA machine with decode steps in stream order: launch
    forks the CPU call (the shared expert then runs on the GPU while the host computes),
    finish joins; capturable, so the whole decode step is one graph, at any batch size.
    Prefill chunks go to the wrapped executor as before (the torch path for large ones)."""

    name = "cpu"
    capturable = True
    needs_pinned_staging = False

    def __init__(self, cpu, device):
        self.inner = cpu
        self.branch = HostBranch(cpu, device)
        self.backend, self.threads, self.isa = cpu.backend, cpu.threads, cpu.isa
        self.gate_up, self.down = cpu.gate_up, cpu.down
        # the expert function the host calls compute (the descriptor's), checked by model/moe.py
        self.activation, self.gate_up_bias, self.down_bias = cpu.activation, cpu.gate_up_bias, cpu.down_bias

    def launch(self, x, ids, weights, layer: int = 0, phase: str = "decode") -> Pending:
        if phase != "decode" or not x.is_cuda:  # decode of any batch size: the C++ kernel takes it
            return self.inner.launch(x, ids, weights, layer, phase)
        return Forked(buffer=self.branch.enqueue(x, ids, weights), dtype=x.dtype)

    def finish(self, pending: Pending) -> torch.Tensor:
        if not isinstance(pending, Forked):
            return self.inner.finish(pending)
        self.branch.join()
        return pending.buffer.to(pending.dtype)

    def observe_step(self, batch: int, seconds: float) -> None:
        """After each decode step (the serving loop): surface a failed CPU call."""
        self.branch.check()

    def stats(self) -> dict:
        return {**self.inner.stats(), **self.branch.stats()}
