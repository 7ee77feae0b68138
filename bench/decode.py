"""Decode tok/s of a full-size Qwen3.6-35B-A3B-shaped model, random BF16 weights made in place.

Batch 1. Configurations:
  gpu   all experts resident in VRAM (the full-VRAM upper bound later issues compare against),
        eager and as one CUDA graph per step (decode is static-shape: it captures as is)
  cpu   CPU-only MoE backend: non-expert layers on the GPU, routed experts on the host with the
        C++ executor (pinned banks)
The floor is active bytes per token (every non-expert weight, top-k experts per MoE layer,
one embedding row, the KV/state read) over the measured device read bandwidth.
    python -m bench.decode [--layers 40] [--experts-on gpu,cpu] [--tokens 64]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import write_result
from freetoken.config import ModelConfig
from freetoken.demo import random_tensor, weight_shapes
from freetoken.experts.executor import TorchExpertExecutor
from freetoken.model.registry import model_class
from freetoken.model.state import DecodeState

QWEN36_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 248320, "hidden_size": 2048,
    "num_hidden_layers": 40, "full_attention_interval": 4, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}


def device_read_bw(dev) -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device=dev).view(torch.float32)
    x.uniform_()
    for _ in range(2):
        x.sum()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        x.sum()
    torch.cuda.synchronize()
    return 10 * x.numel() * 4 / (time.perf_counter() - t0) / 1e9


def build(cfg: dict, dev, experts_on: str, seed=0, max_len: int = 8192, cpu_threads: int = 6):
    """experts_on: gpu (every expert in VRAM), cpu (pinned host banks, the C++ executor) or
    cache (pinned host banks on huge pages behind a GPU expert cache whose slots the serving
    loop's memory plan sizes, the C++ executor for its CPU branch, the split adaptive)."""
    mc = ModelConfig.from_hf(cfg)
    g = torch.Generator(device=dev).manual_seed(seed)
    w = {n: random_tensor(n, s, g, device=dev, embed_std=0.02) for n, s in weight_shapes(mc, experts=False).items()}
    if experts_on == "cache":
        from bench.prefill_stream import make_experts
        from freetoken.experts.cached import CachedExpertExecutor
        from freetoken.experts.cpu import CpuExpertExecutor
        gu_h, dn_h = make_experts(mc, dev, seed)  # made layer by layer on the device: never all in VRAM
        ex = CachedExpertExecutor(gu_h, dn_h, None, dev, torch.bfloat16, CpuExpertExecutor(gu_h, dn_h, cpu_threads),
                                  None, "recent", mc.num_experts)
        model = model_class(mc.arch)(mc, w, ex, dev, torch.bfloat16, max_len)
        return mc, w, ex, model
    n, i, h = mc.num_flat_experts, mc.moe_intermediate_size, mc.hidden_size
    if experts_on == "cpu" and dev.type == "cpu":  # a CPU-only engine, as Engine sets one up there:
        # float32 compute with the bf16 dense matrices kept bf16 (--dense-bf16 auto), by the loader's own rule
        from freetoken.experts.cpu import SPIN_SHARED, CpuExpertExecutor
        from freetoken.weights.reader import dense_weights
        cls = model_class(mc.arch)
        w = dense_weights({}, w, dev, torch.float32, keep_fp32=getattr(cls, "KEEP_FP32", ()), keep_bf16=True,
                          bf16_widen=getattr(cls, "DENSE_WIDEN", ()))
        gu_h, dn_h = host_experts(mc, seed)
        ex = CpuExpertExecutor(gu_h, dn_h, threads=cpu_threads, spin=SPIN_SHARED)
        return mc, w, ex, cls(mc, w, ex, dev, torch.float32, max_len)
    gu = torch.randn(n, 2 * i, h, generator=g, device=dev, dtype=torch.bfloat16).mul_(h ** -0.5)
    dn = torch.randn(n, h, i, generator=g, device=dev, dtype=torch.bfloat16).mul_(i ** -0.5)
    if experts_on == "gpu":
        ex = TorchExpertExecutor(gu, dn, layer_experts=mc.num_experts)
    else:
        from freetoken.experts.cpu import CpuExpertExecutor
        from freetoken.weights.reader import pin_in_place
        gu_h, dn_h = gu.cpu(), dn.cpu()
        del gu, dn
        torch.cuda.empty_cache()
        pin_in_place([gu_h, dn_h])
        ex = CpuExpertExecutor(gu_h, dn_h)
    model = model_class(mc.arch)(mc, w, ex, dev, torch.bfloat16, max_len)  # rope table length
    return mc, w, ex, model


def host_experts(mc, seed: int = 0, pool_layers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 expert banks in host memory, [N, 2I, H] and [N, H, I], made fast: torch's
    CPU generator fills ~0.3 GB/s on one core (64 GB of the full 40 layers would take minutes),
    so `pool_layers` layers' worth of experts are drawn and every layer takes its experts from
    that pool in its own random order. Their values repeat across layers; a token's experts
    are picked by each layer's own random router, so the bytes a step reads are the model's."""
    e, i, h = mc.num_experts, mc.moe_intermediate_size, mc.hidden_size
    layers = mc.num_flat_experts // e
    g = torch.Generator().manual_seed(seed)
    m = min(layers, pool_layers) * e
    pool_gu = torch.randn(m, 2 * i, h, generator=g, dtype=torch.bfloat16).mul_(h ** -0.5)
    pool_dn = torch.randn(m, h, i, generator=g, dtype=torch.bfloat16).mul_(i ** -0.5)
    if layers * e == m:
        return pool_gu, pool_dn
    gu = torch.empty(layers * e, 2 * i, h, dtype=torch.bfloat16)  # [N, 2I, H]
    dn = torch.empty(layers * e, h, i, dtype=torch.bfloat16)  # [N, H, I]
    for layer in range(layers):
        pick = torch.randperm(m, generator=g)[:e]  # [E] pool rows, this layer's order
        torch.index_select(pool_gu, 0, pick, out=gu[layer * e:(layer + 1) * e])
        torch.index_select(pool_dn, 0, pick, out=dn[layer * e:(layer + 1) * e])
    return gu, dn


def active_bytes(mc, w, ctx: int) -> int:
    b = 0
    for name, t in w.items():
        if name == "model.embed_tokens.weight":
            b += t.shape[1] * t.element_size()  # one row
        else:
            b += t.numel() * t.element_size()
    b += len(mc.moe_layers) * mc.top_k * 3 * mc.hidden_size * mc.moe_intermediate_size * 2
    b += len(mc.attention_layers) * 2 * mc.num_kv_heads * ctx * mc.head_dim * 2  # K and V read
    b += len(mc.linear_layers) * mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4 * 2
    return b


def profile_step(step, steps: int = 3, top: int = 12) -> dict:
    """GPU kernels per decode step and where the time goes (eager, so per-kernel times show):
    `top`, the kernels by GPU time; `ops`, the torch ops that launched them with their input
    shapes (which GEMM a cuBLAS kernel is: the kernel names do not say)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in rows)
    rows.sort(key=lambda e: -e.device_time_total)
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type.name == "CPU" and e.key in PROFILED_OPS and e.device_time_total > 0]
    ops.sort(key=lambda e: -e.device_time_total)
    return {"kernels_per_step": round(sum(e.count for e in rows) / steps),
            "gpu_us_per_step": round(total / steps),
            "top": [{"kernel": e.key[:80], "calls_per_step": round(e.count / steps),
                     "us_per_step": round(e.device_time_total / steps, 1)} for e in rows[:top]],
            "ops": [{"op": e.key, "shapes": str(e.input_shapes)[:120], "calls_per_step": round(e.count / steps),
                     "us_per_step": round(e.device_time_total / steps, 1)} for e in ops[:top]]}


