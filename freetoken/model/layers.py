"""Shared building blocks: norms, rotary embedding, the dense SwiGLU MLP.

Functions over plain tensors; parameters are looked up by their checkpoint names.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels import prefill_kernels, use_triton
from ..weights.dense_fp8 import Fp8BlockWeight
from .linear import host_gemv, linear, widened_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim.

    one_centered (Qwen3.5/3.6): scale by (1 + w) in fp32, then cast, as the reference does.
    Otherwise (Qwen3): cast the normalised value first, then scale by w in the input dtype.
    On CUDA one fused Triton kernel (kernels/rmsnorm.py) computes the same.
    """
    if use_triton(x):
        from ..kernels.rmsnorm import rms_norm_triton
        return rms_norm_triton(x, weight, eps, one_centered)
    return rms_norm_torch(x, weight, eps, one_centered)


def add_rms_norm(res: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, one_centered: bool):
    """Residual add then norm: returns (res + h, rms_norm(res + h)); one kernel on CUDA."""
    if use_triton(res) and res.dim() == 2:
        from ..kernels.rmsnorm import add_rms_norm_triton
        return add_rms_norm_triton(res, h, weight, eps, one_centered)
    s = res + h
    return s, rms_norm_torch(s, weight, eps, one_centered)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, one_centered: bool) -> torch.Tensor:
    """The reference (and CPU) RMSNorm."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if one_centered:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet output norm: w * norm(x) * silu(gate), norm before gate; x, gate [N, Hv, dv]. On
    CUDA (unless FREETOKEN_PREFILL_KERNELS=0) one kernel (kernels/rmsnorm.py gated_rms_norm_triton;
    prompt chunks and, since both end in GatedDeltaNet._finish, eager decode steps and the
    graphs captured from them), else the torch form (gated_rms_norm_torch, the reference)."""
    if use_triton(x) and prefill_kernels() and x.dtype == gate.dtype == weight.dtype and x.dim() == 3:
        from ..kernels.rmsnorm import gated_rms_norm_triton
        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_torch(x, gate, weight, eps)


def gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference (and CPU path) of gated_rms_norm: rounded to x's dtype after the norm, after
    the weight and at the end."""
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def rope_frequencies(rotary_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rd/2], attention factor that scales cos and sin), as transformers computes them
    (modeling_rope_utils): plain RoPE, or YaRN (scaling["rope_type"] == "yarn": NTK-by-parts
    interpolation between the original and the `factor`-stretched frequencies over the dims whose
    wavelengths lie between beta_fast and beta_slow rotations of the original context, and
    attention factor 0.1 ln(factor) + 1 unless the config gives one or mscale / mscale_all_dim)."""
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)  # [rd/2]
    if not scaling or scaling.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    if scaling["rope_type"] != "yarn":
        raise ValueError(f"rope type {scaling['rope_type']!r}")
    orig = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations):  # the dim whose wavelength makes `rotations` turns over the original context
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as the reference: no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attn


class Rope:
    """cos/sin tables for partial rotary embedding, indexed by position (static shapes).
    scaling: ModelConfig.rope_scaling (YaRN), None for plain RoPE."""

    def __init__(self, rotary_dim: int, theta: float, max_pos: int, device, dtype, scaling: dict | None = None):
        inv_freq, attn = rope_frequencies(rotary_dim, theta, scaling)
        pos = torch.arange(max_pos, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, rd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, rd]
        cos, sin = emb.cos(), emb.sin()
        if attn != 1.0:  # YaRN: scaled in fp32, then cast, as the reference does
            cos, sin = cos * attn, sin * attn
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)
        self.rotary_dim = rotary_dim

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, hd]; positions: [..., T] -> same shape, first rotary_dim rotated."""
        cos = self.cos[positions].unsqueeze(-2)  # [..., T, 1, rd]
        sin = self.sin[positions].unsqueeze(-2)
        rd = self.rotary_dim
        xr, xp = x[..., :rd], x[..., rd:]
        half = rd // 2
        rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
        return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def lm_head(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] = h [N, H] @ w [V, H]^T.

    On the CPU, for the few rows of a decode step, MKL runs the product 2-4x faster with the
    tall weight as the left operand (w @ h^T) than as F.linear gives it (measured on the 2-core
    dev machine, vocab 152k: batch 2 29 -> 7 ms); a single row goes in twice, since the
    one-column product stays on the slow single-threaded GEMV. Same math, another summation
    order. On CUDA, cuBLAS handles F.linear well."""
    n = h.shape[0]
    if w.dtype != h.dtype:  # a bf16 weight kept under a float32 model (--dense-bf16)
        out = host_gemv(h, w)
        return out if out is not None else widened_linear(h, w)  # [N, V]
    if h.is_cuda or n > 32:
        return F.linear(h, w)
    out = host_gemv(h, w)  # the C++ rows kernel: 1.6x F.linear, 2.6x this form in bf16 (bench/cpu_gemv.py)
    if out is not None:
        return out
    cols = torch.cat([h, h]) if n == 1 else h  # [max(N, 2), H]
    return (w @ cols.T)[:, :n].T  # [N, V]


