"""Reading transformers checkpoint directories as they are published.

Handles sharded safetensors (model.safetensors.index.json) or loose *.safetensors files, the
multimodal wrapper's `model.language_model.` prefix (vision tower and MTP heads skipped), and
routed experts stored one tensor per expert or fused per layer. Tensors are opened lazily
(safetensors mmap) so a checkpoint larger than RAM streams through.

Quantized checkpoints (FP8 with block scales, MXFP4, GPTQ/AWQ, bitsandbytes, ModelOpt,
compressed-tensors) are recognised here, from their config and from their tensors, so that
`ft convert` can refuse them by name instead of dropping their scales.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from ..errors import FreeTokenError

SKIP = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.|model\.vision_tower\.)")
EXPERT_ONE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def canonical(name: str) -> str | None:
    """Checkpoint tensor name -> FreeToken's name (transformers text-model names)."""
    if SKIP.match(name):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):  # older wrappers
        return name[len("language_model."):]
    return name


@dataclass
class Source:
    file: str
    name: str  # name inside the file
    shape: list[int]
    dtype: torch.dtype | None  # None: a safetensors dtype torch has no type for (st_dtype says which)
    st_dtype: str = ""  # the safetensors dtype name, e.g. "BF16", "F8_E4M3"


class Checkpoint:
    """Lazy view of a checkpoint directory's tensors under canonical names."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isdir(path):
            raise FreeTokenError(f"{path}: not a checkpoint directory")
        files = self._shard_files()
        self._handles: dict[str, object] = {}
        self.tensors: dict[str, Source] = {}
        for fn in files:
            h = self._open(fn)
            for key in h.keys():
                c = canonical(key)
                if c is None:
                    continue
                sl = h.get_slice(key)
                st = sl.get_dtype()
                self.tensors[c] = Source(fn, key, list(sl.get_shape()), ST_DTYPES.get(st), st)

    def _shard_files(self) -> list[str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    wm = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise FreeTokenError(f"{index}: unreadable index ({e})") from None
            files = sorted(set(wm.values()))
            missing = [fn for fn in files if not os.path.exists(os.path.join(self.path, fn))]
            if missing:
                raise FreeTokenError(
                    f"{self.path}: shard {missing[0]} named in model.safetensors.index.json is "
                    f"missing ({len(missing)} of {len(files)} shards absent)")
            return [os.path.join(self.path, fn) for fn in files]
        files = sorted(fn for fn in os.listdir(self.path) if fn.endswith(".safetensors"))
        if not files:
            raise FreeTokenError(f"{self.path}: no *.safetensors weight files found")
        return [os.path.join(self.path, fn) for fn in files]

    def _open(self, fn: str):
        if fn not in self._handles:
            try:
                self._handles[fn] = safe_open(fn, framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise FreeTokenError(f"{fn}: not a readable safetensors file ({e})") from None
        return self._handles[fn]

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Whole tensor, or row `index` of its first dimension (reads only that row)."""
        s = self.tensors[name]
        h = self._open(s.file)
        try:
            if index is None:
                return h.get_tensor(s.name)
            return h.get_slice(s.name)[index]
        except Exception as e:
            raise FreeTokenError(f"{s.file}: cannot read tensor {s.name} ({e})") from None


ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
             "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what FTW weights may be

# tensors that only quantized checkpoints have: FP8 block scales (weight_scale_inv), per-tensor
# scales (weight_scale, input_scale, k_scale, ...: ModelOpt, compressed-tensors), MXFP4 pairs
# (*_blocks, *_scales), GPTQ/AWQ (qweight, qzeros, scales, g_idx), bitsandbytes (absmax,
# quant_map, quant_state.*), compressed-tensors packing (weight_packed, weight_zero_point)
QUANT_LEAVES = {"qweight", "qzeros", "scales", "g_idx", "absmax", "quant_map", "SCB", "weight_packed",
                "weight_shape"}
QUANT_SUFFIXES = ("_scale", "_scale_inv", "_scale_2", "_scales", "_blocks", "_zero_point")


