"""Why a bf16 decode can sit far from fp32 at one step: a router near-tie that bf16 decides the
other way. The small fp8_block Qwen3-MoE of the GPU cache tests (tests/test_expert_cache_quant.py,
same seed and sizes), one request alone: its greedy tokens in bf16, then each decode step
teacher-forced in bf16 and in fp32 against the fp32 prefill logits of the same tokens, with the
experts each MoE layer routed to at that step. CPU, `--moe cpu`: no expert cache anywhere.

Rows (`steps`): step, bf16 error and fp32 error (max |a - b| / max |b| against the fp32 prefill
logits), and the layers whose bf16 routing differs from fp32's (`flips`: layer, bf16 experts,
fp32 experts).
    python -m bench.bf16_route_flip [--format fp8_block]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from bench.common import write_result

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # the tests' model builders


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="fp8_block", choices=["fp8_block", "mxfp4", "nvfp4"])
    a = ap.parse_args()
    import hf_models
    import quant_models
    from test_expert_cache_quant import DIMS, serve

    from freetoken.runtime.engine import Engine, EngineConfig
    from freetoken.weights.convert import convert
    d = tempfile.mkdtemp()
    model = hf_models.qwen3_moe(60 + ("fp8_block", "mxfp4", "nvfp4").index(a.format), **DIMS)
    quant_models.write(model, os.path.join(d, "hf"), a.format, "experts", scale_dtype=torch.float32)
    convert(os.path.join(d, "hf"), os.path.join(d, "m.ftw"), progress=False)
    engs = {dt: Engine(os.path.join(d, "m.ftw"), EngineConfig(device="cpu", dtype=dt, moe="cpu", prefill_chunk=16))
            for dt in ("bfloat16", "float32")}
    g = torch.Generator().manual_seed(9)  # the prompts of the GPU test
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (23, 9)]
    _, got = serve(engs["bfloat16"], prompts)
    req = got[0]
    P, ids = len(req.prompt_ids), req.prompt_ids + req.output_ids[:-1]
    st = engs["float32"].new_state(len(ids))
    truth = engs["float32"].prefill(ids, st, all_logits=True)[P:]  # [steps, V]

    def decode(eng):
        """Teacher-forced decode steps -> (logits per step, routed ids per MoE call)."""
        routes, launch = [], eng.executor.launch

        def spy(x, i, w, *args, **kw):
            routes.append(i.sort(-1).values.tolist())
            return launch(x, i, w, *args, **kw)
        s = eng.new_state(len(ids) + 1)
        eng.prefill(req.prompt_ids, s)
        eng.executor.launch = spy
        out = [eng.model.decode(torch.tensor([t]), s, torch.tensor([P + k]))[0] for k, t in enumerate(req.output_ids[:-1])]
        eng.executor.launch = launch
        return out, routes
    (lb, rb), (lf, rf) = decode(engs["bfloat16"]), decode(engs["float32"])
    layers = len(rb) // len(lb)
    steps = []
    for k in range(len(lb)):
        flips = [(j, rb[k * layers + j], rf[k * layers + j]) for j in range(layers) if rb[k * layers + j] != rf[k * layers + j]]
        steps.append({"step": k, "bf16_err": round(rel(lb[k], truth[k]), 4), "fp32_err": round(rel(lf[k], truth[k]), 6),
                      "flips": flips})
        print(steps[-1], flush=True)
    write_result("bf16_route_flip", {"format": a.format, "model": "qwen3_moe test model (3 layers x 16 experts, top-4)",
                                     "prompt_tokens": P, "steps": steps})


if __name__ == "__main__":
    main()
