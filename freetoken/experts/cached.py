"""CachedExpertExecutor: a pool of expert slots on the GPU that follows the router, its misses
split between copies into slots (fills) and in-place computation from the host banks (CPU).

Per MoE layer call (mechanisms 3-5 of the design):
  1. `control` (experts/control.py): dedup the routed experts, classify hits and misses, take
     q of the m misses to fill, r * m on average (r: the fill share, a device scalar; the
     fraction is carried between calls), pick
     the least-recently-used victims, rewrite each pair to its slot or to the CPU;
  2. the CPU branch is launched first: the pairs routed to the CPU run in place from the host
     banks on the C++ executor;
  3. the fills are copied from the host banks into their slots;
  4. the GPU experts run over the slot banks (the resident kernels, slot ids for expert ids);
  5. the two partial sums are added in one fixed order (CPU part, then GPU part).
The result equals the all-resident one up to the order of the sum, for any residency and any r.

Lookahead (`prefetch` > 0, decode only): the MoE layer also applies the next MoE layer's router
to its own input (the residual stream changes little from one layer to the next, so that router
mostly picks what the next layer will pick) and hands those predicted routes over with its call.
After this layer's GPU experts are enqueued, a peek control step (control.py: no clock tick, the
policy's state untouched, none of this call's slots evicted) admits up to `prefetch` of the
predicted misses (largest gate weight first; with "lfu" the highest count) and a side stream
copies them in, mostly while the link would otherwise idle: during the wait for the CPU branch,
the merge, and the next layer's attention and router (in a split step the copies also read host
memory beside the CPU branch). The next layer's call waits for those copies before its own
transfer, so its GPU experts find them as hits. A wrong prediction costs link time, host reads
and an eviction (perhaps of an expert the next layer routes to), never correctness: routes are
always the real router's.

A slot holds one expert in the form the host banks have it: dense banks in the compute dtype;
quantized banks (banks.QuantBank: fp8_block, mxfp4, nvfp4) as their published bytes, values,
scales and scale_2, a quarter of bf16's bytes for the 4-bit formats; the bias banks (GPT-OSS)
beside them. A fill copies every one of these tensors (kernels/expert_transfer.py), and the GPU
experts run the resident executor over the slots: for QuantBanks the kernels that dequantize
in registers (kernels/moe_quant.py), as the all-resident quantized path. The CPU branch reads
quantized banks in place too (the C++ kernels, through the descriptor's QPair).

Decode needs no host sync: the control kernel, the fused zero-copy transfer kernel driven by
the device-side fill list (kernels/expert_transfer.py) and the CPU branch in stream order
(the doorbell or a host-function node calling the C++ executor, experts/cpu/hostcall.py) are
all recorded in the step's CUDA graph. r is a device scalar: fixed with `--fill-share`, or
chosen from measured step times while serving (experts/share.py).
Prefill chunks go through the same steps in slices of at most MAX_PAIRS routed pairs, fill-only
(r = 1): a chunk touches most experts of a layer, and the CPU would be far slower on it.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from ..kernels.expert_transfer import transfer_reference, transfer_triton, zero_copy_ok
from ..kernels import use_triton
from .control import MAX_PAIRS, POLICIES, Residency, control, fill_cap, fill_pad, warm_up_control
from .executor import GRAPH_CAPTURE, SILU, Activation, ExpertExecutor, Pending, TorchExpertExecutor
from ..runtime import host_wait

log = logging.getLogger("freetoken.experts")


def bank_parts(*banks) -> list[torch.Tensor]:
    """Every tensor of the banks whose first dimension is the expert, in a fixed order: a dense
    bank itself, a QuantBank's values, scale (and scale_2), a bias bank; None skipped."""
    return [t for b in banks if b is not None for t in ([b] if isinstance(b, torch.Tensor) else b.tensors())]


