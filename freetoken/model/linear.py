"""linear(x, w, b): what the model calls where it would call F.linear on a dense weight that may
be kept quantized (weights/dense_fp8.py Fp8BlockWeight).

  plain tensor    F.linear; on CUDA with the rows past ROW_GRANULE padded to a multiple of it
                  (below): another row count can pick another cuBLAS kernel, so results may
                  differ from an unpadded call by rounding, never by which rows meet; on the
                  CPU up to HOST_ROWS rows (a decode step) the C++ rows kernel (host_gemv)
  Fp8BlockWeight  CUDA: the Triton kernel reading the FP8 bytes in place (kernels/fp8_linear.py)
                  CPU:  up to FP8_HOST_ROWS rows (a decode step) the C++ rows kernel reading
                        the e4m3 bytes in place (host_gemv_fp8); past them dequantized per call
                        to fp32 (bit for bit quant.py's) in blocks of rows, then F.linear in fp32,
                        rounded once to x's dtype (fp8_blocks_linear)

Why the CPU keeps FP8 (--dense-fp8 auto, where the C++ kernels are built): a CPU decode step is
bound by reading its dense weights, and the same weight dequantized to fp32 at load is 4x the
bytes (2x at bf16). A prompt chunk pays one dequantization per weight per chunk, small beside its
GEMM (2 x rows multiply-adds per value). Why per call rather than caching the dequantized weight:
a cache is the copy keeping FP8 exists to avoid, and the per-call block lives for one block's GEMM.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..kernels import use_triton
from ..weights.dense_fp8 import Fp8BlockWeight
from ..weights.quant import FP8_BLOCK


# cuBLAS picks a GEMM's kernel by its heuristics once per shape and keeps the pick; a prompt
# chunk's row count is new at almost every forward, and on the H200 each new one held the host
# ~4.6 ms on the CPU inside F.linear (the first attention layer's q/k/v projection of each
# forward, which the decode steps between layers then waited for: bench/line_trace.py, device
# plans 55 and 57; it showed less in a process's later rows as the picks accumulated). On CUDA
# the rows of a plain GEMM past ROW_GRANULE are padded up to a multiple of it, so a prompt meets
# at most cap / ROW_GRANULE shapes per weight, and Engine.warm_up runs them all at load
# (warm_gemm_rows). Rows never mix in a GEMM, so the padding changes no real row's inputs.
ROW_GRANULE = 64
PAD_ROWS = True
# (N, K, dtype, device, bias?) -> weak references to (w, b): a plain weight of each shape linear()
# ran on CUDA (weak: an engine's weights are not kept alive by having run here)
SEEN: dict[tuple, tuple] = {}


# The few rows of a CPU decode step go to the C++ rows kernel (experts/cpu/dense.h): torch's
# CPU GEMM read the weights at about half of what the machine reads at these row counts, and up to
# 4x slower than that in fp32 at 2-4 rows (bench/cpu_gemv.py, benchmarks/README.md). Up to 16
# rows the kernel won on every weight of the Qwen3.6 decode step in bf16 and fp32 on the 2-core
# dev machine (1.08-1.3x in bf16 at 16, with its two-row form); above (prefill chunks) torch's
# blocked GEMM is the one to use. FREETOKEN_CPU_KERNELS=0: torch for every row count (A/B runs;
# experts/cpu DECODE_KERNELS).
HOST_ROWS = 16
# A bf16 weight kept under a float32 model (--dense-bf16, the CPU's default for bf16 checkpoints)
# against fp32 rows: the kernel widens as it reads, torch's path widens the weight per call
# (widened_linear). At the Qwen3.6 shape's dense weights on the 2-core dev machine (python -m
# bench.cpu_gemv --threads 2 --dtypes mixed --rows 16,24,32,48,64, cpu_gemv-mixed-rows-cpu.json)
# the kernel took 1.8-5.5x less time at 16 rows, 1.4-2.0x at 32, 1.2-1.4x at 64 (its MAX_ROWS):
# 32 keeps a margin for hosts whose torch GEMM is faster (not measured on the Xeon). The
# interleaver's CPU prompt chunks are mostly 32-64 tokens while streams decode.
MIXED_HOST_ROWS = 32


def host_gemv(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ w [N, K]^T (+ b) by the C++ rows kernel, in x's dtype, where it applies: x and
    w (and b, [N], in x's dtype) on the CPU, float32 or bfloat16, one dtype or float32 x with a
    bfloat16 w (a weight kept bf16 under a float32 model, --dense-bf16: widened exactly as it is
    read), w a plain tensor with contiguous rows, at most HOST_ROWS rows (MIXED_HOST_ROWS for the
    mixed case), no autograd, the extension built. None otherwise (the caller runs torch)."""
    from ..experts import cpu
    if not cpu.DECODE_KERNELS or x.device.type != "cpu" or not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    k, n = w.shape[1], w.shape[0]
    mixed = x.dtype == torch.float32 and w.dtype == torch.bfloat16
    if ((x.dtype != w.dtype and not mixed) or x.dtype not in (torch.float32, torch.bfloat16) or x.shape[-1] != k
            or w.stride() != (k, 1) or w.device.type != "cpu"):
        return None
    if b is not None and (b.dim() != 1 or b.shape[0] != n or b.dtype != x.dtype or b.device.type != "cpu"):
        return None  # broadcast or mixed-dtype biases: F.linear's rules
    rows = x.numel() // k if k else 0
    grads = x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
    if not 0 < rows <= (MIXED_HOST_ROWS if mixed else HOST_ROWS) or (torch.is_grad_enabled() and grads):
        return None
    ext = cpu.extension()  # built once per machine, imported once per process
    if ext is None:
        return None
    bias = torch.empty(0) if b is None else b.to(torch.float32).contiguous()
    out = ext.dense_gemv(x.reshape(rows, k), w, bias, 3)  # [rows, N] fp32
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


