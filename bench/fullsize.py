"""A Qwen3.6-35B-A3B-shaped Engine with random BF16 weights made in place on the GPU machine
(no FTW file: its disk is smaller than the checkpoint), with the demo's real tokenizer."""
from __future__ import annotations

import torch

from freetoken.demo import demo_path
from freetoken.runtime.budget import device_budget
from freetoken.runtime.engine import Engine, EngineConfig


def full_size_engine(layers: int = 40, device: str = "cuda", experts_on: str = "gpu", max_len: int = 8192,
                     **ecfg) -> Engine:
    """experts_on: gpu, cpu or cache (bench.decode.build); ecfg: EngineConfig fields
    (max_step_tokens, cuda_graphs, expert_cache, cpu_threads, ...). device "cpu": a CPU-only
    engine (experts_on "cpu", the C++ executor on host banks)."""
    from bench.decode import QWEN36_35B_A3B, build
    dev = torch.device(device)
    threads = {}
    if dev.type == "cpu":  # a CPU-only engine: its threads as Engine sets them (--cpu-threads, else every core)
        from freetoken.experts.cpu import physical_cores
        threads = {"cpu_threads": ecfg.get("cpu_threads") or len(physical_cores())}
        if ecfg.get("cpu_threads"):
            torch.set_num_threads(ecfg["cpu_threads"])
    mc, w, ex, model = build(dict(QWEN36_35B_A3B, num_hidden_layers=layers), dev, experts_on, max_len=max_len,
                             **threads)
    demo = Engine(demo_path(), EngineConfig(device="cpu", experts="cpu"))
    eng = Engine.__new__(Engine)
    where = {"moe": "cache"} if experts_on == "cache" else {"experts": experts_on}
    eng.ecfg = EngineConfig(device=device, **where, **ecfg)
    # a CPU engine computes in float32 over bf16 weights (bench.decode.build), as Engine's default there
    eng.device, eng.dtype, eng.experts_on = dev, torch.float32 if dev.type == "cpu" else torch.bfloat16, experts_on
    eng.keep_bf16 = dev.type == "cpu"
    # what describe() reports (Engine.__init__ sets them from the file; these are bench.decode's banks)
    eng.expert_format, eng.dense_fp8, eng.keep_fp8 = "bf16", "none", False
    eng.cfg, eng.model, eng.executor, eng.max_len = mc, model, ex, max_len
    eng.tokenizer, eng.eos_ids, eng.files, eng.meta, eng.load_s = demo.tokenizer, demo.eos_ids, demo.files, {}, 0.0
    eng.weight_bytes = 0  # already allocated: the budget below is what is free now
    eng.budget = device_budget(dev, eng.ecfg.vram_budget)
    eng._runner = None
    if experts_on == "cache":  # the engine's streamed prefill (issue 11), as Engine.__init__ sets it up
        from freetoken.runtime.prefill_stream import PrefillStream
        eng.prefill_stream = PrefillStream.for_engine(eng)
    eng.warm_up()  # as Engine.__init__ does (without it the first long chunk took 0.75-3.4 s in one layer)
    return eng
