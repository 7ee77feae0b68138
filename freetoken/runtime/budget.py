"""One memory plan: what the engine puts in the device's memory, sized before anything is
allocated.

On CUDA the budget is VRAM (`--vram-budget`, default: the driver's free memory less a
margin); on the CPU the same plan runs against host memory. The plan takes, in order: the
weights that live on the device (dense layers, plus every expert when they are resident),
work buffers for a prefill chunk and a decode step, the recurrent state of every batch slot,
the prefix cache's checkpoint slots, and the KV page pool (`--kv-cache-tokens`, default: what
is left, up to every slot's full context). What remains is the room a GPU expert cache will
take. Errors name the flag to change. A plan is plain numbers, so it can be recomputed while
serving (the run-time budget issue).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

from .. import limits
from ..config import ModelConfig
from ..errors import FreeTokenError
from ..kernels import page_gather
from ..model.state import checkpoint_state_bytes, kv_page_bytes, ring_layers, ring_scratch_bytes, slot_state_bytes

GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": GiB, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def parse_size(text: str, total: int, flag: str) -> int:
    """'24GiB' / '8e9' / '0.9' (a fraction of `total`) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise FreeTokenError(f"{flag}: {text!r} is not a size (e.g. 24GiB, 8GB) or a fraction of memory (e.g. 0.9)")
    num, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and num <= 1:
        return int(num * total)
    return int(num * _UNITS[unit])


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


@dataclass
class MemoryPlan:
    device: str
    budget: int  # bytes the engine may use there
    weights: int  # dense weights, plus every expert when they are resident on this device
    work: int  # activations and scratch of a prefill chunk and a decode step (estimated)
    state: int  # recurrent state of every batch slot
    checkpoints: int  # prefix-cache checkpoint slots
    kv: int  # the KV page pool
    kv_pages: int  # pages in it (one is the scratch page)
    page_size: int
    left: int  # what is left over
    expert_cache: int = 0  # the GPU expert cache's slots (--moe cache)
    expert_slots: int = 0
    prefill_pass: int = 0  # activations of a streamed prefill pass (--moe cache: runtime/prefill_stream.py)

    @property
    def kv_tokens(self) -> int:
        return (self.kv_pages - 1) * self.page_size

    def summary(self) -> str:
        cache = f" + expert cache {gb(self.expert_cache)} ({self.expert_slots} slots)" if self.expert_slots else ""
        if self.prefill_pass:
            cache += f" + prefill pass {gb(self.prefill_pass)}"
        return (f"memory plan on {self.device}: budget {gb(self.budget)} = weights {gb(self.weights)} + work "
                f"{gb(self.work)} + state {gb(self.state)} + checkpoints {gb(self.checkpoints)}{cache} + KV "
                f"{gb(self.kv)} ({self.kv_tokens} tokens) + left {gb(self.left)}")

    def to_dict(self) -> dict:
        return {**asdict(self), "kv_tokens": self.kv_tokens}


