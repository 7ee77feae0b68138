"""FTW loader: parallel direct I/O straight into exact-size host tensors, then pin.

Each entry gets one host allocation of its exact size (plus alignment slack at the ends that
O_DIRECT needs); worker threads read BLOCK-sized pieces into it and check each piece's CRC
right after the read, while it is still in cache. No tensor is copied or repacked.
"""
from __future__ import annotations

import errno
import logging
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import CorruptModelError, UnsupportedModelError
from .dense_fp8 import Fp8BlockWeight
from .hostmem import host_buffer
from .ftw import ALIGN, BLOCK, DTYPES, align_up, block_spans, crc32, quantized_entries, read_header

log = logging.getLogger("freetoken.weights")


def _aligned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of align_up(nbytes) bytes whose first byte sits on an ALIGN boundary (on
    huge pages where the kernel gives them: hostmem.py)."""
    return host_buffer(nbytes, ALIGN)


class _File:
    """One descriptor per reader: O_DIRECT when the filesystem allows it, else buffered."""

    def __init__(self, path: str, direct: bool):
        self.path = path
        self.direct = False
        flags = os.O_RDONLY
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT)
                self.direct = True
            except OSError:
                self.fd = os.open(path, flags)
        else:
            self.fd = os.open(path, flags)
        self.mode = "direct I/O (O_DIRECT)" if self.direct else "buffered I/O"

    def read_into(self, mv: memoryview, offset: int) -> int:
        got = 0
        while got < len(mv):
            try:
                n = os.preadv(self.fd, [mv[got:]], offset + got)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                # the filesystem refused O_DIRECT at read time: fall back for good
                os.close(self.fd)
                self.fd = os.open(self.path, os.O_RDONLY)
                self.direct = False
                self.mode = "buffered I/O (O_DIRECT refused)"
                continue
            if n == 0:
                break
            got += n
        return got

    def close(self):
        os.close(self.fd)


def load_ftw(path: str, names=None, *, verify: bool = True, threads: int | None = None,
             direct: bool = True, pin: bool = False, progress: bool = False):
    """Read entries of an FTW file. Returns (meta, {name: tensor}); files come as uint8."""
    meta, entries = read_header(path)
    wanted = [entries[n] for n in (names if names is not None else entries)]
    quantized = quantized_entries(meta)
    for e in wanted:
        if e.dtype.startswith("float8") and e.name not in quantized:
            # FTW files converted from FP8 checkpoints before `ft convert` refused them: the block
            # scales were dropped, so these weights are wrong whatever the engine does
            raise UnsupportedModelError(
                f"{path}: tensor {e.name} is {e.dtype}: this file was converted from a quantized (FP8) "
                "checkpoint without its scales (before FreeToken read quantized formats); re-run "
                "`ft convert` on the checkpoint, or convert the BF16 release of the model")
    out = {e.name: _aligned_buffer(e.nbytes) for e in wanted}
    jobs = [(e, s, n) for e in wanted for s, n in block_spans(e.nbytes)]
    total = sum(e.nbytes for e in wanted)
    f = _File(path, direct)
    log.info("loading %s with %s", os.path.basename(path), f.mode)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="load", leave=False)

    def read(job):
        e, start, n = job
        buf = out[e.name][start:start + align_up(n)]
        mv = memoryview(buf.numpy())
        got = f.read_into(mv, e.offset + start)
        if got < n:
            raise CorruptModelError(
                f"{path}: truncated inside {e.name!r}; re-run `ft convert`")
        if verify and crc32(mv[:n]) != e.crc[start // BLOCK]:
            raise CorruptModelError(
                f"{path}: checksum mismatch in {e.name!r} at byte {e.offset + start}: "
                "the file is corrupt; copy it again or re-run `ft convert`")
        if bar is not None:
            bar.update(n)

    try:
        with ThreadPoolExecutor(threads or min(16, os.cpu_count() or 4)) as pool:
            list(pool.map(read, jobs))
    finally:
        f.close()
        if bar is not None:
            bar.close()
    tensors = {}
    for e in wanted:
        t = out[e.name][:e.nbytes].view(DTYPES[e.dtype]).view(e.shape)
        tensors[e.name] = t
    if pin:
        pin_in_place(tensors.values())
    return meta, tensors


def pin_in_place(tensors, min_bytes: int = 4096) -> bool:
    """Register host tensors for DMA without copying them (cudaHostRegister).

    Only whole pages that belong to the tensor are registered (FTW buffers start on a page and
    own their padding), so neighbouring allocations never overlap a registered range. Every
    tensor of a page or more: a bank the GPU expert cache reads in place must be registered
    whatever its size (a small model's or a quantized model's scale bank can be well under a
    MiB), else its fills take a sync and the decode step cannot be one CUDA graph. A refused
    registration is cleared so no later CUDA call sees it.
    """
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    ok, errors = True, set()
    for t in tensors:
        n = t.numel() * t.element_size()
        if n < min_bytes or t.data_ptr() % ALIGN:
            continue
        err = cudart.cudaHostRegister(t.data_ptr(), align_up(n), 0)
        if int(err) != 0:
            ok = False
            errors.add(str(err))
            torch.cuda.cudart().cudaGetLastError()  # do not leave the error for the next call
        else:
            # unregister before the memory goes back to the allocator: a stale registration
            # over freed (and later reused) pages breaks every copy from them
            weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    if not ok:
        log.warning("could not pin every host bank (cudaHostRegister: %s); transfers from them will be "
                    "slower", ", ".join(sorted(errors)))
    return ok


def keeps_fp8(name: str, d: dict, keep: bool, dequant=()) -> bool:
    """Whether dense_weights keeps the quantized dense weight `name` (its meta["quant"]["dense"]
    entry d) as an Fp8BlockWeight: FP8 block, 2-D, the engine keeping dense FP8, and none of
    `name`'s dotted parts among `dequant` (a model class's DENSE_DEQUANT)."""
    return (keep and d["format"] == "fp8_block" and len(d["shape"]) == 2
            and not set(dequant).intersection(name.split(".")))


def dense_weights(meta: dict, tensors: dict, device, dtype, keep_fp32=(), keep_fp8: bool = False,
                  fp8_dequant=(), keep_bf16: bool = False, bf16_widen=()) -> dict:
    """The non-expert weights for the model, on `device`: floating ones cast to `dtype`, integer
    ones as they are, and those stored quantized (meta["quant"]["dense"]) dequantized with the
    quant.py reference (on the device) and cast to `dtype`; their scale tensors are consumed.
    keep_fp32: module names (a model class's KEEP_FP32, transformers' _keep_in_fp32_modules);
    a floating tensor with one of them among its dotted name's parts is loaded in fp32.
    keep_fp8: FP8 block weights stay as published, Fp8BlockWeight (dense_fp8.py; ue8m0 scales
    made fp32), for the model's linear() (model/linear.py), except those keeps_fp8 refuses
    (fp8_dequant: the model class's DENSE_DEQUANT). MXFP4 and NVFP4 dense weights are always
    dequantized here: no dense GEMM reads those formats in place yet (GPT-OSS publishes its dense
    weights in BF16; ModelOpt's NVFP4 releases would gain from one).
    keep_bf16 (a float32 dtype on the CPU, --dense-bf16): 2-D floating tensors stored in bf16 stay
    bf16, except those with one of `bf16_widen`'s names among their dotted parts (a model class's
    DENSE_WIDEN: read other than through linear(), lm_head() or an embedding gather, which widen
    a bf16 weight exactly where they read it)."""
    keep = set(keep_fp32)
    from .quant import dequant_fp8_block, dequant_mxfp4, dequant_nvfp4
    qd = (meta.get("quant") or {}).get("dense") or {}
    consumed = {d[k] for d in qd.values() for k in ("values", "scale", "scale_2") if d.get(k)}
    out = {}
    for name, d in qd.items():
        v = tensors[d["values"]].to(device)
        s = tensors[d["scale"]].to(device)
        fmt, shape = d["format"], d["shape"]
        if keeps_fp8(name, d, keep_fp8, fp8_dequant):
            if list(v.shape) != list(shape):
                raise CorruptModelError(f"weight {name}: its values are {list(v.shape)}, the header says {shape}; "
                                        "re-run `ft convert`")
            out[name] = Fp8BlockWeight(v, s, dtype, name)  # checks the scale's shape
            continue
        if fmt == "fp8_block":
            if s.dtype == torch.uint8:  # ue8m0 scales (DeepSeek-V4), kept as their bytes
                from .hf import e8m0_f32
                s = e8m0_f32(s)
            w = dequant_fp8_block(v, s)
        elif fmt == "mxfp4":
            w = dequant_mxfp4(v.reshape(*shape[:-1], shape[-1] // 2), s)
        elif fmt == "nvfp4":
            w = dequant_nvfp4(v, s, tensors[d["scale_2"]].to(device).float().reshape(()))
        else:
            raise UnsupportedModelError(f"weight {name} is stored as {fmt!r}, a format this FreeToken does "
                                        "not read; update FreeToken or re-run `ft convert`")
        out[name] = w.reshape(shape).to(dtype)
    for k, v in tensors.items():
        if k.startswith(("file/", "experts.")) or k in consumed:
            continue
        if k.endswith(KEEP_STORED_DTYPE) and v.is_floating_point():  # routing-precision tensors
            out[k] = v.to(device)
            continue
        if keep and v.is_floating_point() and keep.intersection(k.split(".")):
            out[k] = v.to(device, torch.float32)
            continue
        if (keep_bf16 and v.dtype == torch.bfloat16 and v.dim() == 2 and dtype == torch.float32
                and not set(bf16_widen).intersection(k.split("."))):
            out[k] = v.to(device)
            continue
        out[k] = v.to(device, dtype) if v.is_floating_point() else v.to(device)
    return out


# Tensors kept in the dtype they were stored in, whatever the compute dtype: the sigmoid
# routers' correction bias (DeepSeek-V3/V4, GLM-5) is an fp32 buffer in transformers and is
# added to fp32 scores; rounded to bf16 it can change which experts are chosen
KEEP_STORED_DTYPE = ("e_score_correction_bias",)
