"""Fused expert transfer: copy the experts of a fill list from the host banks into their slots.

One fixed-shape launch per MoE layer call copies every bank of the experts the control step
chose to fill (experts/control.py: fill_src [K] flat ids, fill_dst [K] slots, -1 past the
fill count). The grid is (K, blocks of one expert over all banks); a program whose fill
entry is -1 reads and writes nothing, so the launch needs no host-side count: no sync, and it
can be recorded in a CUDA graph. A bank is any tensor with the expert as its first dimension:
dense gate_up and down (cast to the slot dtype on the way), or a quantized expert's published
tensors (values, scales, NVFP4's scale_2) and bias banks, copied as their bits (as_bits);
up to MAX_BANKS banks per launch (every layout FTW has fits one).

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
MAX_BANKS = 8  # banks one launch takes: values, scales, scale_2 of gate_up and down, two bias banks


def as_bits(host: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bank whose slots keep the host's dtype (a quantized expert's values, scales, scale_2, a
    bias bank; a dense bank already in the compute dtype) as integers of the same width (same
    storage, no copy): the copy moves its bits, never converts a value (fp8 NaN codes, NaN
    payloads). A dense bank cast to another slot dtype stays as it is."""
    if host.dtype != slot.dtype or not host.dtype.is_floating_point:
        return host, slot
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[host.element_size()]
    return host.view(bits), slot.view(bits)


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
        host, slot = as_bits(host, slot)
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
    def _bank_blocks(h, d, e, s, b, LO: tl.constexpr, HI: tl.constexpr, ROW: tl.constexpr,
                     BLOCK: tl.constexpr, live):
        """Program block b copies its part of the bank whose blocks are [LO, HI) of the grid."""
        if (b >= LO) & (b < HI):
            _copy_bank(h, d, e, s, b - LO, ROW, BLOCK, live)

    @triton.jit
    def _transfer_kernel(src_ids_ptr, dst_slots_ptr,  # [K] int32 fill list (-1 past the count)
                         h0, d0, h1, d1, h2, d2, h3, d3, h4, d4, h5, d5, h6, d6, h7, d7,  # host, slot banks
                         R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,  # row elements
                         R4: tl.constexpr, R5: tl.constexpr, R6: tl.constexpr, R7: tl.constexpr,
                         E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr,  # block ends
                         E4: tl.constexpr, E5: tl.constexpr, E6: tl.constexpr, E7: tl.constexpr,
                         B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr,  # block sizes
                         B4: tl.constexpr, B5: tl.constexpr, B6: tl.constexpr, B7: tl.constexpr,
                         NBANKS: tl.constexpr):
        j = tl.program_id(0)
        b = tl.program_id(1)  # bank 0's blocks [0, E0), bank 1's [E0, E1), ...
        e = tl.load(src_ids_ptr + j).to(tl.int64)
        s = tl.load(dst_slots_ptr + j).to(tl.int64)
        live = (e >= 0) & (s >= 0)
        e = tl.maximum(e, 0)
        s = tl.maximum(s, 0)
        _bank_blocks(h0, d0, e, s, b, 0, E0, R0, B0, live)
        if NBANKS > 1:  # banks past NBANKS are compiled out
            _bank_blocks(h1, d1, e, s, b, E0, E1, R1, B1, live)
        if NBANKS > 2:
            _bank_blocks(h2, d2, e, s, b, E1, E2, R2, B2, live)
        if NBANKS > 3:
            _bank_blocks(h3, d3, e, s, b, E2, E3, R3, B3, live)
        if NBANKS > 4:
            _bank_blocks(h4, d4, e, s, b, E3, E4, R4, B4, live)
        if NBANKS > 5:
            _bank_blocks(h5, d5, e, s, b, E4, E5, R5, B5, live)
        if NBANKS > 6:
            _bank_blocks(h6, d6, e, s, b, E5, E6, R6, B6, live)
        if NBANKS > 7:
            _bank_blocks(h7, d7, e, s, b, E6, E7, R7, B7, live)


def transfer_triton(banks_host: list[torch.Tensor], banks_slot: list[torch.Tensor],
                    fill_src: torch.Tensor, fill_dst: torch.Tensor) -> None:
    """The fused kernel over any number of banks (dense gate_up and down; a quantized expert's
    values, scales and scale_2, bias banks): one launch per MAX_BANKS banks, no host sync.
    A bank of the slots' own dtype is copied as its bits (as_bits); a dense bank is cast to its
    slot's dtype."""
    assert len(banks_host) == len(banks_slot) > 0
    pairs = [as_bits(h, s) for h, s in zip(banks_host, banks_slot)]
    for at in range(0, len(pairs), MAX_BANKS):
        group = pairs[at:at + MAX_BANKS]
        _launch([h for h, _ in group], [s for _, s in group], fill_src, fill_dst)


def _launch(host: list[torch.Tensor], slot: list[torch.Tensor], fill_src, fill_dst) -> None:
    rows = [h[0].numel() for h in host]
    for h, s, r in zip(host, slot, rows):
        assert h.is_contiguous() and s.is_contiguous() and s[0].numel() == r, "banks: contiguous, same rows"
    # 1-byte banks (fp4 pairs, fp8, e8m0 scales) take twice the elements: 16 KiB a program too
    blocks = [BLOCK if h.element_size() > 1 else 2 * BLOCK for h in host]
    ends, total = [], 0
    for r, blk in zip(rows, blocks):
        total += triton.cdiv(r, blk)
        ends.append(total)
    pad = MAX_BANKS - len(host)  # unused pointer slots repeat bank 0; their code is compiled out
    ptrs = [t for h, s in zip(host + host[:1] * pad, slot + slot[:1] * pad) for t in (h, s)]
    const = {**{f"R{i}": v for i, v in enumerate(rows + [1] * pad)},
             **{f"E{i}": v for i, v in enumerate(ends + [total] * pad)},
             **{f"B{i}": v for i, v in enumerate(blocks + [BLOCK] * pad)}}
    _transfer_kernel[(fill_src.numel(), total)](fill_src, fill_dst, *ptrs, NBANKS=len(host), **const,
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