# the torch ops whose kernels are worth telling apart by shape: the leaf GEMMs and reductions
# (not aten::linear / matmul, which wrap them and would count their time twice)
PROFILED_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::sum"}


def run(cfg, dev, experts_on, prompt_len, tokens, graph: bool, profile: bool = False):
    mc, w, ex, model = build(cfg, dev, experts_on)
    ctx = prompt_len + tokens + 8
    st = DecodeState(mc, 1, ctx, dev, torch.bfloat16)
    st.reserve(0, ctx)
    prompt = torch.randint(0, mc.vocab_size, (prompt_len,), device=dev)
    model.prefill(prompt, st, 0, 0)  # compile and autotune for these shapes, warm cuBLAS
    st.reset(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = model.prefill(prompt, st, 0, 0)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    tok[0] = logits[-1].argmax()
    step = lambda: model.decode(tok, st, pos)  # noqa: E731  static shapes: the length is device data
    out = {"experts_on": experts_on, "prompt_tokens": prompt_len, "decode_tokens": tokens,
           "prefill_s": round(prefill_s, 3), "prefill_tok_s": round(prompt_len / prefill_s, 1),
           "active_gb_per_token": round(active_bytes(mc, w, ctx) / 1e9, 3),
           "vram_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1)}
    if graph:
        saved = [t.clone() for t in (*st.conv.values(), *st.rec.values())]
        pos[0] = prompt_len
        eager_logits = step().clone()
        for t, s in zip((*st.conv.values(), *st.rec.values()), saved):
            t.copy_(s)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        for t, sv in zip((*st.conv.values(), *st.rec.values()), saved):
            t.copy_(sv)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            graph_out = step()
        g.replay()
        torch.cuda.synchronize()
        out["graph_matches_eager"] = bool(torch.equal(graph_out, eager_logits))
    if profile:
        out["profile"] = profile_step(step)

    def graph_step():
        g.replay()
        return graph_out

    for mode in (["eager", "graph"] if graph else ["eager"]):
        fn = graph_step if mode == "graph" else step
        pos[0] = prompt_len
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(tokens):
            pos.fill_(prompt_len + k)  # buffers the graph reads: no host round trip
            tok.copy_(fn().argmax(-1))  # greedy feedback stays on the device
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / tokens
        out[f"{mode}_ms_per_token"] = round(dt * 1e3, 3)
        out[f"{mode}_tok_s"] = round(1 / dt, 1)
    del model, w, ex, st
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts-on", default="gpu,cpu")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="record per-kernel GPU time of a step")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode needs a CUDA device")
    dev = torch.device("cuda")
    cfg = dict(QWEN36_35B_A3B, num_hidden_layers=a.layers)
    bw = device_read_bw(dev)
    res = {"model": "Qwen3.6-35B-A3B shape, random BF16", "config": cfg, "layers": a.layers, "batch": 1,
           "device_read_gbs": round(bw, 1), "runs": []}
    for where in a.experts_on.split(","):
        r = run(cfg, dev, where, a.prompt, a.tokens, graph=where == "gpu", profile=a.profile and where == "gpu")
        floor_ms = r["active_gb_per_token"] / bw * 1e3
        r["bandwidth_floor_ms"] = round(floor_ms, 3)
        best = min(v for k, v in r.items() if k.endswith("_ms_per_token"))
        r["floor_over_best"] = round(floor_ms / best, 3)
        res["runs"].append(r)
        print(r, flush=True)
    write_result("decode", res)


if __name__ == "__main__":
    main()