def is_quant_tensor(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return (leaf in QUANT_LEAVES or leaf.endswith(QUANT_SUFFIXES) or ".quant_state." in name
            or leaf.startswith("quant_state"))


def quant_config(path: str, raw: dict) -> tuple[str, dict] | None:
    """(where, settings) of the checkpoint's quantization, if it declares one: config.json's
    `quantization_config` (top level or the wrapper's text_config), or the hf_quant_config.json /
    quant_config.json that NVIDIA ModelOpt writes next to it."""
    for cfg in (raw, raw.get("text_config")):
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if qc:
            return "config.json", qc if isinstance(qc, dict) else {"quant_method": str(qc)}
    for fn in ("hf_quant_config.json", "quant_config.json"):
        full = os.path.join(path, fn)
        if os.path.exists(full):
            try:
                with open(full) as f:
                    qc = json.load(f)
            except ValueError:
                qc = {}
            return fn, qc if isinstance(qc, dict) else {}
    return None


def describe_quant(qc: dict) -> str:
    """'fp8' (e4m3, 128x128 block scales) and the like, from a quantization config."""
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}
    method = (qc.get("quant_method") or qc.get("quant_algo") or inner.get("quant_algo")
              or ("modelopt" if "producer" in qc else "unknown"))
    method = str(method)
    m = method.lower()
    details = []
    if m == "fp8":
        details.append(str(qc.get("fmt") or "e4m3"))
        bs = qc.get("weight_block_size")
        if isinstance(bs, (list, tuple)) and len(bs) == 2:
            details.append(f"{bs[0]}x{bs[1]} block scales")
        else:
            details.append("per-tensor scales")
    elif m == "mxfp4":
        details.append("4-bit blocks with shared e8m0 scales")
    elif m in ("gptq", "awq", "auto-round", "autoround", "hqq", "eetq", "quanto", "higgs", "vptq", "aqlm"):
        bits = qc.get("bits") or qc.get("w_bit") or qc.get("nbits")
        group = qc.get("group_size") or qc.get("q_group_size")
        if bits:
            details.append(f"{bits}-bit")
        if group:
            details.append(f"group size {group}")
    elif m == "bitsandbytes":
        if qc.get("load_in_4bit"):
            details.append(f"4-bit {qc.get('bnb_4bit_quant_type') or 'nf4'}")
        elif qc.get("load_in_8bit"):
            details.append("8-bit")
    elif m == "compressed-tensors":
        if qc.get("format"):
            details.append(str(qc["format"]))
    else:
        algo = inner.get("quant_algo") or qc.get("quant_algo")
        group = inner.get("group_size") or qc.get("group_size")
        if algo and str(algo) != method:
            details.append(str(algo))
        if group:
            details.append(f"group size {group}")
        if "producer" in qc and isinstance(qc["producer"], dict) and qc["producer"].get("name"):
            details.append(f"made by {qc['producer']['name']}")
    return f"'{method}'" + (f" ({', '.join(details)})" if details else "")


def _block_size(ck: "Checkpoint", inv: list[str]) -> tuple[int, int] | None:
    """The (power-of-two) block shape that maps a weight onto its scale_inv grid, from a weight
    big enough to span several blocks each way; None if none is."""
    for n in inv:
        w, s = ck.tensors.get(n[: -len("_scale_inv")]), ck.tensors[n]
        if w is None or len(w.shape) != 2 or len(s.shape) != 2 or min(s.shape) < 2:
            continue
        block = []
        for size, count in zip(w.shape, s.shape):
            b = 1 << max(0, (-(-size // count) - 1).bit_length())  # power of two >= size / count
            if -(-size // b) != count:
                break
            block.append(b)
        if len(block) == 2:
            return block[0], block[1]
    return None


def describe_quant_tensors(ck: "Checkpoint") -> str | None:
    """Name the quantized format from the tensors alone (a checkpoint whose config does not say)."""
    names = [n for n in ck.tensors if is_quant_tensor(n)]
    f8 = [n for n, s in ck.tensors.items() if s.st_dtype.startswith("F8")]
    if not names and not f8:
        return None
    inv = [n for n in names if n.endswith("weight_scale_inv")]
    if inv:
        w = ck.tensors.get(inv[0][: -len("_scale_inv")])
        fmt = w.st_dtype.replace("F8_", "").lower() if w is not None else "fp8"
        block = _block_size(ck, inv)
        scales = f"{block[0]}x{block[1]} block scales" if block else "block scales"
        return f"'fp8' ({fmt}, {scales}; tensor {inv[0]})"
    if any(n.endswith("_blocks") for n in names):
        return f"'mxfp4' (4-bit blocks with shared scales; tensor {next(n for n in names if n.endswith('_blocks'))})"
    if any(n.endswith((".qweight", ".qzeros")) for n in names):
        return f"'gptq/awq' (packed integer weights; tensor {next(n for n in names if n.endswith(('.qweight', '.qzeros')))})"
    if f8:
        return f"'fp8' ({ck.tensors[f8[0]].st_dtype.replace('F8_', '').lower()} weights; tensor {f8[0]})"
    return f"quantization tensors (tensor {names[0]})"


def read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise FreeTokenError(f"{path}: not a checkpoint directory")
    fn = os.path.join(path, "config.json")
    if not os.path.exists(fn):
        raise FreeTokenError(f"{path}: config.json is missing; this is not a transformers checkpoint")
    try:
        with open(fn) as f:
            return json.load(f)
    except ValueError as e:
        raise FreeTokenError(f"{fn}: invalid JSON ({e})") from None
