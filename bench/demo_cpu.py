"""The embedded demo model end to end on this machine: long-prompt prefill and decode speed.

Real clients send ~20k-token prompts; the demo must prefill them well under a minute on a
2-core CPU.   python -m bench.demo_cpu [--prompt 20000] [--tokens 32]
"""
from __future__ import annotations

import argparse
import os

import torch

from bench.common import write_result
from freetoken.demo import demo_path
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.sampler import SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default="demo")
    ap.add_argument("--cpu-threads", type=int, default=0, help="the engine's --cpu-threads (0: its default)")
    ap.add_argument("--attention-pieces", choices=("default", "off"), default="default",
                    help="off: every prompt chunk's attention over its whole context at once (the A/B of "
                         "kernels/split_keys.py, whose key pieces the CPU runs in fp32 by default)")
    ap.add_argument("--dense-bf16", choices=("auto", "keep", "widen"), default="auto",
                    help="the engine's --dense-bf16: its bf16 dense weights kept bf16 under the CPU's float32 "
                         "(keep, the default) or widened to float32 copies at load (widen)")
    a = ap.parse_args()
    if a.attention_pieces == "off":
        from freetoken.kernels import split_keys
        split_keys.wanted = lambda *args: False
    eng = Engine(demo_path(), EngineConfig(device=a.device, dense_bf16=a.dense_bf16, cpu_threads=a.cpu_threads))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 240000, (a.prompt,), generator=g).tolist()
    eng.generate(ids[:64], 4)  # warm-up: JIT, allocator
    out = eng.generate(ids, a.tokens, SamplingParams(temperature=0), stop_at_eos=False)
    res = {"model": "demo (Qwen3.5-MoE arch, random)", "device": str(eng.device), "dtype": str(eng.dtype),
           "experts": eng.experts_on, "cpu_isa": getattr(eng.executor, "isa", None),
           "threads": getattr(eng.executor, "threads", None), "load_s": round(eng.load_s, 2),
           "prompt_tokens": a.prompt, "prefill_s": round(out.prefill_s, 2),
           "prefill_tok_s": round(a.prompt / out.prefill_s, 1),
           "decode_tokens": len(out.token_ids), "decode_tok_s": round((len(out.token_ids) - 1) / out.decode_s, 2),
           "torch_threads": torch.get_num_threads(), "cpu_spin": getattr(eng.executor, "spin", None),
           "cpu_spin_env": os.environ.get("FREETOKEN_CPU_SPIN"),  # the A/B override (None: the engine's)
           "attention_pieces": a.attention_pieces, "dense_bf16": a.dense_bf16,
           "dense_kept_bf16": eng.keep_bf16}
    write_result(a.name, res)


if __name__ == "__main__":
    main()
