"""Host buffers for weight banks: page-aligned, and on transparent huge pages where the kernel
offers them.

The CPU expert executor streams whole experts from these buffers (one 2048 x 512 bf16 expert is
6.3 MB), and the GPU expert cache copies them over PCIe. On 4 KiB pages every page is a TLB
entry to walk for, and the hardware prefetchers stop at each page boundary, so a stream restarts
cold every 4 KiB (a 2048-wide bf16 row is exactly one page). 2 MiB pages remove both. Linux
gives them to an anonymous mapping that asks (`madvise(MADV_HUGEPAGE)`) when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise` (the common default);
`never` leaves 4 KiB pages and nothing else changes. The advice must come before the pages are
first touched: a fault in an advised range then takes a whole huge page.

FREETOKEN_HUGEPAGES=0 turns the advice off (an A/B switch for the benchmarks).
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

log = logging.getLogger("freetoken.weights")

PAGE = 4096
HUGE = 2 << 20  # x86-64 transparent huge page
MADV_HUGEPAGE = 14  # <sys/mman.h>; the same on every Linux architecture
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent huge page setting: always, madvise, never, or unavailable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unavailable"


def hugepages_wanted() -> bool:
    v = os.environ.get("FREETOKEN_HUGEPAGES", "1")
    if v not in ("0", "1"):
        from ..errors import FreeTokenError
        raise FreeTokenError(f"FREETOKEN_HUGEPAGES must be 0 or 1, got {v!r}")
    return v == "1" and thp_mode() in ("always", "madvise")


_libc = None


def _madvise(addr: int, length: int, advice: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0


def host_buffer(nbytes: int, align: int = PAGE, huge: bool | None = None) -> torch.Tensor:
    """An uninitialised uint8 tensor of nbytes rounded up to `align`, starting on an `align`
    boundary and owning its padding (pin_in_place registers whole pages). Buffers of 2 MiB or
    more start on a 2 MiB boundary and are advised onto huge pages (huge=None: unless
    FREETOKEN_HUGEPAGES=0 or the kernel has them off)."""
    padded = -(-max(nbytes, 1) // align) * align
    big = padded >= HUGE and (hugepages_wanted() if huge is None else huge)
    step = max(align, HUGE) if big else align
    raw = torch.empty(padded + step, dtype=torch.uint8)  # large: a fresh mmap, untouched
    skip = (-raw.data_ptr()) % step
    buf = raw[skip:skip + padded]
    if big:
        length = -(-padded // HUGE) * HUGE  # the advice covers whole huge pages ...
        length = min(length, raw.numel() - skip)  # ... inside the allocation
        length -= length % PAGE
        if not _madvise(buf.data_ptr(), length, MADV_HUGEPAGE):
            log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): 4 KiB pages", ctypes.get_errno())
    return buf


def host_tensor(shape, dtype: torch.dtype, huge: bool | None = None) -> torch.Tensor:
    """host_buffer viewed as an uninitialised tensor of `shape` and `dtype`."""
    el = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    return host_buffer(n * el, huge=huge)[:n * el].view(dtype).view(shape)


def _smaps_field(t: torch.Tensor, field: str) -> str | None:
    """The rest of the `field` line of /proc/self/smaps for the mapping that holds t's first
    byte, or None where smaps cannot be read."""
    addr = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head, _, rest = line.partition(" ")
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == field:
                    return rest.strip()
    except (OSError, ValueError):
        return None
    return None


def huge_bytes(t: torch.Tensor) -> int | None:
    """Bytes of t's mapping that sit on huge pages (AnonHugePages), or None where unknown. What
    the kernel gives: under memory fragmentation it may be few, advised or not."""
    v = _smaps_field(t, "AnonHugePages:")
    return None if v is None else int(v.split()[0]) * 1024


def advised(t: torch.Tensor) -> bool | None:
    """Whether t's mapping carries the huge-page advice (VmFlags "hg"), or None where unknown."""
    v = _smaps_field(t, "VmFlags:")
    return None if v is None else "hg" in v.split()
