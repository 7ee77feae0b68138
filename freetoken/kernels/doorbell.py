"""The GPU half of the CPU branch's doorbell (experts/cpu/hostcall.py, moe_cpu.cpp's Bell).

ring: one program on the main stream writes the call's inputs into the pinned buffers (x as
      f32, ids, gate weights as f32), the descriptor's address, fences at system scope, then
      the call's sequence number (a device counter it increments): the CPU thread spinning on
      it runs the call.
wait: one program on the side stream spins on the bell's `done` word until it reaches the
      counter, then copies the result back to a device buffer (volatile loads: the CPU wrote
      it). Gives up after `limit` polls (a CPU thread that never answers must not hang the
      GPU forever): it sets the bell's GAVE_UP word, which the branch checks after each step.
Both are fixed-shape and sync-free, so a captured graph replays them. The fences are PTX
(membar.sys) on the GPU and skipped by the CPU interpreter, whose memory is the host's.

References: `ring_reference` / `wait_reference` (the same protocol from Python), used where
Triton is missing and by the tests.
"""
from __future__ import annotations

import time

import torch

from . import HAS_TRITON, INTERPRET

SEQ, DESC, DONE, STOP, CALLS, GAVE_UP, ENTERED, IDLE_POLLS = range(8)  # int64 words of the bell (moe_cpu.cpp's struct Bell)
BLOCK = 1024


def ring_reference(x, ids, w, xb, ib, wb, counter, bell, desc: int) -> None:
    xb.view(-1).copy_(x.reshape(-1))
    ib.view(-1).copy_(ids.reshape(-1))
    wb.view(-1).copy_(w.reshape(-1))
    counter += 1
    bell[DESC] = desc
    bell[SEQ] = int(counter[0])


def wait_reference(counter, bell, ob, out, limit: float = 10.0) -> None:
    """Polls for at most `limit` seconds; on giving up, bell[GAVE_UP] = 1."""
    end = time.monotonic() + limit
    while int(bell[DONE]) < int(counter[0]):
        if time.monotonic() > end:
            bell[GAVE_UP] = 1
            break
    out.view(-1).copy_(ob.view(-1))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .rounding import emu, round_to

    @triton.jit
    def _fence(FENCE: tl.constexpr):
        if FENCE:  # every thread's stores before it reach the system before its later ones
            tl.inline_asm_elementwise("membar.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)

    @triton.jit
    def _put(src, dst, n, BLOCK: tl.constexpr):
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)  # [BLOCK]
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m).to(dst.dtype.element_ty), mask=m)

    @triton.jit
    def _ring_kernel(x, xb, nx, ids, ib, w, wb, nk, counter, bell, desc, FENCE: tl.constexpr,
                     BLOCK: tl.constexpr):
        _put(x, xb, nx, BLOCK)  # [T, H] -> f32 pinned
        _put(ids, ib, nk, BLOCK)  # [T, K] int64
        _put(w, wb, nk, BLOCK)  # [T, K] -> f32
        s = tl.load(counter) + 1
        # every warp holds the old count before any warp writes the new one: without this a late
        # warp can read the new count and store s + 1, so the count the wait kernel polls for can
        # pass the seq the CPU answers (the likely cause of the gave-up steps seen on the H200)
        tl.debug_barrier()
        tl.store(counter, s)
        tl.store(bell + 1, desc)
        _fence(FENCE)
        tl.debug_barrier()  # every thread fenced its stores: now the sequence number
        tl.store(bell, s)

    @triton.jit
    def _wait_kernel(counter, bell, ob, out, n, limit, FENCE: tl.constexpr, BLOCK: tl.constexpr,
                     EMU: tl.constexpr):
        s = tl.load(counter)
        d = tl.load(bell + 2, volatile=True)
        polls = 0
        while (d < s) & (polls < limit):
            d = tl.load(bell + 2, volatile=True)
            polls += 1
        if d < s:
            tl.store(bell + 5, 1)  # GAVE_UP: host memory, read by HostBranch.check without a sync
        _fence(FENCE)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)  # [BLOCK]
            m = offs < n
            v = tl.load(ob + offs, mask=m, volatile=True)  # [BLOCK] f32
            if EMU:  # a bf16 out under the interpreter, whose cast truncates: to nearest even, as on the GPU
                v = round_to(v, tl.bfloat16, True)
            tl.store(out + offs, v, mask=m)  # rounded to out's dtype (nearest even) by the store


def ring(x, ids, w, xb, ib, wb, counter, bell, desc: int) -> None:
    """x [T, H], ids [T, K] int64, w [T, K] (device) -> the pinned xb, ib, wb; counter [1]
    int64 (device) += 1; bell (pinned int64 [>=3]) gets desc, then the new count."""
    for t in (x, ids, w):
        assert t.is_contiguous()
    _ring_kernel[(1,)](x, xb, x.numel(), ids, ib, w, wb, ids.numel(), counter, bell, desc,
                       FENCE=not INTERPRET, BLOCK=BLOCK, num_warps=4)


def wait(counter, bell, ob, out, limit: int = 10_000_000) -> None:
    """Spin until bell[DONE] >= counter (at most `limit` polls, ~1 us each over PCIe), then
    out <- ob (pinned f32 [T, H] -> device; out f32, or the activations' 16-bit dtype, rounded
    to nearest even as .to() rounds: the caller's cast kernel folded in); bell[GAVE_UP] = 1 if
    it gave up."""
    _wait_kernel[(1,)](counter, bell, ob, out, out.numel(), limit, FENCE=not INTERPRET, BLOCK=BLOCK,
                       EMU=emu(out.dtype), num_warps=4)
