"""Fused expert transfer: copy the experts of a fill list from the host banks into their slots.

One fixed-shape launch per MoE layer call copies every bank of the experts the control step
chose to fill (experts/control.py: fill_src [K] flat ids, fill_dst [K] slots, -1 past the
fill count). The grid is (K, blocks of one expert over all banks); a program whose fill
entry is -1 reads and writes nothing, so the launch needs no host-side count: no sync, and it
can be recorded in a CUDA graph.

The host banks are pinned host memory (cudaHostRegister'd FTW buffers or pinned copies): on a
system with unified addressing the device reads them in place over PCIe (zero-copy), so the
kernel's loads are the transfer; no staging copy, no copy engine per expert. Each program
moves one contiguous block of one expert's rows of one bank (coalesced 16-byte loads).

Reference: `transfer_reference` (index_select + copy per bank, with a host sync for the
count), also the path without Triton or CUDA.
"""
from __future__ import annotations

import torch

from . import HAS_TRITON

BLOCK = 8192  # elements per program: 16 KiB of bf16, enough bytes in flight per SM over PCIe


def transfer_reference(banks_host: list[torch.Tensor], banks_slot: list[torch.Tensor],
                       fill_src: torch.Tensor, fill_dst: torch.Tensor) -> int:
    """Copy host rows fill_src[j] -> slot rows fill_dst[j] of every bank, for the entries up to
    the first -1. Returns how many experts it copied (reads the list on the host: one sync)."""
    src = fill_src.long().cpu()
    n = int((src >= 0).cumprod(0).sum())  # the list is -1 past the fill count
    if n == 0:
        return 0
    src = src[:n]
    dst = fill_dst[:n].long().to(banks_slot[0].device)
    for host, slot in zip(banks_host, banks_slot):
        rows = host.index_select(0, src.to(host.device))  # [n, ...] (pinned source: a DMA copy)
        slot[dst] = rows.to(slot.device, slot.dtype, non_blocking=True)
    return n


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_bank(src_ptr, dst_ptr, e, s, b, ROW: tl.constexpr, BLOCK: tl.constexpr, live):
        """Block b of expert e's rows of one bank (ROW elements) -> the same block of slot s."""
        offs = b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        # the scalar flag broadcast by hand: the CPU interpreter refuses a (scalar & block) mask
        m = (offs < ROW) & (tl.zeros([BLOCK], tl.int32) + live.to(tl.int32) > 0)
        v = tl.load(src_ptr + e * ROW + offs, mask=m)
        tl.store(dst_ptr + s * ROW + offs, v.to(dst_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _transfer_kernel(src_ids_ptr, dst_slots_ptr,  # [K] int32 fill list (-1 past the count)
                         h0, d0, h1, d1,  # host bank and slot bank pointers, two banks
                         ROW0: tl.constexpr, ROW1: tl.constexpr, NB0: tl.constexpr, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        b = tl.program_id(1)  # [0, NB0): bank 0's blocks, then bank 1's
        e = tl.load(src_ids_ptr + j).to(tl.int64)
        s = tl.load(dst_slots_ptr + j).to(tl.int64)
        live = (e >= 0) & (s >= 0)
        e = tl.maximum(e, 0)
        s = tl.maximum(s, 0)
        if b < NB0:
            _copy_bank(h0, d0, e, s, b, ROW0, BLOCK, live)
        else:
            _copy_bank(h1, d1, e, s, b - NB0, ROW1, BLOCK, live)


def transfer_triton(banks_host: list[torch.Tensor], banks_slot: list[torch.Tensor],
                    fill_src: torch.Tensor, fill_dst: torch.Tensor) -> None:
    """The fused kernel over two banks (gate_up, down): one launch, no host sync."""
    assert len(banks_host) == 2 == len(banks_slot), "two banks: gate_up and down"
    rows = [h[0].numel() for h in banks_host]
    for h, s, r in zip(banks_host, banks_slot, rows):
        assert h.is_contiguous() and s.is_contiguous() and s[0].numel() == r, "banks: contiguous, same rows"
    nb0, nb1 = (triton.cdiv(r, BLOCK) for r in rows)
    k = fill_src.numel()
    _transfer_kernel[(k, nb0 + nb1)](fill_src, fill_dst, banks_host[0], banks_slot[0], banks_host[1],
                                     banks_slot[1], ROW0=rows[0], ROW1=rows[1], NB0=nb0, BLOCK=BLOCK,
                                     num_warps=4)


def zero_copy_ok(t: torch.Tensor) -> bool:
    """Whether the device can read host tensor t in place: pinned host memory (allocated pinned,
    or registered with cudaHostRegister: the FTW banks, views into page-aligned buffers) on a
    CUDA machine with unified addressing, where its device address is its host address."""
    if not (HAS_TRITON and torch.cuda.is_available()) or t.device.type != "cpu":
        return False
    return device_address(t.data_ptr()) == t.data_ptr()


def device_address(ptr: int) -> int | None:
    """The device address of host address ptr, if the driver maps it (cuPointerGetAttribute,
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER), else None. Asked of the driver rather than through
    Tensor.is_pinned(), which looks at the start of the tensor's storage: a registered view
    into a larger buffer reads as not pinned there."""
    import ctypes

    from .cuda_driver import driver_fn
    get_attr = driver_fn("cuPointerGetAttribute", [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64])
    if get_attr is None:
        return None
    torch.cuda.init()  # the driver call needs the primary context current
    torch.cuda.current_stream()
    out = ctypes.c_uint64(0)
    err = get_attr(ctypes.byref(out), 3, ptr)  # 3: CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    return int(out.value) if err == 0 else None


def copy_flat_reference(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst <- src (same number of elements, cast to dst's dtype); the path without Triton."""
    dst.view(-1).copy_(src.reshape(-1), non_blocking=True)


COPY_BLOCK = 1024


if HAS_TRITON:
    @triton.jit
    def _copy_flat_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        m = offs < n
        v = tl.load(src_ptr + offs, mask=m)
        tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=m)


def copy_flat(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst <- src by the GPU's own loads and stores, where either side may be pinned host memory
    read or written in place (zero-copy). Why not cudaMemcpyAsync: a copy-engine transfer
    between host and device queues behind the zero-copy fill kernel's PCIe reads, so the CPU
    expert branch's small staging copies waited for the whole fill, serializing the two
    (bench/split_overlap.py); SM loads and stores interleave with it instead. Both contiguous,
    same element count; capturable (no sync)."""
    assert src.is_contiguous() and dst.is_contiguous() and src.numel() == dst.numel()
    n = src.numel()
    _copy_flat_kernel[(triton.cdiv(n, COPY_BLOCK),)](src, dst, n, BLOCK=COPY_BLOCK, num_warps=4)
