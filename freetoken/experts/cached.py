"""CachedExpertExecutor: a pool of expert slots on the GPU that follows the router, its misses
split between copies into slots (fills) and in-place computation from the host banks (CPU).

Per MoE layer call (mechanisms 3-5 of the design):
  1. `control` (experts/control.py): dedup the routed experts, classify hits and misses, take
     q = clamp(round(m * r), 1, m) misses to fill (r: the fill share, a device scalar), pick
     the least-recently-used victims, rewrite each pair to its slot or to the CPU;
  2. the CPU branch is launched first: the pairs routed to the CPU run in place from the host
     banks on the C++ executor;
  3. the fills are copied from the host banks into their slots;
  4. the GPU experts run over the slot banks (the resident kernels, slot ids for expert ids);
  5. the two partial sums are added in one fixed order (CPU part, then GPU part).
The result equals the all-resident one up to the order of the sum, for any residency and any r.

What is still to come (the expert-cache issue): the fused zero-copy transfer kernel driven by
the device-side fill list (today the copy syncs once per layer to read the fill count), the
CPU branch inside the decode graph, and r adapted to bandwidths measured while serving; until
then r is fixed (`--fill-share`) and decode runs eagerly with this executor.
Prefill chunks go through the same steps in slices of at most MAX_PAIRS routed pairs, fill-only
(r = 1): a chunk touches most experts of a layer, and the CPU would be far slower on it.
"""
from __future__ import annotations

import torch

from .control import CPU, MAX_PAIRS, POLICIES, Residency, control
from .executor import NO_EXPERT, ExpertExecutor, Pending, TorchExpertExecutor


class SlotPool:
    """`slots` complete experts (every bank's rows of one flat id) on `device`, and where each
    flat id lives (control.Residency)."""

    def __init__(self, host_gate_up: torch.Tensor, host_down: torch.Tensor, slots: int, device, dtype):
        n, two_i, h = host_gate_up.shape
        if not 1 <= slots:
            raise ValueError("an expert cache needs at least one slot")
        self.host_gu, self.host_dn = host_gate_up, host_down
        self.gate_up = torch.zeros(slots, two_i, h, dtype=dtype, device=device)  # [S, 2I, H]
        self.down = torch.zeros(slots, h, host_down.shape[2], dtype=dtype, device=device)  # [S, H, I]
        self.res = Residency.empty(n, slots, device)
        self.slot_bytes = (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()
        self.bytes_moved = 0

    @property
    def slots(self) -> int:
        return self.gate_up.shape[0]

    def transfer(self, fill_src: torch.Tensor, fill_dst: torch.Tensor, n_fill: torch.Tensor) -> int:
        """Copy host rows fill_src[:n] into slots fill_dst[:n], every bank. Reads the count (one
        sync per layer); the device-list-driven copy kernel removes it."""
        n = int(n_fill)
        if n == 0:
            return 0
        src = fill_src[:n].long().cpu()
        dst = fill_dst[:n].long()
        dev = self.gate_up.device
        for host, slot in ((self.host_gu, self.gate_up), (self.host_dn, self.down)):
            rows = host.index_select(0, src)  # [n, ...] on the host (pinned banks: a DMA-able source)
            slot[dst] = rows.to(dev, slot.dtype, non_blocking=True)
        self.bytes_moved += n * self.slot_bytes
        return n


class CachedExpertExecutor(ExpertExecutor):
    name = "cache"
    backend = "gpu-cache"
    capturable = False  # the transfer reads its count on the host; the CPU branch is eager

    def __init__(self, host_gate_up: torch.Tensor, host_down: torch.Tensor, slots: int | None, device, dtype,
                 cpu: ExpertExecutor, fill_share: float = 1.0, policy: str = "recent"):
        """slots None: allocated later (`allocate`), once the memory plan has sized the pool."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not 0.0 <= fill_share <= 1.0:
            raise ValueError(f"the fill share must be in [0, 1], got {fill_share}")
        self.host_gate_up, self.host_down, self.dtype = host_gate_up, host_down, dtype
        self.pool = self.gpu = None
        self.cpu = cpu
        self.device = torch.device(device)
        self.policy = policy
        self.fill_share = torch.tensor([fill_share], dtype=torch.float32, device=device)  # r
        self._fill_only = torch.ones(1, dtype=torch.float32, device=device)
        self.threads = getattr(cpu, "threads", None)
        self.isa = getattr(cpu, "isa", None)
        self.counts = {"calls": 0, "pairs": 0, "hits": 0, "fills": 0, "cpu_experts": 0}
        if slots is not None:
            self.allocate(slots)

    @property
    def num_experts(self) -> int:
        return self.host_gate_up.shape[0]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (one expert, every bank) in the compute dtype."""
        el = torch.empty((), dtype=self.dtype).element_size()
        return (self.host_gate_up[0].numel() + self.host_down[0].numel()) * el

    def allocate(self, slots: int) -> None:
        """The slot pool (once): `slots` experts, at most all of them."""
        if self.pool is None:
            self.pool = SlotPool(self.host_gate_up, self.host_down, min(slots, self.num_experts), self.device,
                                 self.dtype)
            self.gpu = TorchExpertExecutor(self.pool.gate_up, self.pool.down)  # expert ids = slot ids

    def launch(self, x, ids, weights, layer: int = 0, phase: str = "decode") -> Pending:
        if self.pool is None:
            raise RuntimeError("the expert cache has no slots yet: allocate() comes with the memory plan")
        t, k = ids.shape
        step = max(1, MAX_PAIRS // k)  # tokens per control call
        share = self.fill_share if phase == "decode" else self._fill_only
        outs = [self._call(x[s:s + step], ids[s:s + step], weights[s:s + step], layer, phase, share)
                for s in range(0, t, step)]
        return Pending(out=outs[0] if len(outs) == 1 else torch.cat(outs))

    def _call(self, x, ids, weights, layer, phase, share) -> torch.Tensor:
        ids = ids.to(self.device)
        weights = weights.to(self.device)
        ctl = control(ids, weights, self.pool.res, share, ids.numel(), self.policy)
        cpu_ids = torch.where(ctl.route == CPU, ids, torch.full_like(ids, NO_EXPERT))
        cpu = self.cpu.launch(x, cpu_ids, weights, layer, phase)  # the CPU branch first
        self.pool.transfer(ctl.fill_src, ctl.fill_dst, ctl.n_fill)
        gpu = self.gpu.run(x.to(self.device), ctl.route.long(), weights, phase)  # CPU / NO_EXPERT pairs skipped
        out = self.cpu.finish(cpu).to(gpu.device, gpu.dtype) + gpu  # one fixed order
        self._count(ctl, ids)
        return out.to(x.device)

    def _count(self, ctl, ids) -> None:
        n_fill, n_cpu, n_hit = ctl.counts.tolist()
        c = self.counts
        c["calls"] += 1
        c["pairs"] += int((ids >= 0).sum())
        c["hits"] += n_hit
        c["fills"] += n_fill
        c["cpu_experts"] += n_cpu

    def stats(self) -> dict:
        if self.pool is None:
            return dict(self.counts)
        res = self.pool.res
        return {**self.counts, "slots": self.pool.slots, "slots_used": int((res.id_of >= 0).sum()),
                "bytes_moved": self.pool.bytes_moved, "fill_share": float(self.fill_share)}