def slot_bytes(gate_up, down, gate_up_bias=None, down_bias=None, dtype=torch.float32) -> int:
    """Bytes of one expert slot: dense gate_up and down rows in the compute dtype `dtype`, every
    tensor of a quantized bank and the bias rows in their own dtypes (what the slots hold)."""
    el = torch.empty((), dtype=dtype).element_size()

    def row(t, size):
        return t[0].numel() * size
    banks = sum(row(b, el) if isinstance(b, torch.Tensor) else sum(row(t, t.element_size()) for t in b.tensors())
                for b in (gate_up, down))
    return banks + sum(row(b, b.element_size()) for b in (gate_up_bias, down_bias) if b is not None)


def _slot_bank(host, slots: int, device, dtype):
    """Empty slots for one host bank (None: none): a dense bank in `dtype`; a QuantBank in the
    host's own dtypes, so that a fill copies its bytes unchanged."""
    def alloc(t, dt):
        return torch.zeros(slots, *t.shape[1:], dtype=dt, device=device)  # [S, ...]
    if host is None or isinstance(host, torch.Tensor):
        return None if host is None else alloc(host, dtype)
    return replace(host, values=alloc(host.values, host.values.dtype), scale=alloc(host.scale, host.scale.dtype),
                   scale_2=None if host.scale_2 is None else alloc(host.scale_2, host.scale_2.dtype))


SMALL_BANK = 16 << 20  # bytes: a bank under this is copied into pinned memory if it must be


def _readable_in_place(h: torch.Tensor) -> torch.Tensor:
    """h, or a pinned copy of it when the device cannot read it in place and it is small: pages
    are registered whole, so a bank under a page or not page-aligned (a quantized model's
    scale_2 bank is a few hundred bytes) stays unpinned, and one such bank would cost every
    fill a sync and the decode step its CUDA graph. A large unpinned bank is left as it is."""
    if h.device.type != "cpu" or (zero_copy_ok(h) and h.is_contiguous()) or h.numel() * h.element_size() > SMALL_BANK:
        return h
    return torch.empty(h.shape, dtype=h.dtype, pin_memory=True).copy_(h)


class SlotPool:
    """`slots` complete experts (every bank's rows of one flat id) on `device`, and where each
    flat id lives (control.Residency). Banks: dense tensors (slots in the compute dtype) or
    banks.QuantBanks (slots hold the published bytes: values, scales, scale_2), and the bias
    banks [N, 2I], [N, H] if the experts have them (slots in their dtype)."""

    def __init__(self, host_gate_up, host_down, slots: int, device, dtype, gate_up_bias=None, down_bias=None):
        n = host_gate_up.shape[0]
        if not 1 <= slots:
            raise ValueError("an expert cache needs at least one slot")
        self.host_gu, self.host_dn = host_gate_up, host_down
        self.gate_up = _slot_bank(host_gate_up, slots, device, dtype)  # [S, 2I, H] (or a QuantBank of S)
        self.down = _slot_bank(host_down, slots, device, dtype)  # [S, H, I]
        # bias slots in the banks' own dtype, as the resident executor reads them
        self.gate_up_bias = _slot_bank(gate_up_bias, slots, device, getattr(gate_up_bias, "dtype", None))  # [S, 2I]
        self.down_bias = _slot_bank(down_bias, slots, device, getattr(down_bias, "dtype", None))  # [S, H]
        # what a fill copies, host part -> slot part, every component of an expert
        self.banks_host = bank_parts(host_gate_up, host_down, gate_up_bias, down_bias)
        self.banks_slot = bank_parts(self.gate_up, self.down, self.gate_up_bias, self.down_bias)
        if self.banks_slot[0].is_cuda:  # small banks that could not be registered where they lie
            self.banks_host = [_readable_in_place(h) for h in self.banks_host]
        self.res = Residency.empty(n, slots, device)
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in self.banks_slot)
        # the fused zero-copy kernel reads pinned host banks in place from a CUDA device
        self.zero_copy = self.banks_slot[0].is_cuda and all(zero_copy_ok(h) and h.is_contiguous()
                                                            for h in self.banks_host)

    @property
    def slots(self) -> int:
        return self.banks_slot[0].shape[0]

    def transfer(self, fill_src: torch.Tensor, fill_dst: torch.Tensor) -> None:
        """Copy host rows fill_src[j] into slots fill_dst[j], every bank, for the entries before
        the first -1. The fused kernel when the device can read the host banks in place (one
        launch, no sync: capturable); else the reference copy (reads the count: one sync)."""
        if self.zero_copy:
            transfer_triton(self.banks_host, self.banks_slot, fill_src, fill_dst)
        else:
            transfer_reference(self.banks_host, self.banks_slot, fill_src, fill_dst)

    def copy_runs(self, runs: list[tuple[int, int, int]]) -> None:
        """Copy host experts [f, f + n) into slots [s, s + n) for each run (f, s, n), every bank,
        in the current stream (the streamed prefill's bulk copies)."""
        for f, s, n in runs:
            for host, slot in zip(self.banks_host, self.banks_slot):
                slot[s:s + n].copy_(host[f:f + n], non_blocking=True)  # [n, ...]