# Rows of x up to which a kept FP8 weight goes to the C++ kernel rather than a per-call dequantized
# copy and torch's GEMM (bench/cpu_gemv.py --dtypes fp8 measures the crossover).
FP8_HOST_ROWS = 32


def host_gemv_fp8(x: torch.Tensor, w: Fp8BlockWeight, b: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ w's dequantized [N, K]^T (+ b) by the C++ FP8 rows kernel (experts/cpu/dense.h
    dense_gemv_fp8), in x's dtype; None where it does not apply (as host_gemv: CPU tensors, float32
    or bfloat16 x, at most FP8_HOST_ROWS rows, no autograd, the extension built)."""
    from ..experts import cpu
    k, n = w.shape[1], w.shape[0]
    if (not cpu.DECODE_KERNELS or x.device.type != "cpu" or w.device.type != "cpu" or x.shape[-1] != k
            or x.dtype not in (torch.float32, torch.bfloat16)
            or (torch.is_grad_enabled() and (x.requires_grad or (b is not None and b.requires_grad)))):
        return None
    if b is not None and (b.dim() != 1 or b.shape[0] != n or b.device.type != "cpu"):
        return None
    rows = x.numel() // k if k else 0
    if not 0 < rows <= FP8_HOST_ROWS or not _kernel_reads(w):
        return None
    ext = cpu.extension()
    if ext is None:
        return None
    bias = torch.empty(0) if b is None else b.to(torch.float32).contiguous()
    out = ext.dense_gemv_fp8(x.reshape(rows, k), w.values, w.scale_inv.contiguous(), bias, 3)  # [rows, N] fp32
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def fp8_blocks_linear(x: torch.Tensor, w: Fp8BlockWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x in fp32, w dequantized to fp32, b) rounded once to x's dtype, the weight dequantized
    a block of 128-row scale blocks at a time (at most ~WIDEN_ELEMENTS values): the whole weight
    at fp32 would be a temporary of 4x its bytes per call (a 12,352 x 2,048 projection: 100 MB)."""
    n, k = w.shape
    xf = x.float()
    bf = None if b is None else b.float()
    step = max(1, WIDEN_ELEMENTS // max(k * FP8_BLOCK, 1)) * FP8_BLOCK
    if n <= step:
        return F.linear(xf, _dequantized(w), bf).to(x.dtype)
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32, device=x.device)  # [..., N]
    for a in range(0, n, step):
        e = min(n, a + step)
        out[..., a:e] = F.linear(xf, _dequantized(w.rows(a, e - a)), None if bf is None else bf[a:e])
    return out.to(x.dtype)


