"""Reading transformers checkpoint directories as they are published.

Handles sharded safetensors (model.safetensors.index.json) or loose *.safetensors files, the
multimodal wrapper's `model.language_model.` prefix (vision tower and MTP heads skipped), and
routed experts stored one tensor per expert or fused per layer. Tensors are opened lazily
(safetensors mmap) so a checkpoint larger than RAM streams through.
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
    dtype: torch.dtype


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
                self.tensors[c] = Source(fn, key, list(sl.get_shape()), _dtype(sl.get_dtype(), fn))

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


def _dtype(st: str, fn: str) -> torch.dtype:
    table = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
             "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64,
             "F8_E4M3": torch.float8_e4m3fn}
    if st not in table:
        raise FreeTokenError(f"{fn}: tensor dtype {st} is not supported")
    return table[st]


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
