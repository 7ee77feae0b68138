"""FTW: FreeToken's weight file, laid out as the runtime uses it (mechanism 7).

One file:
    [0, 4096)          preamble: MAGIC, u32 version, u64 header length, then the JSON header
    [4096, ...)        more header pages if the JSON is long, padded to ALIGN
    data               one region per entry, each starting on an ALIGN boundary
An entry is a tensor (dtype, shape) or an embedded file (config.json, tokenizer.json, ...).
Each entry's bytes are cut into BLOCK-sized blocks; the header keeps a CRC32 per block, so a
reader checks exactly what it read, in parallel, with no second pass. Expert banks are
ordinary entries whose first dimension is the flat expert id l*E + e, already merged
(gate and up rows together), so loading is a read into an exact-size tensor, no repacking.

meta["banks"] names the expert banks: "gate_up" and "down" (the value banks), "format" (quant.py's
FORMATS: "dense" for BF16/F16/F32, "fp8_block", "mxfp4", "nvfp4"; absent in files written before
quantized formats: "dense"), and for quantized formats the scale banks "gate_up_scale" /
"down_scale" and, for NVFP4, "gate_up_scale_2" / "down_scale_2", in quant.py's layout.
meta["quant"] (quantized checkpoints only): "format", "experts" (the routed experts' format: the
same, or mxfp4 for DeepSeek-V4's FP4 experts beside FP8 weights), "declared" (where),
"description", and "dense": {weight name: {"format", "values", "scale", "scale_2", "shape"}} for
the non-expert weights stored as published (entries named as in the checkpoint; FP8 ue8m0 scales
as their bytes), dequantized at load, or for FP8 kept as they are (runtime/engine.py --dense-fp8).
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"FTWEIGHT"
VERSION = 1
ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers on this boundary
BLOCK = 16 << 20  # checksum and I/O granularity
PREAMBLE = struct.Struct("<8sIQ")  # magic, version, header length

DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def quantized_entries(meta: dict) -> set[str]:
    """Entries that hold quantized bytes with their scales recorded in the header (expert banks
    of a quantized format, dense weights in meta["quant"]["dense"])."""
    names = set()
    b = meta.get("banks") or {}
    if b.get("format", "dense") != "dense":
        names |= {v for k, v in b.items() if k != "format" and isinstance(v, str)}
    for d in ((meta.get("quant") or {}).get("dense") or {}).values():
        names |= {d.get(k) for k in ("values", "scale", "scale_2") if d.get(k)}
    return names


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class Entry:
    """Where one tensor or file lives in the data region."""
    name: str
    dtype: str  # a DTYPES key; files are "uint8"
    shape: list[int]
    offset: int = 0  # absolute file offset, ALIGN-aligned
    crc: list[int] | None = None  # CRC32 of each BLOCK of the entry's bytes

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        for s in self.shape:
            n *= s
        return n

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": self.shape, "offset": self.offset, "crc": self.crc}


def block_spans(nbytes: int):
    """(start, length) of each checksum block of an entry, relative to its offset."""
    for start in range(0, nbytes, BLOCK):
        yield start, min(BLOCK, nbytes - start)


def crc32(buf) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF  # zlib releases the GIL: parallel threads scale


def layout(entries: list[Entry], meta: dict) -> int:
    """Assign offsets; returns the data start. The header size depends on the CRC list
    lengths but not on offsets' values beyond their digits, so reserve generously."""
    # serialise once with placeholder offsets and CRCs to size the header
    for e in entries:
        e.crc = [0xFFFFFFFF] * max(1, -(-e.nbytes // BLOCK))
        e.offset = 10 ** 15
    probe = header_bytes(entries, meta)
    start = align_up(PREAMBLE.size + len(probe) + ALIGN)
    pos = start
    for e in entries:
        e.offset = pos
        pos = align_up(pos + e.nbytes)
    return start


def header_bytes(entries: list[Entry], meta: dict) -> bytes:
    doc = {"meta": meta, "entries": {e.name: e.to_json() for e in entries}}
    return json.dumps(doc, separators=(",", ":")).encode()


def total_size(entries: list[Entry]) -> int:
    last = max(entries, key=lambda e: e.offset)
    return align_up(last.offset + last.nbytes)


def write_preamble(f, entries: list[Entry], meta: dict, data_start: int):
    body = header_bytes(entries, meta)
    pre = PREAMBLE.pack(MAGIC, VERSION, len(body)) + body
    if len(pre) > data_start:
        raise RuntimeError("FTW header outgrew its reserved space")  # a bug, not user input
    f.seek(0)
    f.write(pre + b"\0" * (data_start - len(pre)))


def read_header(path: str) -> tuple[dict, dict[str, Entry]]:
    """Parse and sanity-check the header; raises CorruptModelError with the file named."""
    from ..errors import CorruptModelError
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        pre = f.read(PREAMBLE.size)
        if len(pre) < PREAMBLE.size:
            raise CorruptModelError(f"{path}: too short to be an FTW file ({size} bytes)")
        magic, version, hlen = PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise CorruptModelError(
                f"{path}: not an FTW file (bad magic); convert a checkpoint with `ft convert`")
        if version != VERSION:
            raise CorruptModelError(
                f"{path}: FTW version {version}, this FreeToken reads version {VERSION}; "
                "re-run `ft convert`")
        if hlen > size - PREAMBLE.size:  # a damaged length field: never read (or allocate) past the file
            raise CorruptModelError(f"{path}: truncated inside the header (it claims {hlen} bytes, the file has "
                                    f"{size}); re-run `ft convert`")
        body = f.read(hlen)
    if len(body) < hlen:
        raise CorruptModelError(f"{path}: truncated inside the header; re-run `ft convert`")
    try:
        doc = json.loads(body)
        entries = {n: Entry(n, d["dtype"], list(d["shape"]), d["offset"], d["crc"])
                   for n, d in doc["entries"].items()}
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptModelError(f"{path}: corrupt FTW header ({e}); re-run `ft convert`") from None
    if entries:
        need = total_size(list(entries.values()))
        if size < need:
            raise CorruptModelError(
                f"{path}: truncated: {size} bytes, the header describes {need}; "
                "the copy or conversion did not finish, re-run `ft convert`")
    return doc["meta"], entries
