"""Driving a ServingEngine in the test's own thread: requests join at given steps; an engine's
routed experts moved onto the torch path."""
from contextlib import contextmanager


def drive(srv, reqs, arrive=None, max_steps: int = 10_000):
    """Step `srv` until every request of `reqs` finished; request i joins at step arrive[i]
    (default: all at step 0). Returns reqs."""
    arrive = arrive or [0] * len(reqs)
    step = 0
    while any(r.finished_at is None for r in reqs):
        for r, at in zip(reqs, arrive):
            if at == step:
                srv.sched.add(r)
        srv.step()
        step += 1
        assert step < max_steps, "the requests did not finish"
    return reqs


def cpu_experts_in_passes(executor) -> list[int]:
    """Spy on an expert cache's frozen() (the decode steps a streamed prefill pass runs between
    its layers): returns a list that gets, per frozen span, the CPU experts its calls ran. Read
    from the device counter at the span's ends, so CUDA graph replays count too (a spy on the
    calls would miss them). A fill-only cache runs experts on the CPU only inside such spans."""
    inside, real = [], executor.frozen

    @contextmanager
    def counted():
        before = int(executor._acc[4])
        with real() as ex:
            yield ex
        inside.append(int(executor._acc[4]) - before)
    executor.frozen = counted
    return inside


def drive_with_arrivals_mid_forward(srv, hook_name: str, stream, long, late) -> bool:
    """Drive `stream` and `long` (joining at steps 0 and 1); the `late` requests arrive from
    inside long's prompt forward, before its layer 1 (through the loop's per-layer hook
    `hook_name`); then step until they finish too. Returns whether they arrived that way."""
    hook = getattr(srv, hook_name)
    added = []

    def arrive_mid_forward(i):
        if i == 1 and not added and long.slot is not None and long.first_token_at is None:
            added.append(i)
            for r in late:
                srv.sched.add(r)
        hook(i)
    setattr(srv, hook_name, arrive_mid_forward)
    drive(srv, [stream, long], arrive=[0, 1])
    while any(r.finished_at is None for r in late):
        srv.step()
    return bool(added)


def torch_experts(eng):
    """The engine with its routed experts on the torch path (TorchExpertExecutor over the same
    banks, quantized or not): every expert resident, reentrant, as resident experts on a GPU."""
    from freetoken.experts.executor import TorchExpertExecutor
    from freetoken.model.moe import MoE
    old = eng.executor
    ex = TorchExpertExecutor(old.gate_up, old.down, layer_experts=eng.cfg.num_experts, activation=old.activation,
                             gate_up_bias=old.gate_up_bias, down_bias=old.down_bias)
    for _, mlp, _, _ in eng.model.layers:
        if isinstance(mlp, MoE):
            mlp.executor = ex
    eng.executor = ex
    return eng


def gpu_paths_vs_fp32(model, ftw: str, prompts, max_tokens: int = 8, device: str = "cuda", dtype: str = "bfloat16",
                      paths=("resident", "cache", "cpu")) -> dict:
    """The model served on `device` in `dtype` (continuous batching, decode graphs on CUDA) with
    every expert resident, through the expert cache (a third of the experts in slots, half of the
    misses on the C++ executor) and CPU-only. Each path is measured against transformers' fp32
    logits of its own tokens: the largest relative error over every step -> {path: error}."""
    import torch

    import hf_models
    from freetoken.cache.config import CacheConfig
    from freetoken.runtime.engine import Engine, EngineConfig
    from freetoken.runtime.request import Request, SamplingOptions
    from freetoken.runtime.serving import ServingEngine
    errs = {}
    probe = Engine(ftw, EngineConfig(device=device, dtype=dtype, moe="cache")).executor
    room = max(2, probe.num_experts // 3) * probe.slot_bytes  # a third of the experts: evictions every step
    settings = {"resident": dict(moe="resident"), "cache": dict(moe="cache", expert_cache=str(room), fill_share="0.5"),
                "cpu": dict(moe="cpu")}
    del probe
    for name in paths:
        eng = Engine(ftw, EngineConfig(device=device, dtype=dtype, prefill_chunk=16, **settings[name]))
        srv = ServingEngine(eng, max_batch=2, max_queue=4, record_logits=True, start=False,
                            cache=CacheConfig(enabled=False))
        reqs = [Request(p, SamplingOptions(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
        drive(srv, reqs, arrive=[2 * i for i in range(len(reqs))])
        worst = 0.0
        for r in reqs:
            truth = hf_models.reference_logits(model, r.prompt_ids + r.output_ids[:-1])[len(r.prompt_ids) - 1:]
            for a, b in zip(r.logits, truth):
                a, b = a.float().cpu(), b.float().cpu()
                worst = max(worst, float((a - b).abs().max() / b.abs().max()))
        errs[name] = round(worst, 4)
        if name == "cache":
            st = eng.executor.stats()
            assert st["cpu_experts"] > 0 and st["fills"] > 0, st
        del eng, srv
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return errs


def check_gpu_paths(model, ftw: str) -> None:
    """On CUDA in fp32 (no router near-tie flips between paths), each of the resident, cache and
    CPU-only paths within 1e-3 of transformers' logits on two prompts."""
    from test_reference import prompt_for
    errs = gpu_paths_vs_fp32(model, ftw, [prompt_for(1), prompt_for(2, n=9)], dtype="float32")
    assert all(e < 1e-3 for e in errs.values()), errs
