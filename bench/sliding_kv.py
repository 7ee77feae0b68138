"""Sliding-window layers in rings (--sliding-kv window) against every page in the pool (full).

Two parts, one JSON (benchmarks/results/sliding_kv-<cpu|gpu>.json):
  plan      the memory plan of the published gpt-oss-20b and gpt-oss-120b shapes and of
            DeepSeek-V4-Flash's attention at a 131k context, batch 1 and 8, bf16 (runtime/budget.py, the numbers the server prints):
            KV pool, slot state (rings), one prefix-cache checkpoint
  measured  a slice of the gpt-oss-20b shape (random bf16 weights; --layers, sliding and full in
            turn) on this machine: the state's allocated bytes and the median decode step at
            each --contexts length, the keys filled with random values, for both layouts

  python -m bench.sliding_kv [--layers 2] [--contexts 4096,32768] [--device cpu]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, write_result  # noqa: F401
from freetoken.config import ModelConfig
from freetoken.model.state import DecodeState, checkpoint_state_bytes, kv_page_bytes, ring_layers
from freetoken.runtime.budget import plan_memory

GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
               "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
               "sliding_window": 128, "max_position_embeddings": 131072}
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)
# DeepSeek-V4-Flash's attention: 43 layers, the published config's pattern (two sliding-only
# layers, then CSA and HCA in turn), head_dim 512, indexer 128, window 128
DEEPSEEK_V4_FLASH = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
                     "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
                     "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
                     "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 256,
                     "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
                     "routed_scaling_factor": 1.5, "norm_topk_prob": True, "swiglu_limit": 10.0, "sliding_window": 128,
                     "num_hash_layers": 3, "compress_ratios": [0, 0] + [4, 128] * 20 + [4],
                     "compress_rope_theta": 160000, "rope_theta": 10000, "index_n_heads": 64, "index_head_dim": 128,
                     "index_topk": 512, "hc_mult": 4, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6}


def plan_rows(ctx: int = 131072) -> list[dict]:
    rows = []
    for name, hf in (("gpt-oss-20b", GPT_OSS_20B), ("gpt-oss-120b", GPT_OSS_120B),
                     ("deepseek-v4-flash", DEEPSEEK_V4_FLASH)):
        cfg = ModelConfig.from_hf(hf)
        for batch in (1, 8):
            row = {"model": name, "context": ctx, "batch": batch}
            for sliding in ("window", "full"):
                p = plan_memory(cfg, torch.device("cpu"), torch.bfloat16, 1 << 50, 0, batch, ctx, 2048, 16, 0,
                                sliding=sliding)
                ring = ring_layers(cfg, ctx, 16, 2048, sliding)
                row[sliding] = {"kv_pool_gb": round(p.kv / 1e9, 3), "slot_state_gb": round(p.state / 1e9, 4),
                                "pool_bytes_per_token": kv_page_bytes(cfg, 16, torch.bfloat16, ring) / 16,
                                "total_gb": round((p.kv + p.state) / 1e9, 3),
                                "checkpoint_mb": round(checkpoint_state_bytes(cfg, torch.bfloat16, ring) / 1e6, 3)}
            row["saved"] = round(1 - row["window"]["total_gb"] / row["full"]["total_gb"], 3)
            rows.append(row)
    return rows


def build(hf: dict, dev: torch.device, max_pos: int):
    """The GPT-OSS model class over random bf16 weights of the shape (experts with biases, as
    published), every tensor made in place."""
    from freetoken.experts.executor import Activation, TorchExpertExecutor
    from freetoken.model.registry import model_class
    mc = ModelConfig.from_hf(hf)
    h, nh, kvh, hd, e, i = (mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.num_experts,
                            mc.moe_intermediate_size)
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, std=None):
        return (torch.randn(shape, generator=g, device=dev) * (std or shape[-1] ** -0.5)).to(torch.bfloat16)
    w = {"model.embed_tokens.weight": rnd(mc.vocab_size, h, std=0.02), "lm_head.weight": rnd(mc.vocab_size, h),
         "model.norm.weight": 1 + rnd(h, std=0.05)}
    for l in range(mc.num_layers):
        p = f"model.layers.{l}."
        w.update({p + "input_layernorm.weight": 1 + rnd(h, std=0.05), p + "post_attention_layernorm.weight":
                  1 + rnd(h, std=0.05), p + "self_attn.sinks": rnd(nh, std=1.0), p + "mlp.router.weight": rnd(e, h),
                  p + "mlp.router.bias": rnd(e, std=0.1)})
        for n, (rows, cols) in {"q_proj": (nh * hd, h), "k_proj": (kvh * hd, h), "v_proj": (kvh * hd, h),
                                "o_proj": (h, nh * hd)}.items():
            w[p + f"self_attn.{n}.weight"], w[p + f"self_attn.{n}.bias"] = rnd(rows, cols), rnd(rows, std=0.02)
    n = mc.num_flat_experts
    ex = TorchExpertExecutor(rnd(n, 2 * i, h), rnd(n, h, i), layer_experts=e, activation=Activation.of(mc),
                             gate_up_bias=rnd(n, 2 * i, std=0.02), down_bias=rnd(n, h, std=0.02))
    return mc, model_class(mc.arch)(mc, w, ex, dev, torch.bfloat16, max_pos)


def measured_rows(layers: int, contexts: list[int], dev: torch.device, steps: int) -> list[dict]:
    # the vocabulary cut to 32k: the logits are not what is measured, and 201k rows twice cost 2.3 GB
    hf = dict(GPT_OSS_20B, num_hidden_layers=layers, vocab_size=32000,
              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    mc, model = build(hf, dev, max(contexts) + 64)
    rows = []
    tok = torch.tensor([1], device=dev)
    for ctx in contexts:
        states = {}
        for sliding in ("window", "full"):
            st = states[sliding] = DecodeState(mc, 1, ctx + 64, dev, torch.bfloat16, chunk=2048, sliding=sliding)
            st.reserve(0, ctx + 64)
            g = torch.Generator(device=dev).manual_seed(1)
            for t in (*st.k.values(), *st.v.values()):  # every key a step may read: finite, random
                t.normal_(generator=g)
        times = {k: [] for k in states}
        pos = torch.tensor([ctx - 1], device=dev)
        for i in range(steps + 1):  # the layouts in turn, so drifts of the machine hit both alike
            for sliding, st in states.items():
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.decode(tok, st, pos)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if i:  # the first round warms up
                    times[sliding].append(time.perf_counter() - t0)
        for sliding, st in states.items():
            ts = sorted(times[sliding])
            rows.append({"context": ctx, "sliding_kv": sliding, "ring_layers": len(st.ring),
                         "state_mb": round(st.nbytes() / 1e6, 1), "decode_ms": round(1e3 * ts[len(ts) // 2], 2)})
            print(rows[-1], flush=True)
        del states
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--name", default="sliding_kv")
    a = ap.parse_args()
    torch.manual_seed(0)
    contexts = [int(c) for c in a.contexts.split(",")]
    res = {"plan": plan_rows(), "measured": measured_rows(a.layers, contexts, torch.device(a.device), a.steps),
           "layers": a.layers, "threads": torch.get_num_threads()}
    write_result(a.name, res)


if __name__ == "__main__":
    main()