def swiglu_mlp(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    """gate, up [I, H], down [H, I]: plain tensors or FP8 block weights (model/linear.py)."""
    return linear(silu_mul(linear(x, gate), linear(x, up)), down)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u; on CUDA one kernel (kernels/shared_expert.py), rounded as the two torch ops."""
    if use_triton(g) and g.dtype == u.dtype:
        from ..kernels.shared_expert import silu_mul_triton
        return silu_mul_triton(g, u)
    return F.silu(g) * u


def gated_add(routed: torch.Tensor, sg: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """routed + sigmoid(sg) * y (the shared expert's gate and the MoE merge): routed, y [T, H],
    sg [T, 1]; on CUDA one kernel, rounded as the three torch ops."""
    if use_triton(routed) and routed.dtype == y.dtype and sg.dtype == y.dtype:
        from ..kernels.shared_expert import gated_add_triton
        return gated_add_triton(routed, sg, y)
    return routed + torch.sigmoid(sg) * y


class FusedLinear:
    """Several projections of the same input as few GEMMs (one launch, one pass over x each);
    returns the outputs split back apart, in the order given. Built once at load from the
    checkpoint's tensors. The plain weights are one GEMM (all of them, in order: without FP8
    weights the only one, as it always was); FP8 block weights (weights/dense_fp8.py) are joined
    into runs whose scale blocks stay whole (the rows of all but a run's last weight a multiple
    of 128, one K), so a Qwen3.6 q/k/v or DeltaNet qkv/z is still one GEMM on the FP8 bytes."""

    def __init__(self, weights: list, biases: list | None = None):
        self.sizes = [w.shape[0] for w in weights]
        with_bias = biases is not None and any(b is not None for b in biases)
        groups: list[list[int]] = []  # indices of the weights each GEMM computes
        plain = [i for i, w in enumerate(weights) if not isinstance(w, Fp8BlockWeight)]
        if plain:
            groups.append(plain)
        fp8: list[int] | None = None  # the FP8 run being built
        for i, w in enumerate(weights):
            if not isinstance(w, Fp8BlockWeight):
                continue
            if fp8 is not None and Fp8BlockWeight.joinable(weights[fp8[-1]], w):
                fp8.append(i)
            else:
                fp8 = [i]
                groups.append(fp8)
        self.groups = []  # (weight [rows, in], bias [rows] or None, indices, rows of padding at the end)
        for idx in groups:
            ws = [weights[i] for i in idx]
            w = Fp8BlockWeight.cat(ws) if isinstance(ws[0], Fp8BlockWeight) else torch.cat(ws, dim=0)  # [sum(out), in]
            b = None
            if with_bias and any(biases[i] is not None for i in idx):
                b = torch.cat([biases[i] if biases[i] is not None else
                               torch.zeros(weights[i].shape[0], dtype=w.dtype, device=w.device) for i in idx])
            pad = self._pad(w)
            if pad:
                w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
                b = None if b is None else torch.cat([b, b.new_zeros(pad)])
            self.groups.append((w, b, idx, pad))

    @staticmethod
    def _pad(w) -> int:
        """Zero rows that make a CUDA weight's output rows whole 16 bytes. The MoE block's router,
        shared expert and its one-row gate are 1,281 rows for Qwen3.6: cuBLAS ran that GEMM with
        an unaligned kernel (cutlass_75 ..._align1), 23.5 of the 391 ms a 32k pass of the 12-layer
        slice spent on an H100 (results/prefill_stream-profile-h100-gpu.json). On the CPU the
        rows stay as they are; on CUDA too with FREETOKEN_PREFILL_KERNELS=0 (kernels.prefill_kernels)."""
        if isinstance(w, Fp8BlockWeight) or not w.is_cuda or not prefill_kernels():
            return 0
        return -w.shape[0] % max(1, 16 // w.element_size())

    def __call__(self, x: torch.Tensor):
        if len(self.groups) == 1:
            w, b, _, pad = self.groups[0]
            return linear(x, w, b).split(self.sizes + [pad] if pad else self.sizes, dim=-1)[:len(self.sizes)]
        out = [None] * len(self.sizes)
        for w, b, idx, pad in self.groups:
            ys = linear(x, w, b).split([self.sizes[i] for i in idx] + ([pad] if pad else []), dim=-1)
            for i, y in zip(idx, ys):
                out[i] = y
        return tuple(out)

    def part(self, i: int):
        """(weight, bias or None) of projection i: views of the fused ones, no copy."""
        for w, b, idx, _ in self.groups:
            if i in idx:
                start = sum(self.sizes[j] for j in idx[:idx.index(i)])
                n = self.sizes[i]
                wi = w.rows(start, n) if isinstance(w, Fp8BlockWeight) else w[start:start + n]
                return wi, (None if b is None else b[start:start + n])
        raise IndexError(f"no projection {i} among {len(self.sizes)}")