def _kernel_reads(w: Fp8BlockWeight) -> bool:
    """Whether the C++ FP8 kernels take w as it is: contiguous rows of e4m3 bytes and a float32,
    bfloat16 or float16 scale (anything else goes the torch way rather than failing a call)."""
    k = w.shape[1]
    return (w.values.stride() == (k, 1) and w.values.dtype in (torch.float8_e4m3fn, torch.uint8)
            and w.scale_inv.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _dequantized(w: Fp8BlockWeight) -> torch.Tensor:
    """w [N, K] in float32 as w.dequantize builds it: by the C++ kernel where built (torch's float8
    cast is slow on the CPU), else by w.dequantize."""
    from ..experts import cpu
    ext = cpu.extension() if cpu.DECODE_KERNELS and w.device.type == "cpu" and _kernel_reads(w) else None
    if ext is None:
        return w.dequantize(torch.float32)
    return ext.dense_dequant_fp8(w.values, w.scale_inv.contiguous())


# values of a kept bf16 weight widened to fp32 at a time past the rows kernel's row counts: a 1 GB
# lm_head widened whole would be a 2 GB temporary per call, and a 4 MB block is written and read
# back from the caches rather than DRAM
WIDEN_ELEMENTS = 1 << 20


def widened_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w widened to x's dtype, b): a bf16 weight kept under a float32 model
    (--dense-bf16) at row counts the rows kernel does not take (prefill chunks), widened exactly in
    blocks of its rows of at most WIDEN_ELEMENTS values (the GEMM of each block is torch's)."""
    n, k = w.shape
    step = max(1, WIDEN_ELEMENTS // max(k, 1))
    if n <= step:
        return F.linear(x, w.to(x.dtype), b)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)  # [..., N]
    for a in range(0, n, step):
        e = min(n, a + step)
        out[..., a:e] = F.linear(x, w[a:e].to(x.dtype), None if b is None else b[a:e])
    return out


def padded_rows(m: int) -> int:
    """The row count a CUDA GEMM of m rows runs at: m up to ROW_GRANULE, else the next multiple."""
    return m if m <= ROW_GRANULE else -(-m // ROW_GRANULE) * ROW_GRANULE


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], w [N, K] (a tensor or an Fp8BlockWeight), b [N] or None -> [..., N] in x's dtype."""
    if not isinstance(w, Fp8BlockWeight):
        if not x.is_cuda:
            out = host_gemv(x, w, b)
            if out is not None:
                return out
            return F.linear(x, w, b) if w.dtype == x.dtype else widened_linear(x, w, b)
        if not (PAD_ROWS and x.dim() == 2) or torch.cuda.is_current_stream_capturing():
            return F.linear(x, w, b)
        key = (w.shape[0], w.shape[1], w.dtype, w.device, b is not None)
        held = SEEN.get(key)
        if held is None or held[0]() is None or (held[1] is not None and held[1]() is None):
            SEEN[key] = (weakref.ref(w), weakref.ref(b) if b is not None else None)
        m = x.shape[0]
        mp = padded_rows(m)
        if mp == m:
            return F.linear(x, w, b)
        return F.linear(F.pad(x, (0, 0, 0, mp - m)), w, b)[:m]  # [mp, N] -> its first m rows
    if use_triton(x):
        from ..kernels.fp8_linear import fp8_linear_triton
        return fp8_linear_triton(x, w.values, w.scale_inv, b)
    if x.is_cuda:  # no Triton: the reference's one GEMM on the device
        return F.linear(x.float(), w.dequantize(torch.float32), None if b is None else b.float()).to(x.dtype)
    out = host_gemv_fp8(x, w, b)
    if out is not None:
        return out
    return fp8_blocks_linear(x, w, b)


def warm_gemm_rows(cap: int) -> int:
    """Every row count a CUDA GEMM of up to cap rows runs at (1..ROW_GRANULE, then each multiple
    of it) through each plain weight linear() has run on CUDA (the load-time prompt forwards'
    weights), so cuBLAS has picked its kernels before a request meets them. Returns the GEMMs run."""
    top = padded_rows(max(cap, 1))
    counts = list(range(1, min(ROW_GRANULE, top) + 1)) + list(range(2 * ROW_GRANULE, top + 1, ROW_GRANULE))
    n = 0
    with torch.no_grad():
        for (_, k, dtype, device, _), (wr, br) in list(SEEN.items()):
            w, b = wr(), br() if br is not None else None
            if w is None or (br is not None and b is None):
                continue
            x = torch.randn(top, k, dtype=dtype, device=device)
            for m in counts:
                F.linear(x[:m], w, b)
                n += 1
    return n