def device_budget(device: torch.device, spec: str, margin: int = GiB) -> int:
    """Bytes the engine may use on `device`: the --vram-budget spec, else free memory less a
    margin (CUDA: driver free memory; CPU: MemAvailable)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        free = total = host_available()
    if spec:
        return parse_size(spec, total, "--vram-budget")
    return max(free - margin, 0)


def host_available() -> int:
    """Host memory this process may still take: MemAvailable, or less where a container's memory
    limit leaves less (freetoken/limits.py; MemAvailable is the whole host's figure there)."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    left = limits.memory_left()
    return avail if left is None else min(avail, left) if avail else left


def work_bytes(cfg: ModelConfig, chunk: int, slots: int, dtype) -> int:
    """Activation memory of a prefill chunk (the largest intermediates of one layer, a few
    live at once) and the logits of a decode step, plus fixed slack for library workspaces."""
    el = torch.empty((), dtype=dtype).element_size()
    per_token = 12 * cfg.hidden_size * el  # residual, norms, projections in flight
    per_token += cfg.top_k * 3 * max(cfg.moe_intermediate_size, 1) * el  # routed pairs' gate/up/act
    per_token += 4 * (cfg.conv_dim + 2 * cfg.num_heads * cfg.head_dim) * 4  # fp32 mixer inputs
    per_token += cfg.linear_num_value_heads * 64 * 4 * 2  # DeltaNet chunk-local [C, C] systems
    logits = (slots + 1) * cfg.vocab_size * 4 * 2
    return chunk * per_token + logits + 256 * (1 << 20)


# prompt tokens an idle step may take on CUDA with the experts in VRAM (--idle-step-tokens auto),
# largest first. Why: a 2,048-token chunk's forward is bound by host launch time, not by the GPU:
# the Qwen3.6 shape's 40 layers all in VRAM prefilled 8k / 32k prompts at 11.0k / 11.1k tok/s in
# chunks of 2,048 against 29.9k / 25.3k in chunks of 8,192 (H100, benchmarks/results/
# prefill_stream-40l-resident-h100-gpu.json, the resident rows).
IDLE_CANDIDATES = (8192, 4096)
# the share of the KV pool a larger idle chunk's work buffers may take from it (auto)
IDLE_KV_SHARE = 1 / 8


def idle_step_tokens(plan_for, base: "MemoryPlan", base_chunk: int, step_tokens: int,
                     context: int = 0) -> tuple[int, "MemoryPlan"]:
    """--idle-step-tokens auto: (tokens, plan). plan_for(n) -> the memory plan with work buffers for
    a step of n prompt tokens (raising FreeTokenError where it does not fit); base: the plan for
    base_chunk. The largest IDLE_CANDIDATES chunk above the step budget whose extra work buffers
    cost base's KV pool at most IDLE_KV_SHARE of it, leave the expert cache its slots and the pool
    at least `context` tokens (or base's, if fewer: a speed setting must not shorten the context a
    request may have); else (the larger of step_tokens and base_chunk, base): base has room for
    base_chunk's work buffers already."""
    for c in IDLE_CANDIDATES:
        if c <= max(step_tokens, base_chunk):
            break
        try:
            plan = plan_for(c)
        except FreeTokenError:
            continue
        if (plan.expert_slots >= base.expert_slots and base.kv - plan.kv <= IDLE_KV_SHARE * base.kv
                and plan.kv_tokens >= min(context, base.kv_tokens)):
            return c, plan
    return max(step_tokens, base_chunk), base


def plan_memory(cfg: ModelConfig, device: torch.device, dtype, budget: int, weights: int, slots: int,
                max_len: int, chunk: int, page_size: int, checkpoint_slots: int, kv_tokens: int = 0,
                expert_slot_bytes: int = 0, num_experts: int = 0, expert_cache: str = "",
                prefill_pass: int = 0, sliding: str = "window", work_chunk: int = 0) -> MemoryPlan:
    """Size everything before allocating any of it. kv_tokens 0: what is left, up to every
    slot's full context. expert_slot_bytes (the GPU expert cache): its slots come before the KV
    pool (what `expert_cache` asks, else all but one full context of KV, at most num_experts).
    prefill_pass: bytes reserved for a streamed prefill pass's activations, capped at a tenth of
    what is left after the fixed parts (the pass then takes fewer tokens, never the KV's room).
    sliding: "window" keeps sliding-window layers in per-slot rings (model/state.py), out of the
    pool's pages and into the slots' state. work_chunk: the work buffers are sized for the larger
    of it and chunk (a prompt step on an idle engine: --idle-step-tokens); the rings for chunk."""
    work = work_bytes(cfg, max(chunk, work_chunk), slots, dtype)
    if torch.device(device).type == "cuda" and page_gather.ENABLED and getattr(cfg, "num_kv_heads", 0):
        # the prefill attention's kept gather buffers (kernels/page_gather.py): one context's K and V
        work += page_gather.workspace_bytes(cfg.num_kv_heads, cfg.head_dim, max_len + page_size, dtype)
    ring = ring_layers(cfg, max_len, page_size, chunk, sliding)
    state = slots * slot_state_bytes(cfg, dtype, ring, page_size, chunk) + ring_scratch_bytes(cfg, ring, page_size, dtype)
    ckpt = checkpoint_slots * checkpoint_state_bytes(cfg, dtype, ring)
    page = max(kv_page_bytes(cfg, page_size, dtype, ring), 1)
    fixed = weights + work + state + ckpt
    if prefill_pass and fixed < budget:
        prefill_pass = min(prefill_pass, (budget - fixed) // 10)
        fixed += prefill_pass
    if fixed > budget:
        raise FreeTokenError(
            f"the model does not fit in {gb(budget)} on {device}: weights {gb(weights)}, work buffers "
            f"{gb(work)}, recurrent state {gb(state)}, checkpoints {gb(ckpt)}; raise --vram-budget, or "
            "lower --max-batch / --prefill-chunk / --idle-step-tokens / --checkpoint-budget, or keep the experts on the host "
            "(--experts cpu)")
    full = slots * -(-max_len // page_size) + 1  # every slot's whole context, and the scratch page
    cache_slots = 0
    if expert_slot_bytes:
        room = budget - fixed
        if expert_cache:
            want = parse_size(expert_cache, room, "--expert-cache")
        else:
            kv_min = (-(-max_len // page_size) + 1) * page if not kv_tokens else (-(-kv_tokens // page_size) + 1) * page
            want = room - kv_min
        cache_slots = min(num_experts, max(want, 0) // expert_slot_bytes)
        if cache_slots < 1:
            raise FreeTokenError(
                f"no room for an expert cache: {gb(room)} left after the weights and buffers on {device}, one "
                f"expert takes {gb(expert_slot_bytes)}; raise --vram-budget or --expert-cache, or lower "
                "--max-seq-len / --kv-cache-tokens")
        fixed += cache_slots * expert_slot_bytes
    if kv_tokens:
        pages = -(-kv_tokens // page_size) + 1
    else:
        pages = min(full, (budget - fixed) // page)
    if pages * page > budget - fixed:
        raise FreeTokenError(
            f"--kv-cache-tokens {kv_tokens} needs {gb(pages * page)} of KV pages but only "
            f"{gb(budget - fixed)} is left of the budget; lower it or raise --vram-budget")
    if pages < 2:
        raise FreeTokenError(
            f"no room for KV pages: {gb(budget - fixed)} left after the weights and buffers; raise "
            "--vram-budget or lower --max-seq-len / --max-batch")
    return MemoryPlan(str(device), budget, weights, work, state, ckpt, pages * page, pages, page_size,
                      budget - fixed - pages * page, cache_slots * expert_slot_bytes, cache_slots, prefill_pass)
