"""A dense (non-expert) Linear weight kept as an FP8 checkpoint publishes it: e4m3 values [N, K]
and one scale per 128 x 128 block, scale_inv [ceil(N/128), ceil(K/128)] (quant.py's fp8_block).

The model hands it to model/linear.py's linear() where it would hand a plain weight to F.linear:
on CUDA the Triton kernel (kernels/fp8_linear.py) reads these bytes in place. dense_weights
(reader.py) builds it when the engine keeps dense FP8 (--dense-fp8); the other quantized dense
formats (MXFP4, NVFP4: small dense shares in the releases that use them) are still dequantized
at load.
"""
from __future__ import annotations

import torch

from ..errors import BankLayoutError
from .quant import FP8_BLOCK


def block_scale_f32(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as a float tensor: ue8m0 bytes (DeepSeek-V4's F8_E8M0, stored as uint8)
    become fp32 2^(b - 127) exactly; float scales (fp32, or bf16 as Qwen publishes them) are
    returned as they are (exact in fp32 wherever they are read)."""
    if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        from .hf import e8m0_f32
        return e8m0_f32(scale)
    return scale


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


class Fp8BlockWeight:
    """values e4m3 [N, K], scale_inv float [ceil(N/128), ceil(K/128)] on one device; dtype: the
    compute dtype (what dequantize() gives, as dense_weights would have). Values or a scale that
    do not fit raise BankLayoutError (a ValueError; from the CLI one line naming the tensor).
    Read-only: the model never writes a weight."""

    __slots__ = ("values", "scale_inv", "dtype", "name")

    def __init__(self, values: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, name: str = "weight"):
        if values.dtype != torch.float8_e4m3fn or values.dim() != 2:
            raise BankLayoutError(f"{name}: an FP8 block weight is float8_e4m3fn [N, K], got {values.dtype} "
                             f"{list(values.shape)}")
        scale_inv = block_scale_f32(scale_inv)  # ue8m0 -> fp32 once, here at load
        n, k = values.shape
        want = [_blocks(n), _blocks(k)]
        if not scale_inv.is_floating_point() or list(scale_inv.shape) != want:
            raise BankLayoutError(f"{name}: its scale_inv is {scale_inv.dtype} {list(scale_inv.shape)}; a [{n}, {k}] "
                             f"weight with {FP8_BLOCK}x{FP8_BLOCK} blocks needs a float scale of shape {want}")
        if scale_inv.device != values.device:
            raise ValueError(f"{name}: values on {values.device}, scale_inv on {scale_inv.device}")
        self.values = values if values.stride(-1) == 1 else values.contiguous()
        self.scale_inv = scale_inv
        self.dtype = dtype
        self.name = name

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scale_inv.numel() * self.scale_inv.element_size()

    def __repr__(self) -> str:
        return f"Fp8BlockWeight({self.name}, {list(self.shape)}, scale {self.scale_inv.dtype}, {self.device})"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [N, K] in `dtype` (default: the compute dtype): bit for bit quant.py's
        dequant_fp8_block then cast, built one block row at a time in place, so the only memory
        it takes is the fp32 copy itself (no [N, K] scale tensor beside it)."""
        n, k = self.values.shape
        w = self.values.to(torch.float32)  # [N, K]
        for i in range(self.scale_inv.shape[0]):
            row = self.scale_inv[i].repeat_interleave(FP8_BLOCK)[:k]  # [K] this block row's scales
            w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK].mul_(row)
        return w.to(dtype or self.dtype)

    def rows(self, start: int, count: int) -> "Fp8BlockWeight":
        """Rows start..start+count as a view (no copy); start must begin a scale block."""
        if start % FP8_BLOCK:
            raise ValueError(f"{self.name}: rows of an FP8 block weight start on a {FP8_BLOCK}-row block, got {start}")
        b = start // FP8_BLOCK
        return Fp8BlockWeight(self.values[start:start + count], self.scale_inv[b:b + _blocks(count)], self.dtype,
                              self.name)

    @staticmethod
    def joinable(a: "Fp8BlockWeight", b: "Fp8BlockWeight") -> bool:
        """Whether b's rows can follow a's in one weight: same K and device, a's rows whole
        blocks (so b's blocks stay b's)."""
        return a.shape[1] == b.shape[1] and a.shape[0] % FP8_BLOCK == 0 and a.device == b.device

    @staticmethod
    def cat(weights: list["Fp8BlockWeight"]) -> "Fp8BlockWeight":
        """One weight of the given weights' rows in order (a fused projection): values and scale
        rows concatenated; each pair must be joinable. Scales of mixed dtypes are joined in fp32."""
        for a, b in zip(weights, weights[1:]):
            if not Fp8BlockWeight.joinable(a, b):
                raise ValueError(f"{b.name} cannot follow {a.name} in one FP8 block weight ({list(a.shape)}, "
                                 f"{list(b.shape)})")
        if len(weights) == 1:
            return weights[0]
        scales = [w.scale_inv for w in weights]
        if len({s.dtype for s in scales}) > 1:
            scales = [s.float() for s in scales]
        return Fp8BlockWeight(torch.cat([w.values for w in weights]), torch.cat(scales), weights[0].dtype,
                              "+".join(w.name for w in weights))
