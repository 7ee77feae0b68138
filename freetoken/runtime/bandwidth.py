"""Bandwidth profiles (`ft bench bw`): what this machine delivers on a model's expert shape,
kept in the cache folder for the engine to start the GPU expert cache's fill share from.

A profile holds B_H (GB/s of expert bytes the C++ CPU executor reads in decode calls), B_P
(GB/s the fused zero-copy kernel copies from pinned host banks into VRAM slots; None without
CUDA), both again measured while the other runs (B_H_concurrent, B_P_concurrent: they share
host DRAM), and the CPU executor's fixed cost per call. The measuring is in bw_measure.py;
this module only names, writes, reads and interprets profiles (cheap to import).

A profile is a starting point, not the answer: the adaptive split (experts/share.py) still
measures real step times, because bandwidths measured alone mispredict serving (other
processes, the cache's own hit rate). A good start only saves the climb's first probes.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import tempfile

from ..paths import cache_dir

log = logging.getLogger("freetoken.bandwidth")
VERSION = 1
MISS_RATE = 0.5  # assumed share of a step's routed experts that miss the cache (batch 1)


def profile_key(cfg, fmt: str, threads: int, act: str = "exact") -> str:
    """File name (without .json) of the profile of one expert shape, format, thread count and
    CPU activation path (--cpu-act: int8 reads the banks faster where the kernels are bound by
    their instructions; exact keeps the names of profiles from before the switch). The layer
    count and top-k are part of it: predicted_share weighs the per-call fixed cost by them."""
    return (f"{fmt}-h{cfg.hidden_size}-i{cfg.moe_intermediate_size}-e{cfg.num_experts}"
            f"-l{len(cfg.moe_layers)}-k{cfg.top_k}-t{threads}" + ("" if act == "exact" else f"-{act}"))


def profile_path(cfg, fmt: str, threads: int, act: str = "exact") -> str:
    return os.path.join(cache_dir(), "bw", profile_key(cfg, fmt, threads, act) + ".json")


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown"


def gpu_name() -> str | None:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def save_profile(profile: dict, path: str) -> str:
    """Write atomically (a temp file in the same folder, then rename): a reader never sees half
    a profile, and two benchmarks finishing together leave one whole file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".bw-", suffix=".partial", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def load_profile(cfg, threads: int, fmt: str = "bf16", path: str | None = None, act: str = "exact") -> dict | None:
    """The profile measured on this machine for this expert shape, format, thread count and CPU
    activation path (the host executor's act: exact, int8, int8-scalar), or None (one log line
    says why: none made yet, unreadable, or made for something else)."""
    path = path or profile_path(cfg, fmt, threads, act)
    if not os.path.exists(path):
        log.info("no bandwidth profile at %s (make one with `ft bench bw MODEL%s`)", path,
                 "" if act == "exact" else f" --cpu-act {act.split('-')[0]}")
        return None
    try:
        with open(path) as f:
            p = json.load(f)
        if not isinstance(p, dict):
            raise ValueError("not a JSON object")
        if p.get("version") != VERSION:
            raise ValueError(f"version {p.get('version')!r}, this FreeToken writes {VERSION}")
        if not (isinstance(p.get("B_H"), (int, float)) and p["B_H"] > 0):
            raise ValueError("no positive B_H")
        m = p["model"]
        want = {"format": fmt, "hidden": cfg.hidden_size, "inter": cfg.moe_intermediate_size,
                "moe_layers": len(cfg.moe_layers), "top_k": cfg.top_k}
        got = {k: m.get(k) for k in want}
        if not m.get("expert_bytes", 0) > 0:  # predicted_share weighs the misses by it
            raise ValueError("no expert_bytes")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("bandwidth profile %s is unreadable (%s); ignoring it (run `ft bench bw` again)", path, e)
        return None
    # a cache folder can be shared between machines (an NFS home): a profile of another machine,
    # shape or thread count would mislead the start more than no profile
    why = None
    if got != want:
        why = f"it was made for {got}, the model is {want}"
    elif p.get("threads") != threads:
        why = f"it was measured with {p.get('threads')} CPU threads, the engine uses {threads}"
    elif p.get("cpu_act", "exact") != act:  # profiles from before --cpu-act in `ft bench bw` are exact
        why = (f"it was measured with {p.get('cpu_act', 'exact')} CPU activations, the engine runs {act} "
               f"(`ft bench bw --cpu-act {act.split('-')[0]}`)")
    elif (p.get("machine") or {}).get("cpu") != cpu_model():
        why = f"it was measured on another CPU ({(p.get('machine') or {}).get('cpu')})"
    elif (p.get("machine") or {}).get("gpu") != gpu_name():
        why = f"it was measured with GPU {(p.get('machine') or {}).get('gpu')}, this machine has {gpu_name()}"
    if why:
        log.warning("bandwidth profile %s ignored: %s (run `ft bench bw` again)", path, why)
        return None
    log.info("bandwidth profile %s: B_P %s GB/s, B_H %s GB/s (measured %s)", path,
             p.get("B_P_concurrent") or p.get("B_P"), p.get("B_H_concurrent") or p["B_H"], p.get("date"))
    return p


def predicted_share(profile: dict, miss_rate: float = MISS_RATE) -> float:
    """The fill share r that balances the two branches of a step: the fills take r*M/B_P, the
    CPU (1-r)*M/B_H, equal at r = B_P / (B_P + B_H) (the concurrent numbers: both run at once
    in a step). r = 1 (fill-only) without a measured link, or when the CPU branch's fixed
    cost per call, paid once per MoE layer, exceeds what splitting saves per step:
    M/B_P - M/(B_P + B_H), M the miss bytes of a batch-1 step (miss_rate of the routed experts)."""
    bp = profile.get("B_P_concurrent") or profile.get("B_P")
    bh = profile.get("B_H_concurrent") or profile.get("B_H")
    if not bp or not bh or bp <= 0 or bh <= 0:
        return 1.0
    m = profile["model"]
    layers = m["moe_layers"]
    miss_bytes = miss_rate * m["top_k"] * layers * m["expert_bytes"]
    saves = miss_bytes / (bp * 1e9) - miss_bytes / ((bp + bh) * 1e9)  # seconds per step
    fixed = layers * (profile.get("cpu_fixed_us") or 0.0) * 1e-6
    if fixed >= saves:
        return 1.0
    return min(1.0, max(0.0, bp / (bp + bh)))
