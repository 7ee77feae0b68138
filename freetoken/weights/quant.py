"""Quantized weight formats as published, and their pure-torch dequantization (the reference
every kernel is tested against). Written from the formats' specifications:

fp8_block  (DeepSeek-V3 / Qwen FP8 releases) e4m3 values [rows, cols] and an fp32 scale per
           128 x 128 block (`weight_scale_inv`, despite its name multiplied in):
               w[r, c] = float(q[r, c]) * scale[r // 128, c // 128]
mxfp4      (OCP Microscaling v1.0; GPT-OSS, DeepSeek-V4 experts) e2m1 values, two per byte (the
           element with the even index in the low nibble), one e8m0 scale per 32 consecutive
           elements of a row:      w = e2m1 * 2 ** (scale - 127)      (scale 255 is NaN)
nvfp4      (NVIDIA ModelOpt) e2m1 values packed as in mxfp4, one e4m3 scale per 16 elements
           and one fp32 scale per tensor (`weight_scale_2`):
               w = e2m1 * float(scale_e4m3) * scale_2

e2m1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0: magnitudes 0, 0.5, 1, 1.5, 2, 3,
4, 6. No infinities or NaN.

FTW expert banks keep these bytes as they are (no re-quantization). Every bank's first dimension
is the flat expert id l*E + e; a format's banks for one projection pair are (rows = output
features, as in the checkpoint; the gate_up bank's rows are the gate rows then the up rows):
    bf16 / f16 / f32   values [N, R, C]
    fp8_block          values float8_e4m3fn [N, R, C], scale float32 [N, ceil(R/128), ceil(C/128)]
                       (gate_up: the gate's block rows, then the up's: ceil(I/128) each)
    mxfp4              values uint8 [N, R, C/2], scale uint8 (e8m0) [N, R, C/32]
    nvfp4              values uint8 [N, R, C/2], scale float8_e4m3fn [N, R, C/16],
                       scale_2 float32 [N, 2] for gate_up (gate's, up's), [N, 1] for down
"""
from __future__ import annotations

import torch

FORMATS = ("dense", "fp8_block", "mxfp4", "nvfp4")
FP8_BLOCK = 128
MX_BLOCK = 32
NV_BLOCK = 16
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# e2m1 code -> value, sign in bit 3
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(device=None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> float32 [..., n]: element 2i from the low nibble, 2i+1 from the high."""
    table = e2m1_table(packed.device)
    lo = table[(packed & 0x0F).long()]  # [..., n/2]
    hi = table[(packed >> 4).long()]
    return torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., n]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) [..., n] -> packed uint8 [..., n/2] (the inverse of the layout
    above; for test checkpoints)."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 -> float32 2 ** (s - 127); 255 -> NaN."""
    s = scale.to(torch.int32)
    out = torch.ldexp(torch.ones_like(s, dtype=torch.float32), s - 127)
    return torch.where(s == 255, torch.full_like(out, float("nan")), out)


def _blocks(values: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """values [..., n] * scale [..., n/block] repeated over each block -> [..., n]."""
    n = values.shape[-1]
    if scale.shape[-1] * block != n:
        raise ValueError(f"{n} values need {n // block} scales of {block}, got {scale.shape[-1]}")
    return (values.unflatten(-1, (n // block, block)) * scale[..., None]).flatten(-2)


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C/2], e8m0 uint8 [..., C/32] -> float32 [..., C]."""
    return _blocks(unpack_fp4(blocks), e8m0_to_float(scales), MX_BLOCK)


def dequant_nvfp4(packed: torch.Tensor, scales: torch.Tensor, scale_2) -> torch.Tensor:
    """uint8 [..., C/2], e4m3 [..., C/16], scale_2 fp32 (a scalar or broadcastable over the
    leading dims, [...,] ) -> float32 [..., C]."""
    w = _blocks(unpack_fp4(packed), scales.float(), NV_BLOCK)
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=w.device)
    return w * s2.reshape(*s2.shape, *([1] * (w.dim() - s2.dim())))


def dequant_fp8_block(values: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """e4m3 [..., R, C], fp32 [..., ceil(R/block), ceil(C/block)] -> float32 [..., R, C]."""
    r, c = values.shape[-2:]
    s = scale.repeat_interleave(block, dim=-2)[..., :r, :].repeat_interleave(block, dim=-1)[..., :c]
    return values.float() * s


def quant_fp8_block(w: torch.Tensor, scale_dtype=torch.float32, block: int = FP8_BLOCK):
    """[R, C] -> (e4m3 [R, C], scale_inv [ceil(R/block), ceil(C/block)] in scale_dtype), so that
    w ~ dequant_fp8_block(q, scale_inv): one scale per block, its amax / 448 (DeepSeek's and Qwen's
    quantizer; an all-zero block gets scale 1). The reference quantizer of the tests' checkpoints
    and the benchmarks' FP8 weights; `ft convert` never re-quantizes."""
    r, c = w.shape
    gr, gc = -(-r // block), -(-c // block)
    pad = torch.zeros(gr * block, gc * block, device=w.device)
    pad[:r, :c] = w.float()
    amax = pad.view(gr, block, gc, block).abs().amax(dim=(1, 3))  # [gr, gc]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
    s = scale.float().repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :c]  # [R, C]
    q = (w.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def is_projection(name: str) -> bool:
    """A Linear projection's weight by its name, as the FP8 / FP4 releases select what they quantize:
    `*_proj.weight`, and DeltaNet's `in_proj_qkv` / `in_proj_z` / `in_proj_a` / `in_proj_b`
    (Qwen3.5/3.6) and `in_proj_qkvz` / `in_proj_ba` (Qwen3-Next); the releases then leave DeltaNet's
    small a / b (ba) projections out (SMALL_PROJECTIONS), with lm_head, embeddings and routers."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    return module.endswith("_proj") or module.startswith("in_proj_")


# projection weights the releases keep unquantized (a few rows each: DeltaNet's gates' inputs)
SMALL_PROJECTIONS = ("in_proj_a.weight", "in_proj_b.weight", "in_proj_ba.weight")


def dequant_fp8_block_pair(values: torch.Tensor, scale: torch.Tensor, rows_first: int,
                           block: int = FP8_BLOCK) -> torch.Tensor:
    """A gate_up bank row range made of two tensors (gate: `rows_first` rows, then up), each
    with its own block grid: values [..., R, C], scale [..., ceil(I/B) + ceil(R-I/B), ceil(C/B)]."""
    g = -(-rows_first // block)
    first = dequant_fp8_block(values[..., :rows_first, :], scale[..., :g, :], block)
    rest = dequant_fp8_block(values[..., rows_first:, :], scale[..., g:, :], block)
    return torch.cat([first, rest], dim=-2)