class CachedExpertExecutor(ExpertExecutor):
    name = "cache"
    backend = "gpu-cache"

    def __init__(self, host_gate_up, host_down, slots: int | None, device, dtype,
                 cpu: ExpertExecutor, fill_share: float | None = 1.0, policy: str = "recent",
                 layer_experts: int | None = None, start_share: float = 1.0, activation: Activation = SILU,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 prefetch: int = 0):
        """host_gate_up, host_down: the host banks, dense tensors or banks.QuantBanks of one format.
        slots None: allocated later (`allocate`), once the memory plan has sized the pool.
        layer_experts: experts per MoE layer (bounds the distinct experts of one call);
        start_share: where the adaptive split starts its climb (a measured profile's prediction).
        activation, gate_up_bias [N, 2I], down_bias [N, H]: the expert function (executor.py);
        the bias banks' rows travel into the slots with the rest of each expert. `cpu` runs the
        CPU branch over the same host banks and must compute the same function.
        prefetch: most experts a decode call copies in ahead for the next MoE layer, from the
        routes its caller predicts (`launch(..., ahead=)`); 0 turns the lookahead off."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.tuner = None
        if fill_share is None:  # adaptive: chosen from measured decode steps (experts/share.py)
            from .share import ShareTuner
            self.tuner, fill_share = ShareTuner(start=start_share), 1.0
        if not 0.0 <= fill_share <= 1.0:
            raise ValueError(f"the fill share must be in [0, 1], got {fill_share}")
        self.host_gate_up, self.host_down, self.dtype = host_gate_up, host_down, dtype
        self.quantized = not isinstance(host_gate_up, torch.Tensor)  # QuantBanks: slots hold their bytes
        self.activation, self.gate_up_bias, self.down_bias = activation, gate_up_bias, down_bias
        self.pool = self.gpu = None
        self.warm_control = True  # compile the control kernel's call sizes at allocate (the engine's --no-warm-up: off)
        self.cpu = cpu
        self.device = torch.device(device)
        self.policy = policy
        self.layer_experts = layer_experts
        # fill-only (r = 1): every miss is copied into a slot, none runs on the CPU, as long as
        # the pool holds one call's distinct experts (checked per call from static shapes)
        self.fill_only = fill_share >= 1.0 and self.tuner is None
        # whether decode steps carry the CPU branch: off at r = 1 (an empty branch still costs its
        # copies and host node per layer, ~10% of a step measured on the H200); the adaptive
        # split turns it on while r < 1, and the decode runner keeps a graph for each variant
        self.branch_on = fill_share < 1.0
        self.fill_share = torch.tensor([fill_share], dtype=torch.float32, device=device)  # r
        self._fill_only = torch.ones(1, dtype=torch.float32, device=device)
        if self.tuner is not None and not (self.device.type == "cuda" and self._host_ok(cpu)):
            # without the CPU branch in stream order, a split costs a host sync per layer: keep
            # fill-only rather than adapt (said once)
            log.info("expert cache: fill-only (the CPU branch cannot run in stream order here)")
            self.tuner, self.fill_only, self.branch_on = None, True, False
        # the CPU branch in stream order (capturable) where the C++ executor allows it
        from .cpu.hostcall import HostBranch
        self.host = HostBranch(cpu, device) if self.device.type == "cuda" and self._host_ok(cpu) else None
        self.threads = getattr(cpu, "threads", None)
        self.isa = getattr(cpu, "isa", None)
        # telemetry on the device (no sync per call; read by stats()):
        # calls, pairs, hits, fills, cpu_experts (distinct experts per call, summed)
        self._acc = torch.zeros(5, dtype=torch.int64, device=device)
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 experts, got {prefetch}")
        self.prefetch = int(prefetch)
        self._pf_policy = "lfu" if policy == "lfu" else "gate"  # predicted misses by gate weight; lfu keeps its victims
        self._pf_stream = None  # the lookahead's copies (CUDA): beside the step's own stream
        self._pf = None  # (copies-done event or None, the lookahead's control output) until the next call joins it
        self._acc_pf = torch.zeros(2, dtype=torch.int64, device=device)  # experts prefetched, of them routed next
        self._saved_r = None  # inside frozen(): r as serving chose it, while the device scalar holds 0
        if slots is not None:
            self.allocate(slots)

    @staticmethod
    def _host_ok(cpu) -> bool:
        from .cpu.hostcall import host_branch_ok
        return host_branch_ok(cpu)

    def observe_step(self, batch: int, seconds: float) -> None:
        """A decode step's measured wall time (the serving loop reports each one): a failed CPU
        call is raised here (a replayed graph cannot raise it); the adaptive split updates r,
        a device scalar, and says which graph variant the next step needs."""
        if self.host is not None:
            self.host.check()
        if self.tuner is not None:
            r = self.tuner.observe(batch, seconds)
            if r is not None:
                self.fill_share.fill_(r)
                self.branch_on = r < 1.0

    def check_branch(self) -> None:
        """Raise if a stream-ordered CPU branch call failed (a replayed graph cannot raise it):
        after each decode step that observe_step does not see (steps between a prompt's layers,
        inside a streamed pass every miss runs on the CPU)."""
        if self.host is not None:
            self.host.check()

    def graph_variant(self) -> str:
        """Which decode graph the current split needs (the decode runner keys graphs by it):
        frozen with the lookahead on is a graph of its own (one without the lookahead's copies)."""
        if self.is_frozen and self.prefetch:
            return "frozen"
        return "split" if self.branch_on else "fill-only"

    @property
    def runs_cpu_branch(self) -> bool:
        """Whether a decode step now runs some of its misses on the host (runtime/host_wait.py):
        a split (r < 1, or frozen inside a streamed pass), or fill-only with a pool smaller than
        a layer's distinct experts (_call's rule), with a host executor behind it."""
        if self.cpu is None or getattr(self.cpu, "name", None) != "cpu":
            return False
        small = self.pool is not None and self.layer_experts and self.pool.slots < self.layer_experts
        return bool(self.branch_on or self.is_frozen or small)

    @property
    def is_frozen(self) -> bool:
        """Inside frozen(): decode steps while a streamed prefill pass holds the pool."""
        return self._saved_r is not None

    @contextmanager
    def frozen(self):
        """Decode calls that leave the slots alone (issue 11: decode steps between the layers of
        a streamed prefill pass, whose layer buffers are slots of this pool and whose copies land
        in free slots on a stream of their own). Inside it r = 0, so no miss is filled and no
        slot evicted: hits are read where they lie, every miss runs on the CPU, and the
        lookahead copies nothing. The residency the calls read is the one the pass published at
        its start (experts/stream.py LayerStreamer.begin: its regions and the free slots it
        fills read as empty), and nothing they write (stamps, the clock) changes where an expert
        lies. The device scalar r is restored after: a graph captured for this variant reads it
        at replay, so the same graph serves every pass."""
        self._saved_r, saved_branch = self.fill_share.clone(), self.branch_on  # stats() reports it meanwhile
        self.fill_share.zero_()
        self.branch_on = True
        try:
            yield self
        finally:
            self.fill_share.copy_(self._saved_r)
            self._saved_r, self.branch_on = None, saved_branch

    @property
    def num_experts(self) -> int:
        return self.host_gate_up.shape[0]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (one expert, every bank: dense ones in the compute dtype, quantized
        ones' values, scales and scale_2 and the bias rows as published): what the plan sizes."""
        return slot_bytes(self.host_gate_up, self.host_down, self.gate_up_bias, self.down_bias, self.dtype)

    @property
    def capturable(self) -> bool:
        """A decode step records into a CUDA graph when nothing in it syncs: the transfer kernel
        reads the host banks in place, and the CPU branch (if any) runs in stream order through a
        host-function node (experts/cpu/hostcall.py)."""
        if self.pool is None or not self.pool.zero_copy:
            return False
        if self.host is not None:
            return True
        # fill-only without the stream-ordered branch: a pool too small for one call's distinct
        # experts would send misses to the eager CPU path (a sync) inside the capture
        return self.fill_only and self.pool.slots >= (self.layer_experts or self.pool.slots + 1)

    def allocate(self, slots: int) -> None:
        """The slot pool (once): `slots` experts, at most all of them."""
        if self.pool is None:
            self.pool = SlotPool(self.host_gate_up, self.host_down, min(slots, self.num_experts), self.device,
                                 self.dtype, self.gate_up_bias, self.down_bias)
            if self.layer_experts:  # "lfu": a halving every 64 decode steps (one clock tick per MoE layer call)
                self.pool.res.half = 64 * max(1, self.num_experts // self.layer_experts)
            self.gpu = self.slot_executor()  # expert ids = slot ids
            if self.prefetch and self.device.type == "cuda":  # made here, never inside a graph capture
                self._pf_stream = torch.cuda.Stream(self.device)
            if self.warm_control and use_triton(self.pool.res.slot_of):  # CUDA with Triton
                self._warm_up_control()

    def _warm_up_control(self) -> None:
        """The control kernel's prefill variants compiled now, at load (control.warm_up_control),
        not inside the first prompts; a variant that fails to compile fails its real call too,
        which then says so in a request: here only a warning."""
        t0 = time.perf_counter()
        try:
            warmed = warm_up_control(self.pool.res.slot_of.numel(), self.pool.slots, self.device, self.policy,
                                     self.dtype, layer_experts=self.layer_experts)
            torch.cuda.synchronize(self.device)
            log.info("expert cache control kernel compiled for %d call sizes (up to %d pairs) in %.1f s",
                     len(warmed), warmed[-1], time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize(self.device)  # a broken CUDA context is an error here, not a warning
            log.warning("expert cache control kernel warm-up failed: %s", str(e).splitlines()[0] if str(e) else e)

    def slot_executor(self, layer_experts: int | None = None) -> TorchExpertExecutor:
        """The resident executor over the slot banks (slot ids for expert ids): the bf16 kernels
        for dense slots, the quantized ones (kernels/moe_quant.py) for QuantBank slots, the bias
        slots beside them."""
        p = self.pool
        return TorchExpertExecutor(p.gate_up, p.down, layer_experts=layer_experts, activation=self.activation,
                                   gate_up_bias=p.gate_up_bias, down_bias=p.down_bias)

    def launch(self, x, ids, weights, layer: int = 0, phase: str = "decode", ahead=None) -> Pending:
        """ahead: (ids [T, k'], weights [T, k']) the next MoE layer's predicted routes (flat ids of
        that layer), for the lookahead (decode, prefetch > 0); None: none."""
        if self.pool is None:
            raise RuntimeError("the expert cache has no slots yet: allocate() comes with the memory plan")
        t, k = ids.shape
        step = max(1, MAX_PAIRS // k)  # tokens per control call
        if step >= 8:  # a multiple of 8 tokens: each slice's ids and bf16 weights start 16-byte aligned,
            step -= step % 8  # as the warmed variants assume (else Triton compiles another in a request)
        if self.is_frozen and phase != "decode":
            raise RuntimeError("only decode calls may run while the expert cache is frozen (a streamed pass)")
        share = self.fill_share if phase == "decode" else self._fill_only
        fill_only = not self.branch_on or phase != "decode"
        if phase != "decode" or not self.prefetch or t > step or self.is_frozen:
            ahead = None
        if t <= step:  # the CPU branch's wait and the merge come with finish: after the shared expert
            return Pending(join=self._call(x, ids, weights, layer, phase, share, fill_only, ahead))
        # each slice joined before the next is enqueued: the doorbell has one ring, and slices of
        # one shape share the branch's buffers (a later ring would overwrite an unread one)
        return Pending(out=torch.cat([self._call(x[s:s + step], ids[s:s + step], weights[s:s + step], layer, phase,
                                                 share, fill_only, ahead)() for s in range(0, t, step)]))

    def _call(self, x, ids, weights, layer, phase, share, fill_only, ahead=None):
        """Enqueue one slice's control step, CPU branch, fills and GPU experts -> a function that
        joins the CPU branch and returns the merged [T, H]. Called later (Pending.join), the
        shared expert's kernels are enqueued between: the GPU computes them while the host works
        on its share, instead of after the wait."""
        ids = ids.to(self.device)
        weights = weights.to(self.device)
        n, bounds = ids.numel(), (self.layer_experts, self.pool.slots)
        # the fill list as long as this call can fill (the transfer runs over it), padded per pair
        # bucket: the kernel variants warm_up_control compiled. The call's ids are one layer's
        # (every MoE block calls once per layer), so its distinct misses are at most layer_experts
        # the call's counts go to the statistics in the same launch (acc)
        ctl = control(ids, weights, self.pool.res, share, fill_cap(n, *bounds), self.policy, k_pad=fill_pad(n, *bounds),
                      acc=self._acc)
        # at r = 1 a miss runs on the CPU only when the pool cannot hold the call's distinct
        # experts (fewer slots than pairs, a tiny pool): then the CPU branch must run
        cpu_branch = not fill_only or self.pool.slots < min(ids.numel(), self.layer_experts or ids.numel())
        staged = forked = None
        if cpu_branch and self.host is not None and phase == "decode":  # in stream order (graph-capturable)
            forked = self.host.enqueue(x, ctl.cpu_route, weights)  # ids where the route is CPU, else NO_EXPERT
        elif cpu_branch:  # the CPU branch's inputs cross first, so its work overlaps the GPU's
            staged = [t.to("cpu", non_blocking=True) for t in (x, ctl.cpu_route, weights)]
            # the host waits for these inputs below: asleep, off the cores the CPU branch needs
            ready = torch.cuda.Event(blocking=host_wait.blocks(True)) if self.device.type == "cuda" else None
            if ready is not None:
                ready.record()
        self._join_prefetch(ids)  # the last call's lookahead copies land before this call's copies and reads
        self.pool.transfer(ctl.fill_src, ctl.fill_dst)
        # int64 slots, as the all-resident path's router ids: Triton's autotuner keys its choice on
        # every tensor argument's dtype, so int32 routes (one copy kernel a layer less) got a tiling
        # of their own, a different fp32 summation order, and fill-only decode drifted from
        # all-resident by bf16 roundings (test_expert_cache_gpu's exact test failed on an H100)
        gpu = self.gpu.run(x.to(self.device), ctl.route.long(), weights, phase)  # CPU / NO_EXPERT pairs skipped
        if ahead is not None:  # after this call's reads of its slots are enqueued: they may be evicted now
            self._prefetch(*ahead)
        src = x.device

        def join() -> torch.Tensor:
            out = gpu
            if forked is not None:
                self.host.join()
                # the doorbell's wait kernel already rounded the CPU part to gpu's dtype
                out = forked.to(out.dtype) + out  # one fixed order: CPU part first
            if staged is not None:
                if ready is not None:
                    ready.synchronize()  # inputs on the host; the transfer and GPU experts run meanwhile
                part = self.cpu.finish(self.cpu.launch(*staged, layer, phase))
                out = part.to(out.device, out.dtype, non_blocking=True) + out  # one fixed order: CPU part first
            return out.to(src)
        return join

    def _prefetch(self, ids, weights) -> None:
        """Admit up to `prefetch` of the predicted experts that miss (largest gate weight first)
        and copy them into their slots: on CUDA on a side stream that starts once this call's GPU
        experts are enqueued (the copies overwrite evicted slots only after those reads), joined
        by the next call. Residency is updated here, in stream order with every control step."""
        ids, weights = ids.to(self.device), weights.to(self.device)
        # a peek: the policy's state (clock, seen, lfu counts) stays what the real routes made it,
        # and no slot this call just used is evicted
        ctl = control(ids, weights, self.pool.res, self._fill_only, self.prefetch, self._pf_policy, peek=True)
        done = None
        if self._pf_stream is not None:
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(self._pf_stream):
                self._pf_stream.wait_event(ready)
                self.pool.transfer(ctl.fill_src, ctl.fill_dst)
                done = torch.cuda.Event()
                done.record()
            if not torch.cuda.is_current_stream_capturing():  # a graph's buffers live as long as the graph
                for t in (ctl.fill_src, ctl.fill_dst):
                    t.record_stream(self._pf_stream)  # not reused before the side stream is done with them
        else:
            self.pool.transfer(ctl.fill_src, ctl.fill_dst)
        self._acc_pf[0:1].add_(ctl.n_fill.to(torch.int64))
        self._pf = (done, ctl)  # ctl's buffers stay referenced until the copies are joined

    def drop_lookahead(self) -> None:
        """Forget lookahead copies left pending by a step that did not finish (an exception, a
        failed graph capture: their event may belong to a capture that no longer exists). The
        copies' buffers were handed to the side stream (record_stream), so dropping them is safe."""
        self._pf = None

    def _join_prefetch(self, ids) -> None:
        """Order the last lookahead's copies before what follows on this stream, and count how
        many of the experts it brought in this call routes to (the prediction's accuracy)."""
        if self._pf is None:
            return
        done, ctl = self._pf
        self._pf = None
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        src = ctl.fill_src.view(1, -1).long()  # [1, K]; -1 past the fills
        routed = ((ids.reshape(-1, 1) == src) & (src >= 0)).any(0).sum()  # distinct prefetched experts routed
        self._acc_pf[1:2].add_(routed.reshape(1))

    def stats(self) -> dict:
        with GRAPH_CAPTURE:  # reads device memory: never while another thread captures a graph
            return self._stats()

    def _stats(self) -> dict:
        calls, pairs, hits, fills, cpu_experts = self._acc.tolist()
        out = {"calls": calls, "pairs": pairs, "hits": hits, "fills": fills, "cpu_experts": cpu_experts}
        pre = 0
        if self.prefetch:  # the lookahead's copies (beside the layers' own fills) and how many the next layer used
            pre, used = self._acc_pf.tolist()
            out.update(prefetch=self.prefetch, prefetched=pre, prefetch_used=used,
                       prefetch_accuracy=round(used / pre, 4) if pre else None)
        if self.pool is None:
            return out
        res = self.pool.res
        return {**out, "slots": self.pool.slots, "slots_used": int((res.id_of >= 0).sum()),
                "bytes_moved": (fills + pre) * self.pool.slot_bytes,
                "fill_share": float(self.fill_share if self._saved_r is None else self._saved_r),
                "frozen": int(self.is_frozen),  # 1 while a streamed prefill pass holds the slots
                "fill_share_adaptive": int(self.tuner is not None),
                "fill_share_decisions": self.tuner.decisions if self.tuner is not None else 0,
                # climbs started because steps became slower than when r was chosen (share.py's watch)
                "fill_share_drifts": self.tuner.drifts if self.tuner is not None else 0,
                "transfer": "zero-copy kernel" if self.pool.zero_copy else "copy (one sync per layer)",
                "cpu_branch": "stream-ordered host node" if self.host is not None else "eager (one sync per layer)",
                **(self.host.stats() if self.host is not None else {}),
                "hit_rate": round(hits / max(1, hits + fills + cpu_experts), 4)}
