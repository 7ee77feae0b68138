"""Routed-expert banks as the executors take them, in any of the formats FTW keeps.

A bank holds one projection of every expert, first dimension the flat id l*E + e:
    gate_up  [N, 2I, H]  rows [0, I) the gate projection, [I, 2I) the up projection
    down     [N, H, I]
An unquantized ("dense": bf16/f16/f32) bank is a plain tensor of that shape, as it always was;
every executor and kernel keeps its existing path for it. A quantized bank is a `QuantBank`:
the published bytes (values, scale and, for NVFP4, scale_2 tensors, each with the same first
dimension; layouts in weights/quant.py's docstring) plus `dequant(ids)`, the reference every
kernel is tested against. `ExpertBanks` is the pair with its format, built from an FTW header.

What a kernel reads, per format (R rows, C columns of one expert's matrix; R = 2I or H):
    fp8_block  values float8_e4m3fn [N, R, C]; scale [N, gR, ceil(C/128)] in the published dtype
               (float32 from DeepSeek, bfloat16/float16 from Qwen), one per 128x128 block; for
               gate_up the gate's ceil(I/128) block rows then the up's (each half its own grid,
               so gR = 2 * ceil(I/128)); w = e4m3 * scale
    mxfp4      values uint8 [N, R, C/2] (element 2k in the low nibble); scale uint8 e8m0
               [N, R, C/32]; w = e2m1 * 2^(scale - 127)
    nvfp4      values uint8 [N, R, C/2]; scale float8_e4m3fn [N, R, C/16]; scale_2 float32
               [N, 2] for gate_up (gate rows use [:, 0], up rows [:, 1]), [N, 1] for down;
               w = e2m1 * scale * scale_2
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import BankLayoutError, UnsupportedModelError
from ..weights.quant import (FORMATS, FP8_BLOCK, MX_BLOCK, NV_BLOCK, dequant_fp8_block, dequant_fp8_block_pair,
                             dequant_mxfp4, dequant_nvfp4)

QUANTIZED = ("fp8_block", "mxfp4", "nvfp4")


@dataclass
class QuantBank:
    """One projection's bank (gate_up or down) of N experts in a quantized format."""
    format: str  # "fp8_block" | "mxfp4" | "nvfp4"
    values: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor | None = None  # nvfp4 only: float32 [N, halves]
    halves: int = 1  # 2 for gate_up: gate rows then up rows, each with its own fp8 grid / nvfp4 scale_2

    def __post_init__(self):
        if self.format not in QUANTIZED:
            raise ValueError(f"not a quantized format: {self.format!r}")
        problem = self._layout_problem()
        if problem:  # caught here, at load, rather than by a kernel at the first decode step
            raise BankLayoutError(f"{self.format} expert bank (values {list(self.values.shape)}, scale "
                             f"{list(self.scale.shape)}): {problem}; the checkpoint's scales do not match "
                             "its weights: re-convert it with `ft convert` from the published files")

    def _layout_problem(self) -> str | None:
        """What is wrong with the tensors' shapes for this format (quant.py's layouts), or None."""
        v, s, s2 = self.values, self.scale, self.scale_2
        if v.dim() != 3 or v.element_size() != 1:
            return "values must be one-byte [N, R, C] (fp8) or [N, R, C/2] (fp4)"
        n, r, c = self.shape
        if s.dim() != 3 or s.shape[0] != n:
            return f"scale must be [{n}, ., .]"
        if self.format == "fp8_block":
            if r % self.halves:
                return f"{r} rows do not split into {self.halves} halves"
            want = (self.halves * -(-(r // self.halves) // FP8_BLOCK), -(-c // FP8_BLOCK))
        else:
            block = MX_BLOCK if self.format == "mxfp4" else NV_BLOCK
            if c % block or s.element_size() != 1:
                return f"fp4 rows of {c} values need one-byte scales per {block}"
            want = (r, c // block)
        if tuple(s.shape[1:]) != want:
            return f"scale must be [{n}, {want[0]}, {want[1]}]"
        if self.format == "nvfp4" and (s2 is None or s2.numel() != n * self.halves):
            return f"nvfp4 needs scale_2 of {n} x {self.halves} values"
        return None

    @property
    def shape(self) -> torch.Size:
        """The float bank's shape [N, R, C] (what a dense bank of these experts would be)."""
        n, r, c = self.values.shape
        return torch.Size([n, r, c if self.format == "fp8_block" else 2 * c])

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the bank (first dimension N): what a copy of expert rows moves."""
        return [t for t in (self.values, self.scale, self.scale_2) if t is not None]

    def dequant(self, ids, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Experts `ids` (an int, or an int tensor of any shape S) as float weights
        [*S, R, C] in `dtype`, with quant.py's reference dequantizers."""
        v, s = self.values[ids], self.scale[ids]
        r = v.shape[-2]
        if self.format == "fp8_block":
            w = dequant_fp8_block_pair(v, s, r // 2) if self.halves == 2 else dequant_fp8_block(v, s)
        elif self.format == "mxfp4":
            w = dequant_mxfp4(v, s)
        else:
            s2 = self.scale_2[ids]
            if self.halves == 2:
                h = r // 2
                w = torch.cat([dequant_nvfp4(v[..., :h, :], s[..., :h, :], s2[..., 0]),
                               dequant_nvfp4(v[..., h:, :], s[..., h:, :], s2[..., 1])], dim=-2)
            else:
                w = dequant_nvfp4(v, s, s2[..., 0])
        return w.to(dtype)

    def select(self, ids: torch.Tensor) -> "QuantBank":
        """The raw rows of experts `ids` (a 1-d index tensor): a bank of len(ids) experts."""
        return replace(self, values=self.values.index_select(0, ids), scale=self.scale.index_select(0, ids),
                       scale_2=None if self.scale_2 is None else self.scale_2.index_select(0, ids))

    def to(self, device, non_blocking: bool = False) -> "QuantBank":
        """The same bytes on `device` (never re-quantized or cast)."""
        return replace(self, values=self.values.to(device, non_blocking=non_blocking),
                       scale=self.scale.to(device, non_blocking=non_blocking),
                       scale_2=None if self.scale_2 is None else self.scale_2.to(device, non_blocking=non_blocking))


def take(bank, ids, dtype: torch.dtype) -> torch.Tensor:
    """Experts `ids` of a bank as `dtype` weights: a gather of a float bank, the selected experts
    dequantized for a QuantBank."""
    if isinstance(bank, torch.Tensor):
        return bank[ids].to(dtype)
    return bank.dequant(ids, dtype)


@dataclass
class ExpertBanks:
    """The gate_up and down banks of every routed expert, in one format."""
    format: str  # quant.py FORMATS: "dense" (bf16/f16/f32 tensors) or a quantized one (QuantBanks)
    gate_up: torch.Tensor | QuantBank
    down: torch.Tensor | QuantBank

    @classmethod
    def from_ftw(cls, meta: dict, tensors: dict) -> "ExpertBanks | None":
        """From an FTW header's meta["banks"] and the loaded entries; None without experts.
        Files written before quantized formats have no "format": dense."""
        b = meta.get("banks") or {}
        if not b.get("gate_up") or b["gate_up"] not in tensors:
            return None
        fmt = b.get("format", "dense")
        if fmt not in FORMATS:
            raise UnsupportedModelError(f"the expert banks are in format {fmt!r}, which this FreeToken does not "
                                        "read; update FreeToken or re-run `ft convert`")
        if fmt == "dense":
            return cls(fmt, tensors[b["gate_up"]], tensors[b["down"]])

        def bank(part: str, halves: int) -> QuantBank:
            s2 = b.get(part + "_scale_2")
            return QuantBank(fmt, tensors[b[part]], tensors[b[part + "_scale"]],
                             tensors[s2] if s2 else None, halves)
        return cls(fmt, bank("gate_up", 2), bank("down", 1))

    @property
    def quantized(self) -> bool:
        return self.format != "dense"

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden(self) -> int:
        return self.gate_up.shape[2]

    @property
    def inter(self) -> int:
        return self.gate_up.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.gate_up.device

    @property
    def label(self) -> str:
        """The format as reported (describe()'s expert_format): the dtype of a dense bank."""
        if self.quantized:
            return self.format
        return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}.get(
            self.gate_up.dtype, str(self.gate_up.dtype).replace("torch.", ""))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert: every bank's row (what a cache slot holds)."""
        return self.nbytes // self.num_experts

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of both banks, first dimension N (values, scales)."""
        return [t for bank in (self.gate_up, self.down)
                for t in ([bank] if isinstance(bank, torch.Tensor) else bank.tensors())]

    def dequant(self, ids, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Float weights of experts `ids`: (gate_up [*S, 2I, H], down [*S, H, I]) in `dtype`."""
        return take(self.gate_up, ids, dtype), take(self.down, ids, dtype)

    def select(self, ids: torch.Tensor) -> "ExpertBanks":
        """The raw rows of experts `ids` (1-d): the banks of len(ids) experts, same format."""
        def one(bank):
            return bank.index_select(0, ids) if isinstance(bank, torch.Tensor) else bank.select(ids)
        return ExpertBanks(self.format, one(self.gate_up), one(self.down))

    def to(self, device, dtype: torch.dtype | None = None) -> "ExpertBanks":
        """On `device`; dense banks cast to `dtype` if given (as the GPU-resident path does),
        quantized banks keep their bytes."""
        def one(bank):
            if isinstance(bank, torch.Tensor):
                return bank.to(device, dtype) if dtype is not None else bank.to(device)
            return bank.to(device)
        return ExpertBanks(self.format, one(self.gate_up), one(self.down))
